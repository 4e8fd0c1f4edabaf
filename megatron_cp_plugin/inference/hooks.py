"""How decoding reaches a GPTModel: stand-ins for one forward (`swapped`).

Generation never changes the model's own modules. For the length of a `with swapped(...)` block, every layer's
core-attention slot holds a stand-in, and the model's rotary-embedding slot one too when asked; the model's own
modules go back afterwards, also on error. The prefill that keeps each layer's K, V shard (`KeepPrefill`), the
eager decode step (generate.py), the static step (static.py) and the tree decoder's steps (tree.py) all reach
the model this way, so megatron/attention.py and megatron/rope.py have no decoding branches.
"""
from __future__ import annotations

import contextlib

import torch

from ..kernels import gemv as _gemv
from ..kernels.bias_add import fused_bias_gelu, fused_bias_residual
from ..kernels.norm import fused_norm
from ..megatron.rope import RopeWrapper, gpt_of, rope_rows
from ..sharding import sequence_positions


def core_owners(model) -> list:
    """The modules of `model` that hold a core attention (`core_attention`), in layer order."""
    return [m for m in model.modules() if isinstance(getattr(m, "core_attention", None), torch.nn.Module)]


class ResidualLink:
    """One half of a transformer layer's residual path in the decode step: the norm before it (whose input is the
    residual: megatron-core's `residual = hidden_states` before input_layernorm / pre_mlp_layernorm), the linear
    that ends it (linear_proj / linear_fc2) and the bias-dropout-add after it. The norm leaves its input here, the
    linear adds it in its kernel (gemv's residual) and leaves the sum, and the bias-dropout-add, handed that sum
    and the same residual, passes the sum on: one residual-add kernel fewer per half layer (64 per 32-layer step,
    ~1.5 us each plus a ~0.45 us gap on an H100)."""

    __slots__ = ("residual", "added", "out")

    def __init__(self):
        self.residual = self.added = self.out = None


class FusedNorm(torch.nn.Module):
    """Stands in for a torch.nn.RMSNorm or LayerNorm over the last dimension: the same weights and eps in one
    kernel (kernels/norm.py) instead of torch's eight. With a link, its input is the residual its layer's linear
    adds (ResidualLink)."""

    def __init__(self, inner, link: ResidualLink | None = None):
        super().__init__()
        self.inner, self.rms, self.link = inner, isinstance(inner, torch.nn.RMSNorm), link

    def forward(self, x):
        if self.link is not None:
            self.link.residual = x
        eps = self.inner.eps
        if eps is None:           # nn.RMSNorm's default: the eps of the dtype it computes in (fp32 for bf16, fp16)
            eps = torch.finfo(torch.float64 if x.dtype == torch.float64 else torch.float32).eps
        return fused_norm(x, self.inner.weight, None if self.rms else self.inner.bias, eps, rms=self.rms)


class FusedBiasDropoutAdd:
    """Stands in for a transformer layer's `self_attn_bda` / `mlp_bda` (megatron-core's get_bias_dropout_add):
    in eval and unfused, with a bias and x, residual of one dtype and shape, the bias and residual adds in one
    kernel (kernels/bias_add.py, torch's two adds bit for bit; its output needs no gradient, as a decode step's);
    anything else goes to the layer's own function: training, no bias, an fp32 residual stream, inputs that need
    gradients, and `bias_dropout_fusion` (megatron-core's jit_fuser compiles that path into one kernel already,
    which adds in fp32 and rounds once: on an H100 its bits differ from two rounded adds, 2026-11-26)."""

    def __init__(self, inner, link: ResidualLink | None = None):
        self.inner, self.link = inner, link

    def __call__(self, training: bool, fused: bool):
        own = self.inner(training, fused)
        link = self.link
        if training or (fused and link is None):
            return own

        def bda(x_with_bias, residual, prob):
            x, bias = x_with_bias
            if link is not None and link.out is not None and x is link.out:       # the linear added the residual
                if residual is not link.added or bias is not None:
                    raise RuntimeError("FusedLinear added another residual than the one its bias-dropout-add "
                                       "was given: the layer's residual is not its norm's input")
                link.out = link.added = None
                return x
            # what fused_bias_residual refuses or should not take (it takes the reference for the rest)
            if (fused or bias is None or x.requires_grad or residual.requires_grad or x.dtype != residual.dtype
                    or bias.dtype != x.dtype or x.shape != residual.shape or bias.dim() != 1):
                return own(x_with_bias, residual, prob)
            return fused_bias_residual(x, bias, residual)
        return bda


