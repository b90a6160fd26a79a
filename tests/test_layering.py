"""Layers stack: no asyncflow module imports a layer above its own, the workflow never imports Megatron or vLLM,
and no asyncflow modules import each other in a circle.

The order is written once, in ``LAYERS`` (bottom first); every module of the package must fall in one of them,
so a new package fails here until it is placed. Imports are read from the source (``ast``), at module level
and inside functions alike; ``if TYPE_CHECKING:`` blocks are not imports at run time and are skipped.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "asyncflow"

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("foundation", ("asyncflow", "asyncflow._deferred_compile", "asyncflow.registry", "asyncflow.ports",
                    "asyncflow.models", "asyncflow.tiny_model")),
    # Each component's own config dataclass sits below the config tree that gathers them.
    ("component configs", ("asyncflow.config_loader", "asyncflow.bridge.config", "asyncflow.data.config",
                           "asyncflow.observability.config", "asyncflow.transfer_queue.config")),
    ("components", ("asyncflow.transfer_queue", "asyncflow.data", "asyncflow.algorithms", "asyncflow.observability")),
    ("tasks", ("asyncflow.rewards", "asyncflow.agents")),
    # The config tree gathers the components' configs; its cross-key rules ask their registries (estimator scopes).
    ("config", ("asyncflow.config", "asyncflow.config_rules", "asyncflow.config_keys")),
    ("bridge", ("asyncflow.bridge",)),
    ("engines", ("asyncflow.engines",)),
    ("workflow", ("asyncflow.workflow",)),
    ("planning", ("asyncflow.planner", "asyncflow.simulator", "asyncflow.recipes_check")),
    ("entry points", ("asyncflow.cli", "asyncflow.demo", "asyncflow.api")),
]
"""Bottom first. A module may import its own layer and those below; the longest matching name places it."""

FACADE = {("asyncflow", "asyncflow.api")}
"""Upward imports allowed inside a function only: ``asyncflow.train`` is the package's lazy ``__getattr__``,
importing ``asyncflow.api`` when first asked for, never when the package is imported."""

BACKENDS = ("megatron", "megatron_patches", "vllm")
"""What the workflow reaches only through the engine interfaces (``asyncflow.engines.base``)."""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _absolute(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".")
    if MODULES[module].name != "__init__.py":
        package = package[:-1]
    package = package[:len(package) - node.level + 1]
    return ".".join(package + ([node.module] if node.module else []))


@functools.cache
def imports(module: str, module_level_only: bool = False) -> frozenset[str]:
    """The modules ``module`` imports (``from pkg import sub`` counts as ``pkg.sub`` where that is a module)."""
    found: set[str] = set()

    def visit(node: ast.AST, top: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child, top)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, node)
            subs = {f"{base}.{alias.name}" for alias in node.names} & MODULES.keys()
            found.update(subs or {base})
        if module_level_only and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return
        for child in ast.iter_child_nodes(node):
            visit(child, top)

    visit(ast.parse(MODULES[module].read_text()), True)
    return frozenset(found)


@functools.cache
def layer_of(module: str) -> int | None:
    """Index into ``LAYERS`` of the longest name that ``module`` is or lies under."""
    best, best_len = None, -1
    for index, (_, names) in enumerate(LAYERS):
        for name in names:
            inside = module == name or (name != "asyncflow" and module.startswith(name + "."))
            if inside and len(name) > best_len:
                best, best_len = index, len(name)
    return best


def test_every_module_is_placed_in_a_layer():
    unplaced = sorted(m for m in MODULES if layer_of(m) is None)
    assert not unplaced, f"place these in tests/test_layering.py LAYERS: {unplaced}"


def test_no_module_imports_a_layer_above_its_own():
    upward = []
    for module in MODULES:
        mine = layer_of(module)
        for target in imports(module):
            theirs = layer_of(target) if target.startswith("asyncflow") else None
            if (module, target) in FACADE and target not in imports(module, module_level_only=True):
                continue
            if theirs is not None and mine is not None and theirs > mine:
                upward.append(f"{module} ({LAYERS[mine][0]}) -> {target} ({LAYERS[theirs][0]})")
    assert not upward, "\n".join(upward)


def test_the_workflow_never_imports_megatron_or_vllm():
    reach = {}
    for module in MODULES:
        if module.startswith("asyncflow.workflow"):
            bad = {t for t in imports(module) if t.split(".")[0] in BACKENDS or
                   t.startswith(("asyncflow.engines.megatron", "asyncflow.engines.vllm", "asyncflow.models.megatron",
                                 "asyncflow.models.parallel"))}
            if bad:
                reach[module] = sorted(bad)
    assert not reach, reach


def test_arch_is_the_bottom():
    """Architecture facts import nothing of asyncflow: the bridge, the planner and the engines all read them."""
    assert not {m for m in imports("asyncflow.models.arch") if m.startswith("asyncflow")}


def test_the_workflow_takes_only_tokenizers_from_transformers():
    models = {}
    for module, path in MODULES.items():
        if module.startswith("asyncflow.workflow"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "transformers":
                    models[module] = [a.name for a in node.names if "Tokenizer" not in a.name]
                elif isinstance(node, ast.Import) and any(a.name.startswith("transformers") for a in node.names):
                    models[module] = ["transformers"]
    assert not any(models.values()), models


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            connect(v)
    return found


def _graph(module_level_only: bool) -> dict[str, set[str]]:
    # A package's own __init__ runs before any of its modules: importing it from inside is no circle.
    return {m: {t for t in imports(m, module_level_only) if t in MODULES and not m.startswith(t + ".")}
            for m in MODULES}


def test_no_import_cycles_at_module_level():
    assert not _cycles(_graph(module_level_only=True))


def test_no_import_cycles_even_through_imports_inside_functions():
    """A circle closed by an import inside a function still points at code in the wrong place."""
    assert not _cycles(_graph(module_level_only=False))


def test_the_checks_see_an_upward_import_and_a_circle():
    assert layer_of("asyncflow.data.config") < layer_of("asyncflow.data") < layer_of("asyncflow.config")
    assert layer_of("asyncflow.workflow.loop") > layer_of("asyncflow.engines.base")
    assert layer_of("asyncflow.new") is None
    assert "asyncflow.engines.base" in imports("asyncflow.workflow.train_services")  # inside a function
    assert "asyncflow.engines.base" not in imports("asyncflow.workflow.train_services", module_level_only=True)
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
