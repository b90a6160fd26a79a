"""The sample stream's rollout loop asks the board for reservations again after a refusal only when something it
knows of changed, or after ``StreamRollout.retry_s``: the board is a Ray actor, and a loop waiting for weights that
asked every ``poll_s`` kept it busy a tenth of a core on the 2-core machine (``asyncflow.workflow.sample_stream``)."""

from types import SimpleNamespace

from asyncflow.workflow.sample_stream import StreamRollout


def _loop(version: int, open_step: int) -> StreamRollout:
    """A loop with only what ``_may_ask`` and ``_granted`` read (no engine, no board)."""
    loop = StreamRollout.__new__(StreamRollout)
    loop.svc = SimpleNamespace(engine=SimpleNamespace(weight_version=version))
    loop.open, loop.asking, loop.held = open_step, 0, 0
    loop._refused, loop._refused_at = 0.0, None
    return loop


def test_a_refusal_is_asked_again_after_retry_s_unless_version_or_open_step_changed():
    loop = _loop(version=3, open_step=5)
    assert loop._may_ask(now=100.0)  # nothing refused yet
    loop.asking = 2
    loop._granted(2, 0, asked=100.0)  # refused at version 3, open step 5
    assert loop.asking == 0 and loop.held == 0
    assert not loop._may_ask(now=100.0 + 1.5 * loop.poll_s)  # the same state: the board would refuse again
    assert not loop._may_ask(now=100.0 + 0.9 * loop.retry_s)
    assert loop._may_ask(now=100.0 + 1.1 * loop.retry_s)  # room others may have made meanwhile
    loop.svc.engine.weight_version = 4  # newer weights applied: at the next poll tick
    assert not loop._may_ask(now=100.0 + loop.poll_s / 2) and loop._may_ask(now=100.0 + 1.5 * loop.poll_s)
    loop.svc.engine.weight_version, loop.open = 3, 6  # the open step moved
    assert loop._may_ask(now=100.0 + 1.5 * loop.poll_s)
    loop.open = 5
    loop._refused_at = None  # this loop gave reservations back (``_release_doomed``)
    assert loop._may_ask(now=100.0 + 1.5 * loop.poll_s)


def test_a_grant_clears_the_refusal():
    loop = _loop(version=3, open_step=5)
    loop._granted(1, 0, asked=100.0)
    loop._granted(1, 1, asked=100.1)
    assert loop.held == 1 and loop._refused_at is None and loop._may_ask(now=100.1 + 1.5 * loop.poll_s)
