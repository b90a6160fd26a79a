"""The methods of ``bench/weight_sync.py``: what runs inside the trainer ranks and the vLLM engine.

- (a) staged, the loop's path: ``TrainerRank.sync("a")`` runs the trainer's own ``weight_stager``; the engine's
  ``VllmRollout.apply_staged`` reads it (``_engine_commands``'s ``staged``; ``_w_read_only`` times the reading alone).
- (b) gather + broadcast, as verl and slime do it: ``baseline_stream`` (an all-gather per parameter),
  ``ShmSender`` (buckets through one shared slot, a TCPStore key per bucket) and ``_w_connect`` / ``_w_receive`` (the
  vLLM workers' side, ``reload_weights`` per bucket).
- (c) ``memcpy_seconds``; vLLM's own reload of the checkpoint from memory (``_w_floor``).

``rank_main`` and ``vllm_main`` are the bodies of the processes the harness starts (``Trainers``, ``Engine``).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import sys
import time
import traceback

import torch

MiB = 2**20
STORE_TIMEOUT = datetime.timedelta(minutes=10)


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

    def __init__(self, store_port: int, stage: int, nbytes: int, session: str):
        from asyncflow.transfer_queue.shm import Arena

        self.stage = stage
        self.store = torch.distributed.TCPStore("127.0.0.1", store_port, is_master=False, timeout=STORE_TIMEOUT)
        self.arena = Arena.create(max(nbytes, 64), f"afq-{os.getpid()}-ws{session}-s{stage}")
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
        self.sender = ShmSender(store_port, self.rank.pp, nbytes, self.spec["session"])
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
        "pids": lambda: rpc("asyncflow_pid"),  # the loop's worker extension, loaded here too
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
