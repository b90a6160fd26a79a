"""megatron_patches: every target exists, apply() is idempotent, CUDA machines are left alone."""

import subprocess
import sys
import textwrap

import pytest

import megatron_patches


def _run(code: str) -> str:
    """Run ``code`` in a fresh interpreter (patches are process-wide) and return its stdout. The interpreter
    imports asyncflow first, as every process of a run does, so that Megatron's import does not compile its
    fusions (``asyncflow._deferred_compile``: about 3 s less each)."""
    code = "import asyncflow\n" + textwrap.dedent(code)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_every_patched_target_exists_in_installed_megatron():
    assert megatron_patches.missing_targets() == []


def test_each_patch_file_has_header_and_targets():
    for patch in megatron_patches.PATCHES:
        doc = patch.__doc__ or ""
        assert "Target" in doc and "Reason" in doc and "Megatron versions checked" in doc, patch.__name__
        assert patch.TARGETS, patch.__name__


def test_installed_version_is_supported():
    assert megatron_patches.check_version().startswith("0.16")


@pytest.mark.parametrize("version", ["0.15.3", "0.17.0", "1.0.0", "0.160.0"])
def test_unsupported_version_gets_clear_error(version):
    with pytest.raises(megatron_patches.UnsupportedMegatronVersion, match=r"supports megatron-core 0\.16\.x"):
        megatron_patches.check_version(version)


@pytest.mark.slow
def test_apply_is_idempotent_and_redirects_cuda():
    out = _run(
        """
        import torch, megatron_patches
        assert megatron_patches.apply() is True
        assert megatron_patches.apply() is True
        t = torch.zeros(3, device="cuda")
        print(t.device, torch.cuda.current_device(), torch.ones(2).cuda().device)
        from megatron.core.tensor_parallel import random as r
        print(r._get_cuda_rng_state().dtype)
        """
    )
    assert out.split() == ["cpu", "cpu", "cpu", "torch.uint8"]


def test_changes_nothing_where_cuda_is_available():
    out = _run(
        """
        import torch, megatron_patches
        original = torch.cuda.current_device
        torch.cuda.is_available = lambda: True  # pretend to be a GPU machine
        print(megatron_patches.apply(), torch.cuda.current_device is original)
        from megatron.core.tensor_parallel import random as r
        print(r._get_cuda_rng_state.__module__)
        """
    )
    assert out.split() == ["False", "True", "megatron.core.tensor_parallel.random"]


def test_rng_tracker_forks_and_restores_cpu_state():
    out = _run(
        """
        import torch, megatron_patches
        megatron_patches.apply()
        from megatron.core.tensor_parallel import random as r
        tracker = r.get_cuda_rng_tracker()
        tracker.reset()
        torch.manual_seed(0)
        tracker.add("model-parallel-rng", 123)
        before = torch.get_rng_state()
        with tracker.fork("model-parallel-rng"):
            a = torch.rand(3)
        assert torch.equal(torch.get_rng_state(), before)  # the default stream is untouched
        torch.manual_seed(123)
        print(torch.equal(a, torch.rand(3)))
        """
    )
    assert out.strip() == "True"


@pytest.mark.slow
def test_mixed_precision_reports_cuda_type_names_only_inside_the_optimizers():
    out = _run(
        """
        import torch, megatron_patches
        from megatron_patches import mixed_precision as mp
        megatron_patches.apply(); megatron_patches.apply()
        from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params as F16
        print(F16.__init__.__wrapped__._asyncflow_cuda_type_names if hasattr(F16.__init__.__wrapped__,
              "_asyncflow_cuda_type_names") else "once")
        x = torch.zeros(2, dtype=torch.bfloat16)
        with mp.CudaTypeNamesMode():
            print(x.type(), x.float().type(), x.type(torch.float32).dtype)
        print(x.type())
        """
    )
    assert out.split() == ["once", "torch.cuda.BFloat16Tensor", "torch.cuda.FloatTensor", "torch.float32",
                           "torch.BFloat16Tensor"]
