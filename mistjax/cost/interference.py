"""Mist's four-channel overlap model: the time of compute, D2D, H2D and D2H work running together
(docs/internals.md).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

from mistjax.hardware.interference import CHANNELS, InterferenceParams


def overlap_time(
    compute: ArrayLike, d2d: ArrayLike, h2d: ArrayLike, d2h: ArrayLike, params: InterferenceParams
) -> np.ndarray:
    """Duration of a phase whose four channels run concurrently (Mist's interference model).

    Args:
        compute: standalone compute time(s), seconds; any shape, broadcast with the others.
        d2d: standalone device<->device collective time(s).
        h2d: standalone host->device copy time(s).
        d2h: standalone device->host copy time(s).
        params: slowdown factors.

    Returns:
        Array of the broadcast shape (0-d for scalar inputs). NaN in any channel gives NaN; inf
        gives inf.

    Raises:
        ValueError: if any input is negative.
    """
    x = np.stack(np.broadcast_arrays(*(np.asarray(v, dtype=np.float64) for v in (compute, d2d, h2d, d2h))))
    if np.any(x < 0):
        raise ValueError("overlap_time: channel times must be >= 0")
    nan = np.isnan(x).any(axis=0)
    x = np.where(np.isnan(x), 0.0, x)  # keep NaN out of the mask logic; restored at the end
    t = np.zeros(x.shape[1:])
    with np.errstate(invalid="ignore"):  # inf - inf in rows not selected by a mask is discarded
        t = _passes(x, t, params)
    t = t + x.sum(axis=0)  # at most one channel is left; it runs alone
    return np.where(nan, np.nan, t)[()]


def _passes(x: np.ndarray, t: np.ndarray, params: InterferenceParams) -> np.ndarray:
    """The 11 masked min/subtract passes; updates ``x`` in place, returns the accumulated time.

    Each pass works on the elements whose busy channels are exactly its mask (gathered by index):
    every element goes through at most three passes, so gathering keeps the work proportional to the
    elements a pass changes, not to 11 sweeps of all of them, with the same arithmetic per element.
    """
    flat, tf = x.reshape(len(CHANNELS), -1), t.reshape(-1).copy()
    code = _busy(flat)
    for mask, f in params.mask_factors():
        idx = np.flatnonzero(code == sum(1 << k for k in mask))
        if not idx.size:
            continue
        at = np.ix_(np.asarray(mask, dtype=np.intp), idx)
        xm = flat[at]
        fb = f.reshape(-1, 1)
        scaled = xm * fb  # time each channel would need under this mask's slowdown
        o = scaled.min(axis=0)
        tf[idx] += o
        # The argmin channel(s) are set to exactly 0 so float residue cannot resurrect them.
        flat[at] = np.where(scaled <= o, 0.0, xm - o / fb)
        code[idx] = _busy(flat[:, idx])
    x[...] = flat.reshape(x.shape)
    return tf.reshape(t.shape)


def _busy(x: np.ndarray) -> np.ndarray:
    """The busy channels (``> 0``) of each column of ``x [channels, n]`` as a bit set (bit k: channel k)."""
    code = np.zeros(x.shape[1], dtype=np.int8)
    for k in range(x.shape[0]):
        code |= (x[k] > 0).view(np.int8) << k
    return code


__all__ = ["overlap_time"]
