"""A static decode step: every buffer preallocated, every varying number a device tensor, so the whole step
(all layers of the GPTModel, tree decoding's merge collectives and the sampling) is captured once as a CUDA
graph and replayed per token. Eager mode runs the same code without the graph and gives the same tokens.

    dec = StaticDecoder(model, cp_group, batch=1, capacity=64 + 32, decoder="tree", graphed=True)
    tokens = dec.generate(prompt [b, L], max_new_tokens=32, algo="ring")   # [b, 32], the same on every rank
    dec.timings                            # prefill / capture seconds, per-token milliseconds
    dec.close()                            # free the graph before destroying the process group

Why each piece is static: a replay re-runs the captured kernels on the captured addresses with no Python, so
  * the cache is `StaticCache`: every layer's K, V shard at a fixed capacity plus one scratch slot, allocated
    once. The new token's K, V go to slot `fill` of the rank that owns its position (position mod P, round-robin
    as in `generate`), to the scratch slot on the others, so every rank runs the same kernels;
  * the position, the fill and the fed token are device tensors that the step itself advances;
  * tree decoding reads `kv_lengths` (fill, plus the new token where owned): the split-KV kernel stops at the
    fill, so a step reads what is filled, not the capacity; its buffers come from one `Workspace`;
  * RoPE's cos, sin come from the position tensor, once per step; each layer rotates its q, k and appends
    its K, V in one kernel (kernels/rope_append.py) instead of Megatron's ~26 small ones (a graphed step is
    bound by its weight and KV reads plus a gap per kernel);
  * each RMSNorm or LayerNorm is one kernel (kernels/norm.py) instead of torch's eight;
  * sampling is `sampling.sample` (no host read-back).
Prefill is the model's own forward with a training algorithm (`CPCoreAttention` hands each layer's K, V shard
to `store_prefill`), as in `generate`. The tree merge variant, unless given, is the decode cost model's choice
for this context, P and mode (graphed or eager), logged once.
"""
from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

from ..algos import registry
from ..algos.ring_decode import ring_decode
from ..algos.tree_decode import VARIANTS, tree_decode
from ..kernels.flash_decode import HEAD_DIMS, Workspace
from ..kernels.flash_decode import available as flash_available
from ..symmetric import fence, unsupported_reason
from ..kernels.local_attn import sdpa_over_cache
from ..kernels.rope_append import rope_append
from ..sharding import sequence_positions
from ..megatron.rope import RopeWrapper, gpt_of
from .hooks import KeepPrefill, swapped
from .sampling import check_sampling, sample

log = logging.getLogger("megatron_cp_plugin.inference")
WARMUP_STEPS = 2          # eager steps on a side stream before capture (Triton compiles, NCCL sets up)


