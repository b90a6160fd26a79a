"""PNG charts of a run: reward curve, sync-vs-async comparison, and the timeline's Gantt chart.

Figures are built with ``matplotlib.figure.Figure`` and saved through the Agg canvas, never through
``pyplot``: no display is needed, and the caller's process keeps whatever backend it had (pyplot's global
figure state is also not thread-safe). matplotlib is imported by the functions that draw: every Ray worker of a
run imports this package (for the timeline), and importing matplotlib there cost each of them about 0.35 s of
CPU at start-up.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from . import keys

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from .timeline import Timeline

Records = Sequence[Mapping[str, Any]]


def load_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Records of a ``metrics.jsonl`` file (blank lines skipped)."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def rolling_mean(values: Sequence[float], window: int) -> np.ndarray:
    """Trailing mean over up to ``window`` points (shorter at the start, so the curve starts at step 0)."""
    values = np.asarray(values, dtype=float)
    csum = np.concatenate([[0.0], np.cumsum(values)])
    idx = np.arange(1, len(values) + 1)
    lo = np.maximum(0, idx - max(1, window))
    return (csum[idx] - csum[lo]) / (idx - lo)


def auto_window(n: int) -> int:
    """Rolling-mean window for ``n`` points: a tenth of the run, between 1 and 20 steps."""
    return max(1, min(20, n // 10))


def _records(source: str | Path | Records) -> Records:
    return load_jsonl(source) if isinstance(source, (str, Path)) else source


def _series(records: Records, key: str, x: str) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) of the records holding ``key``; ``x`` is a record field, ``time`` (seconds from the run start) or
    ``samples`` (samples trained so far, from ``actor/rows``)."""
    rows = [r for r in records if r.get(key) is not None]
    if not rows:
        available = sorted({k for r in records for k in r} - {"step", "time", "elapsed"})
        raise ValueError(f"no records hold {key!r}; keys present: {available}")
    if x == "time":
        # ``elapsed`` counts from the run's start; ``time`` alone would hide how long the first step took.
        xs = [r["elapsed"] if "elapsed" in r else r["time"] - rows[0]["time"] for r in rows]
    elif x == "samples":  # samples trained so far, this step's included: runs compared after equal work
        xs = np.cumsum([r.get("actor/rows", 0.0) for r in rows])
    else:
        xs = [r[x] for r in rows]
    return np.asarray(xs, dtype=float), np.asarray([r[key] for r in rows], dtype=float)


def _figure(width: float, height: float) -> Figure:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height))


