"""The memory planner: per-GPU bytes of a GPT config under each parallel layout, and which layouts fit.

`megatron-cp-bench plan` (bench/plan.py) prints it; megatron-cp-pretrain checks a run with it before any rank
starts (training/memory_check.py); the launch scripts pick a layout with it (bench/launch_plan.py).

    megatron-cp-bench plan --config configs/gpt3-175b.toml --gpus 64 --gpu-mem 80
    megatron-cp-bench plan --config configs/gpt3-13b.toml --gpus 2 --gpu-mem 141 --seq-length 32768 --json out.json

The model flags are megatron-cp-pretrain's (--config files, then any flag on the command line). Every GPU is
in context parallelism unless a layout has pipeline stages (the Attention2D paper's setting: DP = TP = 1), so
one GPU holds S / CP tokens of each sequence. Layouts:
  ddp                        Megatron DDP, Megatron's optimizer: everything replicated
  zero1                      --use-distributed-optimizer: fp32 main params + Adam sharded over the CP group
  fsdp-optim                 --use-megatron-fsdp --data-parallel-sharding-strategy optim (ZeRO-1)
  fsdp-optim_grads           ... optim_grads (ZeRO-2: gradients sharded too)
  fsdp-optim_grads_params    ... optim_grads_params (ZeRO-3: bf16 weights sharded, gathered per layer)
  ppN-zero1                  N pipeline stages of GPUs/N (Megatron-LM's 1F1B; megatron-cp-pretrain has no
                             pipeline parallelism: run these through Megatron-LM with patches/), ZeRO-1 per stage
each without and with full layer-wise recompute (--recompute-granularity full, 1 layer per checkpoint); the five
without pipeline stages also with recompute and the checkpointed layer inputs kept in host memory (+offload:
megatron-cp-pretrain's --offload-layer-inputs, training/offload.py), where no layer's input is kept on the GPU.

Bytes per parameter (bf16 training, fp32 gradient buffer as the trainer configures it): weights 2, gradients 4,
fp32 main weights 4, Adam moments 8; a sharded part is divided by the GPUs that shard it. Activations per
layer, per token on a GPU, of what autograd keeps for the backward in Megatron's local GPT layer with the
plugin's attention (element size e = 2): e x (5 h + (a + 2 g) d + (a + g) d + 2 f) + 4 a + 8, i.e. the
inputs of the two norms, QKV and FC1, the fused QKV output, the rotated q and k, the attention output (also
the projection's input), the FC1 and activation outputs, fp32 lse and norm statistics; with megatron-core's
unfused RoPE (CPU runs, packed documents, --no-rope-fusion) also q's and k's cos and sin, e x 4 d, where the
fused kernel keeps one fp32 freqs table for all layers (4 d at the loss).
The norms count as torch's fused RMSNorm on GPUs keeps them (input + fp32 1/rms; CPU torch keeps fp32 copies
instead). Full recompute keeps e x h per layer and rebuilds one layer at a time. At the loss: the fp32
softmax (4 x vocab bytes per token, kept) and the bf16 logits or their gradient. The CP algorithm
(--context-parallel-algo; auto and a family: the largest of its candidates) adds its own terms
(cost/memory_terms.py): what it keeps beyond the formula's q, k, v, o, lse, and its buffers at the peaks of its
forward and backward. Megatron-FSDP holds gathered units: ZeRO-3 the root unit (embedding, output layer) for
the whole step and the running layer with those its prefetch reaches; in the backward the root's unsharded fp32
gradient bucket (from the output layer's gradient to the embedding's) and those of the running layer and the
layers in its reduce-scatter queue; ZeRO-2 one layer's and the root's fp32 gradients.

The peak is the largest of these moments (bytes beyond the static weights, gradients and optimizer state):
  loss         every layer's kept tensors, the final ones, the logits
  forward      the layers before, the running layer up to its attention, the algorithm's forward buffers
  backward     per layer from the top: the layers not yet done, the running layer (recomputed), the MLP's
               gradients or the algorithm's backward buffers; ZeRO-3: the gradient buckets and the queue
  end          ZeRO-3 after the last layer: the queue and the root unit's gradients
  step         the optimizer step: torch's foreach Adam keeps an fp32 temporary per parameter it steps (4 bytes x
               the rank's shard), a fused Adam none; nothing else is alive. Fused: megatron-cp-pretrain's DDP and
               ZeRO-1 on GPUs (torch's fused kernel, megatron/compat.use_fused_adam), or any layout with
               TransformerEngine or Apex (--fused-adam); foreach: Megatron-FSDP's DTensors without them, and
               Megatron-LM's runs without them (pipeline layouts, launch_plan --trainer megatron-lm)
`transient` is the peak moment less the kept activations (at `step`, where those are freed, the step's bytes
less them), so that the five columns add up to the total; `peak` names the moment, `step` the step's bytes.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .. import cp_grid
from ..algos import registry
from . import memory_terms as terms_mod
from .memory_terms import layer_bytes, moments

GiB = 2**30
ZERO_LAYOUTS = ("ddp", "zero1", "fsdp-optim", "fsdp-optim_grads", "fsdp-optim_grads_params")
HEADROOM_GIB = 4.0
"""GiB per GPU a plan keeps free beyond its peak: the CUDA context, NCCL's buffers and allocator slack."""

