"""Reference compressors for tests, from their definitions in numpy (not the daemon's)."""

from __future__ import annotations

import numpy as np


def topk(v: np.ndarray, ratio: float) -> np.ndarray:
    """Keep the ceil(ratio * n) entries of largest magnitude (no ties in the tests' inputs)."""
    k = max(1, int(np.ceil(ratio * v.size)))
    keep = np.argsort(-np.abs(v), kind="stable")[:k]
    out = np.zeros_like(v)
    out[keep] = v[keep]
    return out


def sign(v: np.ndarray) -> np.ndarray:
    """mean(|v|) * sign(v), with 0 counted as +."""
    scale = np.abs(v.astype(np.float64)).mean()
    return np.where(v >= 0, scale, -scale).astype(v.dtype)


def int8(v: np.ndarray) -> np.ndarray:
    """max|v|/127 * rint(v / (max|v|/127)); all zeros for a zero tensor."""
    scale = v.dtype.type(np.abs(v).max() / 127.0)
    if not scale:
        return np.zeros_like(v)
    return (np.rint(v / scale) * scale).astype(v.dtype)


def int4(v: np.ndarray) -> np.ndarray:
    """max|v|/7 * rint(v / (max|v|/7)), levels -7..7; all zeros for a zero tensor."""
    scale = v.dtype.type(np.abs(v).max() / 7.0)
    if not scale:
        return np.zeros_like(v)
    return (np.rint(v / scale) * scale).astype(v.dtype)
