"""Engines plug in by registry name or dotted path; unknown names list the valid ones."""

import pytest

from asyncflow.engines.base import ROLLOUT_ENGINES, TRAIN_ENGINES, RolloutEngine, Sample, make_rollout_engine
from asyncflow.registry import RegistryError


class EchoRollout(RolloutEngine):
    """A user engine: answers every prompt with the prompt itself (contract example)."""

    def __init__(self, cfg, model_dir):
        self.cfg, self.model_dir, self._version = cfg, model_dir, 0

    def generate(self, prompts, n, on_sample=None):
        out = []
        for i, p in enumerate(prompts):
            for _ in range(n):
                s = Sample(list(p), list(p), [0.0] * len(p), self._version)
                if on_sample:
                    on_sample(i, s)
                out.append(s)
        return out

    def apply_weights(self, named_tensors, version):
        self._version = version

    @property
    def weight_version(self):
        return self._version


def test_builtin_engines_registered():
    make_rollout_engine  # noqa: B018 - importing base registers nothing heavy by itself
    import asyncflow.engines.megatron.actor  # noqa: F401
    import asyncflow.engines.vllm.rollout  # noqa: F401

    assert "megatron" in TRAIN_ENGINES and "vllm" in ROLLOUT_ENGINES


def test_user_engine_by_dotted_path_honours_the_contract():
    seen = []
    engine = make_rollout_engine("tests.engines.test_engine_registry:EchoRollout", {"x": 1}, "/m")
    samples = engine.generate([[1, 2], [3]], n=2, on_sample=lambda i, s: seen.append(i))
    assert [s.response_ids for s in samples] == [[1, 2], [1, 2], [3], [3]]
    assert seen == [0, 0, 1, 1]
    engine.apply_weights([], 4)
    assert engine.weight_version == 4 and engine.abort() == 0


def test_unknown_engine_lists_valid_names():
    with pytest.raises(RegistryError, match="valid: .*vllm"):
        make_rollout_engine("sglang-typo", None, None)


def test_critic_engines_resolve_by_name_and_list_the_valid_ones():
    from asyncflow.engines.base import CRITIC_ENGINES, CriticEngine, make_critic_engine
    from asyncflow.engines.megatron.critic import MegatronCritic

    assert CRITIC_ENGINES.resolve("megatron") is MegatronCritic and issubclass(MegatronCritic, CriticEngine)
    with pytest.raises(RegistryError, match="megatron"):
        make_critic_engine("no-such-critic", None, None)
