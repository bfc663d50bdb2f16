"""Remat and ZeRO-3 on unrolled layer stacks vs scanned ones: the compiled per-device peak with and without each
knob, on the same shapes (8 devices).

Run: python scripts/bench_unrolled_memory.py [--json FILE] [--pairs nnx gpt2] [--target cpu|h100|...]
     [--remat-shape.layers 16 --zero3-shape.hidden 384 ...]  (shapes: `REMAT_SHAPE`, `ZERO3_SHAPE`)

Two pairs of models, each an unrolled stack and a scanned one of the same architecture and shapes:

* ``nnx``: two NNX models with the same MLP blocks, ``nnx-loop`` running its layers as a Python loop over an
  ``nnx.List`` (mistjax runs it with its per-layer loop over the real per-layer leaves) and ``nnx-scan``
  creating them with ``nnx.vmap`` and running them with ``nnx.scan`` (stacked parameters);
* ``gpt2``: Hugging Face's Flax GPT-2 (``hf-gpt2``, a Python loop over ``h/0 .. h/L-1``; needs transformers)
  and the zoo's GPT-3 block (``zoo-gpt3``, scanned; plain logits, as GPT-2 computes them).

Each is trained with a plain optax state (adamw) and ``mistjax.value_and_grad``; each plan's step is lowered and
compiled (never run), for this process's 8 CPU devices or (``--target h100``) deviceless for 8 GPUs
(`mistjax.validate.gpu_aot`; needs the CUDA plugin of the dev extras). The peak is ``argument + output + temp -
alias`` of ``compiled.memory_analysis()`` (`mistjax.core.hlo.memory_stats`). The knobs: remat (``remat_layers=L``)
against the plain DP plan, and ZeRO-3 (``shard_weights`` + ``shard_grads``) against ZeRO-1. ``saving`` is
``1 - peak(knob) / peak(base)``; ``vs scan`` is the saving of the unrolled stack's knob peak measured from its
scanned twin's base peak, as a fraction of the scanned twin's own saving (1.0: the knob reaches the same peak on
both, whatever the bases).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import tyro  # noqa: E402
from flax import nnx  # noqa: E402

import mistjax  # noqa: E402
from mistjax.core import hlo  # noqa: E402

DP, Z1 = dict(shard_opt=False), dict(shard_opt=True)
Z3 = dict(shard_opt=True, shard_grads=True, shard_weights=True)
# knob -> (base plan, plan with the knob); `remat_layers` is filled in with the model's layer count.
KNOBS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {"remat": (DP, dict(DP, remat_layers=-1)),
                                                           "zero3": (Z1, Z3)}


@dataclass(frozen=True)
class Shape:
    """The model and batch shape the families of a measurement are built with."""

    vocab: int = 512
    hidden: int = 384
    ffn: int = 1536
    layers: int = 4
    heads: int = 4  # attention heads of the gpt2 pair
    batch: int = 16  # global batch (rows split over the 8 devices)
    seq: int = 128


# Each knob on shapes where what it frees dominates the peak: remat where activations do (16 thin layers, long
# sequences), ZeRO-3 where weights and optimizer state do.
REMAT_SHAPE = Shape(hidden=128, ffn=512, layers=16, heads=2, batch=32, seq=256)
ZERO3_SHAPE = Shape(hidden=384, ffn=1536, layers=4, heads=4, batch=16, seq=128)


class Block(nnx.Module):
    """RMSNorm, up projection, SiLU, down projection, residual."""

    def __init__(self, shape: Shape, rngs: nnx.Rngs) -> None:
        self.norm = nnx.RMSNorm(shape.hidden, rngs=rngs)
        self.up = nnx.Linear(shape.hidden, shape.ffn, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(shape.ffn, shape.hidden, use_bias=False, rngs=rngs)

    def __call__(self, h: jax.Array) -> jax.Array:
        return h + self.down(jax.nn.silu(self.up(self.norm(h))))


class LoopLM(nnx.Module):
    """Layers as an ``nnx.List``, run in a Python loop (an unrolled stack)."""

    def __init__(self, shape: Shape, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(shape.vocab, shape.hidden, rngs=rngs)
        self.layers = nnx.List([Block(shape, rngs) for _ in range(shape.layers)])
        self.norm = nnx.RMSNorm(shape.hidden, rngs=rngs)

    def __call__(self, ids: jax.Array) -> jax.Array:
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.embed.attend(self.norm(h))


class ScanLM(nnx.Module):
    """Layers created with ``nnx.vmap`` and run with ``nnx.scan`` (stacked parameters)."""

    def __init__(self, shape: Shape, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(shape.vocab, shape.hidden, rngs=rngs)

        @nnx.split_rngs(splits=shape.layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(r: nnx.Rngs) -> Block:
            return Block(shape, r)

        self.layers = create(rngs)
        self.norm = nnx.RMSNorm(shape.hidden, rngs=rngs)

    def __call__(self, ids: jax.Array) -> jax.Array:
        h = self.embed(ids)

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run(h: jax.Array, layer: Block) -> jax.Array:
            return layer(h)

        return self.embed.attend(self.norm(run(h, self.layers)))


def xent(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy (fp32)."""
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets).mean()


