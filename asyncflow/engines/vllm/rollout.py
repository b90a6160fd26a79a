"""A vLLM rollout engine: generation with per-token logprobs and versioned in-place weight updates."""

from __future__ import annotations

import itertools
import json
import os
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch

from asyncflow.config import VllmConfig
from asyncflow.engines.base import RolloutEngine, Sample
from asyncflow.engines.vllm.worker_extension import EXTENSION


def _environment(cfg: VllmConfig, cpus: list[int] | None, visible_devices: list[str] | None) -> None:
    """What vLLM reads from the environment at import and engine start; set only where the user has not,
    except the devices, which placement decides."""
    if visible_devices:  # before CUDA starts in this process: vLLM's TP workers inherit it
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(visible_devices)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.kv_cache_gib))
    rpc = os.environ.get("VLLM_RPC_BASE_PATH")
    if rpc is None or Path(rpc).parent == _IPC:  # unset, or a parent engine process's (inherited): this one's own
        path = str(ipc_dir())
        if len(path) <= IPC_BASE_MAX:  # else (a long TMPDIR) vLLM's default, whose sockets it may still fit
            os.environ["VLLM_RPC_BASE_PATH"] = path
    if cfg.in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    tp = cfg.tensor_parallel
    if cpus:
        # vLLM's CPU workers bind their OpenMP threads to these cores (they would claim every core otherwise):
        # one "|"-separated list per tensor-parallel rank; ranks share a core when there are fewer cores.
        per_rank = [cpus[i * len(cpus) // tp:(i + 1) * len(cpus) // tp] or [cpus[i % len(cpus)]] for i in range(tp)]
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(",".join(map(str, c)) for c in per_rank))
    elif tp > 1 and not torch.cuda.is_available():
        # One core per CPU worker; without it start-up fails with "Not enough allowed NUMA nodes".
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(tp)))


# The CPU tensor-parallel group's shared-memory communicator: its segments are unlinked by a C++ destructor that runs
# only when a worker exits normally; a worker vLLM has to kill at shutdown (slow to exit) leaves them behind.
_SHM_DIR = "/dev/shm/"
_CPU_SHM_MARK = "-cpushm_"


def _mapped(pids) -> tuple[set[str], set[int]]:
    """The files under /dev/shm that processes ``pids`` map, by path and by inode. The inode is what shows a
    semaphore's creator: glibc's ``sem_open`` makes a semaphore under a temporary name, maps that and links it to
    the real name, so the creator's mapping reads ``/dev/shm/sem.XXXXXX (deleted)`` and only the inode matches."""
    paths, inodes = set(), set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    parts = line.split(None, 5)  # address, perms, offset, device, inode, path (when a file)
                    if len(parts) == 6 and parts[5].startswith(_SHM_DIR):
                        paths.add(parts[5].rstrip("\n"))
                        inodes.add(int(parts[4]))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return paths, inodes


def _mapped_segments(pids) -> set[str]:
    """The files under /dev/shm that processes ``pids`` map (by path)."""
    return _mapped(pids)[0]


def _inode(path: str) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


def _in(path: str, mapped: tuple[set[str], set[int]]) -> bool:
    return path in mapped[0] or _inode(path) in mapped[1]


def _descendants() -> list[int]:
    import psutil

    try:
        return [child.pid for child in psutil.Process().children(recursive=True)]
    except psutil.Error:
        return []


def _worker_segments(workers: list[int]) -> set[str]:
    """The CPU communicator segments that vLLM's TP workers (``workers``, and this process's descendants) map;
    empty off Linux."""
    return {path for path in _mapped_segments([*_descendants(), *workers]) if _CPU_SHM_MARK in path}


def _unlink_unused(segments: set[str]) -> None:
    """Unlink those of ``segments`` still present that no process maps any more (their workers are gone)."""
    left = {path for path in segments if os.path.exists(path)}
    if not left:
        return
    in_use = _mapped(int(p) for p in os.listdir("/proc") if p.isdigit())
    for path in (path for path in left if not _in(path, in_use)):
        try:
            os.unlink(path)
        except FileNotFoundError:  # a worker's own cleanup got there first
            pass