class FusedBiasGelu(torch.nn.Module):
    """Stands in for an MLP's linear_fc1 while the MLP's activation_func is the identity: fc1's output with its
    bias added and GELU applied in one kernel (kernels/bias_add.py), returned without a bias, so that the MLP's own
    `+ bias` and activation are skipped. Only for megatron-core's plain path: exact GELU, no gated linear unit,
    no bias-activation fusion, no TE activation (`bias_gelu_mlps`)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, hidden_states, *args, **kwargs):
        out, bias = self.inner(hidden_states, *args, **kwargs)
        if bias is None:
            return torch.nn.functional.gelu(out), None
        if out.requires_grad or bias.dtype != out.dtype or bias.dim() != 1:       # what fused_bias_gelu refuses
            return torch.nn.functional.gelu(out + bias), None
        return fused_bias_gelu(out, bias), None


class FusedLinear(torch.nn.Module):
    """Stands in for a layer's linear (megatron-core's ColumnParallelLinear or RowParallelLinear, one tensor-parallel
    rank): a decode step's few rows through one kernel (kernels/gemv.py) with, where `fuse_bias`, the bias added and,
    where `gelu`, GELU applied in the same kernel; the result comes back with no separate bias, so that a
    bias-dropout-add after it adds the residual alone and an MLP whose fc1 this is with gelu applies the identity.
    Without fuse_bias the bias comes back separate, as the layer's own. What the kernel does not take (more than
    gemv.MAX_ROWS rows, fp64, a CPU, a weight passed in) goes to the layer's own forward, then its bias and GELU as
    megatron-core would apply them (FusedBiasGelu)."""

    def __init__(self, inner, *, fuse_bias: bool = True, gelu: bool = False, link: ResidualLink | None = None):
        super().__init__()
        self.inner, self.fuse_bias, self.gelu, self.link = inner, fuse_bias, gelu, link
        self.fallback = FusedBiasGelu(inner) if gelu else inner

    def takes(self, x) -> bool:
        """Whether the kernel takes x alone (the call megatron-core makes: no other arguments)."""
        return _gemv.takes(x, self.inner.weight, self.inner.bias if self.fuse_bias else None)

    def forward(self, x, *args, grouped: _gemv.Grouped | None = None, **kwargs):
        inner, link = self.inner, self.link
        bias = inner.bias if self.fuse_bias else None
        if not args and kwargs.get("weight") is None and self.takes(x):
            res = link.residual if link is not None else None
            if res is not None and (res.dtype != x.dtype or tuple(res.shape) != (*x.shape[:-1], inner.weight.shape[0])):
                res = None
            y = _gemv.gemv(x, inner.weight, bias, gelu=self.gelu, residual=res, grouped=grouped)
            if res is not None:                       # the bias-dropout-add passes y on (FusedBiasDropoutAdd)
                link.residual, link.added, link.out = None, res, y
            return y, (None if self.fuse_bias or not inner.skip_bias_add else inner.bias)
        if grouped is not None:
            raise ValueError("FusedLinear: grouped output needs the kernel (GroupedQKV checks takes() first)")
        return self.fallback(x, *args, **kwargs)


class GroupedQKV:
    """Stands in for a self-attention's `get_query_key_value_tensors` (megatron-core 0.16.1 and 0.19.2) where its
    linear_qkv is a FusedLinear: the fused QKV GEMV writes [all q | all k | all v] (gemv.Grouped), so q [sq, b, np,
    hn], k and v [sq, b, ng, hn] are views; megatron-core's own splits the per-group layout and copies the query
    into heads (one copy kernel a layer, 32 a step). Anything else goes to its own: an output gate, split_qkv off,
    key_value_states, q or k layernorms, more tensor-parallel ranks than KV groups, test_mode, or inputs the kernel
    does not take."""

    def __init__(self, attention, own, linear: FusedLinear):
        self.attention, self.own, self.linear = attention, own, linear
        a = attention
        self.heads, self.groups = a.num_attention_heads_per_partition, a.num_query_groups_per_partition
        self.hn = a.hidden_size_per_attention_head
        self.grouped = _gemv.Grouped(self.heads // self.groups * self.hn, self.hn, self.groups)

    def _plain(self, hidden_states, key_value_states, output_gate, split_qkv) -> bool:
        a, cfg = self.attention, self.attention.config

        def none(m):
            return m is None or type(m).__name__ == "IdentityOp"

        return (not output_gate and split_qkv and key_value_states is None and none(a.q_layernorm)
                and none(a.k_layernorm) and not getattr(cfg, "test_mode", False)
                and cfg.num_query_groups >= a.world_size and self.linear.takes(hidden_states))

    def __call__(self, hidden_states, key_value_states=None, output_gate: bool = False, split_qkv: bool = True):
        if not self._plain(hidden_states, key_value_states, output_gate, split_qkv):
            return self.own(hidden_states, key_value_states, output_gate=output_gate, split_qkv=split_qkv)
        mixed, _ = self.linear(hidden_states, grouped=self.grouped)                 # [sq, b, ng (np / ng + 2) hn]
        sq, b = mixed.shape[0], mixed.shape[1]
        nq, nk = self.heads * self.hn, self.groups * self.hn
        query = mixed[..., :nq].view(sq, b, self.heads, self.hn)
        key = mixed[..., nq:nq + nk].view(sq, b, self.groups, self.hn)
        value = mixed[..., nq + nk:].view(sq, b, self.groups, self.hn)
        return query, key, value


LINEAR_SLOTS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
"""The attention's and MLP's linears FusedLinear stands in for (megatron-core 0.16.1 and 0.19.2 local spec)."""


def _one_rank_linear(m) -> bool:
    """megatron-core's own Column/RowParallelLinear (not TE's) on one tensor-parallel rank, not an expert's."""
    name = type(m).__name__
    if name == "ColumnParallelLinear":
        whole = m.output_size_per_partition == m.output_size
    elif name == "RowParallelLinear":
        whole = m.input_size_per_partition == m.input_size
    else:
        return False
    return whole and not getattr(m, "is_expert", False) and getattr(m, "weight", None) is not None


