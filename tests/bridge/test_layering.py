"""Layers stack: the bridge never imports the engines (architecture facts live in ``asyncflow.models``)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "asyncflow"


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_bridge_and_models_do_not_import_engines_or_workflow():
    offenders = {}
    for folder in ("bridge", "models"):
        for path in (ROOT / folder).glob("*.py"):
            bad = {m for m in _imports(path) if m.startswith(("asyncflow.engines", "asyncflow.workflow"))}
            if bad:
                offenders[f"{folder}/{path.name}"] = sorted(bad)
    assert not offenders, offenders


def test_arch_is_the_bottom():
    assert not {m for m in _imports(ROOT / "models" / "arch.py") if m.startswith("asyncflow")}
