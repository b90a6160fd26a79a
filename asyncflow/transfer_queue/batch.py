"""What consumers receive: metadata of a batch (from the controller) and the batch itself."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class BatchMeta:
    """Rows handed to one task by the controller, with where their bytes live.

    ``done`` is True when the partition is sealed and the task has received every row it can
    receive; such a meta is empty. ``ready`` is filled by non-blocking polls that found too few rows.
    """

    partition: str
    task: str
    indexes: list[int]
    versions: list[int] = field(default_factory=list)
    group_ids: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    done: bool = False
    ready: int | None = None
    locations: dict = field(default_factory=dict, repr=False)
    """field -> [spec, units, offsets, nbytes, len0] as sent by the controller."""
    handout: int | None = None
    """Id of this hand-out: acks and renewals name it, so that they never touch a later hand-out of the
    same rows (after a release or an expired lease)."""
    lease_s: float | None = None
    """The rows return to the task unless read (acked) or renewed within this many seconds."""
    lost_rows: int = 0
    """Rows of the partition lost with a dead storage unit (they are never handed out)."""
    units: dict = field(default_factory=dict, repr=False)
    """Storage unit id (str) -> incarnation: a client reconnects to a unit that registered again."""

    def __len__(self) -> int:
        return len(self.indexes)

    @property
    def fields(self) -> list[str]:
        return list(self.locations)

    @classmethod
    def from_reply(cls, partition: str, task: str, reply: dict) -> BatchMeta:
        return cls(partition, task, list(reply.get("indexes", [])), list(reply.get("versions", [])),
                   list(reply.get("group_ids", [])), list(reply.get("lengths", [])),
                   bool(reply.get("done")), reply.get("ready"), dict(reply.get("fields", {})),
                   reply.get("handout"), reply.get("lease"), int(reply.get("lost_rows", 0)),
                   dict(reply.get("units", {})))


@dataclass
class Batch:
    """A micro-batch: ``batch["responses"]`` is a tensor (dense), a list of tensors or ``Packed``
    (ragged, by the caller's choice) or a list of Python values (object fields)."""

    meta: BatchMeta
    data: dict

    def __getitem__(self, name: str):
        return self.data[name]

    def __contains__(self, name: str) -> bool:
        return name in self.data

    def __len__(self) -> int:
        return len(self.meta)

    def keys(self):
        return self.data.keys()

    @property
    def indexes(self) -> list[int]:
        return self.meta.indexes

    @property
    def done(self) -> bool:
        return self.meta.done

    def select(self, positions: list[int]) -> Batch:
        """The rows at ``positions`` (0-based within this batch) as a new batch, e.g. after a filter.

        Dense fields are indexed, ragged-as-list and object fields picked; packed ragged fields (which
        share one buffer) are not supported here.
        """
        import torch

        meta = BatchMeta(self.meta.partition, self.meta.task, [self.meta.indexes[i] for i in positions],
                         [self.meta.versions[i] for i in positions] if self.meta.versions else [],
                         [self.meta.group_ids[i] for i in positions] if self.meta.group_ids else [],
                         [self.meta.lengths[i] for i in positions] if self.meta.lengths else [],
                         self.meta.done, self.meta.ready, self.meta.locations, self.meta.handout,
                         self.meta.lease_s, self.meta.lost_rows, self.meta.units)
        data = {}
        for name, value in self.data.items():
            if isinstance(value, torch.Tensor):
                data[name] = value[torch.as_tensor(positions, dtype=torch.long)]
            elif isinstance(value, list):
                data[name] = [value[i] for i in positions]
            else:
                raise TypeError(f"field {name!r}: select() does not support {type(value).__name__}")
        return Batch(meta, data)