def linear_slots(model) -> list[tuple[torch.nn.Module, str, bool, bool]]:
    """(parent, attribute, fuse_bias, gelu) of every linear of `model`'s layers FusedLinear can take: the bias is
    fused where the layer adds it itself (skip_bias_add off), where a bias-dropout-add takes it (linear_proj,
    linear_fc2) and into a plain-GELU MLP's fc1 with GELU (bias_gelu_mlps); any other fc1 keeps its bias apart."""
    gelu_mlps = {id(m) for m in bias_gelu_mlps(model)}
    out = []
    for parent in model.modules():
        for name in LINEAR_SLOTS:
            m = getattr(parent, name, None)
            if isinstance(m, torch.nn.Module) and not isinstance(m, FusedLinear) and _one_rank_linear(m):
                gelu = name == "linear_fc1" and id(parent) in gelu_mlps
                fuse = gelu or not m.skip_bias_add or name in ("linear_proj", "linear_fc2")
                out.append((parent, name, fuse, gelu))
    return out


def _identity(x):
    return x


def bias_gelu_mlps(model) -> list:
    """The MLPs of `model` whose fc1 bias and GELU FusedBiasGelu can take: megatron-core's MLP on its plain path
    (F.gelu, not gated, bias_activation_fusion and TE's activation off), not stood in for yet."""
    out = []
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if (isinstance(getattr(m, "linear_fc1", None), torch.nn.Module) and hasattr(m, "linear_fc2")
                and not isinstance(m.linear_fc1, (FusedBiasGelu, FusedLinear)) and getattr(m, "activation_func", None)
                is torch.nn.functional.gelu and cfg is not None and not cfg.gated_linear_unit
                and not cfg.bias_activation_fusion and not getattr(cfg, "use_te_activation_func", False)):
            out.append(m)
    return out