REPORTED_GIB = {80: 79.1, 141: 139.8}
"""GiB CUDA reports for a GPU sold as 80 GB and as 141 GB (torch.cuda.mem_get_info's total), what a run has and
what megatron-cp-pretrain's check plans against: an H200 (141 GB) gave 139.8 here (2026-11-25); 80 GB H100s and
A100s report 79.10-79.18 GiB in PyTorch's out-of-memory messages (the lowest taken), and ours had 78.0 GiB free
with a CUDA context up. The configs' comments and docs/training.md's table plan for these, not for the label."""


def reported_gib(gpu_class: float) -> float:
    """The GiB CUDA reports for a GPU sold as `gpu_class` GB (REPORTED_GIB; a class not listed: as given)."""
    return REPORTED_GIB.get(gpu_class, gpu_class)


@dataclass(frozen=True)
class Model:
    """A GPT's shape and one micro-batch (TP = 1)."""

    layers: int
    """Transformer layers."""
    hidden: int
    """Hidden size h."""
    heads: int
    """Query heads a."""
    groups: int
    """Key/value heads g (= a without GQA)."""
    ffn: int
    """FFN hidden size f."""
    vocab: int
    """Vocabulary (padded), embedding and output layer untied."""
    seq: int
    """Sequence length S."""
    micro_batch: int = 1
    """Sequences per micro-batch."""
    bf16: bool = True
    """bf16 weights and activations with fp32 main weights (else fp32 throughout)."""
    algo: str = "attention2d"
    """--context-parallel-algo: an algorithm, or auto / a family (the largest of its candidates is planned);
    registry.DEFAULT_ALGO, as in the plugin's commands."""
    grid: tuple[int, int] | None = None
    """--cp-grid (rows, cols) of a grid algorithm; None, or one of other than CP ranks: the registry's default."""
    group_tokens: int | None = None
    """--cp-group-tokens: Attention2D's cap on the query tokens of one grouped kernel call (cp_grid.GROUP_TOKENS);
    None: its default rule (`estimate`), or the smallest cap where the rule's calls do not fit (`fit`)."""
    rope_fused: bool = True
    """RoPE runs fused (kernels/rope.py; training/config.rope_fusion_on: GPU runs unless --no-rope-fusion or
    packed documents): autograd keeps the model's fp32 freqs table once instead of each layer's bf16 cos and sin."""

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def layer_params(self) -> int:
        """QKV (+ bias), projection (+ bias), FC1 and FC2 (+ biases), two RMSNorm weights."""
        h, f, qkv = self.hidden, self.ffn, (self.heads + 2 * self.groups) * self.head_dim
        return h * qkv + qkv + h * h + h + h * f + f + f * h + h + 2 * h

    @property
    def root_params(self) -> int:
        """Embedding, output layer and final norm (Megatron-FSDP's root unit)."""
        return 2 * self.vocab * self.hidden + self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.root_params

    @property
    def elem(self) -> int:
        return 2 if self.bf16 else 4

    def layer_activation_bytes_per_token(self, norms: bool = True) -> float:
        """What autograd keeps per token for one layer's backward (see the module docstring); norms=False leaves
        out the two RMSNorms' own saved tensors (their inputs and fp32 statistics)."""
        h, a, g, d, f, e = self.hidden, self.heads, self.groups, self.head_dim, self.ffn, self.elem
        rope = 0 if self.rope_fused else 4 * d        # unfused: q's and k's cos and sin, per layer
        kept = e * (3 * h + (a + 2 * g) * d + (a + g) * d + 2 * f + rope) + 4 * a
        return kept + (2 * (e * h + 4) if norms else 0)

    def final_activation_bytes_per_token(self, norms: bool = True) -> float:
        """The final norm's input, the output layer's input and the loss's fp32 softmax; fused RoPE: the fp32
        freqs table every layer's RoPE keeps (its fp32 cos/sin cache, 8 d bytes a token, is not saved for the
        backward and is left to the headroom: 32 MiB at 2.7B, 64k, CP = 2)."""
        rope = 4 * self.head_dim if self.rope_fused else 0
        return self.elem * self.hidden + 4 * self.vocab + rope + ((self.elem * self.hidden + 4) if norms else 0)


