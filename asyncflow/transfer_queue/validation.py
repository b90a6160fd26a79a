"""Strict checks of header values received over the wire (they come from untrusted peers)."""

from __future__ import annotations

import numpy as np

from .errors import BadRequestError


def check_int(h: dict, key: str, minimum: int, default=None) -> int:
    """``h[key]`` as an int >= minimum (bools refused), else BadRequestError naming the key."""
    value = h.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise BadRequestError(f"{key} must be an integer >= {minimum}, got {value!r}")
    return value


def check_float(h: dict, key: str, default: float) -> float:
    """``h[key]`` as a non-negative finite number (None gives ``default``)."""
    value = h.get(key, default)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < 1e9:
        raise BadRequestError(f"{key} must be a non-negative number, got {value!r}")
    return float(value)


def int_array(value, count: int, what: str) -> np.ndarray | None:
    """A list of ``count`` integers as an int64 array (vectorised check: this runs for every put)."""
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != count:
        raise BadRequestError(f"{what} must be a list of {count} integers")
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError, OverflowError):
        arr = None
    # bools, floats, strings and ints beyond int64 give another dtype kind (or object) and are refused.
    if arr is None or arr.ndim != 1 or (arr.dtype.kind not in "iu" and count) or (
            arr.dtype.kind == "u" and count and arr.max() >= 1 << 63):
        raise BadRequestError(f"{what} must contain integers only")
    return arr.astype(np.int64, copy=False) if count else np.zeros(0, np.int64)