def _save(fig: Figure, out_png: str | Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    fig.savefig(out_png, dpi=120, bbox_inches="tight")
    return out_png


def plot_reward_curve(source: str | Path | Records, out_png: str | Path, key: str = keys.REWARD_MEAN,
                      window: int | None = None, title: str | None = None) -> Path:
    """Plot ``key`` against step (raw points and a trailing rolling mean) from records or a JSONL path.

    ``window`` is the rolling-mean length in steps (default ``auto_window``).
    """
    steps, values = _series(_records(source), key, "step")
    window = window or auto_window(len(values))
    fig = _figure(8, 4.5)
    ax = fig.add_subplot()
    ax.plot(steps, values, color="tab:blue", alpha=0.3, lw=1, marker=".", ms=4, label=key)
    ax.plot(steps, rolling_mean(values, window), color="tab:blue", lw=2.2, label=f"rolling mean ({window} steps)")
    ax.set(xlabel="step", ylabel=key, title=title or f"{key} per step")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    return _save(fig, out_png)


def plot_compare(runs: Mapping[str, str | Path | Records], out_png: str | Path, key: str = keys.REWARD_MEAN,
                 x: str = "time", window: int | None = None, title: str | None = None) -> Path:
    """Overlay ``key`` of several runs (e.g. ``{"sync": ..., "async": ...}``) against wall time or step.

    ``x`` is ``time`` (seconds since each run's start), ``samples`` (samples trained so far) or a record field
    such as ``step``; ``window`` is the rolling-mean length in points (default ``auto_window`` of each run).
    """
    return plot_compare_panels({title or f"{key}: {' vs '.join(runs)}": runs}, out_png, key, x, window)


def plot_compare_panels(panels: Mapping[str, Mapping[str, str | Path | Records]], out_png: str | Path,
                        key: str = keys.REWARD_MEAN, x: str = "time", window: int | None = None) -> Path:
    """``plot_compare`` for several groups of runs in one figure, one panel per group (``{title: runs}``), stacked.
    Repeats of one run, labelled ``name#1``, ``name#2``, share a colour and differ in line style."""
    fig = _figure(8, 4.5 * len(panels))
    xlabel = {"time": "wall time (s)", "samples": "samples trained"}.get(x, x)
    for row, (title, runs) in enumerate(panels.items()):
        ax = fig.add_subplot(len(panels), 1, row + 1)
        kinds: dict[str, int] = {}  # repeats of one run ("sync#1", "sync#2"): one colour, a line style each
        repeats: dict[str, int] = {}
        for label, source in runs.items():
            kind = label.split("#")[0]
            color = f"C{kinds.setdefault(kind, len(kinds)) % 10}"
            repeats[kind] = repeats.get(kind, -1) + 1
            style = ("-", "--", ":", "-.")[repeats[kind] % 4]
            xs, values = _series(_records(source), key, x)
            w = window or auto_window(len(values))
            ax.plot(xs, values, color=color, alpha=0.25, lw=1, ls=style)
            ax.plot(xs, rolling_mean(values, w), color=color, lw=2.2, ls=style, label=f"{label} (rolling mean {w})")
        ax.set(xlabel=xlabel, ylabel=key, title=title)
        ax.grid(alpha=0.3)
        ax.legend(loc="best")
    if len(panels) > 1:
        fig.tight_layout()
    return _save(fig, out_png)


def _nesting_depths(spans: Iterable[Mapping[str, Any]]) -> list[tuple[Mapping[str, Any], int]]:
    """Each span of one row with how many spans of the row enclose it (nested spans draw thinner)."""
    out, open_ends = [], []
    for s in sorted(spans, key=lambda s: (s["start"], -s["end"])):
        while open_ends and open_ends[-1] <= s["start"]:
            open_ends.pop()
        out.append((s, len(open_ends)))
        open_ends.append(s["end"])
    return out


def plot_gantt(timeline: Timeline, out_png: str | Path, title: str | None = None) -> Path:
    """Gantt chart of a timeline: one row per (group, worker), bars colored by span name, x in seconds.

    Row labels carry each worker's idle fraction; nested spans are drawn thinner on top of their parent.
    """
    spans = timeline.export_spans()
    if not spans:
        raise ValueError("the timeline has no spans to plot")
    t0, t1 = timeline.wall_span()
    rows = timeline.rows()
    names = list(dict.fromkeys(s["name"] for s in sorted(spans, key=lambda s: s["start"])))
    cmap = _colormap(len(names))
    colors = {n: cmap(i % cmap.N) for i, n in enumerate(names)}

    height = min(40.0, 1.6 + 0.42 * len(rows))
    fig = _figure(12, height)
    ax = fig.add_subplot()
    spans_by_row: dict[tuple[str, Any], list[Mapping[str, Any]]] = {}
    for s in spans:
        spans_by_row.setdefault((s["group"], s["worker"]), []).append(s)
    for y, row in enumerate(rows):
        by_draw: dict[tuple[str, int], list[tuple[float, float]]] = {}
        for s, depth in _nesting_depths(spans_by_row[row]):
            by_draw.setdefault((s["name"], depth), []).append((s["start"] - t0, s["end"] - s["start"]))
        for (name, depth), xranges in by_draw.items():
            h = 0.8 * 0.6**depth
            ax.broken_barh(xranges, (y - h / 2, h), facecolors=colors[name], edgecolor="none", zorder=2 + depth)
    labels = [f"{g}/{w}  idle {timeline.idle_fraction(g, w):.0%}" for g, w in rows]
    ax.set_yticks(range(len(rows)), labels, fontsize=9 if len(rows) < 40 else 6)
    for y in range(1, len(rows)):
        if rows[y][0] != rows[y - 1][0]:  # a line between worker groups
            ax.axhline(y - 0.5, color="0.6", lw=0.8)
    ax.set_ylim(len(rows) - 0.5, -0.5)  # first group on top
    ax.set_xlim(0, max(t1 - t0, 1e-9))
    ax.set_xlabel("seconds from start")
    ax.grid(axis="x", alpha=0.3, zorder=0)
    idle = ", ".join(f"{g} {f:.0%}" for g, f in timeline.idle_fractions().items())
    ax.set_title(title or f"timeline ({t1 - t0:.1f} s; idle: {idle})", fontsize=10)
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color=colors[n], label=n) for n in names], loc="upper left",
              bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False, title="span")
    return _save(fig, out_png)


def _colormap(n: int):
    from matplotlib import colormaps

    return colormaps["tab10" if n <= 10 else "tab20"]
