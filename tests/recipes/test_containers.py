"""containers/: the GPU image installs exactly setup.py's gpu extra, from a pinned base image.

The image cannot be built here (no network, no GPU); these checks keep its pins from drifting away from the
repository's.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import subprocess
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
INSTALL = ROOT / "containers/install_gpu_stack.sh"
DOCKERFILE = ROOT / "containers/Dockerfile"
APPTAINER = ROOT / "containers/asyncflow.def"


def _setup_list(name: str) -> list[Requirement]:
    """A list literal of setup.py (read, not run: running it would call setup())."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return [Requirement(r) for r in ast.literal_eval(node.value)]
    raise AssertionError(f"setup.py has no {name}")


def _installed_by_script() -> dict[str, Requirement]:
    """The quoted requirements the install script gives pip, by package name."""
    text = INSTALL.read_text()
    found = [Requirement(r) for r in re.findall(r'"([A-Za-z0-9_.-]+(?:\[[^\]]*\])?[=<>!~][^"]*)"', text)]
    return {r.name: r for r in found}


def test_install_script_pins_setup_pys_gpu_stack():
    script = _installed_by_script()
    for want in _setup_list("GPU_STACK"):
        assert want.name in script, f"containers/install_gpu_stack.sh does not install {want}"
        got = script[want.name]
        assert got.specifier == want.specifier, (str(got), str(want))
        assert got.extras == want.extras, (str(got), str(want))
    assert "/opt/asyncflow[gpu]" in INSTALL.read_text()  # and then the package itself, with the same extra


def test_transformer_engine_is_the_one_megatron_core_declares():
    """megatron-core 0.16.1 names its Transformer Engine (extras and upper bound) in its own "dev" extra."""
    te = next(r for r in _setup_list("GPU_STACK") if r.name == "transformer-engine")
    declared = [Requirement(r) for r in importlib.metadata.requires("megatron-core") or []]
    dev = next(r for r in declared if r.name == "transformer-engine" and r.marker and "dev" in str(r.marker))
    assert dev.extras <= te.extras, (str(dev), str(te))
    upper = [Version(s.version) for s in dev.specifier if s.operator == "<"]
    assert upper and [Version(s.version) for s in te.specifier if s.operator == "<"] == upper, (str(dev), str(te))


def test_images_share_a_pinned_base_and_the_install_script():
    docker_base = re.search(r"^FROM (\S+)$", DOCKERFILE.read_text(), re.M).group(1)
    apptainer_base = re.search(r"^From: (\S+)$", APPTAINER.read_text(), re.M).group(1)
    assert docker_base == apptainer_base
    image, _, tag = docker_base.partition(":")
    assert image.startswith(("nvidia/cuda", "nvcr.io/nvidia/")) and re.match(r"\d+\.\d+", tag), docker_base
    for path in (DOCKERFILE, APPTAINER):
        text = path.read_text()
        assert "containers/install_gpu_stack.sh" in text, path
        for part in ("setup.py", "asyncflow", "megatron_patches", "containers"):
            assert re.search(rf"(^|\s){part}\s", text, re.M), (path, part)
    result = subprocess.run(["bash", "-n", str(INSTALL)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
