"""Fields as raw bytes: how tensors, ragged tensors and small Python objects cross the data plane.

A field has one of three kinds, fixed by its first write:

- ``dense``: every row has the same shape; put as one tensor ``[rows, *shape]``, returned the same way.
- ``ragged``: rows differ in their first dimension (token sequences); put as a list of tensors or as
  ``Packed(values, offsets)``; returned as a list of tensors or as ``Packed``, by the caller's choice.
- ``object``: msgpack-serialisable Python values (prompt strings, ground-truth answers).

Tensors travel as their raw bytes with dtype and shape described in msgpack headers, never pickled.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack
import numpy as np
import torch

from .errors import BadRequestError
from .schema import ITEMSIZES, FieldSpec

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in ITEMSIZES}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


@dataclass
class Packed:
    """Variable-length rows packed along dim 0: row i is ``values[offsets[i]:offsets[i + 1]]``."""

    values: torch.Tensor
    offsets: torch.Tensor

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def to_list(self) -> list[torch.Tensor]:
        """Row views (no copy)."""
        return list(torch.split(self.values, torch.diff(self.offsets).tolist()))

    @property
    def lengths(self) -> torch.Tensor:
        return torch.diff(self.offsets)


class EncodedField:
    """One field of a put as bytes: its spec, per-row sizes, and the rows' memory."""

    def __init__(self, spec: FieldSpec, row_nbytes: np.ndarray, row_len0: np.ndarray | None,
                 contiguous: memoryview | None, rows: list[memoryview] | None, keepalive=None):
        self.spec = spec
        self.row_nbytes = row_nbytes
        self.row_len0 = row_len0
        self.cum = np.concatenate(([0], np.cumsum(row_nbytes, dtype=np.int64)))
        self._contiguous = contiguous
        self._rows = rows
        self._keepalive = keepalive  # the tensors whose memory the views point into

    @property
    def num_rows(self) -> int:
        return len(self.row_nbytes)

    def row_range_pieces(self, start: int, stop: int) -> list[memoryview]:
        """Bytes of rows [start, stop) in order, as few views as possible (no copies)."""
        if self._contiguous is not None:
            return [self._contiguous[int(self.cum[start]):int(self.cum[stop])]]
        return self._rows[start:stop]


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """Flat uint8 view of a contiguous CPU tensor (no copy for contiguous input)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def copy_bytes(dst: memoryview, src: memoryview) -> None:
    """dst[:] = src, a plain memcpy. (Splitting large copies over torch's intra-op threads was tried:
    on a busy 2-core machine the OpenMP barrier made 4 MiB copies 5x slower, so it stays serial.)"""
    dst[:] = src


def encode_field(name: str, value) -> EncodedField:
    """Turn a user value into an EncodedField, or raise BadRequestError saying what is wrong."""
    if isinstance(value, np.ndarray):
        value = torch.from_numpy(value)
    if isinstance(value, torch.Tensor):
        return _encode_dense(name, value)
    if isinstance(value, Packed):
        return _encode_packed(name, value)
    if isinstance(value, (list, tuple)):
        if value and all(isinstance(v, (torch.Tensor, np.ndarray)) for v in value):
            return _encode_ragged(name, [torch.as_tensor(v) for v in value])
        return _encode_objects(name, value)
    raise BadRequestError(f"field {name!r}: unsupported value type {type(value).__name__}; pass a tensor "
                          "[rows, ...], a list of tensors, Packed(values, offsets) or a list of objects")


def _dtype_name(name: str, t: torch.Tensor) -> str:
    if t.dtype not in DTYPE_NAMES:
        raise BadRequestError(f"field {name!r}: dtype {t.dtype} is not supported")
    return DTYPE_NAMES[t.dtype]


def _encode_dense(name: str, t: torch.Tensor) -> EncodedField:
    if t.dim() == 0:
        raise BadRequestError(f"field {name!r}: a dense field needs a leading row dimension")
    t = t.detach().cpu().contiguous()
    spec = FieldSpec("dense", _dtype_name(name, t), tuple(t.shape[1:]))
    per_row = spec.inner_numel * t.element_size()
    return EncodedField(spec, np.full(t.shape[0], per_row, np.int64), None, tensor_bytes(t), None, t)


def _encode_ragged(name: str, rows: list[torch.Tensor]) -> EncodedField:
    first = rows[0]
    if first.dim() == 0:
        raise BadRequestError(f"field {name!r}: ragged rows need at least one dimension")
    dtype, inner = first.dtype, tuple(first.shape[1:])
    for i, r in enumerate(rows):
        if r.dtype != dtype or tuple(r.shape[1:]) != inner or r.dim() == 0:
            raise BadRequestError(f"field {name!r}: row {i} is {r.dtype}{list(r.shape)} but row 0 is "
                                  f"{dtype}[n, {', '.join(map(str, inner))}]; rows may differ only in dim 0")
    rows = [r.detach().cpu().contiguous() for r in rows]
    spec = FieldSpec("ragged", _dtype_name(name, first), inner)
    len0 = np.array([r.shape[0] for r in rows], np.int64)
    nbytes = np.array([r.numel() * r.element_size() for r in rows], np.int64)
    return EncodedField(spec, nbytes, len0, None, [tensor_bytes(r) for r in rows], rows)


def _encode_packed(name: str, p: Packed) -> EncodedField:
    values, offsets = p.values.detach().cpu().contiguous(), torch.as_tensor(p.offsets).cpu()
    if values.dim() == 0 or offsets.dim() != 1 or len(offsets) < 1:
        raise BadRequestError(f"field {name!r}: Packed needs values [total, ...] and offsets [rows + 1]")
    off = offsets.to(torch.int64).numpy()
    if off[0] != 0 or off[-1] != values.shape[0] or np.any(np.diff(off) < 0):
        raise BadRequestError(f"field {name!r}: offsets must start at 0, never decrease and end at "
                              f"len(values)={values.shape[0]}")
    spec = FieldSpec("ragged", _dtype_name(name, values), tuple(values.shape[1:]))
    row_elems = spec.inner_numel * values.element_size()
    len0 = np.diff(off).astype(np.int64)
    return EncodedField(spec, len0 * row_elems, len0, tensor_bytes(values), None, values)


def _encode_objects(name: str, values) -> EncodedField:
    try:
        rows = [msgpack.packb(v, use_bin_type=True) for v in values]
    except (TypeError, ValueError, OverflowError) as exc:
        raise BadRequestError(f"field {name!r}: values must be tensors or msgpack-serialisable "
                              f"(str, bytes, numbers, lists, dicts): {exc}") from None
    nbytes = np.array([len(r) for r in rows], np.int64)
    return EncodedField(FieldSpec("object", "object", ()), nbytes, None, None,
                        [memoryview(r) for r in rows], rows)


def new_output(spec: FieldSpec, len0: np.ndarray, total_bytes: int) -> tuple[torch.Tensor | None, memoryview]:
    """Allocate the tensor that receives a field's rows and its writable byte view."""
    if spec.kind == "object":
        buf = bytearray(total_bytes)
        return None, memoryview(buf)
    dtype = DTYPES[spec.dtype]
    if spec.kind == "dense":
        out = torch.empty((len(len0), *spec.shape), dtype=dtype)
    else:
        out = torch.empty((int(len0.sum()), *spec.shape), dtype=dtype)
    return out, tensor_bytes(out) if out.numel() else memoryview(bytearray(0))


def finish_output(spec: FieldSpec, out: torch.Tensor | None, raw: memoryview, row_nbytes: np.ndarray,
                  len0: np.ndarray, ragged: str):
    """Turn filled bytes into what the caller asked for."""
    if spec.kind == "dense":
        return out
    if spec.kind == "object":
        cum = np.concatenate(([0], np.cumsum(row_nbytes)))
        return [msgpack.unpackb(raw[int(cum[i]):int(cum[i + 1])], raw=False) for i in range(len(row_nbytes))]
    offsets = torch.from_numpy(np.concatenate(([0], np.cumsum(len0))).astype(np.int64))
    if ragged == "packed":
        return Packed(out, offsets)
    return list(torch.split(out, len0.tolist())) if len(len0) else []