# vLLM's multi-process engine (``rollout.in_process: false``, TP > 1) makes shared-memory message queues (psm_*),
# multiprocessing semaphores (sem.mp-*) and the CPU communicator's segments; its shutdown unlinks them, but an
# engine process that is SIGKILLed (a rollout instance's death) never shuts down, and hundreds of MB stay in
# /dev/shm. So each engine process that made segments lists them in a ledger of its own, and every engine that
# starts or closes on the host unlinks those of dead processes (the restarted instance does it for its predecessor).
_LEDGERS = Path(tempfile.gettempdir()) / "asyncflow-vllm-segments"


def _own_segments(workers: list[int]) -> tuple[set[str], set[int]]:
    """The files under /dev/shm that this process, its descendants and vLLM's ``workers`` map (``_mapped``)."""
    return _mapped([os.getpid(), *_descendants(), *workers])


def _record_segments(made: set[str]) -> None:
    """Write this process's ledger of the segments its engine ``made`` (none: no ledger)."""
    import psutil

    if not made:
        return
    _LEDGERS.mkdir(parents=True, exist_ok=True)
    me = psutil.Process()
    ledger = _LEDGERS / f"{me.pid}.json"
    try:  # another engine of this process listed its own
        entry = json.loads(ledger.read_text())
        if abs(entry["started"] - me.create_time()) < 1.0:
            made = made | set(entry["segments"])
    except (OSError, ValueError):
        pass
    ledger.write_text(json.dumps({"pid": me.pid, "started": me.create_time(), "segments": sorted(made)}))


def _process_lives(pid: int, started: float) -> bool:
    import psutil

    try:
        return abs(psutil.Process(pid).create_time() - started) < 1.0  # not a later process given the same pid
    except psutil.Error:
        return False


def remove_stale_segments() -> list[str]:
    """Unlink the segments listed by the ledgers of engine processes that died without closing their engine, once
    no live process maps them; returns them. A ledger goes once none of its segments is left."""
    removed: list[str] = []
    for ledger in sorted(_LEDGERS.glob("*.json")) if _LEDGERS.is_dir() else []:
        try:
            entry = json.loads(ledger.read_text())
        except (OSError, ValueError):  # being written, or removed by another sweep
            continue
        if _process_lives(entry["pid"], entry["started"]):
            continue
        left = {path for path in entry["segments"] if os.path.exists(path)}
        _unlink_unused(left)
        removed += sorted(path for path in left if not os.path.exists(path))
        if not any(os.path.exists(path) for path in left):
            ledger.unlink(missing_ok=True)
    return removed


# vLLM's message queues and engine sockets are ZeroMQ ``ipc://`` sockets, files under ``VLLM_RPC_BASE_PATH`` (the
# temporary directory by default). A socket's file goes when the socket closes; a SIGKILLed engine process (a
# rollout instance's death) never closes its own or its workers', and their files would stay in /tmp. So each engine
# process gives vLLM a directory of its own, named after it, and every engine that starts or closes on the host
# removes those of dead processes (``remove_stale_ipc``), as for the shared-memory segments above.
_IPC = Path(tempfile.gettempdir()) / "asyncflow-vllm-ipc"
IPC_BASE_MAX = 107 - 37
"""Longest ``VLLM_RPC_BASE_PATH`` this sets: a socket's path, the base then ``/<uuid4>``, must fit in the 107 bytes of
``sockaddr_un.sun_path`` (ZeroMQ refuses a longer one)."""


