"""The driver's checkpoint bookkeeping: the saved data cursor is the one before the checkpoint's step,
even though the driver has already fed later steps (async mode runs ahead)."""

from transformers import AutoTokenizer

from asyncflow.config import load_config
from asyncflow.data import make_prompt_source
from asyncflow.workflow.resume import RunCheckpoints, checkpoint_due, trim_metrics


def test_checkpoint_due_every_interval_and_at_the_end():
    assert [n for n in range(0, 8) if checkpoint_due(n, 3, 7)] == [3, 6, 7]
    assert not any(checkpoint_due(n, 0, 7) for n in range(8))


def test_cursor_of_a_checkpoint_replays_the_next_steps_prompts(tiny_model_dir, tmp_path):
    cfg = load_config(None, [f"checkpoint.dir={tmp_path / 'ckpt'}", "checkpoint.interval=2", "workflow.steps=8"])
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    source = make_prompt_source("add1", tok, 0)
    run = RunCheckpoints(cfg, source)
    fed = {}
    for step in range(6):  # the driver feeds ahead of training
        run.before_feed(step)
        fed[step] = source.next_prompts(4)
        run.log_draw(step, 4, True)
        if step == 4:  # a dynamic-sampling top-up of step 3, drawn after step 4's first prompts
            source.next_prompts(2)
            run.log_draw(3, 2, False)
    assert run.step_done(2, {}) is None  # 3 trained steps: not due
    (run.manager.staging(4) / "actor").mkdir()  # what the actor ranks write
    path = run.step_done(3, {0: [0], 1: [1], 2: [2], 3: [3]})
    assert path.name == "step_000004"

    again = make_prompt_source("add1", tok, 0)
    start, found, meta = RunCheckpoints(cfg, again).resume()
    assert (start, found) == (4, path) and meta["weight_version"] == 4 and meta["trained_groups"]["3"] == [3]
    # The draws since the cursor, in order: what a resume replays (dropping the top-up of step 3).
    assert meta["replay"] == [[4, 4, True], [3, 2, False], [5, 4, True]]
    assert again.next_prompts(4) == fed[4]
    again.next_prompts(2)
    assert again.next_prompts(4) == fed[5]


def test_trim_metrics_drops_steps_trained_again(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n{"step": 2}\n{"step": 3')  # cut by a crash
    assert trim_metrics(tmp_path, 2)
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 0}\n{"step": 1}\n'
    assert not trim_metrics(tmp_path / "none", 0)
