"""Every command shown in the README and in docs/ is checked against the code.

Shell lines are read from the fenced ``bash``/``sh``/``shell`` blocks of ``README.md``, ``docs/*.md`` and the
``examples/*/README.md`` files. What each kind of line gets:

- ``asyncflow config ...`` and ``asyncflow plan ...`` run for real, in this process (exit 0, or the exit status
  the line's comment names, e.g. ``# exit 1``);
- ``asyncflow train|demo|profile|simulate ...``: the command line is parsed by the real parser and its config
  (file and ``key=value`` overrides) loaded and validated; the run itself is the job of the tests that run it;
- ``python tools/make_tiny_model.py ...`` runs for real in a scratch folder;
- any other ``python SCRIPT ...`` (tools, benchmarks, data preparation) is run up to its argument parser, which
  must accept the line's arguments: the script's own work (minutes of benchmark, a model on a cluster) is not
  done here;
- ``make TARGET``: the target exists (``make -n``); ``bash SCRIPT`` parses (``bash -n``); ``sbatch``: the script
  exists; ``pip install -e ".[EXTRA]"``: the extra exists.

Every repository path a line names must exist, and a line of any other kind fails the test, so a new kind of
command in the docs needs a rule here.
"""

from __future__ import annotations

import argparse
import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted(REPO.glob("examples/*/README.md"))]
SHELLS = {"bash", "sh", "shell", "console"}
RUN_FOR_REAL = {("config", "show"), ("config", "keys"), ("plan",)}
PATH_ROOTS = ("recipes/", "tools/", "bench/", "docs/", "examples/", "containers/", "asyncflow/")
PLACEHOLDERS = ("tests/path/", "my_pkg", "DIR", "OUT")


def _lines(doc: Path) -> list[tuple[str, str]]:
    """(where, command line) for every shell line of ``doc``'s fenced shell blocks, continuations joined."""
    out = []
    for match in re.finditer(r"^```(\w*)\n(.*?)^```", doc.read_text(), re.S | re.M):
        if match.group(1) not in SHELLS:
            continue
        text = match.group(2).replace("\\\n", " ")
        for n, line in enumerate(text.splitlines()):
            line = line.strip().removeprefix("$ ").strip()
            if line and not line.startswith("#"):
                out.append((f"{doc.relative_to(REPO)} block line {n + 1}", line))
    return out


ALL = [item for doc in DOCS for item in _lines(doc)]


def _split(line: str) -> tuple[list[str], str]:
    """The words of ``line`` before its comment (environment assignments dropped), and the comment."""
    quote, cut = None, len(line)
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            cut = i
            break
    # A synopsis's optional parts (``[--steps 16]``) are passed as given: the parser must know each of them.
    words = [w.removeprefix("[").removesuffix("]") for w in shlex.split(line[:cut])]
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
        words = words[1:]
    return words, line[cut:]


class _Parsed(Exception):
    """Raised by the patched ``parse_args``: the command line was accepted; stop before the work."""


def _parse_only(monkeypatch, run) -> None:
    for method in ("parse_args", "parse_intermixed_args"):  # recipes_check parses intermixed
        real = getattr(argparse.ArgumentParser, method)

        def parse_then_stop(self, args=None, namespace=None, _real=real):
            _real(self, args, namespace)
            raise _Parsed

        monkeypatch.setattr(argparse.ArgumentParser, method, parse_then_stop)
    with pytest.raises(_Parsed):
        run()


def _check_paths(words: list[str]) -> None:
    for word in words:
        for part in word.split("="):
            if part.startswith(PATH_ROOTS) and not any(p in part for p in PLACEHOLDERS):
                path = part.split(":")[0].rstrip(",")
                assert (REPO / path).exists(), f"the docs name {path}, which is not in the repository"


def _asyncflow(words: list[str], comment: str, monkeypatch, capsys) -> None:
    from asyncflow.cli import main
    from asyncflow.config import load_config

    args = words[1:]
    command = tuple(args[:2]) if args[:1] == ["config"] else tuple(args[:1])
    if command in RUN_FOR_REAL:
        want = int(m.group(1)) if (m := re.search(r"exit (\d)", comment)) else 0
        assert main(args) == want
        return
    _parse_only(monkeypatch, lambda: main(args))
    flags_with_values = {"--costs", "--out", "--lengths", "--prompt-len", "--steps", "--devices"}
    items = [a for i, a in enumerate(args[1:]) if not a.startswith("--") and args[i] not in flags_with_values]
    if items and "=" not in items[0] and (REPO / items[0]).exists():
        monkeypatch.undo()
        path = REPO / items[0]
        load_config(path / "config.yaml" if path.is_dir() else path, items[1:])


def _python(words: list[str], tmp_path, monkeypatch) -> None:
    if words[1] == "-m":
        assert words[2] in ("pytest", "asyncflow.recipes_check"), f"no rule for python -m {words[2]}"
        if words[2] == "asyncflow.recipes_check":
            from asyncflow.recipes_check import main

            _parse_only(monkeypatch, lambda: main(words[3:]))
        return
    script = REPO / words[1]
    assert script.exists(), f"{words[1]} is not in the repository"
    monkeypatch.setattr(sys, "argv", [str(script), *words[2:]])
    if words[1] == "tools/make_tiny_model.py":
        monkeypatch.chdir(tmp_path)
        with pytest.raises(SystemExit) as done:
            runpy.run_path(str(script), run_name="__main__")
        assert done.value.code in (0, None)
        return
    _parse_only(monkeypatch, lambda: runpy.run_path(str(script), run_name="__main__"))


@pytest.mark.parametrize(("where", "line"), ALL, ids=[f"{w}: {ln[:60]}" for w, ln in ALL])
def test_doc_command(where, line, tmp_path, monkeypatch, capsys):
    words, comment = _split(line)
    assert words, f"{where}: empty command {line!r}"
    _check_paths(words)
    program = Path(words[0]).name
    if program == "asyncflow":
        _asyncflow(words, comment, monkeypatch, capsys)
    elif program in ("python", "python3"):
        _python(words, tmp_path, monkeypatch)
    elif program == "make":
        targets = [w for w in words[1:] if "=" not in w]
        done = subprocess.run(["make", "-n", *targets], cwd=REPO, capture_output=True, text=True)
        assert done.returncode == 0, f"{where}: make {targets}: {done.stderr}"
    elif program == "bash":
        script = next(w for w in words[1:] if not w.startswith("-"))
        assert subprocess.run(["bash", "-n", REPO / script]).returncode == 0
    elif program == "sbatch":
        assert any((REPO / w).exists() for w in words[1:] if "/" in w) or "--wrap" in words, where
    elif program == "pip":
        extras = re.findall(r"\.\[([\w,-]+)\]", line)
        setup = (REPO / "setup.py").read_text()
        for extra in (e for group in extras for e in group.split(",")):
            assert f'"{extra}"' in setup, f"{where}: no extra {extra!r} in setup.py"
    else:
        pytest.fail(f"{where}: no rule for the command {line!r}; add one to tests/test_docs_commands.py")


def test_docs_show_commands():
    """The check above sees the docs' commands (a broken block parser would pass vacuously)."""
    programs = {Path(_split(line)[0][0]).name for _, line in ALL}
    assert {"make", "asyncflow", "python"} <= programs
