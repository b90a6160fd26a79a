"""Multi-process helpers for the bridge tests: Megatron gloo ranks and a vLLM engine in its own process.

The vLLM engine runs in a process of its own (in-process mode for TP1, multi-process for TP2) so that its
global state never leaks into pytest's process; the test talks to it with JSON messages over a Unix socket.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import tempfile
import traceback
import zlib
from pathlib import Path

import torch

from asyncflow.models.parallel import free_port
from tests.forkserver import start_method


def fixed_tokens(vocab: int = 19, batch: int = 2, seq: int = 10) -> torch.Tensor:
    """The fixed sequences whose logprobs both engines compute."""
    gen = torch.Generator().manual_seed(11)
    return torch.randint(4, vocab, (batch, seq), generator=gen)


# ---------------------------------------------------------------------------------------------- vLLM
def _vllm_main(conn, model_dir: str, tp: int) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    torch.set_num_threads(1)
    try:
        from asyncflow.config import VllmConfig
        from asyncflow.engines.vllm.rollout import VllmRollout

        rollout = VllmRollout(
            VllmConfig(tensor_parallel=tp, max_model_len=64, max_num_seqs=8), model_dir
        )
        conn.send_bytes(json.dumps({"ok": True}).encode())
        while True:
            msg = json.loads(conn.recv_bytes())
            if msg["cmd"] == "stop":
                rollout.close()  # a forked child exits via os._exit: vLLM's atexit cleanup would not run
                break
            if msg["cmd"] == "staged":
                out = rollout.apply_staged(msg["staging"], msg["version"])
            elif msg["cmd"] == "staged_expect_failure":  # report the failure and what the engine does next
                try:
                    rollout.apply_staged(msg["staging"], msg["version"])
                    out = {"error": None}
                except Exception as exc:  # noqa: BLE001 - reported to the test
                    out = {"error": f"{type(exc).__name__}: {exc}", "served": rollout.served_versions(),
                           "version": rollout.weight_version}
                    try:
                        rollout.generate([[2, 5]], n=1)
                        out["generate_error"] = None
                    except Exception as gen_exc:  # noqa: BLE001
                        out["generate_error"] = str(gen_exc)
            elif msg["cmd"] == "update":  # full tensors through the blob path (bucketed)
                from safetensors.torch import load_file

                state = load_file(msg["file"])
                rollout.update_weights(state.items(), msg["version"], bucket_mb=msg.get("bucket_mb"))
                out = None
            elif msg["cmd"] == "partial":  # part of a version, then (optionally) a different version
                from safetensors.torch import load_file, save

                state = load_file(msg["file"])
                part = {k: v for k, v in state.items() if k.startswith("model.layers.0.self_attn.")}
                rollout.apply_blob(save(part), msg["version"], final=False)
                out = {"during": rollout.served_versions()}
                try:
                    rollout.apply_blob(save(part), msg["version"] + 1, final=False)
                    out["mixed_error"] = None
                except Exception as exc:  # noqa: BLE001 - reported to the test
                    out["mixed_error"] = str(exc)
                rollout.apply_blob(save(state), msg["version"])
                out["after"] = rollout.served_versions()
            elif msg["cmd"] == "logprobs":
                out = prompt_logprobs(rollout, msg["tokens"])
            elif msg["cmd"] == "versions":
                out = rollout.served_versions()
            conn.send_bytes(json.dumps({"ok": True, "out": out}).encode())
    except Exception:  # report to the test instead of hanging it
        conn.send_bytes(json.dumps({"ok": False, "error": traceback.format_exc()}).encode())


def prompt_logprobs(rollout, tokens: list[list[int]]) -> list[list[float]]:
    """vLLM's logprob of each token after the first (prompt logprobs)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    outs = rollout.llm.generate([{"prompt_token_ids": t} for t in tokens], params, use_tqdm=False)
    return [
        [step[tok].logprob for step, tok in zip(o.prompt_logprobs[1:], t[1:])] for o, t in zip(outs, tokens)
    ]


