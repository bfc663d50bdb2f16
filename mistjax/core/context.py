"""What the context-parallel ring attention sends, per device and layer: the rule the runtime's kernel
(`mistjax.runtime.context_attention`, causal zigzag form) follows and the cost model prices."""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike


def ring_traffic(cp: ArrayLike, q_bytes: ArrayLike, kv_bytes: ArrayLike, acc_scale: ArrayLike
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Bytes one device sends in one layer's ring attention for one micro-batch: ``(forward, backward)``.

    Forward: q, k, v into the zigzag layout and the output back (``2 q + kv``), and ``cp - 1`` hops of the
    local keys and values. Backward: ``do`` in and ``dq, dk, dv`` out (``2 q + kv`` again), ``cp - 1`` hops of
    the keys and values, and ``cp`` hops of their gradient accumulators (float32: ``acc_scale`` = 4 / the
    activations' bytes per element). With ``cp = 2`` the even chunks already sit where the zigzag puts them
    (that permutation is the identity and is skipped), so the layout moves half as much. Nothing for ``cp = 1``.

    Args:
      cp: context-parallel degree.
      q_bytes: the device's local queries (as many bytes as the output).
      kv_bytes: its local keys and values together.
      acc_scale: bytes of a dK / dV accumulator element over an activation element.
    """
    cp, q, kv = (np.asarray(x, dtype=np.float64) for x in (cp, q_bytes, kv_bytes))
    layout = np.where(cp == 2, 0.5, 1.0) * (2.0 * q + kv)
    hops = (cp - 1.0) * kv
    on = cp > 1
    return np.where(on, layout + hops, 0.0), np.where(on, layout + hops + cp * kv * np.asarray(acc_scale), 0.0)


__all__ = ["ring_traffic"]
