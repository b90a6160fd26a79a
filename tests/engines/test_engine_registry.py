"""Engines plug in by registry name or dotted path; unknown names list the valid ones; the interface holds exactly
what the workflow calls."""

import pytest

from asyncflow.engines.base import (
    CRITIC_ENGINES,
    ROLLOUT_ENGINES,
    TRAIN_ENGINES,
    RolloutEngine,
    RolloutStream,
    Sample,
    TrainableEngine,
    make_rollout_engine,
)
from asyncflow.registry import RegistryError


class EchoRollout(RolloutEngine):
    """A user engine: answers every prompt with the prompt itself (contract example)."""

    def __init__(self, cfg, model_dir, *, share_device=False, cpus=None, visible_devices=None):
        self.cfg, self.model_dir, self._version = cfg, model_dir, 0
        self.cpus = cpus

    def generate(self, prompts, n, on_sample=None, max_new_tokens=None, ignore_eos=False):
        out = []
        for i, p in enumerate(prompts):
            for _ in range(n):
                s = Sample(list(p), list(p), [0.0] * len(p), self._version)
                if on_sample:
                    on_sample(i, s)
                out.append(s)
        return out

    def apply_staged(self, staging, version):
        self._version = version
        return {"buckets": 0, "bytes_per_rank": [0], "ranks": []}

    @property
    def weight_version(self):
        return self._version


def test_builtin_engines_are_named_without_importing_them():
    assert {"megatron", "fake"} <= set(TRAIN_ENGINES.names()) and "megatron" in CRITIC_ENGINES
    assert "vllm" in ROLLOUT_ENGINES


def test_user_engine_by_dotted_path_honours_the_contract():
    seen = []
    engine = make_rollout_engine("tests.engines.test_engine_registry:EchoRollout", {"x": 1}, "/m", share_device=False,
                                 cpus=[0, 1], visible_devices=None)
    samples = engine.generate([[1, 2], [3]], n=2, on_sample=lambda i, s: seen.append(i))
    assert [s.response_ids for s in samples] == [[1, 2], [1, 2], [3], [3]]
    assert seen == [0, 0, 1, 1] and engine.cpus == [0, 1]
    engine.apply_staged({}, 4)
    assert engine.weight_version == 4 and engine.sleep() == 0


def test_the_loop_s_weight_path_is_required():
    class NoStaging(RolloutEngine):
        def generate(self, prompts, n, on_sample=None, max_new_tokens=None, ignore_eos=False):
            return []

        @property
        def weight_version(self):
            return 0

    with pytest.raises(TypeError, match="apply_staged"):
        NoStaging()


def test_what_the_workflow_reads_of_a_trainable_engine_is_abstract():
    assert {"ranks", "micro_batch_size", "fixed_seq_len", "seq_multiple", "gather_data_parallel",
            "check_same_rows", "group_timeout_s", "train_step", "save", "load"} == TrainableEngine.__abstractmethods__
    assert not {"apply_weights", "pause", "resume", "abort"} & set(dir(RolloutEngine))


def test_the_workflow_calls_every_abstract_engine_method_and_nothing_outside_the_interfaces():
    import ast
    from pathlib import Path

    from asyncflow.engines.base import CriticEngine, TrainEngine

    used = set()
    for path in (Path(__file__).resolve().parents[2] / "asyncflow" / "workflow").glob("*.py"):
        used |= {node.attr for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Attribute)
                 and isinstance(node.value, ast.Attribute) and node.value.attr == "engine"}
    classes = (TrainEngine, CriticEngine, RolloutEngine)
    offered = {name for cls in classes for name in dir(cls) if not name.startswith("_")} | {"version"}
    assert used <= offered, used - offered
    assert set().union(*(cls.__abstractmethods__ for cls in classes)) <= used


def test_the_continuous_stream_interface_is_what_the_rollout_loops_call():
    # The step-tied continuous loop and the sample stream's loop together, with the agent turns they share.
    import ast
    import inspect

    import asyncflow.workflow.agent_turns as agent_turns
    import asyncflow.workflow.rollout_stream as rollout_stream
    import asyncflow.workflow.sample_stream as sample_stream

    called = {node.attr for module in (rollout_stream, sample_stream, agent_turns)
              for node in ast.walk(ast.parse(inspect.getsource(module)))
              if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
              and node.value.attr == "stream"}
    assert called == RolloutStream.__abstractmethods__ - {"__len__"}


def test_unknown_engine_lists_valid_names():
    with pytest.raises(RegistryError, match="valid: .*vllm"):
        make_rollout_engine("sglang-typo", None, None)


def test_critic_engines_resolve_by_name_and_list_the_valid_ones():
    from asyncflow.engines.base import CriticEngine, make_critic_engine
    from asyncflow.engines.megatron.critic import MegatronCritic

    assert CRITIC_ENGINES.resolve("megatron") is MegatronCritic and issubclass(MegatronCritic, CriticEngine)
    with pytest.raises(RegistryError, match="megatron"):
        make_critic_engine("no-such-critic", None, None)
