"""mistjax model zoo: GPT-3, Llama and Falcon in Flax NNX with a scanned layer stack.

Example::

    from flax import nnx
    import models
    cfg = models.get_config("llama-tiny")
    model = models.build(cfg, rngs=nnx.Rngs(0))
    logits = model(tokens)                      # float32 [B, T, vocab]
    axes = models.logical_axes(model)           # same tree as nnx.state(model, nnx.Param), tuple leaves
    cfg = models.from_hf_config("Meta-Llama-3-8B/config.json")  # a Hugging Face config (models.hf)
"""

from __future__ import annotations

# mistjax first: it chooses the platform quietly (no CUDA plugin noise) before jax starts.
import mistjax  # noqa: F401
import jax
from flax import nnx

from models import falcon, gpt3, llama, moe
from models.config import ModelConfig, human_count
from models.falcon import Falcon
from models.gpt3 import GPT3
from models.hf import HFConfigError, HFConfigWarning, from_hf_config
from models.llama import Llama
from models.loss import cross_entropy, make_loss_fn
from models.moe import MoEForCausalLM, make_moe_loss_fn
from models.moe_config import MoEConfig
from models.transformer import CausalLM

__all__ = ["MOE_PRESETS", "PRESETS", "CausalLM", "Falcon", "GPT3", "HFConfigError", "HFConfigWarning", "Llama",
           "MoEConfig", "MoEForCausalLM", "ModelConfig", "build", "cross_entropy", "from_hf_config", "get_config",
           "human_count", "logical_axes", "make_loss_fn", "make_moe_loss_fn", "workload"]

PRESETS: dict[str, ModelConfig] = {**gpt3.PRESETS, **llama.PRESETS, **falcon.PRESETS}
# Mixture-of-Experts presets (models.moe), apart from PRESETS: the planner does not tune them yet (issue #51).
MOE_PRESETS: dict[str, ModelConfig] = dict(moe.PRESETS)

_FAMILY_CLASSES: dict[str, type[CausalLM]] = {"gpt3": GPT3, "llama": Llama, "falcon": Falcon}


def get_config(name: str) -> ModelConfig:
    """Returns the preset called ``name`` (dense `PRESETS` or `MOE_PRESETS`).

    Raises:
        ValueError: for an unknown name; the message lists the valid names.
    """
    try:
        return PRESETS[name] if name in PRESETS else MOE_PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; valid names: {', '.join(PRESETS)}; Mixture-of-Experts: "
                         f"{', '.join(MOE_PRESETS)}") from None


def build(config: ModelConfig, *, rngs: nnx.Rngs) -> CausalLM:
    """Instantiates the model class of ``config.family`` (params in ``config.param_dtype``); a config with
    ``moe`` set builds `MoEForCausalLM`."""
    if config.moe is not None:
        return MoEForCausalLM(config, rngs=rngs)
    return _FAMILY_CLASSES[config.family](config, rngs=rngs)


def logical_axes(state_or_model: nnx.Module | nnx.State) -> nnx.State:
    """Logical axis names of every parameter.

    Args:
        state_or_model: a model (concrete or from ``nnx.eval_shape``) or a state of ``nnx.Variable`` leaves,
            e.g. ``nnx.state(model, nnx.Param)``.

    Returns:
        An ``nnx.State`` with the same keys as ``nnx.state(model, nnx.Param)`` whose leaves are tuples of axis
        names, one per array dimension (stacked block params start with ``"layers"``). Pair it with params via
        ``jax.tree.map(f, params, axes, is_leaf=lambda x: isinstance(x, nnx.Variable))`` or compare
        ``nnx.to_flat_state(params)`` with ``nnx.to_flat_state(axes)``.

    Raises:
        ValueError: if a leaf is not an ``nnx.Variable`` or carries no ``out_sharding`` metadata.
    """
    state = nnx.state(state_or_model, nnx.Param) if isinstance(state_or_model, nnx.Module) else state_or_model

    def names(var):
        if not isinstance(var, nnx.Variable):
            raise ValueError(f"expected nnx.Variable leaves, got {type(var)}; "
                             "pass nnx.state(model, nnx.Param)")
        axes = var.get_metadata().get("out_sharding")
        if axes is None:
            raise ValueError(f"parameter of shape {var.shape} has no logical axis names")
        return tuple(axes)

    return jax.tree.map(names, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def __getattr__(name: str) -> object:
    # The cost model pulls in sympy and cvxpy's neighbours: load `models.workload` on first use.
    if name == "workload":
        from models.cost import workload

        return workload
    raise AttributeError(f"module 'models' has no attribute {name!r}")