Loss = Callable[[Any, Any], jax.Array]


def _nnx(cls: type[nnx.Module]) -> Callable[[Shape], tuple[Any, Loss]]:
    def build(shape: Shape) -> tuple[Any, Loss]:
        graphdef, params = nnx.split(cls(shape, nnx.Rngs(0)), nnx.Param)
        return params, lambda params, batch: xent(nnx.merge(graphdef, params)(batch["inputs"]), batch["targets"])

    return build


def hf_gpt2(shape: Shape) -> tuple[Any, Loss]:
    """Hugging Face's Flax GPT-2 (tied embeddings, learned positions, GELU MLP of width `ffn`)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import FlaxGPT2LMHeadModel, GPT2Config

    cfg = GPT2Config(vocab_size=shape.vocab, n_embd=shape.hidden, n_inner=shape.ffn, n_layer=shape.layers,
                     n_head=shape.heads, n_positions=shape.seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = FlaxGPT2LMHeadModel(cfg, seed=0, dtype=jnp.float32)

    def loss_fn(params: Any, batch: Any) -> jax.Array:
        ids = batch["inputs"]
        pos = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
        return xent(model.module.apply({"params": params}, ids, jnp.ones_like(ids), pos).logits, batch["targets"])

    return model.params, loss_fn


def zoo_gpt3(shape: Shape) -> tuple[Any, Loss]:
    """The zoo's GPT-3 block (`models`, scanned), tied embeddings, plain (unfused) logits as GPT-2's."""
    import models

    cfg = models.ModelConfig(name="bench-gpt3", family="gpt3", vocab_size=shape.vocab, hidden_size=shape.hidden,
                             num_layers=shape.layers, num_heads=shape.heads, num_kv_heads=shape.heads,
                             ffn_size=shape.ffn, max_seq_len=shape.seq, tie_embeddings=True, vocab_multiple=1)
    graphdef, params = nnx.split(models.build(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    return params, models.make_loss_fn(graphdef, fused_head=False)


# family -> (builder, unrolled); pair -> (unrolled family, scanned family)
FAMILIES: dict[str, tuple[Callable[[Shape], tuple[Any, Loss]], bool]] = {
    "nnx-loop": (_nnx(LoopLM), True), "nnx-scan": (_nnx(ScanLM), False),
    "hf-gpt2": (hf_gpt2, True), "zoo-gpt3": (zoo_gpt3, False)}
PAIRS: dict[str, tuple[str, str]] = {"nnx": ("nnx-loop", "nnx-scan"), "gpt2": ("hf-gpt2", "zoo-gpt3")}
TX = optax.adamw(1e-3)


def build(family: str, shape: Shape) -> tuple[Callable[..., Any], dict[str, Any], dict[str, np.ndarray]]:
    """``(train_step, state, batch)`` of one family: an optax state ``{"params", "opt"}`` and a token batch."""
    params, loss_fn = FAMILIES[family][0](shape)

    def train_step(state: Any, batch: Any) -> tuple[Any, Any]:
        loss, grads = mistjax.value_and_grad(loss_fn)(state["params"], batch)
        updates, opt = TX.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, {"loss": loss}

    tok = np.random.default_rng(0).integers(0, shape.vocab, (shape.batch, shape.seq + 1)).astype(np.int32)
    batch = {"inputs": tok[:, :-1], "targets": tok[:, 1:]}
    return train_step, {"params": params, "opt": TX.init(params)}, batch


def plan_for(shape: Shape, knobs: dict[str, Any], devices: int) -> mistjax.Plan:
    """``uniform_plan(L, devices, **knobs)`` with one micro-batch (``remat_layers=-1``: every layer)."""
    knobs = {k: (shape.layers if k == "remat_layers" and v < 0 else v) for k, v in knobs.items()}
    return mistjax.uniform_plan(shape.layers, devices, micro_batch=shape.batch // devices, **knobs)


def compile_plan(family: str, shape: Shape, knobs: dict[str, Any]) -> Any:
    """The compiled step of `family` under `plan_for` on this process's devices."""
    train_step, state, batch = build(family, shape)
    step = mistjax.autoshard(train_step, jax.devices(), plan=plan_for(shape, knobs, jax.device_count()))
    return step.lower(state, batch).compile()


