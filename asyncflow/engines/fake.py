"""Fake engines for workflow tests: the whole pipeline runs for real (Ray actors, the TransferQueue, the version
board, the services, the driver loop), only the models are a table.

Select them as ``fake`` (``trainer.engine``, ``critic.engine``, ``rollout.engine``) or by dotted path
(``asyncflow.engines.fake.FakeTrainEngine``, ...; ``tests/recipe_runs.FAKE`` sets all three). They import neither
Megatron nor vLLM and take microseconds per call.

The policy is an additive n-gram table, ``logits = sum_k W[k, token t-k]`` over the last ``CONTEXT`` tokens,
the same function on both sides: the trainer's ``compute_logprobs`` of a response equals the logprobs the rollout
reported for it at the same version (the loop's logprob-gap check holds exactly), and ``train_step`` is a real
gradient step on the table through the run's loss function. Versions travel the loop's weight path for real: the
exporting trainer rank stages the table into a shared-memory segment (two slots, a sequence-locked header
``[seq, version]`` like ``asyncflow.bridge.staging``), announces it on the board, and the rollout engine reads it
back when the service applies that version. A version the rollout did not read is a version it cannot serve.

Faults for the failure tests come from environment variables (``FakeFaults``), which Ray's workers inherit
from the driver's environment when the run starts its own Ray; runs that join a Ray already up (the tests'
in-process runs) name a subclass that sets its faults instead (``tests/fakes/slowed.py``, ``tests/fakes/faulty.py``).
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import json
import os
import signal
import time
import zlib
from collections.abc import Callable, Hashable, Iterable, Sequence
from pathlib import Path
from types import SimpleNamespace

import torch

from asyncflow.engines.base import (
    CRITIC_ENGINES,
    ROLLOUT_ENGINES,
    TRAIN_ENGINES,
    CriticEngine,
    Ranks,
    RolloutEngine,
    RolloutStream,
    Sample,
    StreamRequest,
    TrainEngine,
)

SOURCE = "0.0.0"
"""The one exporting rank's key (``asyncflow.bridge.staging.source_key`` of tp 0, pp 0, ep 0)."""
CONTEXT = 6
"""Tokens the fake policy looks back at: enough for the add-one task (an answer digit comes 5 tokens after the
digit it answers), so a fake run can learn it."""
PAD = 0


@dataclasses.dataclass
class FakeFaults:
    """Slowness and failures on purpose, read from the environment of the process that builds the engine."""

    token_s: float = 0.0
    """``ASYNCFLOW_FAKE_TOKEN_S``: seconds per rollout engine step (one token of every running sequence)."""
    train_s: float = 0.0
    """``ASYNCFLOW_FAKE_TRAIN_S``: seconds added to every ``train_step``."""
    fail_apply_from: int | None = None
    """``ASYNCFLOW_FAKE_FAIL_APPLY``: ``apply_staged`` of this version and every later one raises."""
    die_applying: int | None = None
    """``ASYNCFLOW_FAKE_DIE_APPLYING``: the rollout's process SIGKILLs itself while applying this version."""

    @classmethod
    def from_env(cls) -> FakeFaults:
        """The faults set in ``os.environ`` (absent variables keep the defaults: no fault)."""
        env = os.environ

        def version(name: str) -> int | None:
            return int(env[name]) if env.get(name) else None

        return cls(token_s=float(env.get("ASYNCFLOW_FAKE_TOKEN_S") or 0.0),
                   train_s=float(env.get("ASYNCFLOW_FAKE_TRAIN_S") or 0.0),
                   fail_apply_from=version("ASYNCFLOW_FAKE_FAIL_APPLY"),
                   die_applying=version("ASYNCFLOW_FAKE_DIE_APPLYING"))


