"""`MoEConfig`: the Mixture-of-Experts part of a zoo `ModelConfig` (``ModelConfig.moe``; issue #51).

Kept apart from `models.config` so that the dense families never read it; `models.moe` builds the blocks.
"""

from __future__ import annotations

import dataclasses
import numbers

from mistjax.core.moe import RouterSpec, Scoring

SCORINGS = tuple(s.value for s in Scoring)


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Routed experts, shared experts and where the MoE layers sit in the stack.

    The first ``first_dense_layers`` blocks have the dense MLP (``ModelConfig.ffn_size``); the rest form periods
    of ``layer_freq`` blocks whose last block is MoE and the others dense (Qwen2-MoE's ``decoder_sparse_step``,
    Megatron-Core's ``--moe-layer-freq``).

    Raises:
        ValueError: from ``__post_init__`` when a field is invalid; the message names the field and the fix.
    """

    num_experts: int  # routed experts E
    top_k: int  # experts per token
    expert_ffn_size: int  # inner width of one routed expert (HF moe_intermediate_size)
    scoring: str = "softmax"  # "softmax" | "sigmoid" (DeepSeek-V3)
    normalize: bool = True  # renormalise the top-k scores to sum to one (HF norm_topk_prob)
    routed_scale: float = 1.0  # multiplies the routed output (DeepSeek-V3's routed_scaling_factor 2.5)
    capacity_factor: float | None = None  # None: dropless; else per-sequence capacity (mistjax.core.moe.capacity)
    aux_loss_coef: float = 0.0  # weight of the Switch load-balancing loss added by models.moe.make_moe_loss_fn
    expert_bias: bool = False  # aux-loss-free balancing bias (selection only; models.moe.update_biases)
    bias_update_rate: float = 1e-3  # step of the bias update (DeepSeek-V3's gamma)
    shared_ffn_size: int = 0  # inner width of the always-on shared expert(s) together; 0: none
    first_dense_layers: int = 0  # leading dense blocks (DeepSeek-V3's first_k_dense_replace = 3)
    layer_freq: int = 1  # one MoE block per this many blocks after the dense-first ones
    num_groups: int = 1  # group-limited routing: expert groups (DeepSeek-V3's n_group = 8) ...
    top_groups: int = 1  # ... of which each token routes into this many (topk_group = 4)
    swiglu_limit: float | None = None  # gpt-oss's clamped SwiGLU in the experts (7.0); None: plain SwiGLU

    def __post_init__(self) -> None:
        def bad(field: str, msg: str) -> ValueError:
            return ValueError(f"MoEConfig.{field}: {msg}")

        for field in ("num_experts", "top_k", "expert_ffn_size", "layer_freq", "num_groups", "top_groups"):
            value = getattr(self, field)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value <= 0:
                raise bad(field, f"must be a positive integer, got {value!r}")
        for field in ("shared_ffn_size", "first_dense_layers"):
            value = getattr(self, field)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 0:
                raise bad(field, f"must be a non-negative integer, got {value!r}")
        if self.top_k > self.num_experts:
            raise bad("top_k", f"{self.top_k} exceeds num_experts={self.num_experts}; pick at most that many")
        if self.num_experts % self.num_groups or self.top_groups > self.num_groups:
            raise bad("num_groups", f"{self.num_groups} groups with top_groups={self.top_groups} do not split "
                                    f"num_experts={self.num_experts}; use a divisor and top_groups <= num_groups")
        if self.num_groups > 1 and self.top_groups * (self.num_experts // self.num_groups) < self.top_k:
            raise bad("top_groups", f"{self.top_groups} groups of {self.num_experts // self.num_groups} experts hold "
                                    f"fewer than top_k={self.top_k}; raise top_groups")
        if self.scoring not in SCORINGS:
            raise bad("scoring", f"unknown scoring {self.scoring!r}; use one of {SCORINGS}")
        if self.capacity_factor is not None and not (isinstance(self.capacity_factor, numbers.Real)
                                                     and self.capacity_factor > 0):
            raise bad("capacity_factor", f"must be a positive number or None (dropless), got {self.capacity_factor!r}")
        for field in ("routed_scale", "bias_update_rate"):
            if not isinstance(getattr(self, field), numbers.Real) or not getattr(self, field) > 0:
                raise bad(field, f"must be a positive number, got {getattr(self, field)!r}")
        if self.swiglu_limit is not None and not (isinstance(self.swiglu_limit, numbers.Real)
                                                  and self.swiglu_limit > 0):
            raise bad("swiglu_limit", f"must be a positive number or None, got {self.swiglu_limit!r}")
        if not isinstance(self.aux_loss_coef, numbers.Real) or self.aux_loss_coef < 0:
            raise bad("aux_loss_coef", f"must be a non-negative number, got {self.aux_loss_coef!r}")

    def router_spec(self) -> RouterSpec:
        """The routing hyper-parameters `mistjax.core.moe` reads."""
        return RouterSpec(self.num_experts, self.top_k, Scoring(self.scoring), self.normalize,
                          float(self.routed_scale), None if self.capacity_factor is None
                          else float(self.capacity_factor), self.num_groups, self.top_groups,
                          None if self.swiglu_limit is None else float(self.swiglu_limit))

    def check_layers(self, num_layers: int) -> None:
        """Refuses a layer pattern that does not tile ``num_layers``.

        Raises:
            ValueError: no MoE layer is left, or ``layer_freq`` does not divide the layers after the dense ones.
        """
        rest = num_layers - self.first_dense_layers
        if rest <= 0:
            raise ValueError(f"MoEConfig.first_dense_layers={self.first_dense_layers} leaves no MoE layer of "
                             f"num_layers={num_layers}; lower it")
        if rest % self.layer_freq:
            raise ValueError(f"MoEConfig.layer_freq={self.layer_freq} does not divide the {rest} layers after the "
                             f"{self.first_dense_layers} dense-first ones; choose a divisor")

    def moe_layers(self, num_layers: int) -> int:
        """How many of ``num_layers`` blocks are MoE blocks."""
        return (num_layers - self.first_dense_layers) // self.layer_freq

    def mlp_params(self, hidden: int) -> int:
        """Parameters of one MoE MLP: router, routed experts (SwiGLU), shared expert."""
        return hidden * self.num_experts + 3 * hidden * (self.num_experts * self.expert_ffn_size
                                                          + self.shared_ffn_size)

    def active_mlp_params(self, hidden: int) -> int:
        """Parameters one token reads in an MoE MLP: router, ``top_k`` experts, shared expert."""
        return hidden * self.num_experts + 3 * hidden * (self.top_k * self.expert_ffn_size + self.shared_ffn_size)


__all__ = ["SCORINGS", "MoEConfig"]