class VllmProcess:
    """A vLLM engine (TP ``tp``) in a process of its own, forked from the real-stack fork server (vLLM already
    imported; ``tests.zygote.forked_script``); ``call`` sends one command and waits. The test connects to it over a
    Unix socket with a random key (``multiprocessing.connection``: byte messages, JSON inside, no pickle)."""

    def __init__(self, model_dir: str | Path, tp: int = 1):
        import time
        from multiprocessing.connection import Client

        from tests.zygote import forked_script

        self._folder = tempfile.mkdtemp(prefix="afvllm-")
        address, key = os.path.join(self._folder, "conn.sock"), secrets.token_bytes(16)
        self.proc = forked_script(Path(__file__), str(model_dir), str(tp), address,
                                  env={**os.environ, "ASYNCFLOW_TEST_VLLM_KEY": key.hex()})
        deadline = time.monotonic() + 300
        while True:  # the child listens once it has started
            try:
                self.conn = Client(address, authkey=key)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError(f"the vLLM process never listened (exit status {self.proc.poll()})") from None
                time.sleep(0.1)
        self._reply(timeout=300)

    def _reply(self, timeout: float):
        if not self.conn.poll(timeout):
            raise TimeoutError("vLLM process did not answer")
        msg = json.loads(self.conn.recv_bytes())
        if not msg["ok"]:
            raise RuntimeError(msg["error"])
        return msg.get("out")

    def send(self, **msg) -> None:
        """Send a command without waiting (pair with ``reply``)."""
        self.conn.send_bytes(json.dumps(msg).encode())

    def reply(self, timeout: float = 300, peers=None):
        """The answer to the last command; ``peers`` (a process context) are checked while waiting, so a
        crashed Megatron rank fails the test at once instead of leaving vLLM waiting for its bytes."""
        waited = 0.0
        while peers is not None and not self.conn.poll(1.0):
            peers.join(timeout=0)  # raises ProcessRaisedException if a rank died
            waited += 1.0
            if waited > timeout:
                raise TimeoutError("vLLM process did not answer")
        return self._reply(timeout)

    def call(self, timeout: float = 300, **msg):
        """Send a command and return its answer."""
        self.send(**msg)
        return self._reply(timeout)

    def close(self) -> None:
        """Stop the engine process (and its workers)."""
        try:
            if self.proc.poll() is None and getattr(self, "conn", None) is not None:
                self.send(cmd="stop")
                self.proc.wait(60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(10)
            if getattr(self, "conn", None) is not None:
                self.conn.close()
            shutil.rmtree(self._folder, ignore_errors=True)


if __name__ == "__main__":  # the engine's process: MODEL_DIR TP ADDRESS (``VllmProcess``)
    import sys
    from multiprocessing.connection import Listener

    model_dir, tp, address = sys.argv[1:4]
    with Listener(address, authkey=bytes.fromhex(os.environ["ASYNCFLOW_TEST_VLLM_KEY"])) as listener:
        connection = listener.accept()
    _vllm_main(connection, model_dir, int(tp))


# ---------------------------------------------------------------------------------------------- Megatron
def _wait_file(path: Path, timeout: float = 600) -> None:
    import time

    t0 = time.time()
    while not path.exists():
        if time.time() - t0 > timeout:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.02)


def _stage_and_wait(out_dir: str, rank: int, version: int, stager, plan: dict, extra: dict) -> None:
    """Stage ``version``, tell the test where it is, and wait until the test applied it (file handshake):
    a rank stages into slot ``v % 2``, so version v+2 would overwrite v."""
    from asyncflow.bridge.staging import source_key

    stats = stager.stage(version).as_dict() if stager is not None else None
    info = {"plan": plan, "stats": stats, **extra,
            "source": None if stager is None else [source_key(stager.rank), stager.segment]}
    tmp = Path(out_dir) / f".rank{rank}_v{version}.json"
    tmp.write_text(json.dumps(info))
    tmp.rename(Path(out_dir) / f"rank{rank}_v{version}.json")
    _wait_file(Path(out_dir) / f"go_v{version}")


def staged(out_dir, version: int, world: int, peers=None) -> tuple[dict, list[dict]]:
    """Wait until all ``world`` ranks staged ``version``; the staging dict for vLLM and every rank's info."""
    import time

    paths = [Path(out_dir) / f"rank{r}_v{version}.json" for r in range(world)]
    while not all(p.exists() for p in paths):
        if peers is not None:
            peers.join(timeout=0)  # raises ProcessRaisedException if a rank died
        time.sleep(0.05)
    infos = [json.loads(p.read_text()) for p in paths]
    segments = dict(i["source"] for i in infos if i["source"])
    return {"plan": infos[0]["plan"], "segments": segments}, infos


def release(out_dir, version: int) -> None:
    """Let the ranks go on after ``version`` (they may overwrite it two versions later)."""
    (Path(out_dir) / f"go_v{version}").touch()


def _megatron_main(rank, world, port, tp, pp, model_dir, out_dir, versions, bucket_mb, save_state):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from asyncflow.config import MegatronConfig
    from asyncflow.engines.megatron.trainer import MegatronTrainer
    from asyncflow.models.parallel import destroy_megatron

    trainer = MegatronTrainer(
        MegatronConfig(tensor_parallel=tp, pipeline_parallel=pp, micro_batch_size=2, lr=2e-2), model_dir
    )
    trainer.load_hf(model_dir)
    stager, plan = trainer.weight_stager(bucket_mb, f"t{port}")
    tokens = fixed_tokens()
    mask = torch.ones(tokens.shape[0], tokens.shape[1] - 1)
    try:
        for version in range(1, versions + 1):
            trainer.train_step(tokens, mask)
            if save_state:  # the exact weights this version staged, for bit-exact checks
                _save_state(trainer.model.module, trainer.arch, trainer.bridge_layout(), out_dir, rank, version)
            logprobs = trainer.logprobs(tokens)
            _stage_and_wait(out_dir, rank, version, stager, plan,
                            {"logprobs": None if logprobs is None else logprobs.tolist()})
    finally:
        if stager is not None:
            stager.close()
        destroy_megatron()


