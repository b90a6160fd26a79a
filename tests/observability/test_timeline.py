"""Timeline: spans, Chrome trace JSON, merging spans from other processes, idle fractions."""

import json
import multiprocessing as mp
import threading

import msgpack
import pytest

from asyncflow.observability import Timeline
from tests.forkserver import start_method


def _hand_made() -> Timeline:
    """Wall span 0..10 s. rollout busy [0,4] u [3,6] (one worker each) = 6 s; actor busy [2,4] u [8,10] = 4 s."""
    tl = Timeline()
    tl.add("rollout", "generate", 0.0, 4.0, worker=0)
    tl.add("rollout", "generate", 3.0, 6.0, worker=1)
    tl.add("actor", "train_step", 2.0, 4.0, worker=0)
    tl.add("actor", "forward", 2.5, 3.5, worker=0)  # nested: must not count twice
    tl.add("actor", "train_step", 8.0, 10.0, worker=0)
    return tl


def test_idle_fraction_hand_made():
    tl = _hand_made()
    assert tl.wall_span() == (0.0, 10.0)
    assert tl.idle_fraction("rollout") == pytest.approx(0.4)
    assert tl.idle_fraction("actor") == pytest.approx(0.6)
    assert tl.idle_fraction("rollout", worker=1) == pytest.approx(0.7)
    assert tl.idle_fraction("actor", window=(2.0, 4.0)) == pytest.approx(0.0)
    assert tl.idle_fractions() == pytest.approx({"rollout": 0.4, "actor": 0.6})
    with pytest.raises(ValueError, match=r"groups: \['rollout', 'actor'\]"):
        tl.idle_fraction("critic")


def test_span_context_records_args_and_errors():
    clock = iter([10.0, 11.5, 20.0, 20.25]).__next__
    tl = Timeline(clock=clock)
    with tl.span("rollout", "generate", worker="vllm-1", batch=8) as args:
        args["tokens"] = 96
    with pytest.raises(KeyError), tl.span("reward", "score"):
        raise KeyError("x")
    spans = tl.export_spans()
    assert spans[0] == {"group": "rollout", "name": "generate", "worker": "vllm-1", "start": 10.0, "end": 11.5,
                        "args": {"batch": 8, "tokens": 96}}
    assert spans[1]["args"] == {"error": "KeyError"} and spans[1]["end"] - spans[1]["start"] == 0.25


def test_disabled_timeline_records_nothing():
    tl = Timeline(enabled=False)
    with tl.span("a", "b"):
        pass
    tl.add("a", "b", 0, 1)
    assert len(tl) == 0 and tl.to_chrome_trace()["traceEvents"] == []


def test_chrome_trace(tmp_path):
    tl = _hand_made()
    tl.add("rollout", "generate", 1.0, 2.0, worker=10)  # numeric order: worker 10 after worker 1
    path = tl.write_chrome_trace(tmp_path / "timeline.json")
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    meta = {(e["name"], e["pid"], e["tid"]): e["args"] for e in events if e["ph"] == "M"}
    assert meta[("process_name", 1, 0)] == {"name": "rollout"} and meta[("process_name", 2, 0)] == {"name": "actor"}
    assert [meta[("thread_name", 1, t)]["name"] for t in range(3)] == ["rollout/0", "rollout/1", "rollout/10"]
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == len(tl) == 6
    assert all({"name", "cat", "pid", "tid", "ts", "dur", "args"} <= set(e) for e in spans)
    first_actor = next(e for e in spans if e["cat"] == "actor")
    assert (first_actor["pid"], first_actor["ts"], first_actor["dur"]) == (2, 2e6, 2e6)
    w10 = next(e for e in spans if e["tid"] == 2)
    assert (w10["pid"], w10["ts"], w10["dur"]) == (1, 1e6, 1e6)


def _record_in_child(queue, rank):
    tl = Timeline()
    with tl.span("rollout", "generate", worker=rank, rank=rank):
        pass
    tl.add("rollout", "apply_weights", 100.0 + rank, 100.5 + rank, worker=rank, args={"version": 3})
    queue.put(msgpack.packb(tl.export_spans(clear=True)))  # what a Ray actor would return
    assert len(tl) == 0


def test_merge_spans_from_other_processes(tmp_path):
    ctx = mp.get_context(start_method())
    queue = ctx.Queue()
    procs = [ctx.Process(target=_record_in_child, args=(queue, rank)) for rank in range(2)]
    for p in procs:
        p.start()
    payloads = [queue.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0

    driver = Timeline()
    with driver.span("actor", "train_step"):
        pass
    for payload in payloads:
        driver.merge(msgpack.unpackb(payload))
    assert len(driver) == 5
    assert driver.rows() == [("rollout", 0), ("rollout", 1), ("actor", 0)]  # apply_weights at t=100 starts first
    applied = sorted((s["worker"], s["start"], s["args"]["version"]) for s in driver.export_spans()
                     if s["name"] == "apply_weights")
    assert applied == [(0, 100.0, 3), (1, 101.0, 3)]
    trace = json.loads(driver.write_chrome_trace(tmp_path / "t.json").read_text())
    assert sum(e["ph"] == "X" for e in trace["traceEvents"]) == 5
    with pytest.raises(ValueError, match="lacks"):
        driver.merge([{"group": "g", "name": "n"}])


def test_thread_safe_recording():
    tl = Timeline()

    def work(worker):
        for i in range(500):
            tl.add("rollout", "generate", i, i + 0.5, worker=worker)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(tl) == 2000 and len(tl.rows()) == 4
