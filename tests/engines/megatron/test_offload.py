"""Device memory leaves and comes back: the colocated ``sync`` offload and the streamed reference model.

On one gloo process with the real Megatron engine (DDP grad buffers, Megatron's optimizer):

- ``MegatronActor.offload`` frees every storage of parameters, gradient buffers and Adam state (0 bytes
  left), ``onload`` brings them back, and training continues bit-identically to a run that never offloaded;
- a frozen engine (``trainable=False``, the reference) has no optimizer or gradient buffers;
- ``LayerStreamer`` (``reference_placement: offload``) gives bit-identical logprobs, loads each layer once
  per forward pass and holds no weight on the device between passes.

The engine's device is the CPU here, so the memory freed is host memory; the code is the GPU path's.
float32 only: Megatron's mixed-precision optimizer (bf16 weights with fp32 master copies, which
``offload.optimizer_tensors`` reaches through the optimizer's parameter groups) needs CUDA parameters.
"""

import multiprocessing as mp

import pytest

pytestmark = pytest.mark.slow


def _train(model_dir: str, offload: bool, dtype: str) -> dict:
    import torch

    from asyncflow.config import MegatronConfig
    from asyncflow.engines.megatron.actor import MegatronActor
    from asyncflow.engines.megatron.offload import train_state_offloader
    from asyncflow.models.parallel import destroy_megatron
    from tests.engines.megatron.dist_harness import fixed_batch

    torch.set_num_threads(1)
    actor = MegatronActor(MegatronConfig(micro_batch_size=2, lr=1e-2, params_dtype=dtype), model_dir)
    tokens, mask = fixed_batch()
    losses, freed, left, back = [], [], [], []
    for _ in range(3):
        losses.append(actor.trainer.train_step(tokens, mask)["loss"])
        if offload:
            freed.append(actor.offload())
            left.append(train_state_offloader(actor.trainer).device_bytes())  # what is still allocated
            actor.onload()
            back.append(train_state_offloader(actor.trainer).device_bytes())
    out = {"losses": losses, "logprobs": actor.compute_logprobs(tokens).tolist(), "freed": freed, "left": left,
           "back": back}
    destroy_megatron()
    return out


def _offload_before_the_first_step(model_dir: str) -> dict:
    """The colocated sync loop offloads the actor before its first step (rollout runs first), when Adam's
    moments do not exist yet; they are born at the step and must be offloaded from then on."""
    import torch

    from asyncflow.config import MegatronConfig
    from asyncflow.engines.megatron.actor import MegatronActor
    from asyncflow.models.parallel import destroy_megatron
    from tests.engines.megatron.dist_harness import fixed_batch

    torch.set_num_threads(1)
    actor = MegatronActor(MegatronConfig(micro_batch_size=2, lr=1e-2), model_dir)
    tokens, mask = fixed_batch()
    actor.offload()
    actor.onload()
    actor.trainer.train_step(tokens, mask)
    inner = actor.trainer.optimizer.optimizer
    moments = [v for state in inner.state.values() for k, v in state.items() if k in ("exp_avg", "exp_avg_sq")]
    before = [m.clone() for m in moments]
    actor.offload()
    out = {"moments": len(moments), "moment_bytes_left": sum(m.untyped_storage().nbytes() for m in moments)}
    actor.onload()
    out["moments_back"] = all(torch.equal(a, b) for a, b in zip(before, moments))
    destroy_megatron()
    return out


def _reference(model_dir: str) -> dict:
    import torch

    from asyncflow.config import MegatronConfig
    from asyncflow.engines.megatron.actor import MegatronActor
    from asyncflow.models.parallel import destroy_megatron
    from tests.engines.megatron.dist_harness import fixed_batch

    torch.set_num_threads(1)
    cfg = MegatronConfig(micro_batch_size=2)
    ref = MegatronActor(cfg, model_dir, trainable=False)
    tokens, _ = fixed_batch()
    resident = ref.compute_logprobs(tokens)
    weight_bytes = sum(p.numel() * p.element_size() for p in ref.trainer.module.parameters())
    ref.stream_weights_from_host()
    between = ref.streamer.device_bytes()
    streamed = ref.compute_logprobs(tokens)
    out = {"no_optimizer": ref.trainer.optimizer is None,
           "no_grad": not any(p.requires_grad for p in ref.trainer.module.parameters()),
           "equal": torch.equal(resident, streamed), "between": between, "after": ref.streamer.device_bytes(),
           "weight_bytes": weight_bytes, "loads": ref.streamer.loads,
           "layers": len(ref.trainer.module.decoder.layers), "micro_batches": tokens.shape[0] // 2}
    try:
        ref.trainer.zero_grad()
        out["train_refused"] = False
    except RuntimeError:
        out["train_refused"] = True
    destroy_megatron()
    return out


@pytest.fixture(scope="module")
def results(tiny_model_dir):
    with mp.get_context("spawn").Pool(1) as pool:
        return {name: pool.apply(fn, (str(tiny_model_dir), *args)) for name, fn, args in [
            ("plain", _train, (False, "float32")), ("offload", _train, (True, "float32")),
            ("early", _offload_before_the_first_step, ()), ("reference", _reference, ())]}


def test_offload_frees_everything_and_training_continues_bit_identically(results):
    plain, off = results["plain"], results["offload"]
    assert off["losses"] == plain["losses"] and off["logprobs"] == plain["logprobs"]
    assert all(b > 0 for b in off["freed"]) and off["left"] == [0, 0, 0]
    # Everything comes back, and the Adam moments born at the first step are managed from then on.
    assert off["back"] == off["freed"]
    assert off["losses"][2] < off["losses"][0]


def test_adam_moments_born_after_the_first_offload_are_offloaded(results):
    early = results["early"]
    assert early["moments"] > 0
    assert early["moment_bytes_left"] == 0  # once: every moment stayed on the device for the whole run
    assert early["moments_back"]


def test_reference_is_frozen_and_streams_its_layers(results):
    ref = results["reference"]
    assert ref["no_optimizer"] and ref["no_grad"] and ref["train_refused"]
    assert ref["equal"]
    assert ref["between"] == 0 and ref["after"] == 0 and ref["weight_bytes"] > 0
    assert ref["loads"] == ref["layers"] * ref["micro_batches"]
