"""Vocab-parallel token entropy: value and gradient match torch's Categorical on the unpadded vocabulary.

Megatron runs in spawned gloo processes so that its patches and process group never leak into pytest.
"""

import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from asyncflow.models.parallel import free_port
from tests.forkserver import start_method

VOCAB, PADDED = 19, 24  # Megatron pads 19 to 24; the last 5 rows are padding


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """Padded logits [2, 5, 24] (garbage in the padded rows, a wide range elsewhere) and loss weights."""
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(2, 5, PADDED, generator=gen) * 4
    logits[0, 0, :VOCAB] = 0.0  # uniform: entropy log 19
    logits[1, 1, 3] = 60.0  # nearly one-hot: entropy ~ 0
    return logits, torch.randn(2, 5, generator=gen)


def _reference() -> tuple[torch.Tensor, torch.Tensor]:
    logits, weights = _inputs()
    x = logits[..., :VOCAB].clone().requires_grad_()
    entropy = torch.distributions.Categorical(logits=x).entropy()
    (entropy * weights).sum().backward()
    grad = torch.zeros(logits.shape)
    grad[..., :VOCAB] = x.grad
    return entropy.detach(), grad


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from asyncflow.engines.megatron.logprobs import token_entropy
    from asyncflow.models.parallel import destroy_megatron, init_megatron

    init_megatron(world, 1, seed=0)
    try:
        logits, weights = _inputs()
        shard = PADDED // world
        x = logits[..., rank * shard : (rank + 1) * shard].clone().requires_grad_()
        entropy = token_entropy(x, VOCAB)
        (entropy * weights).sum().backward()
        torch.save({"entropy": entropy.detach(), "grad": x.grad}, Path(out_dir) / f"rank{rank}.pt")
    finally:
        destroy_megatron()


def test_entropy_without_parallel_state_matches_categorical():
    from asyncflow.engines.megatron.logprobs import token_entropy

    logits, weights = _inputs()
    ref_entropy, ref_grad = _reference()
    x = logits.clone().requires_grad_()
    entropy = token_entropy(x, VOCAB)
    (entropy * weights).sum().backward()
    assert torch.allclose(entropy, ref_entropy, atol=1e-5)
    assert entropy[0, 0].item() == pytest.approx(torch.log(torch.tensor(19.0)).item(), abs=1e-6)
    assert torch.allclose(x.grad, ref_grad, atol=1e-5)
    assert not x.grad.isnan().any() and x.grad[..., VOCAB:].abs().max() == 0


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_vocab_parallel_entropy_and_gradient_match_categorical(tp, tmp_path):
    mp.start_processes(_worker, args=(tp, free_port(), str(tmp_path)), nprocs=tp, join=True,
                       start_method=start_method())
    ref_entropy, ref_grad = _reference()
    shard = PADDED // tp
    for rank in range(tp):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        assert torch.allclose(result["entropy"], ref_entropy, atol=1e-5)  # every rank holds the full entropy
        assert torch.allclose(result["grad"], ref_grad[..., rank * shard : (rank + 1) * shard], atol=1e-5)