def all_gathers(hlo_text: str) -> dict[str, int]:
    """All-gathers of a compiled program: how many instructions, and how many run (loop trips counted)."""
    gathers = [c for c in hlo.collectives(hlo_text) if c.op == "all-gather"]
    trips = hlo.computation_trips(hlo_text)
    return {"count": len(gathers), "executed": sum(trips.get(c.computation, 1) for c in gathers)}


def compiled_stats(family: str, shape: Shape, knobs: dict[str, Any], target: str = "cpu"
                   ) -> tuple[dict[str, float], dict[str, int]]:
    """Memory stats (bytes per device, and the compile seconds) and all-gathers of one plan's step, compiled on
    this process's devices (``target="cpu"``) or deviceless for 8 GPUs of an XLA:GPU target (`TARGET_SPECS` of
    `mistjax.validate.gpu_aot`: h100, a100-80gb, ...)."""
    t0 = time.perf_counter()
    if target == "cpu":
        compiled = compile_plan(family, shape, knobs)
        stats: dict[str, float] = dict(hlo.memory_stats(compiled))
        text = compiled.as_text()
    else:
        from mistjax.hardware import ClusterSpec
        from mistjax.validate import gpu_aot

        train_step, state, batch = build(family, shape)
        report = gpu_aot.compile_plan(train_step, state, batch, plan_for(shape, knobs, 8), ClusterSpec.preset(target),
                                      breakdown=False)
        m = report.memory
        stats = {"argument": m.argument, "output": m.output, "temp": m.temp, "alias": m.alias, "peak": m.peak}
        text = report.hlo_text
    stats["compile_s"] = round(time.perf_counter() - t0, 1)
    return stats, all_gathers(text)


def measure_knob(family: str, shape: Shape, knob: str, target: str = "cpu") -> dict[str, Any]:
    """One family under one knob: the base and knob memory stats (bytes per device), their all-gathers and the
    saving (see `compiled_stats` for `target`)."""
    out: dict[str, Any] = {"family": family, "knob": knob, "unrolled": FAMILIES[family][1], "target": target}
    for key, plan in zip(("base", "with"), KNOBS[knob]):
        out[key], out[f"{key}_all_gathers"] = compiled_stats(family, shape, plan, target)
    out["saving"] = 1 - out["with"]["peak"] / out["base"]["peak"]
    return out


def versus_scan(unrolled: dict[str, Any], scanned: dict[str, Any]) -> float:
    """The unrolled stack's knob saving measured from the scanned twin's base peak, over the scanned saving
    (>= 0.9: within 10% of the scanned saving)."""
    base = scanned["base"]["peak"]
    return (base - unrolled["with"]["peak"]) / (base - scanned["with"]["peak"])


