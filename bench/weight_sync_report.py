"""The report of ``bench/weight_sync.py``: the table per workload and vLLM TP, the correctness checks, and one
PASS/MISS line per target of the weight path."""

from __future__ import annotations

import dataclasses

import torch

from bench.weight_sync_methods import MiB

TOL = 1e-5


@dataclasses.dataclass
class Measure:
    """One version applied by one method (seconds, bytes)."""

    blocked: float | None = None
    paused: float | None = None
    e2e: float | None = None
    pack: float | None = None
    transport: float | None = None
    apply: float | None = None
    bytes_per_worker: float | None = None
    rss_trainer: float | None = None  # worst exporting rank
    rss_workers: list[float] | None = None
    rss_trainer_excess: float | None = None  # worst (peak extra - own shard - 2 buckets) over ranks


def best(ms: list[Measure]) -> Measure:
    """Best of rounds: the shortest time of each kind, the largest bytes and memory."""
    out = Measure()
    for f in dataclasses.fields(Measure):
        vals = [getattr(m, f.name) for m in ms if getattr(m, f.name) is not None]
        if not vals:
            continue
        if f.name == "rss_workers":
            setattr(out, f.name, [max(v) for v in zip(*vals)])
        elif f.name.startswith(("rss", "bytes")):
            setattr(out, f.name, max(vals))
        else:
            setattr(out, f.name, min(vals))
    return out


def check_logprobs(log) -> tuple[bool, str]:
    """Within a step every method gives the same logprobs (TOL); each step's first method changed them."""
    if not log or log[0][2] is None:
        return True, "logprobs: not checked"
    worst, least_change, prev, step_ref = 0.0, float("inf"), None, {}
    for label, _method, lp in log:
        lp = torch.tensor(lp)
        if label not in step_ref:
            if prev is not None:
                least_change = min(least_change, (lp - prev).abs().max().item())
            step_ref[label] = lp
        else:
            worst = max(worst, (lp - step_ref[label]).abs().max().item())
        prev = lp
    ok = worst <= TOL and least_change > 10 * TOL
    return ok, (f"logprobs: (a) vs (b) with the same weights, max |diff| {worst:.2e} (tolerance {TOL:g}); every new "
                f"version changed them by >= {least_change:.2e} -> {'PASS' if ok else 'FAIL'}")


def _cell(v, base=None, digits=2) -> str:
    if v is None:
        return "-"
    text = f"{v:.{digits}f}"
    return f"{text} ({v / base:.2f}x)" if base else text


def _mib(v) -> str:
    return "-" if v is None else f"{v / MiB:.0f}"


ROWS = [("a", "(a) staged: stage() + apply_staged (the loop's path)"),
        ("b", "(b) TP all-gather + shared-memory hand-off of full buckets (verl/slime)"),
        ("memcpy", "(c) memcpy of the model's bytes"),
        ("floor whole", "vLLM reload_weights, whole model from memory, one call"),
        ("floor buckets", "vLLM reload_weights, same bytes in buckets")]


def print_table(title: str, res: dict, tp: int) -> None:
    base = res["b"]
    print(f"\n### {title}\n")
    print("| method | trainer blocked s | rollout paused s | end to end s | pack s | transport s | apply s "
          "| MB per vLLM worker | peak extra RSS, worst trainer rank MiB | peak extra RSS per vLLM worker MiB |")
    print("|---" * 10 + "|")
    for key, name in ROWS:
        m = res[key]
        ratio = key != "b"
        workers = "-" if m.rss_workers is None else ", ".join(_mib(v) for v in m.rss_workers)
        mb = None if m.bytes_per_worker is None else m.bytes_per_worker / 1e6
        print(f"| {name} | {_cell(m.blocked, ratio and base.blocked)} | {_cell(m.paused, ratio and base.paused)} "
              f"| {_cell(m.e2e, ratio and base.e2e)} | {_cell(m.pack)} | {_cell(m.transport)} | {_cell(m.apply)} "
              f"| {_cell(mb, ratio and base.bytes_per_worker / 1e6, 0)} | {_mib(m.rss_trainer)} | {workers} |")
    print(f"\nratios are against (b) in the same run; vLLM TP{tp}. Phases: (a) pack = stage() on the slowest rank, "
          "transport = staged -> apply starts plus the slowest worker's reading of its boxes (timed again, alone, "
          "right after), apply = the rest of apply_staged (vLLM's reload, rpc); (b) pack = all-gathers and "
          "conversion on the busiest sender, transport = copying buckets into the shared slot, apply = reload "
          "(slowest worker); the phases of (b) overlap (bucket i+1 is gathered while bucket i is applied).")


def target_lines(res: dict, tp: int, model_bytes: int, largest_bucket: int, segment_bytes: int) -> list[str]:
    """One line per target of the issue: PASS/MISS with the numbers."""
    a, b, floor = res["a"], res["b"], res["floor whole"].e2e

    def line(ok, text):
        return f"- {'PASS' if ok else 'MISS'}: {text}"

    out = [line(a.blocked <= 0.25, f"trainer blocked <= 0.25 s per version: {a.blocked:.3f} s"),
           line(a.e2e <= 1.3 * floor, f"end to end <= 1.3 x vLLM's own apply ({floor:.2f} s -> {1.3 * floor:.2f} s): "
                                      f"{a.e2e:.2f} s ({a.e2e / floor:.2f}x)"),
           line(a.e2e < b.e2e, f"end to end faster than the baseline: {a.e2e:.2f} s vs {b.e2e:.2f} s "
                               f"({b.e2e / a.e2e:.2f}x faster)"),
           line(a.paused <= 1.2 * floor, f"rollout paused <= 1.2 x vLLM's own apply ({1.2 * floor:.2f} s): "
                                         f"{a.paused:.2f} s ({a.paused / floor:.2f}x)")]
    share = a.bytes_per_worker / b.bytes_per_worker
    if tp > 1:
        out.append(line(share <= 0.55, f"bytes per vLLM worker about half the baseline's: "
                                       f"{a.bytes_per_worker / 1e6:.0f} MB vs {b.bytes_per_worker / 1e6:.0f} MB "
                                       f"({share:.2f}x)"))
    else:
        out.append(f"- n/a: bytes per vLLM worker at TP1 ({share:.2f}x of the baseline's: one worker needs the "
                   "whole model either way)")
    limit = model_bytes / tp + 2 * largest_bucket
    worst_worker = max(a.rss_workers)
    ok = a.rss_trainer_excess <= 0 and worst_worker <= limit
    out.append(line(ok, f"peak extra memory <= own shard + two of the largest bucket ({_mib(largest_bucket)} MiB; "
                        f"a fused group is never split): worst trainer rank {_mib(a.rss_trainer)} MiB "
                        f"({_mib(-a.rss_trainer_excess)} MiB under its bound), worst vLLM worker "
                        f"{_mib(worst_worker)} MiB <= {_mib(limit)} MiB ({worst_worker * tp / model_bytes:.2f}x "
                        "its shard)"))
    out.append(f"  (the staging segments stand apart from that: two slots of a rank's pieces, {_mib(segment_bytes)} "
               "MiB for the largest rank, allocated once, resident after the first two versions)")
    return out
