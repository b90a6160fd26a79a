"""Megatron's fusions compile on first call (``asyncflow._deferred_compile``), not at import."""

import json
import subprocess
import sys

from asyncflow._deferred_compile import deferred


def test_deferred_applies_the_fuser_once_on_first_call():
    calls = []

    def fuser(fn):
        calls.append(fn.__name__)
        return lambda *a, **k: ("compiled", fn(*a, **k))

    @deferred(fuser)
    def add(a, b=0):
        """Adds."""
        return a + b

    assert calls == []  # decorating compiles nothing
    assert add(1, b=2) == ("compiled", 3)
    assert add(4) == ("compiled", 4)
    assert calls == ["add"]  # compiled once, then reused
    assert add.__name__ == "add" and add.__doc__ == "Adds."


def test_importing_megatron_after_asyncflow_loads_no_inductor():
    code = (
        "import json, sys, torch, asyncflow, megatron.core\n"
        "from megatron.core import jit\n"
        "from megatron.core.fusions import fused_bias_gelu\n"
        "print(json.dumps({'inductor': 'torch._inductor.compile_fx' in sys.modules,\n"
        "    'fuser': getattr(fused_bias_gelu.bias_gelu, 'deferred_fuser', None) is torch.compile,\n"
        "    'source': jit.__spec__.loader.get_filename(jit.__name__)}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    got = json.loads(out.strip().splitlines()[-1])
    assert got["inductor"] is False
    assert got["fuser"] is True  # the fusion still gets torch.compile, on its first call
    assert got["source"].endswith("megatron/core/jit.py")
