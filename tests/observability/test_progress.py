"""ProgressReporter: plain lines with the standard fields, throttling, a closing summary."""

from asyncflow.observability import ProgressReporter, keys

METRICS = {keys.REWARD_MEAN: 0.4312, keys.SAMPLES_PER_S: 25.34, keys.TOKENS_PER_S: 410.2,
           keys.LAG_MEAN: 0.5, keys.LAG_MAX: 1, keys.QUEUE_DEPTH: 32}


def test_line_shows_every_field():
    lines = []
    rep = ProgressReporter(total_steps=100, every_s=0, print_fn=lines.append)
    line = rep.update(12, METRICS)
    assert lines == [line]
    for text in ("step  12/100", "reward  0.431", "25.3 samples/s", "410 tok/s", "lag 0.50 max 1", "queue   32",
                 "eta"):
        assert text in line, (text, line)
    assert "\r" not in line and "\n" not in line


def test_missing_values_print_as_dash_and_no_total():
    rep = ProgressReporter(total_steps=None, print_fn=lambda _: None)
    line = rep.format_line(3, {keys.REWARD_MEAN: 1.0})
    assert line.startswith("step    3 |") and "samples/s" in line and "eta" not in line
    assert "queue    -" in line


def test_throttled_but_first_and_last_always_print():
    lines = []
    rep = ProgressReporter(total_steps=5, every_s=1e9, print_fn=lines.append)
    printed = [rep.update(step, METRICS) is not None for step in range(1, 6)]
    assert printed == [True, False, False, False, True]
    assert lines[-1].startswith("step 5/5")
    assert rep.update(6, METRICS, force=True) is not None


def test_default_printer_flushes_plain_lines(capsys):
    rep = ProgressReporter(total_steps=2, every_s=0)
    rep.update(1, METRICS)
    summary = rep.finish("idle rollout 10%")
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("step 1/2 |") and out[1] == summary
    assert summary.startswith("done: 1 steps in 0:00:") and summary.endswith("| idle rollout 10%")