def model_facts(model_dir: str | Path) -> tuple[int, int | None, int]:
    """``(vocab size, eos id, seed)`` of a Hugging Face model folder: the seed hashes its config, so every engine
    built on the same folder starts from the same table (as real engines load the same checkpoint)."""
    raw = (Path(model_dir) / "config.json").read_bytes()
    config = json.loads(raw)
    eos = config.get("eos_token_id")
    return int(config["vocab_size"]), eos[0] if isinstance(eos, list) else eos, zlib.crc32(raw)


def initial_table(vocab: int, seed: int, width: int | None = None, context: int = 1) -> torch.Tensor:
    """The weights every engine of a model starts from: ``[context, vocab, width or vocab]`` float32."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(context, vocab, width or vocab, generator=gen) * (0.5 / context**0.5)


def contexts(tokens: torch.Tensor) -> torch.Tensor:
    """``[b, s-1, CONTEXT]``: at the position that scores token ``t+1``, tokens ``t, t-1, ...`` (``PAD`` before
    the start)."""
    padded = torch.cat([torch.full((tokens.shape[0], CONTEXT - 1), PAD, dtype=tokens.dtype), tokens[:, :-1]], 1)
    width = tokens.shape[1] - 1
    return torch.stack([padded[:, CONTEXT - 1 - k : CONTEXT - 1 - k + width] for k in range(CONTEXT)], -1)


def _context(seq: list[int]) -> list[int]:
    """The last ``CONTEXT`` tokens of ``seq``, newest first (``PAD`` before the start): ``contexts`` of one row."""
    return [seq[-1 - k] if k < len(seq) else PAD for k in range(CONTEXT)]


def ngram_logits(table: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
    """``sum_k table[k, ctx[..., k]]``, added in one fixed order so that trainer and rollout get the same bits."""
    out = table[0][ctx[..., 0]]
    for k in range(1, table.shape[0]):
        out = out + table[k][ctx[..., k]]
    return out


# ---------------------------------------------------------------------------------------------- process group
@dataclasses.dataclass(frozen=True)
class _Position:
    """Where this rank sits in its group (Megatron's order: tensor-parallel fastest, then data, then pipeline)."""

    rank: int = 0
    world: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    tp_rank: int = 0
    pp_rank: int = 0
    tp_size: int = 1
    pp_size: int = 1

    @property
    def mp_rank(self) -> int:
        return self.tp_rank + self.tp_size * self.pp_rank

    @property
    def mp_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def writer(self) -> bool:
        """Last pipeline stage, tensor-parallel rank 0: holds its replica's outputs."""
        return self.pp_rank == self.pp_size - 1 and self.tp_rank == 0


class _Group:
    """This rank's gloo process group (joined here unless the caller already did) and its data-parallel and
    model-parallel subgroups; nothing at world size 1."""

    def __init__(self, cfg, timeout_s: float | None):
        world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
        tp, pp = cfg.tensor_parallel, cfg.pipeline_parallel
        dp = max(world // (tp * pp), 1)
        self.pos = _Position(rank, world, (rank // tp) % dp, dp, rank % tp, rank // (tp * dp), tp, pp)
        self.timeout_s = timeout_s
        self.dp_group = self.mp_group = None
        if world == 1:
            return
        dist = torch.distributed
        if not dist.is_initialized():
            kw = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
            dist.init_process_group("gloo", rank=rank, world_size=world, **kw)

        def at(t: int, d: int, p: int) -> int:
            return t + tp * (d + dp * p)

        # Every rank creates every subgroup, in the same order (new_group is collective).
        for p in range(pp):
            for t in range(tp):
                group = dist.new_group([at(t, d, p) for d in range(dp)], backend="gloo")
                if (t, p) == (self.pos.tp_rank, self.pos.pp_rank):
                    self.dp_group = group
        for d in range(dp):
            group = dist.new_group([at(t, d, p) for p in range(pp) for t in range(tp)], backend="gloo")
            if d == self.pos.dp_rank:
                self.mp_group = group

    def gather(self, items: list, group) -> list[list]:
        """Every member's ``items`` (this rank's alone without a group)."""
        if group is None or torch.distributed.get_world_size(group) == 1:
            return [items]
        out: list = [None] * torch.distributed.get_world_size(group)
        torch.distributed.all_gather_object(out, items, group=group)
        return out

    def sum_over_data_parallel(self, tensor: torch.Tensor) -> None:
        if self.dp_group is not None and self.pos.dp_size > 1:
            torch.distributed.all_reduce(tensor, group=self.dp_group)


# ---------------------------------------------------------------------------------------------- training
class _TableAdam:
    """Adam on the one table, by torch's own Adam (``torch.optim.adam.adam``) without ``torch.optim.Optimizer``,
    whose constructor imports ``torch._dynamo``: that import would cost a fake trainer rank's start more than torch's
    own import. Same updates as ``torch.optim.Adam`` with these settings; ``state_dict`` is its own."""

    def __init__(self, param: torch.nn.Parameter, lr: float, betas: tuple[float, float]):
        self.param, self.lr, self.betas = param, lr, betas
        self.exp_avg, self.exp_avg_sq = torch.zeros_like(param), torch.zeros_like(param)
        self.step_count = torch.tensor(0.0)

    def zero_grad(self) -> None:
        self.param.grad = None

    @torch.no_grad()
    def step(self) -> None:
        from torch.optim.adam import adam

        if self.param.grad is None:
            return
        adam([self.param], [self.param.grad], [self.exp_avg], [self.exp_avg_sq], [], [self.step_count],
             foreach=False, capturable=False, differentiable=False, fused=None, grad_scale=None, found_inf=None,
             has_complex=False, amsgrad=False, beta1=self.betas[0], beta2=self.betas[1], lr=self.lr,
             weight_decay=0.0, eps=1e-8, maximize=False)

    def state_dict(self) -> dict:
        return {"step": self.step_count.clone(), "exp_avg": self.exp_avg.clone(), "exp_avg_sq": self.exp_avg_sq.clone()}

    def load_state_dict(self, state: dict) -> None:
        self.step_count.copy_(state["step"])
        self.exp_avg.copy_(state["exp_avg"])
        self.exp_avg_sq.copy_(state["exp_avg_sq"])


class _FakeTrainable:
    """What the fake train and critic engines share: a table, its Adam optimizer, the group, checkpoints."""

    def __init__(self, cfg, model_dir: str | Path, *, trainable: bool = True, group_timeout_s: float | None = None,
                 width: int | None = None, zero: bool = False, **_ignored):
        self.cfg = cfg
        self.faults = FakeFaults.from_env()
        self.vocab, self.eos, seed = model_facts(model_dir)
        table = torch.zeros(CONTEXT, self.vocab, width or self.vocab) if zero else \
            initial_table(self.vocab, seed, width, CONTEXT)
        self.table = torch.nn.Parameter(table, requires_grad=trainable)
        self.optimizer = _TableAdam(self.table, cfg.lr, (cfg.adam_beta1, cfg.adam_beta2)) if trainable else None
        self.group = _Group(cfg, group_timeout_s)
        self.version = 0

    # The agreed interface (``asyncflow.engines.base``): ranks and groups, micro-batch size, fixed shapes.
    @property
    def ranks(self):
        """This rank's position (``dp_rank``, ``dp_size``, ``tp_rank``, ``pp_rank``, ``mp_rank``, ``mp_size``,
        ``writer``)."""
        p = self.group.pos
        return Ranks(dp_rank=p.dp_rank, dp_size=p.dp_size, tp_rank=p.tp_rank, pp_rank=p.pp_rank, mp_rank=p.mp_rank,
                     mp_size=p.mp_size, writer=p.writer)

    @property
    def micro_batch_size(self) -> int:
        return self.cfg.micro_batch_size

    @property
    def fixed_seq_len(self) -> bool:
        return self.cfg.pipeline_parallel > 1

    @property
    def seq_multiple(self) -> int:
        """No kernel to align for: a micro-batch is as wide as its longest row."""
        return 1

    def gather_data_parallel(self, items: list) -> list:
        """Every replica's ``items``, replica order."""
        return [x for part in self.group.gather(list(items), self.group.dp_group) for x in part]

    def check_same_rows(self, fingerprints: list[torch.Tensor], what: str) -> None:
        """Raise unless every model-parallel rank of this replica saw the same batches."""
        everyone = self.group.gather([f.tolist() for f in fingerprints], self.group.mp_group)
        if any(other != everyone[0] for other in everyone):
            raise RuntimeError(f"{what}: the model-parallel ranks of one replica read different rows (batch "
                               f"fingerprints per rank: {everyone}); they must receive identical batches")

    def group_timeout_s(self) -> float | None:
        return self.group.timeout_s

    def forward(self, tokens: torch.Tensor, entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[b, s-1]`` outputs of ``tokens`` (and the entropy per position when asked)."""
        raise NotImplementedError

    def train_step(self, micro_batches: Iterable[dict[str, torch.Tensor]], num_microbatches: int,
                   loss_fn: Callable) -> dict:
        """One Adam step over ``micro_batches`` with the engine contract of ``MegatronActor.train_step``: losses
        are numerators, gradients are divided by the normalizer summed over micro-batches and replicas."""
        if self.faults.train_s:
            time.sleep(self.faults.train_s)
        self.optimizer.zero_grad()
        outputs = []
        for mb in micro_batches:
            out, entropy = self.forward(mb["tokens"], getattr(loss_fn, "needs_entropy", False))
            loss, metrics = loss_fn(out, mb if entropy is None else {**mb, "entropy": entropy})
            loss.backward()
            outputs.append({k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in metrics.items()})
        normalizer = torch.tensor([sum(float(o["normalizer"]) for o in outputs)])
        self.group.sum_over_data_parallel(normalizer)
        grad = self.table.grad if self.table.grad is not None else torch.zeros_like(self.table)
        self.group.sum_over_data_parallel(grad)  # replicas stay identical, as under Megatron's DDP
        self.table.grad = grad / max(normalizer.item(), 1.0)
        grad_norm = torch.nn.utils.clip_grad_norm_([self.table], self.cfg.clip_grad).item()
        self.optimizer.step()
        return {"grad_norm": grad_norm, "update_ok": True, "normalizer": normalizer.item(), "micro": outputs}

    def save(self, path: str) -> None:
        """The table and the optimizer state in ``path/fake.pt`` (written by the group's rank 0)."""
        if self.group.pos.rank == 0:
            Path(path).mkdir(parents=True, exist_ok=True)
            torch.save({"table": self.table.detach().clone(), "optimizer": self.optimizer.state_dict()},
                       Path(path) / "fake.pt")
        if self.group.pos.world > 1:
            torch.distributed.barrier()

    def load(self, path: str) -> None:
        """Restore ``save``'s output (the caller restores ``version``)."""
        state = torch.load(Path(path) / "fake.pt")
        with torch.no_grad():
            self.table.copy_(state["table"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])


@TRAIN_ENGINES.register("fake")
class FakeTrainEngine(_FakeTrainable, TrainEngine):
    """The n-gram policy as a train engine (actor, or reference with ``trainable=False``)."""

    def forward(self, tokens: torch.Tensor, entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        logp = torch.log_softmax(ngram_logits(self.table, contexts(tokens)), dim=-1)
        picked = logp.gather(-1, tokens[:, 1:, None]).squeeze(-1)
        return picked, (-(logp.exp() * logp).sum(-1) if entropy else None)

    @torch.no_grad()
    def compute_logprobs(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.forward(tokens)[0]

    def stream_weights_from_host(self) -> None:
        """Nothing to stream: the table lives in host memory."""

    def weight_stager(self, bucket_mb: float, session: str) -> tuple[FakeStagingWriter | None, dict]:
        """Replica 0's first rank stages the table; every other rank sends nothing (it holds the same table)."""
        plan = FakePlan(self.table.shape).as_dict()
        p = self.group.pos
        if (p.dp_rank, p.tp_rank, p.pp_rank) != (0, 0, 0):
            return None, plan
        return FakeStagingWriter(self.table, f"afq-{os.getpid()}-w{session}-{SOURCE}"), plan


@CRITIC_ENGINES.register("fake")
class FakeCriticEngine(_FakeTrainable, CriticEngine):
    """A value per token (``V[token]``), trained by the run's value loss; starts at zero like a fresh value head."""

    def __init__(self, cfg, model_dir: str | Path, **kwargs):
        super().__init__(cfg, model_dir, width=1, zero=True, **kwargs)

    def forward(self, tokens: torch.Tensor, entropy: bool = False) -> tuple[torch.Tensor, None]:
        return ngram_logits(self.table, contexts(tokens))[..., 0], None

    @torch.no_grad()
    def compute_values(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.forward(tokens)[0]


# ---------------------------------------------------------------------------------------------- weight path
class FakePlan:
    """The fake engines' ``asyncflow.bridge.buckets.SyncPlan``: one exporting rank (tp 0, pp 0, ep 0) sending the
    whole table as one float32 bucket. It gives the bridge's staging slots (``asyncflow.bridge.staging``) the same
    byte layout as a one-rank Megatron plan, so the relay between hosts (``asyncflow.bridge.relay``) mirrors a fake
    trainer's segment as it mirrors a real one."""

    dtype = torch.float32

    def __init__(self, shape: Sequence[int]):
        from asyncflow.bridge.shards import MRank

        self.shape, self.rank = list(shape), MRank(0, 0, 0)
        self.buckets = [SimpleNamespace(sources={self.rank: []}, numel=self._numel)]

    def _numel(self, src) -> int:
        return torch.Size(self.shape).numel() if src == self.rank else 0

    def as_dict(self) -> dict:
        """Plain data for the rollout side (``from_dict``)."""
        return {"engine": "fake", "shape": list(self.shape)}

    @classmethod
    def from_dict(cls, data: dict) -> FakePlan:
        """The plan ``as_dict`` describes."""
        return cls(data["shape"])


def _slots(arena, plan: FakePlan):
    from asyncflow.bridge.staging import _Slots

    return _Slots(arena, plan, plan.rank)


class FakeStagingWriter:
    """``asyncflow.bridge.staging.StagingWriter`` over the table: ``stage(version)`` copies it into slot
    ``version % 2`` of a shared-memory segment (``segment``, the bridge's slot layout), removed by ``close``. A
    ``asyncflow.bridge.relay.RelaySender`` reads its slots like a real writer's."""

    def __init__(self, table: torch.Tensor, segment: str):
        from asyncflow.bridge.staging import segment_bytes
        from asyncflow.transfer_queue.shm import Arena

        self.table, self.segment = table, segment
        self.plan = FakePlan(table.shape)
        self.rank, self.shape = self.plan.rank, self.plan.shape
        self._slots = _slots(Arena.create(segment_bytes(self.plan, self.rank), segment), self.plan)
        for header in self._slots.headers:
            header[1] = -1  # no version yet

    def stage(self, version: int):
        """Write ``version`` (sequence lock: ``seq`` is odd while the slot is being written)."""
        from asyncflow.bridge.staging import StageStats

        t0 = time.perf_counter()
        header, data = self._slots.headers[version % 2], self._slots.data[version % 2]
        header[0] += 1
        header[1] = version
        data.copy_(self.table.detach().reshape(-1))
        header[0] += 1
        return StageStats(seconds=time.perf_counter() - t0, bytes=data.numel() * 4, buckets=1)

    def close(self) -> None:
        """Remove the segment."""
        if self._slots is not None:
            self._slots.close()
            self._slots = None


def read_staged(segment: str, shape: Sequence[int], version: int) -> torch.Tensor:
    """The table staged as ``version`` in ``segment`` (a trainer's own segment, or a relay mirror of it);
    ``StaleStagingError`` when the slot holds another version or was rewritten while it was read."""
    from asyncflow.bridge.staging import StaleStagingError, segment_bytes
    from asyncflow.transfer_queue.shm import Arena

    plan = FakePlan(shape)
    slots = _slots(Arena.attach(segment, segment_bytes(plan, plan.rank)), plan)
    try:
        header = slots.headers[version % 2]
        before = header.tolist()
        table = slots.data[version % 2].clone().view(*shape)
        after = header.tolist()
        del header  # the views must go before the mapping closes
    finally:
        slots.close()
    if before != after or before[0] % 2 or before[1] != version:
        raise StaleStagingError(f"{segment}: slot of version {version} holds {after[1]} (seq {after[0]})")
    return table


# ---------------------------------------------------------------------------------------------- rollout
@ROLLOUT_ENGINES.register("fake")
class FakeRolloutEngine(RolloutEngine):
    """Samples from the n-gram table it was last given; one engine step is one token of every running sequence."""

    def __init__(self, cfg, model_dir: str | Path, *, share_device: bool = False, cpus=None, visible_devices=None):
        self.cfg = cfg
        self.faults = FakeFaults.from_env()
        self.vocab, self.eos, seed = model_facts(model_dir)
        self.table = initial_table(self.vocab, seed, context=CONTEXT)
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.version = 0
        self.applied: list[int] = []  # every version read from the weight path, in order

    @property
    def weight_version(self) -> int:
        return self.version

    def stream(self, ignore_eos: bool = False, turns: bool = False) -> FakeStream:
        return FakeStream(self, ignore_eos, turns)

    def generate(self, prompts: Sequence[Sequence[int]], n: int = 1, on_sample=None,
                 max_new_tokens: int | Sequence[int] | None = None, ignore_eos: bool = False,
                 temperature: float | None = None) -> list[Sample]:
        """``n`` responses per prompt in prompt order; ``on_sample(prompt_index, sample)`` as each finishes."""
        budgets = max_new_tokens if isinstance(max_new_tokens, Sequence) else [max_new_tokens] * len(prompts)
        stream, done = self.stream(ignore_eos), {}
        stream.temperature = self.cfg.temperature if temperature is None else temperature
        for i, prompt in enumerate(prompts):
            for j in range(n):
                stream.add((i, j), list(prompt), budgets[i])
        while len(stream):
            for key, sample in stream.step():
                done[key] = sample
                if on_sample is not None:
                    on_sample(key[0], sample)
        return [done[key] for key in sorted(done)]

    def relay_plan(self, plan: dict, model_dir: str | Path) -> FakePlan:
        """The table's one-bucket layout (``FakePlan``)."""
        return FakePlan.from_dict(plan)

    def apply_staged(self, staging: dict, version: int) -> dict:
        """Read ``version`` from the exporting rank's segment and serve it."""
        if self.faults.die_applying == version:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.faults.fail_apply_from is not None and version >= self.faults.fail_apply_from:
            raise RuntimeError(f"fake rollout: applying weight version {version} failed on purpose")
        t0 = time.perf_counter()
        self.table = read_staged(staging["segments"][SOURCE], staging["plan"]["shape"], version)
        self.version = version
        self.applied.append(version)
        nbytes = self.table.numel() * 4
        return {"ranks": [{"bytes_by_source": {SOURCE: nbytes}}], "bytes_per_rank": [nbytes],
                "seconds": time.perf_counter() - t0, "buckets": 1}


class FakeStream(RolloutStream):
    """Continuous batching on the fake engine (``RolloutStream``, like ``asyncflow.engines.vllm.stream.VllmStream``):
    ``add``, ``step``, ``swap_weights``, ``running``, ``free``, and multi-turn ``continue_turn`` / ``release``.

    An n-gram has no KV cache: after a swap every next token is exactly what the new version gives for the
    whole sequence, as vLLM's recomputed prefix makes it."""

    def __init__(self, engine: FakeRolloutEngine, ignore_eos: bool = False, turns: bool = False):
        self.engine, self.ignore_eos, self.turns = engine, ignore_eos, turns
        self.temperature = engine.cfg.temperature  # 0: greedy (argmax), drawing nothing from the generator
        self.capacity = engine.cfg.max_num_seqs
        self._live: dict[int, StreamRequest] = {}
        self._ended: dict[Hashable, StreamRequest] = {}
        self._ids = itertools.count()
        self.swaps = self.resumed = 0

    def __len__(self) -> int:
        return len(self._live)

    @property
    def free(self) -> int:
        return max(self.capacity - len(self._live), 0)

    def running(self) -> int:
        """Sequences one engine step advances (at most ``capacity``; the rest wait, as in vLLM's queue)."""
        return min(len(self._live), self.capacity)

    def add(self, key: Hashable, prompt: list[int], max_new_tokens: int | None = None,
            stop_token_ids: tuple[int, ...] = ()) -> None:
        budget = int(max_new_tokens or self.engine.cfg.max_new_tokens)
        self._live[next(self._ids)] = StreamRequest(key, list(prompt), budget, stop=tuple(stop_token_ids))

    def continue_turn(self, key: Hashable, observation: list[int]) -> bool:
        req = self._ended.pop(key)
        req.tokens += observation
        req.logprobs += [0.0] * len(observation)
        req.versions += [self.engine.version] * len(observation)
        req.mask += [0] * len(observation)
        if len(req.tokens) >= req.budget:
            return False
        self._live[next(self._ids)] = req
        return True

    def release(self, key: Hashable) -> None:
        self._ended.pop(key, None)

    def step(self) -> list[tuple[Hashable, Sample]]:
        """One token for each running sequence; the responses that finished."""
        if self.engine.faults.token_s:
            time.sleep(self.engine.faults.token_s)
        running = list(self._live.items())[: self.capacity]
        if not running:
            return []
        engine = self.engine
        ctx = torch.tensor([_context(r.prompt + r.tokens) for _, r in running])
        logits = ngram_logits(engine.table, ctx)
        logp = torch.log_softmax(logits, dim=-1)
        if self.temperature > 0:
            picked = torch.multinomial(torch.softmax(logits / self.temperature, -1), 1,
                                       generator=engine.generator).squeeze(-1)
        else:
            picked = logits.argmax(-1)
        done = []
        for (rid, req), tok, row in zip(running, picked.tolist(), logp):
            req.tokens.append(tok)
            req.logprobs.append(row[tok].item())
            req.versions.append(engine.version)
            req.mask.append(1)
            stopped = tok in req.stop or (tok == engine.eos and not self.ignore_eos)
            if stopped or len(req.tokens) >= req.budget:
                del self._live[rid]
                req.turns += 1
                if self.turns:
                    self._ended[req.key] = req
                done.append((req.key, self._sample(req, "stop" if stopped else "length", rid)))
        return done

    def _sample(self, req: StreamRequest, finish_reason: str, rid: int) -> Sample:
        return req.to_sample(finish_reason, f"f{rid}", self.engine.version)

    def swap_weights(self, apply: Callable[[], object], keep_kv: bool = False) -> tuple[object, list]:
        """Apply a newer version between two steps; every in-flight response carries on under it."""
        self.swaps += 1
        self.resumed += len(self._live)
        return apply(), []

    def abort(self) -> int:
        n = len(self._live)
        self._live.clear()
        return n
