"""Device memory leaves and comes back: the colocated ``sync`` offload and the streamed reference model.

On one gloo process with the real Megatron engine (DDP grad buffers, Megatron's optimizer):

- ``MegatronActor.offload`` frees every storage of parameters, gradient buffers and Adam state (0 bytes
  left), ``onload`` brings them back, and training continues bit-identically to a run that never offloaded;
- a frozen engine (``trainable=False``, the reference) has no optimizer or gradient buffers;
- ``LayerStreamer`` (``reference_placement: offload``) gives bit-identical logprobs, loads each layer once
  per ``compute_logprobs`` call (layer-major, ``layer_major``; at TP1, TP2 and PP2, where each stage loads its
  own layers once and hands every micro-batch's hidden states to the next) and holds no weight on the device
  between calls.

The engine's device is the CPU here, so the memory freed is host memory; the code is the GPU path's.
float32 only: Megatron's mixed-precision optimizer (bf16 weights with fp32 master copies, which
``offload.optimizer_tensors`` reaches through the optimizer's parameter groups) needs CUDA parameters.
"""

import multiprocessing as mp

import pytest

from tests.forkserver import start_method

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


def _padded_batch():
    """Seven rows of one width, each padded (id 0) from a different position: four micro-batches of 2 after
    ``compute_logprobs`` repeats the last row."""
    from tests.engines.megatron.dist_harness import fixed_batch

    tokens, _ = fixed_batch(batch=7, seq=12)
    for row, length in enumerate([12, 3, 9, 5, 12, 7, 1]):
        tokens[row, length:] = 0
    return tokens


def _reference(model_dir: str, tp: int = 1, out_dir: str | None = None, rank: int = 0, pp: int = 1) -> dict:
    import torch
    from megatron.core import parallel_state as ps

    from asyncflow.config import MegatronConfig
    from asyncflow.engines.megatron.actor import MegatronActor
    from asyncflow.models.parallel import destroy_megatron
    from tests.engines.megatron.dist_harness import fixed_batch

    def same(a, b):  # None on a stage before the last, on both paths
        return a is None and b is None if a is None or b is None else torch.equal(a, b)

    torch.set_num_threads(1)
    cfg = MegatronConfig(micro_batch_size=2, tensor_parallel=tp, pipeline_parallel=pp)
    ref = MegatronActor(cfg, model_dir, trainable=False)
    last = ps.is_pipeline_last_stage()
    batches = [fixed_batch()[0], _padded_batch()]
    resident = [ref.compute_logprobs(t) for t in batches]
    weight_bytes = sum(p.numel() * p.element_size() for p in ref.trainer.module.parameters())
    ref.stream_weights_from_host()
    between = ref.streamer.device_bytes()
    streamed, loads = [], []
    for t in batches:  # layer-major: each of this stage's layers loaded once per call
        before = ref.streamer.loads
        streamed.append(ref.compute_logprobs(t))
        loads.append(ref.streamer.loads - before)
    # The per-micro-batch path (Megatron's schedule with the streamer's hooks), for comparison.
    before = ref.streamer.loads
    hooked = ref.trainer.logprobs(batches[0])
    pairs = list(zip(resident, streamed))
    out = {"no_optimizer": ref.trainer.optimizer is None, "last": last,
           "no_grad": not any(p.requires_grad for p in ref.trainer.module.parameters()),
           "equal": [same(a, b) for a, b in pairs],
           "max_diff": max((float((a - b).abs().max()) for a, b in pairs if a is not None), default=0.0),
           "hooked_equal": same(resident[0], hooked), "hooked_loads": ref.streamer.loads - before,
           "between": between, "after": ref.streamer.device_bytes(), "weight_bytes": weight_bytes,
           "loads": loads, "layers": len(ref.trainer.module.decoder.layers),
           "micro_batches": [batches[0].shape[0] // 2, (batches[1].shape[0] + 1) // 2]}
    try:
        ref.trainer.zero_grad()
        out["train_refused"] = False
    except RuntimeError:
        out["train_refused"] = True
    destroy_megatron()
    if out_dir is not None:
        import json
        from pathlib import Path

        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(out))
    return out


def _reference_rank(rank: int, world: int, port: int, model_dir: str, out_dir: str, pp: int = 1) -> None:
    import os

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    _reference(model_dir, tp=world // pp, out_dir=out_dir, rank=rank, pp=pp)


@pytest.fixture(scope="module")
def results(tiny_model_dir):
    with mp.get_context(start_method()).Pool(1) as pool:
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


def _check_reference(ref: dict) -> None:
    assert ref["no_optimizer"] and ref["no_grad"] and ref["train_refused"]
    assert ref["between"] == 0 and ref["after"] == 0 and ref["weight_bytes"] > 0
    # Bit-identical to the resident model over several micro-batches, rows padded from different positions.
    assert ref["equal"] == [True, True], ref["max_diff"]
    # Layer-major: each layer visits the device once per call, not once per micro-batch (4 of them here).
    assert all(m > 1 for m in ref["micro_batches"])
    assert ref["loads"] == [ref["layers"], ref["layers"]]
    # Megatron's per-micro-batch schedule still streams through the hooks, with the same results.
    assert ref["hooked_equal"] and ref["hooked_loads"] == ref["layers"] * ref["micro_batches"][0]


def test_reference_is_frozen_and_streams_each_layer_once_per_call(results):
    _check_reference(results["reference"])


def test_layer_major_reference_at_tensor_parallel_2(tiny_model_dir, tmp_path):
    """Two gloo ranks of one TP group: each streams its shard of every layer once per call, and the
    collectives inside the layers (run layer-major, in the same order on both ranks) give the resident
    model's logprobs."""
    import json

    import torch.multiprocessing as tmp

    from asyncflow.models.parallel import free_port

    tmp.start_processes(_reference_rank, args=(2, free_port(), str(tiny_model_dir), str(tmp_path)), nprocs=2,
                        join=True, start_method=start_method())
    for rank in range(2):
        _check_reference(json.loads((tmp_path / f"rank{rank}.json").read_text()))


@pytest.mark.parametrize("tp", [1, 2])
def test_layer_major_reference_at_pipeline_parallel_2(tmp_path, tp):
    """Gloo ranks of two pipeline stages (TP1: one rank a stage; TP2: two, each exchanging with its own peer), two
    layers a stage: each stage loads its own layers once per call (the stage's layers, not layers x
    micro-batches), the first hands every micro-batch's hidden states to the second, and the last stage's
    logprobs are the resident PP2 reference's (None on the first stage, as there)."""
    import json

    import torch.multiprocessing as tmp

    from asyncflow.models.parallel import free_port
    from asyncflow.tiny_model import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "qwen2", family="qwen2", num_layers=4, seed=0)
    world = 2 * tp
    tmp.start_processes(_reference_rank, args=(world, free_port(), str(model_dir), str(tmp_path), 2), nprocs=world,
                        join=True, start_method=start_method())
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(world)]
    assert [r["last"] for r in ranks] == [False] * tp + [True] * tp  # Megatron's order: TP inside PP
    for ref in ranks:
        assert ref["layers"] == 2
        _check_reference(ref)