class StaticCache:
    """This rank's K, V shard of every layer: k, v [layers, b, capacity + 1, h_kv, d] (slot `capacity` is the
    scratch slot), pos [b, capacity + 1] the global position of each slot (-1: empty; one array serves every
    layer, as every layer holds the same tokens), fill [1] int64 on the device (slots filled, in every layer)."""

    def __init__(self, layers: int, batch: int, capacity: int, kv_heads: int, head_dim: int, dtype, device):
        self.capacity = capacity
        self.k, self.v = (torch.zeros(layers, batch, capacity + 1, kv_heads, head_dim, dtype=dtype, device=device)
                          for _ in range(2))
        self.pos = torch.full((batch, capacity + 1), -1, dtype=torch.long, device=device)
        self.fill = torch.zeros(1, dtype=torch.long, device=device)

    def bytes_per_token(self) -> int:
        """Bytes of K and V that one filled slot holds over all layers and the batch."""
        layers, b, _, h_kv, d = self.k.shape
        return self.token_bytes(layers, b, h_kv, d, self.k.element_size())

    @staticmethod
    def token_bytes(layers: int, batch: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
        """bytes_per_token() of a cache of this shape, without making one."""
        return 2 * layers * batch * kv_heads * head_dim * dtype_bytes

    @classmethod
    def bytes_for(cls, layers: int, batch: int, capacity: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
        """What the constructor allocates, without allocating: k, v of capacity + 1 slots (the scratch slot),
        the int64 positions and the fill."""
        return ((capacity + 1) * (cls.token_bytes(layers, batch, kv_heads, head_dim, dtype_bytes) + 8 * batch)
                + 8)


DECODERS = ("tree", "ring", "sdpa")
"""The static step's attention: tree decoding, ring decoding (the baseline), torch's SDPA (the P = 1 anchor)."""


class StaticDecoder:
    """Generation with a sequence-sharded KV cache and a static (CUDA-graphable) decode step.

    model: a GPTModel from build_gpt (any CP algorithm; the same on every rank of cp_group); batch, capacity:
    sequences and cache slots per rank (capacity >= ceil((prompt + new tokens) / P)); decoder "tree", "ring"
    (the baseline) or "sdpa" (P = 1 only: torch's SDPA over the whole cache, the single-GPU anchor); variant:
    tree_decode's merge (None: the cost model's choice); graphed: capture the step as a CUDA graph (default on
    GPUs); temperature (0: greedy), top_p, seed: sampling; mlp: "split" (each MLP's weights split over the CP
    ranks, one reduce a layer: inference/split_mlp.py), "whole" (every rank runs every MLP whole) or None: "split"
    where P > 1 and the model's MLPs can be split; peer_rounds: flag rounds of each NVLink peer kernel call, 2
    (ready, done) or 1 (ready only: `symmetric.fence`, where the "peer" merge and the split MLPs' peer sum alternate
    in every layer), None: 1 where they alternate, else 2.
    """

    def __init__(self, model, cp_group, *, batch: int, capacity: int, decoder: str = "tree",
                 variant: str | None = None, graphed: bool | None = None, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0, mlp: str | None = None, peer_rounds: int | None = None):
        from ..megatron.attention import CPCoreAttention
        from .split_mlp import SplitMLPs, splittable_mlps

        if decoder not in DECODERS:
            raise ValueError(f"decoder must be 'tree', 'ring' (the ring-decode baseline) or 'sdpa' (torch's SDPA, "
                             f"P = 1), got {decoder!r}")
        if decoder == "sdpa" and cp_group.size() != 1:
            raise ValueError(f"decoder 'sdpa' (torch's SDPA over the whole cache, the single-GPU anchor) runs at "
                             f"P = 1 only, got a context-parallel group of {cp_group.size()}")
        if mlp not in (None, "split", "whole"):
            raise ValueError(f"mlp must be 'split' (each MLP split over the CP ranks), 'whole' or None (split where "
                             f"P > 1), got {mlp!r}")
        if variant is not None and variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS} or None (the cost model's choice), got {variant!r}")
        for name, v in (("batch", batch), ("capacity", capacity)):
            if not (isinstance(v, int) and v >= 1):
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        check_sampling(temperature, top_p)
        self.model, self.group, self.decoder = model.eval(), cp_group, decoder
        self.world, self.rank = cp_group.size(), cp_group.rank()
        self.batch, self.temperature, self.top_p, self.seed = batch, temperature, top_p, seed
        self.device = next(model.parameters()).device
        self.graphed = self.device.type == "cuda" if graphed is None else graphed
        if self.graphed and self.device.type != "cuda":
            raise ValueError("graphed=True needs the model on a CUDA device")
        gpt = gpt_of(model)
        cfg = gpt.config
        self.owners = [m for m in model.modules() if isinstance(getattr(m, "core_attention", None), CPCoreAttention)]
        if not self.owners:
            raise ValueError("model: no CPCoreAttention layers (build it with megatron_cp_plugin.megatron.build_gpt)")
        tp = cfg.tensor_model_parallel_size
        self.heads = cfg.num_attention_heads // tp
        self.kv_heads = (cfg.num_query_groups or cfg.num_attention_heads) // tp
        self.head_dim = cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads
        self.cache = StaticCache(len(self.owners), batch, capacity, self.kv_heads, self.head_dim,
                                 cfg.params_dtype, self.device)
        self._symmetric = None if self.world == 1 else unsupported_reason(cp_group, self.device, collective=True)
        if mlp is None:
            mlp = "split" if self.world > 1 and splittable_mlps(model) else "whole"
        self.mlp, self.split = mlp, None
        if mlp == "split":
            # The reduce over NVLink where the peer merge could run (symmetric memory, Triton), else the collective.
            peer = self.world > 1 and self._symmetric is None and flash_available(self.device)
            self.split = SplitMLPs(model, cp_group, rows=batch, peer=peer)
        self.variant, self.variant_note = variant, f"{variant} (given)"
        if decoder == "tree" and variant is None:
            if self.world == 1:                                            # nothing to merge
                self.variant, self.variant_note = "allgather", "none (P = 1)"
            else:
                self.variant, self.variant_note = self._choose_variant(capacity * self.world)
        elif decoder == "tree" and variant == "peer" and self.world > 1:
            why = self._peer_unsupported()
            if why is not None:
                raise ValueError(f"variant 'peer' needs one NVLink node, one GPU a rank: {why}")
        self.peer_rounds = self._rounds(peer_rounds)
        dev, long = self.device, torch.long
        self.tokens = torch.zeros(batch, 1, dtype=long, device=dev)        # the token fed to the step
        self.position = torch.zeros(1, dtype=long, device=dev)              # its global position
        self.position_ids = torch.zeros(batch, 1, dtype=long, device=dev)
        self.next_tokens = torch.zeros(batch, dtype=long, device=dev)      # the token the step sampled
        self.workspace = Workspace()
        rope = getattr(gpt, "rotary_pos_emb", None)
        inner = getattr(rope, "inner", rope)
        self._inv_freq = None if inner is None else inner.inv_freq.to(dev)
        self._rope_inner = inner
        self._cos = self._sin = None                                        # this step's RoPE, [r / 2] fp32
        self.graph: torch.cuda.CUDAGraph | None = None
        self.position_host = self.fill_host = 0                            # host mirrors (no read-back)
        self.timings: dict = {}

    # ------------------------------------------------------------------------------------------ set-up
    def weight_bytes_read(self) -> int:
        """Bytes of weights this rank reads a step: all of its parameters, less the MLP shares of the other ranks
        where the MLPs are split (the decode floor's weights)."""
        from .floor import weight_bytes

        return weight_bytes(self.model) - (self.split.weight_bytes_saved() if self.split is not None else 0)

    def _peer_unsupported(self) -> str | None:
        """Why the "peer" merge cannot run this step, or None: it needs the split-KV kernel (a head_dim it has, not
        fp64) and symmetric memory, every rank its own GPU of one node (a small all-gather of hosts and GPUs:
        every rank builds the decoder together, and the shapes agree, so all take the same branches)."""
        if self.head_dim not in HEAD_DIMS or self.cache.k.dtype == torch.float64:
            return f"the split-KV kernel takes head_dim {HEAD_DIMS} and no fp64 (here {self.head_dim}, " \
                   f"{self.cache.k.dtype})"
        return self._symmetric

    def _rounds(self, given: int | None) -> int:
        """Flag rounds of the peer kernels' calls: 1 where every layer's "peer" merge alternates with its MLP's peer
        sum (symmetric.fence), else 2; a given 1 where they do not is refused (ValueError)."""
        if given not in (None, 1, 2):
            raise ValueError(f"peer_rounds must be 1, 2 or None, got {given!r}")
        alternate = (self.decoder == "tree" and self.variant == "peer" and self.world > 1 and self.split is not None
                     and self.split.reduce.bufs is not None and len(self.split.mlps) == len(self.owners))
        if given == 1 and not alternate:
            raise ValueError("peer_rounds=1 needs the 'peer' tree merge and split MLPs summed over NVLink in every "
                             f"layer (P > 1, one NVLink node); here decoder {self.decoder!r}, variant "
                             f"{self.variant!r}, P = {self.world}, mlp {self.mlp!r}, peer sum "
                             f"{self.split is not None and self.split.reduce.bufs is not None}")
        return 1 if alternate and given != 2 else 2

    def _fence(self) -> None:
        """With peer_rounds 1, once the step has made the merge's symmetric buffers (its first call), fence them with
        the MLPs' sum buffers: the calls after this make one flag round each."""
        if self.peer_rounds != 1:
            return
        merge = self.workspace.kept("tree_decode.peer")
        if merge is not None and not merge.fenced:
            fence(merge, self.split.reduce.bufs)

    def _choose_variant(self, context: int) -> tuple[str, str]:
        from .. import cost as cm
        from .floor import hardware_of

        hw = hardware_of(self.device)
        pb = cm.DecodeProblem(context, self.world, self.heads, self.kv_heads, self.head_dim, batch=self.batch,
                              dtype_bytes=self.cache.k.element_size())
        peer = self._peer_unsupported() is None
        best, times = cm.choose_tree_variant(pb, hw, graphed=self.graphed, peer=peer)
        note = (f"{best} (the decode cost model's choice: {hw.name}, "
                f"{'graphed' if self.graphed else 'eager'}, context {context}, P = {self.world}; us per layer "
                + ", ".join(f"{v} {t * 1e6:.0f}" for v, t in times.items()) + ")")
        if self.rank == 0:
            log.info("tree merge variant %s", note)
        return best, note

    def reset(self, position: int = 0, fill: int = 0) -> None:
        """Set the step's state (in place: a captured graph stays valid): the next token is at `position`, this
        rank's shard holds `fill` tokens; slots from `fill` on are marked empty."""
        if not 0 <= fill <= self.cache.capacity:
            raise ValueError(f"fill {fill} outside the cache capacity {self.cache.capacity}")
        self.position.fill_(position)
        self.cache.fill.fill_(fill)
        self.cache.pos[:, fill:] = -1
        self.position_host, self.fill_host = position, fill

    def _share(self, n: int) -> int:
        """Tokens of positions [0, n) that this rank holds (round-robin: position mod P)."""
        return n // self.world + (1 if self.rank < n % self.world else 0)

    @torch.no_grad()
    def fill_random(self, context: int, seed: int = 0) -> None:
        """Fill the cache as if `context` tokens had been decoded round-robin, with random K, V (N(0, 1)): for
        latency measurements at contexts whose prefill would take minutes."""
        n = self._share(context)
        if n > self.cache.capacity:
            raise ValueError(f"context {context}: {n} tokens on this rank exceed the capacity {self.cache.capacity}")
        g = torch.Generator(device=self.device).manual_seed(seed * 1000 + self.rank)
        for x in (self.cache.k, self.cache.v):
            for layer in x:                                               # a layer at a time: no big temporary
                layer[:, :n].normal_(generator=g)
        self.cache.pos[:, :n] = torch.arange(n, device=self.device) * self.world + self.rank
        self.reset(context, n)

    # ------------------------------------------------------------------------------------------ prefill
    @torch.no_grad()
    def prefill(self, prompt: torch.Tensor, algo: str):
        """Run the longest shardable prefix of prompt [b, L] with `algo`, keeping each layer's K, V shard in the
        cache. Returns the last prefilled token's logits [b, vocab] fp32 (None when nothing was prefilled)."""
        b, L = prompt.shape
        P = self.world
        L0 = L - L % registry.divisor(algo, P)
        self.reset(0, 0)
        if not L0:
            return None
        index = {m.core_attention.layer_number: i for i, m in enumerate(self.owners)}
        cache = self.cache

        def store(layer, k, v, positions):
            i, s = index[layer], k.shape[1]
            cache.k[i, :, :s], cache.v[i, :, :s] = k, v
            cache.pos[:, :s] = positions

        pos = sequence_positions(L0, algo=algo, rank=self.rank, world_size=P).to(self.device)
        if pos.numel() > cache.capacity:
            raise ValueError(f"prompt: {pos.numel()} prefilled tokens on this rank exceed the capacity {cache.capacity}")
        self.model.eval()
        with swapped(self.model, owners=self.owners, core=lambda c, i: KeepPrefill(c, store, self.group)):
            logits = self.model(prompt[:, :L0].index_select(1, pos), pos.expand(b, -1), None)   # [b, L0 / P, V]
        last = (pos == L0 - 1).nonzero()
        row = (logits[:, last[0, 0]].float().contiguous() if len(last)
               else torch.zeros(b, logits.shape[-1], device=self.device))
        if P > 1:
            dist.all_reduce(row, group=self.group)                         # the owner's row, everywhere
        self.reset(L0, pos.numel())
        return row

    # ------------------------------------------------------------------------------------------ the step
    def _swapped(self):
        """The step's forward reaches the model through the static core attention and RoPE, and on a GPU its norms,
        bias-residual adds and linears (bias and GELU in the same kernel) through one fused kernel each
        (inference/hooks.py)."""
        gpu = self.device.type == "cuda"
        return swapped(self.model, owners=self.owners, core=lambda c, i: _StaticCore(c, i, self),
                       rope=lambda r: _StaticRope(r, self), norms=gpu, bda=gpu, linears=gpu, split=self.split)

    def _body(self):
        """One decode step on device tensors only (what the graph captures)."""
        c, b = self.cache, self.batch
        self._cos = self._sin = None                     # _StaticRope sets this step's (no RoPE: stays None)
        owner = torch.remainder(self.position, self.world) == self.rank                     # [1]
        # Over capacity (only warm-up steps can get there) the write lands in the scratch slot.
        self._slot = torch.where(owner, c.fill, c.capacity).clamp_(max=c.capacity)
        self._lengths = (c.fill + owner).clamp_(max=c.capacity).to(torch.int32).expand(b).contiguous()
        c.pos.index_copy_(1, self._slot, torch.where(owner, self.position, -1).expand(b, 1))
        self.position_ids.copy_(self.position.expand(b, 1))
        logits = self.model(self.tokens, self.position_ids, None)                         # [b, 1, vocab]
        nxt = sample(logits[:, -1].float(), temperature=self.temperature, top_p=self.top_p, seed=self.seed,
                     key=self.position + 1)
        self.next_tokens.copy_(nxt)
        self.tokens.copy_(nxt[:, None])
        c.fill.add_(owner)
        self.position.add_(1)

    @torch.no_grad()
    def capture(self) -> None:
        """Warm up on a side stream, restore the state, capture the step as one CUDA graph."""
        state = (self.position_host, self.fill_host, self.tokens.clone())
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), self._swapped():
            for _ in range(WARMUP_STEPS):
                self._body()
        torch.cuda.current_stream().wait_stream(side)
        self._fence()
        self.reset(*state[:2])
        self.tokens.copy_(state[2])
        graph = torch.cuda.CUDAGraph()
        with self._swapped(), torch.cuda.graph(graph):
            self._body()
        self.graph = graph

    @torch.no_grad()
    def step(self) -> None:
        """Decode one token: feed self.tokens at self.position; self.next_tokens gets the sampled token."""
        # The fullest rank holds ceil((position + 1) / P) tokens after this step (equal prefill shares, then
        # round-robin): the same test on every rank, so all raise together.
        if -(-(self.position_host + 1) // self.world) > self.cache.capacity:
            raise ValueError(f"the KV cache is full ({self.cache.capacity} slots per rank) at position "
                             f"{self.position_host}: make the capacity at least ceil((prompt + new tokens) / P)")
        if self.graphed:
            if self.graph is None:
                self.capture()
            self.graph.replay()
        else:
            with self._swapped():
                self._body()
            self._fence()
        self.fill_host += int(self.position_host % self.world == self.rank)
        self.position_host += 1

    def close(self) -> None:
        """Free the graph (NCCL waits for graphs that captured its collectives when destroying a group) and the split
        MLPs' buffers."""
        self.graph = None
        if self.split is not None:
            self.split.close()
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    # ------------------------------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, *, max_new_tokens: int, algo: str) -> torch.Tensor:
        """prompt [batch, L] (the same on every rank) -> new tokens [batch, max_new_tokens], identical on every
        rank. Records self.timings: prefill_s, capture_s, token_ms (per decode step, after the first token)."""
        b, L = prompt.shape
        if b != self.batch or L < 1:
            raise ValueError(f"prompt must be [batch={self.batch}, L >= 1], got {tuple(prompt.shape)}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        need = -(-(L + max_new_tokens) // self.world)
        if need > self.cache.capacity:
            raise ValueError(f"capacity {self.cache.capacity} < ceil((prompt {L} + {max_new_tokens} new) / P) = {need}")
        prompt = prompt.to(self.device)
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        row = self.prefill(prompt, algo)
        out = []
        if row is not None and self.position_host == L:                  # the first new token from the prefill
            key = torch.full((1,), L, dtype=torch.long, device=self.device)
            out.append(sample(row, temperature=self.temperature, top_p=self.top_p, seed=self.seed, key=key))
            self.tokens.copy_(out[-1][:, None])
        sync()
        t1 = time.perf_counter()
        if self.graphed and self.graph is None:
            self.capture()
        sync()
        t2 = time.perf_counter()
        for p in range(self.position_host, L):                            # the prompt's tail, a step each
            self.tokens.copy_(prompt[:, p:p + 1])
            self.step()
        if not out:
            out.append(self.next_tokens.clone())
        sync()
        t3 = time.perf_counter()
        stamps = _Stamps(self.device)
        for _ in range(max_new_tokens - 1):
            self.step()
            out.append(self.next_tokens.clone())
            stamps.mark()
        self.timings = {"prefill_s": t1 - t0, "capture_s": t2 - t1, "tail_s": t3 - t2,
                        "token_ms": stamps.intervals_ms()}
        return torch.stack(out, 1)


class _Stamps:
    """Times between consecutive marks without a host sync per mark (CUDA events), read at the end."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.marks = [self._now()]

    def _now(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def mark(self):
        self.marks.append(self._now())

    def intervals_ms(self) -> list[float]:
        if self.cuda:
            self.marks[-1].synchronize()
            return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:])]
        return [(b - a) * 1e3 for a, b in zip(self.marks, self.marks[1:])]


class _StaticCore(torch.nn.Module):
    """A layer's core attention during the static step: write the new K, V to the slot, attend over the shard."""

    def __init__(self, inner, index: int, dec: StaticDecoder):
        super().__init__()
        self.inner, self.index, self.dec = inner, index, dec

    def forward(self, query, key, value, attention_mask=None, **_):
        """query [1, b, h, d], key, value [1, b, h_kv, d] -> [1, b, h * d]. RoPE is applied here (the step's
        cos, sin from _StaticRope) unless Megatron applied it (interleaved RoPE, or no RoPE at all)."""
        dec, c = self.dec, self.dec.cache
        k_all, v_all = c.k[self.index], c.v[self.index]
        q, k, v = (x.transpose(0, 1) for x in (query, key, value))                # [b, 1, ., d] views
        if dec._cos is not None:
            b, _, h, d = q.shape
            buf = dec.workspace.take("static.q", b * h * d, q.dtype, q.device).view(b, 1, h, d)
            q = rope_append(q, k, v, dec._cos, dec._sin, dec._slot, k_all, v_all, out=buf)
        else:
            k_all.index_copy_(1, dec._slot, k)
            v_all.index_copy_(1, dec._slot, v)
        cap, scale = c.capacity, self.inner.softmax_scale
        if dec.decoder == "ring":
            o = ring_decode(q, k_all[:, :cap], v_all[:, :cap], group=dec.group, softmax_scale=scale,
                            kv_positions=c.pos[:, :cap])
        elif dec.decoder == "sdpa":
            o = sdpa_over_cache(q, k_all[:, :cap], v_all[:, :cap], dec._lengths, scale)
        else:
            o = tree_decode(q, k_all[:, :cap], v_all[:, :cap], group=dec.group, softmax_scale=scale,
                            variant=dec.variant, kv_lengths=dec._lengths, validate=False, workspace=dec.workspace)
        return o.transpose(0, 1).reshape(query.shape[0], query.shape[1], -1)


class _StaticRope(RopeWrapper):
    """Stands in for the model's rotary embedding during the step: computes cos, sin of the position tensor
    (as Megatron's get_emb: position * inv_freq in fp32) for `_StaticCore` and gives Megatron no table, so its
    own RoPE kernels do not run. Interleaved RoPE: the [1, 1, 1, dim] table row, applied by Megatron."""

    def __init__(self, inner, dec: StaticDecoder):
        super().__init__(inner)
        self.dec = dec

    def forward(self, *_, **__):
        inner, dec = self.dec._rope_inner, self.dec
        seq = dec.position.to(torch.float32)
        if inner.seq_len_interpolation_factor is not None:
            seq = seq * (1 / inner.seq_len_interpolation_factor)
        freqs = torch.outer(seq, dec._inv_freq)                                  # [1, r / 2]
        if inner.rotary_interleaved:
            return torch.stack((freqs, freqs), dim=-1).view(1, 1, 1, -1)
        dec._cos, dec._sin = torch.cos(freqs[0]), torch.sin(freqs[0])
        return None