BDA_SLOTS = ("self_attn_bda", "mlp_bda")
"""The layer attributes FusedBiasDropoutAdd stands in for (megatron-core 0.16.1 and 0.19.2 call both as
`self.<slot>(self.training, self.config.bias_dropout_fusion)(x_with_bias, residual, dropout)`)."""


def bda_slots(model) -> list[tuple[object, str]]:
    """(layer, attribute) of every bias-dropout-add of `model`'s transformer layers not stood in for yet."""
    return [(m, n) for m in model.modules() for n in BDA_SLOTS
            if callable(getattr(m, n, None)) and not isinstance(getattr(m, n), FusedBiasDropoutAdd)]


def norm_slots(model) -> list[tuple[torch.nn.Module, str]]:
    """(parent, attribute) of every torch.nn.RMSNorm and LayerNorm of `model` over one last dimension (the
    norms of megatron-core's local layer spec; TE's fused norm-linear layers are not these and stay)."""
    slots = []
    for parent in model.modules():
        if isinstance(parent, FusedNorm):                       # a norm already stood in for
            continue
        for name, child in parent.named_children():
            if type(child) in (torch.nn.RMSNorm, torch.nn.LayerNorm) and len(child.normalized_shape) == 1:
                slots.append((parent, name))
    return slots


def residual_links(model) -> list[tuple[torch.nn.Module, torch.nn.Module, tuple[object, str]]]:
    """(norm, linear, (layer, bda attribute)) of each half of each transformer layer whose residual the linear can
    add (ResidualLink): input_layernorm, self_attention.linear_proj, self_attn_bda and pre_mlp_layernorm,
    mlp.linear_fc2, mlp_bda of megatron-core's layer (0.16.1 and 0.19.2 take the residual as the norm's input);
    not with fp32_residual_connection (the residual is then an fp32 copy)."""
    out = []
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is None or getattr(cfg, "fp32_residual_connection", False):
            continue
        for norm, block, linear, bda in (("input_layernorm", "self_attention", "linear_proj", "self_attn_bda"),
                                         ("pre_mlp_layernorm", "mlp", "linear_fc2", "mlp_bda")):
            n, lin = getattr(m, norm, None), getattr(getattr(m, block, None), linear, None)
            if isinstance(n, torch.nn.Module) and isinstance(lin, torch.nn.Module) and callable(getattr(m, bda, None)):
                out.append((n, lin, (m, bda)))
    return out


