"""The cost model's `Workload` of a zoo model (the library itself never imports the zoo)."""

from __future__ import annotations

from flax import nnx

from mistjax.analysis import ModelProfile, analyze_model
from mistjax.core.moe import MoENotTunedError
from mistjax.cost.workload import Workload
from models import build
from models.config import ModelConfig
from models.loss import make_loss_fn

# Profiles by (config, policies, tensor-split names): the analysis traces the loss at seven sizes (seconds per
# model). A model whose key / value heads some tensor degrees replicate has a second analysis (`KVRegimes`).
_PROFILES: dict[tuple[ModelConfig, tuple[str, ...] | None, tuple[str, ...]], ModelProfile] = {}


def workload(config: ModelConfig, seq_len: int, global_batch: int, optimizer: str = "adamw",
             policies: tuple[str, ...] | None = None, *, master_weights: bool | None = None,
             grad_dtype: str | None = None, cache: bool = True) -> Workload:
    """Analyse ``config``'s loss abstractly (no parameters are allocated).

    Args:
      config: a zoo `ModelConfig` (`models.get_config`); ``param_dtype`` is how the train state stores
        the weights.
      seq_len: sequence length.
      global_batch: sequences per step.
      optimizer: ``adamw`` (default), ``adam``, ``sgd`` or ``momentum``.
      policies: remat policies to analyse (default: the analysis's defaults).
      master_weights: the optimizer keeps an fp32 master copy (`mistjax.with_master_weights`); default:
        whenever the weights are stored in 16 bits, as Megatron-LM and Mist train.
      grad_dtype: dtype gradients are accumulated and reduced in (None: the weights' own).
      cache: use the on-disk profile cache (`mistjax.analysis.cache`); False analyses afresh, keeping the
        analysed graphs (``profile.passes``) that the compiled-program checks of `mistjax.validate` read.

    Raises:
      MoENotTunedError: ``config.moe`` is set: the cost model and the tuner do not price MoE layers yet.
    """
    if config.moe is not None:
        raise MoENotTunedError(
            f"{config.name} has Mixture-of-Experts layers (ModelConfig.moe), which the planner does not tune yet: "
            "the cost model has no router, all-to-all or expert-parallel terms (issue #51, items 4-5). Train it "
            "with the expert-parallel runtime (mistjax.runtime.experts, docs/moe.md) and a hand-set mesh")
    abstract = nnx.eval_shape(lambda: build(config, rngs=nnx.Rngs(0)))
    graphdef, params = nnx.split(abstract, nnx.Param)
    loss_fn = make_loss_fn(graphdef)

    def analyze(tensor_axes: tuple[str, ...]) -> ModelProfile:
        key = (config, None if policies is None else tuple(policies), tuple(tensor_axes))
        if key not in _PROFILES or (not cache and _PROFILES[key].passes is None):
            _PROFILES[key] = analyze_model(loss_fn, params, policies=policies, cache=cache,  # on disk too
                                           tensor_axes=tensor_axes)
        return _PROFILES[key]

    master = config.param_dtype != "float32" if master_weights is None else master_weights
    return Workload.from_loss(loss_fn, params, seq_len=seq_len, global_batch=global_batch, optimizer=optimizer,
                              name=config.name, policies=policies, compute_dtype=config.dtype,
                              master_weights=master, grad_dtype=grad_dtype, analyze=analyze)


__all__ = ["MoENotTunedError", "workload"]