@dataclass(frozen=True)
class Layout:
    """How the parameters, gradients and optimizer state are spread, and whether layers are recomputed."""

    zero: str
    """One of ZERO_LAYOUTS."""
    pp: int = 1
    """Pipeline stages (1: none)."""
    recompute: bool = False
    """Full layer-wise activation recompute."""
    offload: bool = False
    """With full recompute: the checkpointed layer inputs wait for the backward in host memory
    (megatron-cp-pretrain's --offload-layer-inputs, training/offload.py; no pipeline stages)."""

    def __post_init__(self):
        if self.offload and (not self.recompute or self.pp != 1):
            raise ValueError("a layout offloads layer inputs only with full recompute and no pipeline stages")

    @property
    def name(self) -> str:
        base = self.zero if self.pp == 1 else f"pp{self.pp}-{self.zero}"
        return base + (" +recompute" if self.recompute else "") + (" +offload" if self.offload else "")

    def flags(self) -> str:
        """The megatron-cp-pretrain (or Megatron-LM) flags of this layout."""
        z = {"ddp": "", "zero1": "--use-distributed-optimizer"}.get(self.zero)
        if z is None:
            z = f"--use-megatron-fsdp --data-parallel-sharding-strategy {self.zero.split('-', 1)[1]}"
        pp = f" --pipeline-model-parallel-size {self.pp} (Megatron-LM)" if self.pp > 1 else ""
        rc = " --recompute-granularity full" if self.recompute else ""
        rc += " --offload-layer-inputs (megatron-cp-pretrain)" if self.offload else ""
        return (z + pp + rc).strip() or "(defaults)"


@dataclass
class Estimate:
    """Per-GPU bytes of one layout (the most loaded GPU: the first pipeline stage, or the last)."""

    layout: Layout
    cp: int
    """GPUs in context parallelism (one pipeline stage)."""
    tokens: int
    """Tokens of one micro-batch on one GPU (micro-batch x S / CP)."""
    weights: float
    """bf16 weights (fp32 without bf16), sharded as the layout says."""
    grads: float
    """The fp32 gradient buffer, sharded as the layout says."""
    optimizer: float
    """fp32 main weights + Adam moments."""
    activations: float
    """Kept for the backward, summed over the stage's layers and micro-batches in flight."""
    transient: float
    """The peak moment's bytes beyond the static ones and the kept activations (see the module docstring)."""
    algo: str = "ring"
    """The CP algorithm planned (for auto or a family: the candidate with the largest peak)."""
    peak: str = "loss"
    """The moment of the peak: loss, forward, backward, end (of the backward) or step."""
    step: float = 0.0
    """The optimizer step's temporaries (torch's foreach Adam: 4 bytes per parameter this GPU steps)."""
    grouped: bool = False
    """Some algorithm planned makes grouped kernel calls (the registry's `grouped`: Attention2D), at CP > 1."""
    group_tokens: int | None = None
    """The group cap planned: --cp-group-tokens, or the smallest of cp_grid.GROUP_TOKENS where the default rule's
    calls do not fit (`fit`); None: the default rule."""

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations + self.transient

    def row(self, gpu_mem_gib: float | None = None, headroom_gib: float = 0.0) -> dict:
        r = {"layout": self.layout.name, "CP": self.cp, "tokens/GPU": self.tokens,
             **{k: getattr(self, k) / GiB for k in ("weights", "grads", "optimizer", "activations", "transient",
                                                   "total", "step")}, "peak": self.peak, "algo": self.algo,
             "group_tokens": (self.group_tokens or "default") if self.grouped else None}
        if gpu_mem_gib is not None:
            r["fits"] = self.total / GiB + headroom_gib <= gpu_mem_gib
        r["flags"] = self.layout.flags() + group_flag(self.group_tokens)
        return r


