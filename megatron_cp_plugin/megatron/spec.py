"""The GPT layer spec with our core attention: Megatron's own layers around it (TE's when installed)."""
from __future__ import annotations

import copy

from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_layer_local_spec,
                                                      get_gpt_layer_with_transformer_engine_spec)
from megatron.core.transformer.spec_utils import ModuleSpec

from .attention import CPCoreAttention


def _te_available() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401, PLC0415 (optional extra)
    except Exception:
        return False
    return True


def get_gpt_layer_spec(algo: str, *, grid: tuple[int, int] | None = None, gpus_per_node: int | None = None,
                       group_tokens: int | None = None, backend: str | None = None, num_experts: int | None = None,
                       moe_grouped_gemm: bool = False, qk_layernorm: bool = False, normalization: str | None = None,
                       use_te: bool | None = None) -> ModuleSpec:
    """A GPT TransformerLayer spec whose self-attention core is `CPCoreAttention(algo, grid, ...)`.

    group_tokens: Attention2D's cap on one grouped kernel call's query tokens (None: cp_grid.GROUP_TOKENS' rule).
    use_te: TransformerEngine's fused linear and norm layers (None: when transformer-engine imports);
    otherwise Megatron's local ones. The other keywords are get_gpt_layer_*_spec's.
    """
    use_te = _te_available() if use_te is None else use_te
    make = get_gpt_layer_with_transformer_engine_spec if use_te else get_gpt_layer_local_spec
    # TE's spec function takes no `normalization` (TE layers read config.normalization themselves).
    norm = {"normalization": normalization} if normalization and not use_te else {}
    spec = copy.deepcopy(make(num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm, qk_layernorm=qk_layernorm,
                              **norm))
    attn = spec.submodules.self_attention.submodules
    attn.core_attention = ModuleSpec(module=CPCoreAttention, params={
        "algo": algo, "grid": grid, "gpus_per_node": gpus_per_node, "group_tokens": group_tokens,
        "backend": backend})
    return spec
