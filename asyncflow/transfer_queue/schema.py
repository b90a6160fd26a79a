"""Field types as plain data, shared by clients and servers (no torch import: servers start fast)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import BadRequestError

ITEMSIZES: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
    "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "float8_e4m3fn": 1, "float8_e5m2": 1,
}
KINDS = ("dense", "ragged", "object")


@dataclass(frozen=True)
class FieldSpec:
    """Type of a field: kind, dtype name and per-row shape (for ragged fields, after dim 0)."""

    kind: str
    dtype: str
    shape: tuple[int, ...]

    def to_wire(self) -> list:
        return [self.kind, self.dtype, list(self.shape)]

    @classmethod
    def from_wire(cls, obj) -> FieldSpec:
        if not (isinstance(obj, (list, tuple)) and len(obj) == 3):
            raise BadRequestError(f"malformed field spec {obj!r}")
        kind, dtype, shape = obj
        if kind not in KINDS:
            raise BadRequestError(f"unknown field kind {kind!r}; valid: {', '.join(KINDS)}")
        if kind == "object":
            if dtype != "object":
                raise BadRequestError("object fields have dtype 'object'")
        elif dtype not in ITEMSIZES:
            raise BadRequestError(f"unsupported dtype {dtype!r}; valid: {', '.join(ITEMSIZES)}")
        if not isinstance(shape, (list, tuple)) or not all(
                isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 40 for d in shape):
            raise BadRequestError(f"malformed shape {shape!r}")
        if len(shape) > 16:
            raise BadRequestError("at most 16 dimensions per field")
        return cls(kind, dtype, tuple(shape))

    @property
    def itemsize(self) -> int:
        return 1 if self.kind == "object" else ITEMSIZES[self.dtype]

    @property
    def inner_numel(self) -> int:
        return int(np.prod(self.shape)) if self.shape else 1

    def describe(self) -> str:
        dims = "x".join(str(d) for d in self.shape)
        if self.kind == "ragged":
            return f"ragged {self.dtype}[n{'x' + dims if dims else ''}]"
        if self.kind == "object":
            return "object"
        return f"{self.dtype}[{dims}]"


