"""Context parallelism's vocabulary: the attention forms, which heads Ulysses can split, and what each form
sends per device and layer: the rules the runtime's kernel (`mistjax.runtime.context_attention`) follows and
the cost model prices."""

from __future__ import annotations

import enum

import numpy as np
from numpy.typing import ArrayLike


class ContextForm(enum.StrEnum):
    """How the sequence-split attention communicates."""

    RING = "ring"  # K/V shards passed around a ring (point-to-point), zigzag load balance
    ULYSSES = "ulysses"  # all-to-all to a head split and back


CONTEXT_FORMS: tuple[str, ...] = tuple(f.value for f in ContextForm)


def ulysses_supported(heads: int, kv_heads: int, cp: int, tp: int = 1) -> str | None:
    """Why Ulysses cannot split these heads over ``cp`` devices (None when it can).

    Every device gets ``heads / cp`` query heads and the kv heads they read: ``kv_heads / cp`` of them when
    ``cp`` divides ``kv_heads``, else (``kv_heads < cp``, ``kv_heads`` dividing ``cp``) each kv head is
    repeated ``cp / kv_heads`` times before the all-to-all, so that every device gets the one kv head its
    query heads read (the repeats' gradients are summed back). Under tensor parallelism (``tp`` > 1) the
    heads are split over ``tensor`` too, and the kernel's strided head groups stay inside each device's
    tensor block only when ``cp * tp`` divides ``kv_heads``.

    Args:
        heads: query heads.
        kv_heads: key/value heads (dividing ``heads``).
        cp: devices on the context axis.
        tp: devices on the tensor axis the heads are split over.
    """
    if kv_heads <= 0 or heads % kv_heads:
        return f"kv_heads {kv_heads} must divide heads {heads}"
    if heads % cp:
        return f"heads {heads} is not divisible by the context size cp = {cp} (Ulysses gives each device heads / cp)"
    if kv_heads % cp and cp % kv_heads:
        return (f"kv_heads {kv_heads} and the context size cp = {cp} do not divide one another (Ulysses needs "
                "kv_heads / cp whole heads per device, or kv_heads dividing cp to repeat them)")
    if tp > 1 and kv_heads % (cp * tp):
        return (f"kv_heads {kv_heads} is not divisible by cp x tp = {cp * tp} (under tensor parallelism each "
                "device's kv heads must split cp ways)")
    return None


def ulysses_traffic(cp: ArrayLike, q_bytes: ArrayLike, kv_bytes: ArrayLike, kv_repeat: ArrayLike
                    ) -> tuple[np.ndarray, np.ndarray]:
    """Bytes one device sends in one layer's Ulysses attention for one micro-batch: ``(forward, backward)``.

    Each all-to-all keeps ``1 / cp`` of what a device holds and sends the rest. Forward: q, k and v to the
    head split and the output back (``2 q + kv'``); backward: ``do`` to the head split and ``dq, dk, dv``
    back, in the input dtype (``2 q + kv'`` again). ``kv' = kv_repeat * kv``: with fewer kv heads than
    ``cp`` each is repeated ``cp / kv_heads`` times before the exchange. Nothing for ``cp = 1``.

    Args:
      cp: context-parallel degree.
      q_bytes: the device's local queries (as many bytes as the output).
      kv_bytes: its local keys and values together.
      kv_repeat: ``max(1, cp / kv_heads)``.
    """
    cp, q, kv = (np.asarray(x, dtype=np.float64) for x in (cp, q_bytes, kv_bytes))
    sent = (cp - 1.0) / np.maximum(cp, 1.0) * (2.0 * q + np.asarray(kv_repeat) * kv)
    on = cp > 1
    return np.where(on, sent, 0.0), np.where(on, sent, 0.0)


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


__all__ = ["CONTEXT_FORMS", "ContextForm", "ring_traffic", "ulysses_supported", "ulysses_traffic"]