def group_flag(cap: int | None) -> str:
    """" --cp-group-tokens N" for a cap, "" for the default rule (what a run without the flag gets)."""
    return f" --cp-group-tokens {cap}" if cap is not None else ""


def static_bytes(m: Model, zero: str, params: float, shards: int) -> tuple[float, float, float]:
    """(weights, grads, optimizer) bytes for `params` parameters sharded over `shards` GPUs as `zero` says."""
    w, main = m.elem, (4 if m.bf16 else 0)           # fp32 training: the weights are the main weights
    opt = (main + 8) * params
    if zero == "ddp":
        return w * params, 4 * params, opt
    if zero in ("zero1", "fsdp-optim"):
        return w * params, 4 * params, opt / shards
    if zero == "fsdp-optim_grads":
        return w * params, 4 * params / shards, opt / shards
    if zero == "fsdp-optim_grads_params":
        return w * params / shards, 4 * params / shards, opt / shards
    raise ValueError(f"layout must be one of {ZERO_LAYOUTS}, got {zero!r}")


def estimate(m: Model, layout: Layout, gpus: int, fused_adam: bool | None = None) -> Estimate:
    """Per-GPU bytes of m under layout on `gpus` GPUs (CP = gpus / pipeline stages); `fused_adam`: whether the
    optimizer step keeps no temporaries: True, TransformerEngine's or Apex's FusedAdam installed; False, torch's
    foreach Adam everywhere (Megatron-LM without them); None, megatron-cp-pretrain's choice (`fused_adam_for`)."""
    if gpus < 1 or gpus % layout.pp:
        raise ValueError(f"--gpus {gpus} must be a positive multiple of the pipeline stages ({layout.pp})")
    if m.layers % layout.pp:
        raise ValueError(f"{layout.pp} pipeline stages do not divide {m.layers} layers")
    cp = gpus // layout.pp
    per_stage = m.layers // layout.pp
    emb, out = m.vocab * m.hidden, m.vocab * m.hidden + m.hidden
    final = m.final_activation_bytes_per_token() * (m.micro_batch * m.seq // cp)

    def stage(lb, params, root, in_flight, has_loss):
        wb, gb, ob = static_bytes(m, layout.zero, params, cp)
        acts = per_stage * in_flight * lb.kept + (final if has_loss else 0.0)
        mo = moments(m, layout, lb, params, root, per_stage, in_flight, has_loss, fused_adam)
        peak = max(mo, key=mo.get)
        return wb, gb, ob, acts, mo[peak] - acts, peak, mo["step"]

    def worst(algo):
        lb = layer_bytes(m, layout, cp, algo)
        if layout.pp == 1:
            parts = stage(lb, m.params, m.root_params, 1, True)
        else:   # 1F1B: the first stage keeps pp micro-batches in flight, the last one; embedding first, output last
            first = stage(lb, per_stage * m.layer_params + emb, emb, layout.pp, False)
            last = stage(lb, per_stage * m.layer_params + out, out, 1, True)
            parts = max(first, last, key=lambda x: sum(x[:5]))
        return Estimate(layout, cp, lb.attn.tokens, *parts[:5], algo=algo, peak=parts[5], step=parts[6])

    algos = terms_mod.algorithms(m.algo, m.heads, cp, m.grid is not None)
    worst_est = max((worst(a) for a in algos), key=lambda x: x.total)
    worst_est.grouped = cp > 1 and any(registry.get(a).grouped for a in algos)
    worst_est.group_tokens = m.group_tokens if worst_est.grouped else None
    return worst_est


def fit(m: Model, layout: Layout, gpus: int, gpu_mem_gib: float, headroom_gib: float = HEADROOM_GIB,
        fused_adam: bool | None = None) -> Estimate:
    """`estimate` at the group cap the run gets: m.group_tokens where given; else cp_grid.GROUP_TOKENS' default rule
    where its peak plus `headroom_gib` fits `gpu_mem_gib`, and the smallest cap where that does not fit and needs
    less. Only the Attention2D algorithms make grouped calls: for the others the rule's estimate is taken."""
    est = estimate(m, layout, gpus, fused_adam)
    if m.group_tokens is not None or not est.grouped or est.total / GiB + headroom_gib <= gpu_mem_gib:
        return est
    low = estimate(replace(m, group_tokens=cp_grid.GROUP_TOKENS[-1]), layout, gpus, fused_adam)
    return low if low.total < est.total else est


def layouts(m: Model, gpus: int) -> list[Layout]:
    out = [Layout(z, 1, rc) for rc in (False, True) for z in ZERO_LAYOUTS]
    out += [Layout(z, 1, True, True) for z in ZERO_LAYOUTS]
    pp = 2
    while pp <= min(gpus, m.layers):
        if gpus % pp == 0 and m.layers % pp == 0:
            out += [Layout("zero1", pp, rc) for rc in (False, True)]
        pp *= 2
    return out


def plan(m: Model, gpus: int, gpu_mem_gib: float, headroom_gib: float = HEADROOM_GIB,
         fused_adam: bool = False) -> list[dict]:
    """One row per layout (GiB), ordered as layouts() lists them, each at the group cap it gets (`fit`)."""
    return [fit(m, lay, gpus, gpu_mem_gib, headroom_gib, fused_adam).row(gpu_mem_gib, headroom_gib)
            for lay in layouts(m, gpus)]


PREFERENCE = ("zero1", "fsdp-optim_grads", "fsdp-optim_grads_params")
"""Less sharding first (less communication), recompute only when sharding alone does not fit, the layer inputs on
the host only when recompute does not fit (two PCIe copies a layer), pipeline stages last (megatron-cp-pretrain has
none)."""


def recommend(m: Model, gpus: int, gpu_mem_gib: float, headroom_gib: float = HEADROOM_GIB) -> str | None:
    """The first layout in PREFERENCE order (then with recompute, then with the layer inputs offloaded, then
    pipeline stages) that fits, or None."""
    fits = {r["layout"] for r in plan(m, gpus, gpu_mem_gib, headroom_gib) if r["fits"]}
    order = [z for z in PREFERENCE] + [z + " +recompute" for z in PREFERENCE]
    order += [z + " +recompute +offload" for z in PREFERENCE]
    order += [lay.name for lay in layouts(m, gpus) if lay.pp > 1]
    return next((name for name in order if name in fits), None)


def recommendations(m: Model, gpu_mem_gib: float, counts=(1, 2, 4, 8, 16, 32, 64, 128)) -> list[tuple[int, str]]:
    """(GPUs, layout) where the recommended layout changes, over `counts` (the first entry: the fewest GPUs
    that fit at all)."""
    out, last = [], None
    for n in counts:
        if m.micro_batch * m.seq % n:
            continue
        name = recommend(m, n, gpu_mem_gib)
        if name is not None and name != last:
            out.append((n, name))
        last = name
    return out


COUNTS = (1, 2, 4, 8, 16, 32, 64, 128)


def recommendation_line(m: Model, gpu_class: float, counts=COUNTS) -> str:
    """"GPUs 4: a; 8: b; 16-128: c", what each GPT-3 config's comment says for GPUs sold as `gpu_class` GB, planned
    against what CUDA reports for them (`reported_gib`; tests/test_plan.py checks the comments)."""
    recs = recommendations(m, reported_gib(gpu_class), counts)
    if not recs:
        return f"nothing fits on up to {counts[-1]} GPUs"
    parts = []
    for i, (n, name) in enumerate(recs):
        end = recs[i + 1][0] // 2 if i + 1 < len(recs) else counts[-1]
        parts.append(f"{n}: {name}" if end == n else f"{n}-{end}: {name}")
    return "GPUs " + "; ".join(parts)