def measure(shapes: dict[str, Shape], pairs: tuple[str, ...] = tuple(PAIRS), target: str = "cpu"
            ) -> list[dict[str, Any]]:
    """One record per pair, knob (a key of `shapes`: the shape it is measured on) and family (`measure_knob`); an
    unrolled family's also holds ``vs_scan`` (`versus_scan`)."""
    records = []
    for pair in pairs:
        loop, scan = PAIRS[pair]
        for knob, shape in shapes.items():
            u, s = measure_knob(loop, shape, knob, target), measure_knob(scan, shape, knob, target)
            u["vs_scan"] = versus_scan(u, s)
            records += [dict(u, shape=asdict(shape)), dict(s, shape=asdict(shape))]
    return records


def table(records: list[dict[str, Any]]) -> str:
    """The records as a text table (MiB per device)."""
    mib = 1 / 2**20
    head = (f"{'knob':<6} {'family':<9} {'base peak':>10} {'knob peak':>10} {'saving':>7} {'vs scan':>8} "
            f"{'base temp':>10} {'knob temp':>10} {'all-gathers run':>16}")
    lines = [head, "-" * len(head)]
    for r in records:
        b, w = r["base"], r["with"]
        ag = f"{r['base_all_gathers']['executed']} -> {r['with_all_gathers']['executed']}"
        vs = f"{r['vs_scan']:.2f}" if "vs_scan" in r else ""
        lines.append(f"{r['knob']:<6} {r['family']:<9} {b['peak'] * mib:>10.1f} {w['peak'] * mib:>10.1f} "
                     f"{r['saving']:>7.1%} {vs:>8} {b['temp'] * mib:>10.1f} {w['temp'] * mib:>10.1f} {ag:>16}")
    return "\n".join(lines)


@dataclass(frozen=True)
class Args:
    """Flags of scripts/bench_unrolled_memory.py."""

    remat_shape: Shape = REMAT_SHAPE  # the shape remat is measured on
    zero3_shape: Shape = ZERO3_SHAPE  # the shape ZeRO-3 is measured on
    pairs: tuple[str, ...] = tuple(PAIRS)  # nnx (NNX loop vs nnx.scan), gpt2 (HF GPT-2 vs the zoo's GPT-3)
    target: str = "cpu"  # cpu: this process's 8 devices; h100, a100-80gb, ...: a deviceless XLA:GPU compile for 8
    json_out: Annotated[str | None, tyro.conf.arg(name="json")] = None  # write the records here


def describe(knob: str, s: Shape) -> str:
    """One line naming a knob's shape and plans."""
    plans = {"remat": "DP -> DP + remat_layers=L", "zero3": "ZeRO-1 -> ZeRO-3"}[knob]
    return (f"{knob}: {plans}; L={s.layers} hidden={s.hidden} ffn={s.ffn} vocab={s.vocab} heads={s.heads}, "
            f"global batch {s.batch} x seq {s.seq}")


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Measure every pair under both knobs, print the table, return (and optionally write) the records."""
    args = tyro.cli(Args, args=argv, description=__doc__)
    unknown = set(args.pairs) - set(PAIRS)
    if unknown:
        raise SystemExit(f"unknown pairs {sorted(unknown)}; use {list(PAIRS)}")
    shapes = {"remat": args.remat_shape, "zero3": args.zero3_shape}
    records = measure(shapes, args.pairs, args.target)
    where = f"{jax.device_count()} CPU devices" if args.target == "cpu" else f"8 x {args.target} (deviceless XLA:GPU)"
    print(f"{where}, fp32 + adamw; MiB per device, peak = argument + output + temp - alias")
    for knob, shape in shapes.items():
        print(describe(knob, shape))
    print(table(records))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"target": args.target, "records": records}, indent=1))
        print(f"wrote {args.json_out}")
    return records


if __name__ == "__main__":
    main()