@contextlib.contextmanager
def swapped(model, *, core=None, rope=None, owners=None, norms: bool = False, bda: bool = False,
            linears: bool = False, split=None):
    """Inside the block, owner i's core_attention is core(its own, i) (owners: core_owners(model) unless given),
    the model's rotary_pos_emb is rope(its own) (when it has one), with norms every RMSNorm and LayerNorm a
    FusedNorm of itself, with bda every layer's bias-dropout-adds a FusedBiasDropoutAdd of themselves and every
    plain-GELU MLP's fc1 a FusedBiasGelu (its activation the identity), and with linears every linear of
    linear_slots a FusedLinear (a plain-GELU fc1 with GELU, its activation the identity) and each self-attention's
    get_query_key_value_tensors a GroupedQKV over its FusedLinear linear_qkv; with all three, each
    layer's linear_proj and linear_fc2 also add the residual (residual_links); with split (a split_mlp.SplitMLPs)
    the MLPs it holds compute this rank's share through SplitFC1 / SplitFC2 instead (a plain-GELU fc1 with GELU,
    fc2 with the residual where the norms, bda and linears are stood in for); the model's own are restored after."""
    owners = core_owners(model) if owners is None else owners
    gpt = gpt_of(model)
    link_of: dict = {}
    if norms and bda and linears:
        for n, lin, (layer, attr) in residual_links(model):
            link_of[id(n)] = link_of[id(lin)] = link_of[(id(layer), attr)] = ResidualLink()
    # Every stand-in is one (object, attribute, stand-in) swap, made in this order and undone in reverse.
    swaps = [(m, "core_attention", core(m.core_attention, i)) for i, m in enumerate(owners)] if core else []
    if rope is not None and getattr(gpt, "rotary_pos_emb", None) is not None:
        swaps.append((gpt, "rotary_pos_emb", rope(gpt.rotary_pos_emb)))
    swaps += [(p, n, FusedNorm(getattr(p, n), link_of.get(id(getattr(p, n))))) for p, n in
              (norm_slots(model) if norms else [])]
    swaps += [(p, n, FusedBiasDropoutAdd(getattr(p, n), link_of.get((id(p), n)))) for p, n in
              (bda_slots(model) if bda else [])]
    split_ids = {id(m) for m in split.mlps} if split is not None else set()
    lins = [s for s in linear_slots(model) if id(s[0]) not in split_ids] if linears else []
    if split is not None:
        from .split_mlp import SplitFC1, SplitFC2

        gelu_mlps = {id(m) for m in bias_gelu_mlps(model)}
        for i, m in enumerate(split.mlps):
            gelu = id(m) in gelu_mlps
            swaps += [(m, "linear_fc1", SplitFC1(m.linear_fc1, split.fc1_weight[i], split.fc1_bias[i], gelu=gelu)),
                      (m, "linear_fc2", SplitFC2(m.linear_fc2, split.fc2_weight[i], split.reduce,
                                                 link_of.get(id(m.linear_fc2))))]
            if gelu:
                swaps.append((m, "activation_func", _identity))          # GELU is in SplitFC1
    fused = [(p, n, FusedLinear(getattr(p, n), fuse_bias=fuse, gelu=gelu,
                                link=link_of.get(id(getattr(p, n))) if fuse else None)) for p, n, fuse, gelu in lins]
    swaps += fused
    # each self-attention whose fused QKV is a FusedLinear gets its q, k, v as views (GroupedQKV)
    swaps += [(p, "get_query_key_value_tensors", GroupedQKV(p, p.get_query_key_value_tensors, lin))
              for p, n, lin in fused if n == "linear_qkv" and getattr(p, "attention_type", None) == "self"
              and callable(getattr(p, "get_query_key_value_tensors", None))]
    gelu_fc1 = {id(p) for p, _, _, gelu in lins if gelu}
    for m in bias_gelu_mlps(model) if (bda or linears) else []:
        if id(m) in split_ids:
            continue
        if id(m) not in gelu_fc1:
            if not bda:
                continue
            swaps.append((m, "linear_fc1", FusedBiasGelu(m.linear_fc1)))
        swaps.append((m, "activation_func", _identity))          # GELU is in fc1's stand-in
    # (own value, whether it was the object's own attribute: a method stood in for goes back by deletion)
    own = [(getattr(o, a), a in vars(o) or a in getattr(o, "_modules", {})) for o, a, _ in swaps]
    done = 0
    try:
        for o, a, new in swaps:
            setattr(o, a, new)
            done += 1
        yield
    finally:
        for (o, a, _), (old, kept) in reversed(list(zip(swaps[:done], own))):
            if kept:
                setattr(o, a, old)
            else:
                delattr(o, a)


class KeepPrefill(torch.nn.Module):
    """A layer's core attention (a CPCoreAttention) during prefill: its own attention, after which the layer's K,
    V shard [b, s, h_kv, d] and their global positions [1, s] go to store(layer_number, k, v, positions)."""

    def __init__(self, inner, store, cp_group):
        super().__init__()
        self.inner, self.store, self.cp_group = inner, store, cp_group

    def forward(self, query, key, value, attention_mask=None, **kw):
        if kw.get("packed_seq_params") is not None:
            raise ValueError("packed_seq_params: packed (THD) batches cannot be decoded; generate without packing")
        o = self.inner(query, key, value, attention_mask, **kw)
        k, v = key.transpose(0, 1), value.transpose(0, 1)
        P, rank = self.cp_group.size(), self.cp_group.rank()
        pos = sequence_positions(k.shape[1] * P, algo=self.inner.algo, rank=rank, world_size=P)
        self.store(self.inner.layer_number, k.contiguous(), v.contiguous(), pos.to(k.device)[None])
        return o


class PositionRope(RopeWrapper):
    """Stands in for the model's rotary embedding: the table rows of the given positions [n] (the new tokens')."""

    def __init__(self, inner, positions: torch.Tensor):
        super().__init__(inner)
        self.positions = positions

    def forward(self, *_, **__):
        return rope_rows(self.inner, self.positions)