def ipc_dir() -> Path:
    """This process's directory for vLLM's ``ipc://`` sockets (made here; its children inherit the variable)."""
    import psutil

    me = psutil.Process()
    path = _IPC / f"{me.pid}-{me.create_time():.3f}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def remove_stale_ipc() -> list[Path]:
    """Remove the ``ipc_dir`` of every engine process that is gone, with what its engine left there; returns them."""
    import shutil

    removed = []
    for path in sorted(_IPC.iterdir()) if _IPC.is_dir() else []:
        pid, _, started = path.name.partition("-")
        try:
            alive = _process_lives(int(pid), float(started))
        except ValueError:  # not one of ours
            continue
        if not alive:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


class VllmRollout(RolloutEngine):
    """Owns one vLLM ``LLM``; every call is synchronous and made from the owning process."""

    def __init__(self, cfg: VllmConfig, model_dir: str | Path, *, share_device: bool = False,
                 cpus: list[int] | None = None, visible_devices: list[str] | None = None):
        """``share_device``: the trainer uses the same devices in turns (colocated ``sync``); on CUDA the engine
        then starts with vLLM's sleep mode so that ``sleep`` can release its memory. vLLM-cpu has no sleep
        mode ("not supported on current platform"), so on CPU the engine keeps its memory and ``sleep`` is a
        no-op: host memory holds both sides there anyway. ``cpus`` and ``visible_devices``: see
        ``RolloutEngine``."""
        _environment(cfg, cpus, visible_devices)
        from vllm import LLM

        self.cfg = cfg
        # Untested here (no GPU): the sleep-mode path below runs only on CUDA.
        self.sleeps = share_device and torch.cuda.is_available()
        self.asleep = False
        shm_before = set(os.listdir(_SHM_DIR)) if os.path.isdir(_SHM_DIR) else set()
        self.llm = LLM(
            model=str(model_dir),
            dtype=cfg.dtype,
            enforce_eager=cfg.enforce_eager,
            max_model_len=cfg.max_model_len,
            max_num_seqs=cfg.max_num_seqs,
            tensor_parallel_size=cfg.tensor_parallel,
            # In process at TP > 1: the engine core here, the TP workers in vLLM's own processes.
            distributed_executor_backend="uni" if cfg.in_process and cfg.tensor_parallel == 1 else "mp",
            worker_extension_cls=EXTENSION,
            seed=cfg.seed,
            enable_prefix_caching=cfg.enable_prefix_caching,
            enable_sleep_mode=self.sleeps,
            # GPUs only: on CPU the KV cache is sized by VLLM_CPU_KVCACHE_SPACE (rollout.kv_cache_gib).
            **({"gpu_memory_utilization": cfg.gpu_memory_utilization} if torch.cuda.is_available() else {}),
        )
        self.version = 0
        self._request_ids = itertools.count()
        self._worker_pids = [pid for pid in self.llm.collective_rpc("asyncflow_pid") if pid != os.getpid()]
        if os.path.isdir(_SHM_DIR):
            made = {_SHM_DIR + name for name in set(os.listdir(_SHM_DIR)) - shm_before}
            # Only what this process or its descendants map (a semaphore's creator by its inode): another engine
            # starting on the host at the same time makes segments too, and its semaphores unlinked at this
            # engine's close would break its workers' start (FileNotFoundError in SemLock._rebuild).
            own = _own_segments(self._worker_pids)
            _record_segments({path for path in made if _in(path, own)})
            remove_stale_segments()
        remove_stale_ipc()

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int = 1,
        on_sample: Callable[[int, Sample], None] | None = None,
        max_new_tokens: int | Sequence[int] | None = None,
        temperature: float | None = None,
        ignore_eos: bool = False,
    ) -> list[Sample]:
        """``n`` sampled responses per token-id prompt, each with the logprob of every generated token.

        Drives vLLM's engine step by step so that ``on_sample(prompt_index, sample)`` fires as soon as
        a response finishes (streaming into the TransferQueue), not when the whole batch is done.
        ``max_new_tokens`` may be one budget per prompt; ``ignore_eos`` makes responses use it all.
        Returned in prompt order. Weights never change during a call: ``apply_staged`` is only called
        between calls by the owner, so one response never mixes two weight versions.
        """
        from vllm import SamplingParams

        if self.version < 0:
            raise RuntimeError("this vLLM engine holds a half-applied weight version; apply a complete version "
                               "before generating")
        budgets = max_new_tokens if isinstance(max_new_tokens, Sequence) else [max_new_tokens] * len(prompts)
        engine = self.llm.llm_engine
        owner: dict[str, tuple[int, int]] = {}
        for i, prompt in enumerate(prompts):
            params = SamplingParams(
                n=1,  # n independent requests: each finishes (and streams out) on its own
                temperature=self.cfg.temperature if temperature is None else temperature,
                max_tokens=int(budgets[i] or self.cfg.max_new_tokens),  # per prompt: long-tailed budgets
                logprobs=0,  # the sampled token's logprob only
                ignore_eos=ignore_eos,
                detokenize=False,  # token ids only: nothing reads the text, and decoding it (and each logprob's
                # token) costs time in every engine step
            )
            for j in range(n):
                request_id = f"r{next(self._request_ids)}"
                owner[request_id] = (i, j)
                engine.add_request(request_id, {"prompt_token_ids": list(prompt)}, params)
        done: dict[tuple[int, int], Sample] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if not out.finished or out.request_id not in owner:
                    continue
                comp = out.outputs[0]
                ids = list(comp.token_ids)
                sample = Sample(
                    prompt_ids=list(out.prompt_token_ids),
                    response_ids=ids,
                    response_logprobs=[step[tok].logprob for step, tok in zip(comp.logprobs, ids)],
                    weight_version=self.version,
                    finish_reason=comp.finish_reason,
                    request_id=out.request_id,
                )
                key = owner.pop(out.request_id)
                done[key] = sample
                if on_sample is not None:
                    on_sample(key[0], sample)
        return [done[key] for key in sorted(done)]

    def sleep(self) -> int:
        """See ``RolloutEngine.sleep``: vLLM's level-2 sleep discards weights and KV cache (the weights are
        replaced by the next version anyway, so a host copy would be wasted memory). The engine then serves
        no version (-1) until the next apply. Returns the device bytes released (0 on CPU)."""
        if not self.sleeps or self.asleep:
            return 0
        free = torch.cuda.mem_get_info()[0]
        self.llm.sleep(level=2)
        self.asleep, self.version = True, -1
        return max(0, torch.cuda.mem_get_info()[0] - free)

    def wake(self) -> None:
        """See ``RolloutEngine.wake``: reallocate weights and KV cache (the weights hold garbage until the next
        apply; ``version`` stays -1, so ``generate`` refuses until then)."""
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def stream(self, ignore_eos: bool = False, turns: bool = False):
        """Continuous batching on this engine (``asyncflow.engines.vllm.stream``)."""
        from asyncflow.engines.vllm.stream import VllmStream

        return VllmStream(self, ignore_eos=ignore_eos, turns=turns)

    @property
    def weight_version(self) -> int:
        """The version this engine serves."""
        return self.version

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int,
                       bucket_mb: float | None = None) -> None:
        """Apply Hugging Face-named full tensors as weight ``version`` on every vLLM rank (tools and tests; the
        loop's weight path is ``apply_staged``).

        With ``bucket_mb`` the stream is cut into buckets of about that size that keep every fused group
        (q/k/v, gate/up, a layer's experts) whole, and each bucket is one reload; ranks report the new
        version only after the last bucket. Without it, everything goes in one reload.
        """
        from safetensors.torch import save as save_safetensors

        if bucket_mb is None:
            buckets = [list(named_tensors)]
        else:
            from asyncflow.bridge.buckets import iter_buckets
            from asyncflow.models.arch import GPTArch

            arch = GPTArch.from_pretrained(self.llm.model_config.model)
            buckets = iter_buckets(named_tensors, arch, int(bucket_mb * 2**20))
        pending = None
        for bucket in buckets:
            if pending is not None:
                self.apply_blob(pending, version, final=False)
            pending = save_safetensors({name: t.contiguous() for name, t in bucket})
        if pending is not None:
            self.apply_blob(pending, version)

    def apply_blob(self, blob: bytes, version: int, final: bool = True) -> None:
        """Apply a safetensors blob of Hugging Face-named tensors as ``version`` (its end if ``final``)."""
        from asyncflow.engines.vllm.worker_extension import MIXED

        self.version = MIXED  # until the final blob is in on every rank
        served = self.llm.collective_rpc("asyncflow_apply_weights", args=(blob, version, final))
        expected = version if final else MIXED
        if any(v != expected for v in served):
            raise RuntimeError(f"vLLM ranks report versions {served} after applying version {version}")
        if final:
            self._weights_changed()
            self.version = version

    def apply_staged(self, staging: dict, version: int, apply_format: str = "checkpoint") -> dict:
        """Apply ``version`` staged by the trainer's exporting ranks (``asyncflow.bridge.staging``).

        Every vLLM rank reads only its own boxes, bucket by bucket. All-or-nothing from the caller's view:
        on success every rank serves ``version``; otherwise this engine reports ``MIXED`` (-1) and must not
        generate until a later apply succeeds. Raises ``StaleStagingError`` when the trainer overwrote the
        version while it was read (apply the newest instead) and ``RuntimeError`` naming the ranks that
        failed. Returns the per-rank stats (``seconds``, ``bytes``, ``buckets``).
        """
        from asyncflow.bridge.staging import StaleStagingError
        from asyncflow.engines.vllm.worker_extension import MIXED

        self.version = MIXED  # until every rank reports the new version
        try:
            results = list(self.llm.collective_rpc("asyncflow_apply_staged", args=(staging, version, apply_format)))
        except Exception as exc:
            raise RuntimeError(f"vLLM workers failed while applying weight version {version}: "
                               f"{type(exc).__name__}: {exc}") from exc
        errors = [f"rank {i}: {r['error']}" for i, r in enumerate(results) if r["outcome"] == "error"]
        if errors:
            raise RuntimeError(f"applying weight version {version} failed on vLLM " + "; ".join(errors))
        stale = [r["error"] for r in results if r["outcome"] == "stale"]
        if stale:
            raise StaleStagingError(stale[0])
        self._weights_changed()
        self.version = version
        return {"ranks": results, "bytes_per_rank": [r["bytes"] for r in results],
                "seconds": max(r["seconds"] for r in results), "buckets": results[0]["buckets"]}

    def _weights_changed(self) -> None:
        """Drop the prefix cache: its KV blocks were computed by the old weights, and a request of the new
        version that shares a prompt prefix would otherwise attend to them (wrong logprobs, silently)."""
        if not self.cfg.enable_prefix_caching:
            return  # nothing cached (partial_kv=keep applies versions while requests hold KV blocks)
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight update (requests running?)")

    def close(self) -> None:
        """Shut the engine down, workers included (idempotent).

        Needed before a process exits through ``os._exit`` (multiprocessing children, killed Ray
        actors): atexit hooks do not run there, and vLLM's multi-process engine core would be orphaned.
        """
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if core is not None:
            segments = _worker_segments(getattr(self, "_worker_pids", []))
            core.shutdown()
            _unlink_unused(segments)
        ledger = _LEDGERS / f"{os.getpid()}.json"
        if ledger.exists():  # what the engine made that no process uses any more (workers vLLM had to kill)
            made = set(json.loads(ledger.read_text())["segments"])
            _unlink_unused(made)
            if not any(os.path.exists(path) for path in made):
                ledger.unlink(missing_ok=True)  # else the rest goes once this process has exited
        remove_stale_segments()
        remove_stale_ipc()

    def served_versions(self) -> list[int]:
        """The weight version each vLLM rank reports."""
        return list(self.llm.collective_rpc("asyncflow_weight_version"))