def _save_state(module, arch, layout, out_dir, rank: int, version: int) -> None:
    from safetensors.torch import save_file

    from asyncflow.bridge.mcore import model_offsets, model_rank
    from asyncflow.bridge.sync import global_state

    state = global_state(module, *model_offsets(module, arch, layout, model_rank()[0]))
    save_file({k: v.contiguous() for k, v in state.items()}, str(Path(out_dir) / f"state{rank}_v{version}.st"))


def start_megatron(tp: int, pp: int, model_dir, out_dir, versions: int, bucket_mb: float, save_state: bool = False):
    """Start ``tp * pp`` Megatron ranks that, per version, train a step and stage their shards (then wait for
    ``release``); returns the process context."""
    import torch.multiprocessing as tmp

    Path(out_dir).mkdir(parents=True, exist_ok=True)
    args = (tp * pp, free_port(), tp, pp, str(model_dir), str(out_dir), versions, bucket_mb, save_state)
    return tmp.start_processes(_megatron_main, args=args, nprocs=tp * pp, join=False, start_method=start_method())


def join(ctx) -> None:
    """Wait for the ranks (raising their errors)."""
    while not ctx.join(timeout=600):
        pass


def kill(ctx) -> None:
    """Kill the ranks of a failed test (only the processes this harness started)."""
    for proc in ctx.processes:
        if proc.is_alive():
            proc.kill()
            proc.join(10)


def _moe_main(rank, world, port, ep, model_dir, out_dir, versions, bucket_mb):
    """A Megatron MoE rank at EP=``ep`` (TP=1): load HF, then per version perturb the weights and stage them.

    Megatron refuses MoE training with TP > 1 unless sequence parallelism is on, which does not run on CPU,
    so the weights change by a seeded perturbation instead of an optimizer step.
    """
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from asyncflow.bridge.buckets import SyncPlan
    from asyncflow.bridge.mcore import HFReader, init_parallel, load_hf_into, model_layout, model_offsets, model_rank
    from asyncflow.bridge.staging import StagingWriter, source_key
    from asyncflow.bridge.sync import global_state, plan_to_dict
    from asyncflow.models.megatron import GPTArch, build_gpt_model, transformer_config
    from asyncflow.models.parallel import destroy_megatron

    init_parallel(1, 1, ep)
    arch = GPTArch.from_pretrained(model_dir)
    model = build_gpt_model(arch, transformer_config(arch, expert_parallel=ep))
    layout = model_layout(model, arch)
    mrank, is_source = model_rank()
    load_hf_into(model, arch, layout, mrank, HFReader(model_dir))
    bucket_bytes = int(bucket_mb * 2**20)
    plan = SyncPlan(arch, layout, bucket_bytes)
    state = global_state(model, *model_offsets(model, arch, layout, mrank))
    stager = StagingWriter(plan, mrank, state, f"afq-{os.getpid()}-wmoe{port}-{source_key(mrank)}") \
        if is_source else None
    tokens = fixed_tokens()
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    try:
        for version in range(1, versions + 1):
            with torch.no_grad():
                for name, p in state.items():
                    # Seeded by the global name, so data-parallel replicas of a parameter stay identical.
                    gen = torch.Generator().manual_seed(zlib.crc32(f"{version}:{name}".encode()))
                    p.add_(0.05 * torch.randn(p.shape, generator=gen))
            _save_state(model, arch, layout, out_dir, rank, version)
            with torch.no_grad():
                logits = model(tokens, positions, None)[..., : arch.vocab_size]
            logprobs = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, tokens[:, 1:, None])[..., 0]
            _stage_and_wait(out_dir, rank, version, stager, plan_to_dict(plan, bucket_bytes),
                            {"logprobs": logprobs.tolist()})
    finally:
        if stager is not None:
            stager.close()
        destroy_megatron()


def start_moe(ep: int, model_dir, out_dir, versions: int, bucket_mb: float):
    """Start ``ep`` Megatron MoE ranks (EP=``ep``); see ``_moe_main``."""
    import torch.multiprocessing as tmp

    Path(out_dir).mkdir(parents=True, exist_ok=True)
    args = (ep, free_port(), ep, str(model_dir), str(out_dir), versions, bucket_mb)
    return tmp.start_processes(_moe_main, args=args, nprocs=ep, join=False, start_method=start_method())
