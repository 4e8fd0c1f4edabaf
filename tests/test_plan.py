"""megatron-cp-bench plan: its byte counts against the trainer's real tensors (CPU processes, the GPU code
path), its layouts for GPT-3 175B, and the layouts the GPT-3 configs' comments name."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_cp_plugin.bench import plan
from megatron_cp_plugin.training.config import parse_args

REPO = Path(__file__).resolve().parents[1]
SMALL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--num-query-groups", "4",
         "--seq-length", "1024", "--micro-batch-size", "1", "--bf16", "--context-parallel-algo", "ring"]


def _probe(tmp_path, *flags, nproc=2):
    out = tmp_path / "probe.json"
    r = subprocess.run([sys.executable, "-W", "ignore", "-m", "tests.plan_probe", str(out), *SMALL, *flags,
                        "--nproc", str(nproc)], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("zero,flags", [("zero1", ["--use-distributed-optimizer"]),
                                        ("fsdp-optim_grads_params", ["--use-megatron-fsdp"])])
def test_planner_bytes_match_the_trainers_tensors(tmp_path, zero, flags):
    got = _probe(tmp_path, *flags)
    m = plan.model_from_args(parse_args(SMALL))
    assert got["n_params"] == m.params                               # the parameter count is exact
    assert m.rope_fused                                              # plans are for GPUs: fused RoPE
    m = dataclasses.replace(m, rope_fused=got["rope_fusion"])       # the probe's device: CPU runs keep it unfused
    est = plan.estimate(m, plan.Layout(zero), gpus=2)
    static = est.weights + est.grads + est.optimizer
    if zero == "fsdp-optim_grads_params":
        # Between steps Megatron-FSDP also holds gathered layers (prefetched for the next forward), part of
        # what the planner counts as transient.
        assert static <= got["static_bytes"] <= static + est.transient, (got, static, est.transient)
    else:                                                            # buffers' padding: well under 1 %
        assert got["static_bytes"] == pytest.approx(static, rel=0.01), (got, static)
    # What autograd keeps for the backward, the RMSNorms' own tensors aside (CPU torch keeps fp32 copies where
    # the GPU's fused kernel keeps its bf16 input): per layer and at the loss, within 1 %.
    t = est.tokens
    expect = t * (m.layers * m.layer_activation_bytes_per_token(norms=False) + m.final_activation_bytes_per_token(
        norms=False))
    if zero == "fsdp-optim_grads_params":
        # The linears also keep the gathered weights of the units not yet released (how many depends on the
        # prefetch's timing): within what the planner allows for gathered units.
        gathered = got["saved_rest_bytes"] - expect
        assert 0 < gathered <= est.transient, (got, expect, est.transient)
    else:
        assert got["saved_rest_bytes"] == pytest.approx(expect, rel=0.01), (got, expect)


def _run_cli(capsys, *argv):
    assert plan.main([str(a) for a in argv]) == 0
    return capsys.readouterr().out


def test_gpt3_175b_on_64_and_128_gpus_of_80_gb(capsys, tmp_path):
    out = _run_cli(capsys, "--config", REPO / "configs/gpt3-175b.toml", "--gpus", 64, "--gpu-mem", 80,
                   "--json", tmp_path / "p.json")
    rows = {r["layout"]: r for r in json.loads((tmp_path / "p.json").read_text())["rows"]}
    assert "175.20B parameters" in out
    # ZeRO-1 keeps bf16 weights and fp32 gradients whole: 6 bytes x 175B per GPU, at any GPU count.
    assert rows["zero1"]["weights"] + rows["zero1"]["grads"] == pytest.approx(6 * 175.2e9 / 2**30, rel=0.01)
    assert not rows["zero1"]["fits"] and not rows["zero1 +recompute"]["fits"]
    # ZeRO-3 + recompute misses 80 GB on 64 GPUs: a 175B layer is 1.81B parameters, so in the backward
    # Megatron-FSDP holds 3 unsharded fp32 layer gradient buckets (the running layer's and 2 queued, 6.75 GiB
    # each) and the root's (4.6 GiB) beside 2 gathered layers and the root's bf16 weights.
    z3 = rows["fsdp-optim_grads_params +recompute"]
    assert not z3["fits"] and z3["peak"] == "backward" and z3["total"] == pytest.approx(84.2, abs=0.05)
    assert "fits: none of these layouts" in out
    for r in rows.values():
        assert r["total"] == pytest.approx(sum(r[k] for k in ("weights", "grads", "optimizer", "activations",
                                                              "transient")))
    totals = [rows[z]["weights"] + rows[z]["grads"] + rows[z]["optimizer"] for z in plan.ZERO_LAYOUTS]
    assert totals == sorted(totals, reverse=True)                   # more sharding, fewer bytes
    assert rows["zero1 +recompute"]["activations"] < rows["zero1"]["activations"] / 10
    assert {"pp2-zero1", "pp32-zero1 +recompute"} <= rows.keys()
    # Pipeline stages: the first stage's weights hold its layers and the embedding.
    m = plan.model_from_args(parse_args(["--config", str(REPO / "configs/gpt3-175b.toml")]))
    assert rows["pp8-zero1"]["weights"] * 2**30 == pytest.approx(2 * (12 * m.layer_params + m.vocab * m.hidden),
                                                                 rel=1e-6)
    out = _run_cli(capsys, "--config", REPO / "configs/gpt3-175b.toml", "--gpus", 128, "--gpu-mem", 80)
    assert "fits: fsdp-optim_grads_params (" in out


def test_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        plan.main(["--gpus", "0", "--gpu-mem", "80"])
    with pytest.raises(ValueError, match="pipeline stages"):
        plan.estimate(plan.Model(4, 64, 8, 8, 256, 257, 256), plan.Layout("zero1", pp=2), gpus=3)
    with pytest.raises(ValueError, match="layout"):
        plan.estimate(plan.Model(4, 64, 8, 8, 256, 257, 256), plan.Layout("zero9"), gpus=2)


@pytest.mark.parametrize("size", ["760m", "2.7b", "13b", "66b", "175b"])
def test_gpt3_config_comments_name_the_planners_layouts(size):
    path = REPO / f"configs/gpt3-{size}.toml"
    text = path.read_text()
    m = plan.model_from_args(parse_args(["--config", str(path)]))
    for mem in (80, 141):
        found = re.search(rf"^#\s+{mem} GB GPUs:\s+(.+)$", text, re.M)
        assert found, f"{path} has no '{mem} GB GPUs:' comment"
        assert found.group(1).strip() == plan.recommendation_line(m, mem)


def test_recommendations_plan_against_what_cuda_reports_not_the_label():
    """GPT-3 2.7B at 32k on 2 GPUs: ZeRO-1 needs 75.85 GiB + 4 headroom, which a nominal 80 holds and the 79.1 GiB
    an 80 GB GPU gives CUDA does not; the config comment's line for 80 GB GPUs plans for the 79.1."""
    m = plan.model_from_args(parse_args(["--config", str(REPO / "configs/gpt3-2.7b.toml")]))
    assert plan.reported_gib(80) == 79.1 and plan.reported_gib(141) == 139.8 and plan.reported_gib(96) == 96
    assert plan.recommend(m, 2, 80) == "zero1"
    assert plan.recommend(m, 2, plan.reported_gib(80)) == "fsdp-optim_grads"
    assert "; 2: fsdp-optim_grads; " in plan.recommendation_line(m, 80)


# ---------------------------------------------------------- per-algorithm and per-layout terms (cost/memory_terms.py)
from megatron_cp_plugin.cost import memory_terms as plan_terms  # noqa: E402

GQA = plan_terms.Shape(tokens=8, heads=4, groups=2, head_dim=4, elem=2, cp=4)
"""Q = 8*4*4*2 = 256, K = 128, L = 4*4*8 = 128, Qa = 512, Ka = 256, G = Q + 2K = 512, ws = Qa + 2Q (GQA) = 1024,
blk = 2G + ws = 2048."""


def _algo(m, algo, grid=None):
    return dataclasses.replace(m, algo=algo, grid=grid)


@pytest.mark.parametrize("algo,grid,forward,backward", [
    # P = 4, 8 tokens a rank: rounds of g = 3 ranks; forward 2Qa + 4gK + Q; backward 4gK + Qa + 2Ka + 6gK (the
    # partials in the input dtype) + 2(Q + 2gK) + ws
    ("ring", (1, 1), 2 * 512 + 4 * 3 * 128 + 256, 4 * 3 * 128 + 512 + 2 * 256 + 6 * 3 * 128 + 2 * (256 + 6 * 128)
     + 1024),                                                                                    # 2816, 7936
    # ring's forward; backward in rounds of g = 3: 3L + 4g(Q + L) + Qa + 2Ka + 3gQ (the dQ partials in the input
    # dtype) + the call (gQ + 2gL + 2(gQ + 2K) + g ws = 6656) + G
    ("burst", (1, 1), 2816, 3 * 128 + 4 * 3 * 384 + 512 + 2 * 256 + 3 * 3 * 256 + 6656 + 512),   # 15488
    # P = 4: grouped calls, gathered 2PK, 2Qa, Q, the call's keys (P - 1)K; backward 2PK + 2PKa + Qa + the
    # largest of reduce max(8PK = 4096, 3584) and the call 2(Q + 3K) + ws + 3K = 2688
    ("allgather", (1, 1), 2 * 4 * 128 + 2 * 512 + 256 + 3 * 128, 2 * 4 * 128 + 2 * 4 * 256 + 512 + 4096),
    # one K, V head per member (k_U = 1): Kh = 8*4*1*4*2 = 256, heads = Q + 2Kh = 768
    ("ulysses", (1, 4), 768 + 4 * 768 - 256, 5 * 768 + 2 * 256),                                   # 3584, 4352
    # R = C = 2: n = 2 chunks per kernel call (t = 8), gq = 2Q = 512, gkv = 2RK = 512; forward 2K + gq + gkv +
    # C(Qa + L) + max(n(2Q + Qa) = 2048, AttnFix 2C(Qa + L) = 2560); backward's largest: the call, n(Q + blk + G)
    ("attention2d-no", (2, 2), 256 + 512 + 512 + 2 * 640 + 2 * 2 * 640,
     128 + 2 * 512 + 2 * 2 * 128 + 512 + 2 * 512 + 2 * 2 * 256 + 2 * (256 + 2048 + 512)),        # 5120, 9856
    # qn = 1, no = nq = 3, travel 4K (R = 2); pass 1 batched (m = 2 chunks a call at t = 8): the stack 2RK and the
    # call's repeated Q, output and lse m (2Q + L) in place of one call's Q + Qa; C = 2 has no batched backward pass
    ("attention2d-o", (2, 2), 2 * 2 * 128 + 256 + 3 * 640 + 2 * 2 * 128 + 2 * (2 * 256 + 128),
     (512 + 256) + 128 + 2 * 128 + 2 * 2 * 256 + 3 * 512 + 512 + 256 + 2048 + 512),             # 4480, 7040
])
def test_each_algorithms_buffers_are_what_its_code_allocates(monkeypatch, algo, grid, forward, backward):
    from megatron_cp_plugin import cp_grid
    monkeypatch.setattr(cp_grid, "OVERLAP_MIN_LOCAL", 0)     # Attention2D-O's own terms at t = 8 (else -NO's: below)
    got = plan_terms.terms(algo, dataclasses.replace(GQA, grid=grid))
    assert (got.forward, got.backward) == (forward, backward)
    # one rank: the local block alone (Qa + Q; blk + Qa + 2Ka), whatever the algorithm
    assert plan_terms.terms(algo, dataclasses.replace(GQA, cp=1)) == plan_terms.Terms(0, 768, 2048 + 512 + 512)


def test_attention2d_o_on_short_shards_plans_attention2d_no():
    """At the shipped cp_grid.OVERLAP_MIN_LOCAL, t = 8 tokens run Attention2D-NO's schedule: its terms."""
    sh = dataclasses.replace(GQA, grid=(2, 2))
    assert plan_terms.terms("attention2d-o", sh) == plan_terms.terms("attention2d-no", sh) != (
        plan_terms.terms("attention2d-o", dataclasses.replace(sh, tokens=8192)))


def test_the_neighbour_ring_below_its_rounds():
    """P = 3 < ring.ROUND_MIN_P: one block a step; forward K, V in hand and in flight 4K, 2Qa, Q; backward Qa + 4K
    + 6Ka + blk."""
    got = plan_terms.terms("ring", dataclasses.replace(GQA, cp=3))
    assert (got.forward, got.backward) == (2 * 512 + 4 * 128 + 256, 512 + 4 * 128 + 6 * 256 + 2048)   # 1792, 4608


def test_burst_below_its_rounds():
    """P = 3 < ring.ROUND_MIN_P: (Q, dO, D, lse) in hand and in flight (4Q + 4L), D, 3Qa, 2Ka, surrogate Q,
    max(3Qa, blk), G."""
    got = plan_terms.terms("burst", dataclasses.replace(GQA, cp=3))
    assert got.backward == (4 * 256 + 4 * 128) + 128 + 3 * 512 + 2 * 256 + 256 + 2048 + 512      # 6528


def test_allgather_below_its_grouped_calls_stacks_k_v():
    """P = 3 < allgather.GROUPED_MIN_P: one call per owner; the forward's torch.stack([k, v]) (2K), gathered 2PK,
    2Qa, Q; backward 2PK + 2PKa + Qa + the largest of blk (2G + ws = 2048), reduce max(8PK = 3072, 2688)."""
    got = plan_terms.terms("allgather", dataclasses.replace(GQA, cp=3))
    assert (got.forward, got.backward) == (2 * 128 + 2 * 3 * 128 + 2 * 512 + 256, 2 * 3 * 128 + 2 * 3 * 256 + 512
                                           + 3072)


def test_the_algorithms_backward_buffers_set_the_backward_moment():
    """Where the attention's backward is the step's peak (long sequence, tiny FFN, vocabulary and weights), two
    algorithms' peaks differ by exactly their `backward` terms; their forward moments by their `forward` terms."""
    m = plan.Model(layers=2, hidden=64, heads=8, groups=2, ffn=8, vocab=16, seq=8192)
    lay = plan.Layout("zero1", recompute=True)
    lb = {a: plan_terms.layer_bytes(_algo(m, a), lay, 4, a) for a in ("ring", "burst", "allgather")}
    mo = {a: plan_terms.moments(m, lay, x, m.params, m.root_params, 2, 1, True) for a, x in lb.items()}
    # t = 2048: Q = 262144, K = L = 65536, Qa = 524288, Ka = 131072, G = 393216, ws = Qa + 2Q, blk = 2G + ws
    # in rounds of g = 3 (2048 tokens a rank): ring 4gK + Qa + 2Ka + 6gK + 2(Q + 2gK) + ws; burst 3L + 4g(Q + L)
    # + Qa + 2Ka + 3gQ + (gQ + 2gL + 2(gQ + 2K) + g ws) + G (both algorithms' round partials in the input dtype)
    assert (lb["ring"].terms.backward, lb["burst"].terms.backward) == (5_111_808, 13_828_096)
    diff = lb["burst"].terms.backward - lb["ring"].terms.backward
    assert mo["burst"]["backward"] - mo["ring"]["backward"] == diff
    est = {a: plan.estimate(_algo(m, a), lay, 4) for a in ("ring", "burst")}
    assert est["ring"].peak == est["burst"].peak == "backward"
    assert est["burst"].total - est["ring"].total == diff
    assert (mo["allgather"]["forward"] - mo["ring"]["forward"]
            == lb["allgather"].terms.forward - lb["ring"].terms.forward)


@pytest.mark.parametrize("algo,saved", [("attention2d-no", -(8 + 4) * 32 * 2 * 512),   # -(a + g) d e per token
                                        ("ulysses", (2 * 2 * 2 - 3 * 4) * 32 * 2 * 512)])  # (2 U k_U - 3g) d e
def test_what_an_algorithm_keeps_is_the_formula_plus_its_saved_term(tmp_path, algo, saved):
    """The trainer's tensors (CPU processes, tests.plan_probe): Attention2D keeps its stacked K, V instead of the
    fused QKV output and the rotated k, Ulysses its head-sharded q, k, v, o; with SMALL's shape (t = 512, a = 8,
    g = 4, d = 32) that is -393216 and -131072 bytes a layer, the planner's activations exactly that apart."""
    ring = _probe(tmp_path, "--use-distributed-optimizer")
    got = _probe(tmp_path, "--use-distributed-optimizer", "--context-parallel-algo", algo)
    m = plan.model_from_args(parse_args(SMALL))
    sh = plan_terms.layer_bytes(_algo(m, algo), plan.Layout("zero1"), 2, algo)
    assert sh.terms.saved == saved
    assert got["saved_rest_bytes"] - ring["saved_rest_bytes"] == m.layers * saved
    est = {a: plan.estimate(_algo(m, a), plan.Layout("zero1"), 2) for a in ("ring", algo)}
    assert est[algo].activations - est["ring"].activations == m.layers * saved


def test_fsdp_gathers_and_queues_what_megatron_fsdp_does():
    """Megatron-FSDP 0.16.1, optim_grads_params: unit U = max(1e9, 2L) elements. GPT-3 13B (L = 314,629,120):
    the running layer and ceil(5e8 / L) = 2 prefetched are gathered, 1e9 // L + 1 = 4 unsharded fp32 gradients
    queue; 175B (L = 1.81e9, U = 2L): 2 gathered, 2 queued. With full recompute the backward's peak is where the
    queue first fills (the j-th layer from the top, j = 4): one queued gradient less is 4L bytes less after the
    backward, and at the backward's peak 4L less but one layer earlier, with one more layer input (e h t) kept."""
    m = plan.model_from_args(parse_args(["--config", str(REPO / "configs/gpt3-13b.toml")]))
    L = m.layer_params
    assert L == 314_629_120 and plan_terms.fsdp_gathered_layers(L) == 3 and plan_terms.fsdp_queued_grads(L) == 4
    assert plan_terms.fsdp_gathered_layers(1_812_074_496) == 2 and plan_terms.fsdp_queued_grads(1_812_074_496) == 2
    lay = plan.Layout("fsdp-optim_grads_params", recompute=True)
    lb = plan_terms.layer_bytes(m, lay, 2, "ring")
    full = plan_terms.moments(m, lay, lb, m.params, m.root_params, m.layers, 1, True)
    # after the backward: the root's bf16 weights and fp32 bucket, the embedding's bf16 gradient, 4 queued layers
    assert full["end"] == 2 * m.root_params + 4 * m.root_params + 2 * m.vocab * m.hidden + 4 * L * 4
    plan_terms_q = plan_terms.fsdp_queued_grads
    try:
        plan_terms.fsdp_queued_grads = lambda n: plan_terms_q(n) - 1
        less = plan_terms.moments(m, lay, lb, m.params, m.root_params, m.layers, 1, True)
    finally:
        plan_terms.fsdp_queued_grads = plan_terms_q
    assert full["end"] - less["end"] == 4 * L
    assert full["backward"] - less["backward"] == 4 * L - 2 * m.hidden * 16384


def test_13b_with_fsdp_and_recompute_on_2_gpus_peaks_in_the_optimizer_step():
    """GPT-3 13B, 32k tokens, CP = 2, Megatron-FSDP optim_grads_params + full recompute: static 109.81 GiB + one fp32
    temporary per parameter of the rank's shard (torch's foreach Adam: 4 x 13.10e9 / 2 = 24.40 GiB) + the root unit's
    gathered bf16 weights, which megatron-core 0.19.2 keeps through the step (2 x 515M = 0.96 GiB) = 135.17 GiB.
    The run that went out of memory at 135.34 GiB allocated asking for 400 MiB (2026-11-25, an fp32 FC weight of
    Adam's step) ran 0.19.2 with bf16 main gradients plus their fp32 copy (12.2 GiB more at the step: the trainer
    now asks for fp32 main gradients, megatron/compat.py); not yet run again on 2 x H200."""
    a = parse_args(["--config", str(REPO / "configs/gpt3-13b.toml"), str(REPO / "configs/recompute-full.toml"),
                    "--seq-length", "32768", "--use-megatron-fsdp"])
    m = plan.model_from_args(a)
    est = plan.estimate(m, plan.Layout("fsdp-optim_grads_params", recompute=True), 2)
    static = est.weights + est.grads + est.optimizer
    root_gathered = 2 * m.root_params
    assert est.peak == "step" and est.step == 4 * m.params / 2 + root_gathered
    assert est.total == pytest.approx(static + 4 * m.params / 2 + root_gathered)
    assert est.total / 2**30 == pytest.approx(135.17, abs=0.01)
    fused = plan.estimate(m, plan.Layout("fsdp-optim_grads_params", recompute=True), 2, fused_adam=True)
    # fused Adam: the backward is the peak, attention2d-no's (the config's algorithm) on 2 x 1 with its dK, dV
    # exchange buffers beside the own pair's last call (attention2d.own_split; 131.6 while the exchange came last)
    assert fused.step == root_gathered and fused.peak == "backward" and fused.total / 2**30 == pytest.approx(132.54,
                                                                                                          abs=0.05)
    # ZeRO-1's optimizer steps plain tensors (the rank's fp32 main shard), DDP's every fp32 main weight: with torch's
    # foreach Adam (Megatron-LM without TE or Apex) a temporary each; megatron-cp-pretrain fuses them (none)
    z1 = plan.estimate(m, plan.Layout("zero1", recompute=True), 2, fused_adam=False)
    ddp = plan.estimate(m, plan.Layout("ddp", recompute=True), 2, fused_adam=False)
    assert (z1.step, ddp.step) == (4 * m.params / 2, 4 * m.params)
    assert [plan.estimate(m, plan.Layout(z, recompute=True), 2).step for z in ("zero1", "ddp")] == [0.0, 0.0]
    pp2 = plan.Layout("zero1", pp=2, recompute=True)                             # Megatron-LM's layouts: foreach
    assert plan.estimate(m, pp2, 2).step == plan.estimate(m, pp2, 2, fused_adam=False).step > 0


def test_the_loss_moment_holds_the_fp32_softmax_beside_the_bf16_logits():
    """Every layer's kept tensors, the final norm and output layer inputs, the fp32 softmax (4 V per token) and the
    bf16 logits (2 V per token) at once: t = 4096 tokens a GPU, V = 1024."""
    from megatron_cp_plugin.algos import registry
    assert plan.Model(2, 64, 4, 4, 256, 1024, 8192).algo == registry.DEFAULT_ALGO     # the plugin's commands' default
    m = plan.Model(layers=2, hidden=64, heads=4, groups=4, ffn=256, vocab=1024, seq=8192, algo="ring")
    lay = plan.Layout("zero1")
    lb = plan_terms.layer_bytes(m, lay, 2, "ring")
    mo = plan_terms.moments(m, lay, lb, m.params, m.root_params, 2, 1, True)
    t = 4096
    # the final norm's and output layer's inputs, the softmax, the fused RoPE's fp32 freqs (head dim 16), the norm
    assert mo["loss"] == 2 * lb.kept + t * (2 * 64 + 4 * 1024 + 4 * 16 + 2 * 64 + 4) + t * 2 * 1024
    est = plan.estimate(m, lay, 2)
    assert est.peak == "loss" and est.transient == t * 2 * 1024             # the logits, beside the kept softmax


def test_the_capacity_is_what_the_device_reports_unless_gpu_mem_says_otherwise(capsys, monkeypatch):
    """13B, ZeRO-3 + recompute at 135.17 GiB: with 5 GiB headroom it fits a nominal 141 GB H200, not the 139.8 GiB
    the device reports. No GPU here: devices.gpu_capacity_gib is stood in for."""
    from megatron_cp_plugin import devices
    monkeypatch.setattr(devices, "gpu_capacity_gib", lambda: 139.8)     # nvidia-smi's answer on an H200
    flags = ["--config", REPO / "configs/gpt3-13b.toml", REPO / "configs/recompute-full.toml", "--seq-length",
             32768, "--gpus", 2, "--headroom", 5]

    def fits(*extra):
        out = _run_cli(capsys, *flags, *extra)
        row = next(x for x in out.splitlines() if x.strip().startswith("fsdp-optim_grads_params +recompute"))
        return out, row.split("|")[9].strip() == "True"
    out, ok = fits()
    assert "2 GPUs x 139.8 GiB (as this machine's GPU reports)" in out and not ok
    out, ok = fits("--gpu-mem", 141)
    assert "2 GPUs x 141 GiB (--gpu-mem)" in out and ok
    monkeypatch.setattr(devices, "gpu_capacity_gib", lambda: None)      # no GPU (or no nvidia-smi) here
    with pytest.raises(SystemExit, match="--gpu-mem is required"):
        plan.main([str(x) for x in flags])


# ------------------------------------------------------------ the launch scripts' plan (bench/launch_plan.py)
from megatron_cp_plugin.bench import launch_plan  # noqa: E402
from megatron_cp_plugin.megatron_lm.flags import layout_flags, megatron_lm_flags  # noqa: E402
from megatron_cp_plugin.training.config import build_parser  # noqa: E402


def _sbatch_shape(path):
    text = path.read_text()
    nodes = int(re.search(r"^#SBATCH --nodes=(\d+)", text, re.M).group(1))
    gpn = int(re.search(r"^#SBATCH --gpus-per-node=(\d+)", text, re.M).group(1))
    config = re.search(r"CONFIG=\$\{CONFIG:-([^}]+)\}", text).group(1).split()
    return nodes * gpn, config


@pytest.mark.parametrize("size", ["760m", "2.7b", "13b", "66b", "175b"])
def test_shipped_gpt3_sbatch_scripts_fit_their_gpus_with_either_trainer(size):
    gpus, config = _sbatch_shape(REPO / f"launch/gpt3-{size}.sbatch")
    for seq in (None, 65536):                      # the config's, and the docs' SEQ=65536 examples
        a = parse_args(["--config", *(str(REPO / c) for c in config)] + (["--seq-length", str(seq)] if seq else []))
        for trainer in ("plugin", "megatron-lm"):
            lay, line, err = launch_plan.choose(a, trainer, "auto", gpus, 80, 4.0, False)
            assert err is None, (size, seq, trainer, err)
            gib = float(re.fullmatch(r"plan: ([0-9.]+) GiB per GPU of 80 GiB \((.+)\)", line).group(1))
            assert gib + 4 <= 80 and line.endswith(f"({lay.name})"), line


def test_a_named_layout_that_does_not_fit_is_refused_naming_one_that_does():
    a = parse_args(["--config", str(REPO / "configs/gpt3-13b.toml"), "--seq-length", "65536"])
    lay, line, err = launch_plan.choose(a, "plugin", "zero1", 16, 80, 4.0, False)
    assert line == "plan: 110.7 GiB per GPU of 80 GiB (zero1)"         # attention2d-no's saved set
    assert err.startswith("launch: LAYOUT=zero1") and "fsdp-optim_grads fits (LAYOUT=auto picks it)" in err
    assert launch_plan.choose(a, "plugin", "zero1", 16, 80, 4.0, True)[2] is None          # PLAN_FORCE=1
    # what the configs say (zero1) does not fit either; auto does
    assert launch_plan.choose(a, "plugin", "config", 16, 80, 4.0, False)[2] is not None
    lay, line, err = launch_plan.choose(a, "plugin", "auto", 16, 80, 4.0, False)
    assert err is None and lay.name == "fsdp-optim_grads"
    with pytest.raises(ValueError, match="LAYOUT 'zero3'"):
        launch_plan.choose(a, "plugin", "zero3", 16, 80, 4.0, False)
    with pytest.raises(ValueError, match="LAYOUT 'pp2-zero1'"):          # no pipeline stages in the plugin trainer
        launch_plan.choose(a, "plugin", "pp2-zero1", 16, 80, 4.0, False)


def test_auto_keeps_what_the_flags_force():
    base = ["--config", str(REPO / "configs/gpt3-760m.toml")]
    lay = launch_plan.choose(parse_args(base), "plugin", "auto", 16, 80, 4.0, False)[0]
    assert lay.name == "zero1"
    lay = launch_plan.choose(parse_args(base + ["--recompute-granularity", "full"]), "plugin", "auto", 16, 80, 4.0,
                             False)[0]
    assert lay.name == "zero1 +recompute"                  # the flag stays, so the plan must count it
    lay = launch_plan.choose(parse_args(base + ["--use-megatron-fsdp"]), "plugin", "auto", 16, 80, 4.0, False)[0]
    assert lay.name == "fsdp-optim_grads_params"
    assert launch_plan.layout_args(lay) == ["--use-megatron-fsdp", "--data-parallel-sharding-strategy",
                                            "optim_grads_params"]


def test_megatron_lm_flags_of_the_planners_layouts():
    a = parse_args(["--config", str(REPO / "configs/gpt3-13b.toml")])
    flags = megatron_lm_flags(a, build_parser(), world_size=16, layout="pp4-zero1 +recompute")
    i = flags.index
    assert flags[i("--pipeline-model-parallel-size") + 1] == "4" and flags[i("--context-parallel-size") + 1] == "4"
    assert flags[i("--recompute-granularity") + 1] == "full" and "--use-megatron-fsdp" not in flags
    assert layout_flags(a, "fsdp-optim_grads")[:3] == ["--use-megatron-fsdp", "--data-parallel-sharding-strategy",
                                                       "optim_grads"]
    with pytest.raises(ValueError, match="--layout pp2-fsdp"):
        layout_flags(a, "pp2-fsdp")


def test_megatron_fsdp_asks_megatron_lm_for_fp32_main_gradients_where_it_has_the_flag(tmp_path, monkeypatch):
    """From core_v0.17.0 Megatron-LM's --megatron-fsdp-main-grads-dtype defaults to 'auto' (bf16 gradients and an
    fp32 copy of the shard at the optimizer step, 2 bytes a parameter of the shard more than the planner counts;
    issue 35): the FSDP layouts ask for fp32 there, never on core_v0.16.1 (no such flag) or an unknown release; the
    launch scripts read the release from $MEGATRON_LM's package_info.py."""
    a = parse_args(["--config", str(REPO / "configs/gpt3-13b.toml")])
    want = ["--megatron-fsdp-main-grads-dtype", "fp32"]
    assert layout_flags(a, "fsdp-optim_grads_params", (0, 19, 0))[-2:] == want
    for release in (None, (0, 16, 1)):
        assert "--megatron-fsdp-main-grads-dtype" not in layout_flags(a, "fsdp-optim_grads_params", release)
    assert "--megatron-fsdp-main-grads-dtype" not in layout_flags(a, "zero1", (0, 19, 0))
    mlm = tmp_path / "Megatron-LM"
    (mlm / "megatron" / "core").mkdir(parents=True)
    (mlm / "megatron" / "core" / "package_info.py").write_text("MAJOR = 0\nMINOR = 19\nPATCH = 0\n")
    monkeypatch.setenv("MEGATRON_LM", str(mlm))
    argv = ["--trainer", "megatron-lm", "--layout", "fsdp-optim_grads_params", "--gpus", "4", "--gpu-mem", "141",
            "--force", "--", "--config", str(REPO / "configs/gpt3-13b.toml")]
    out = subprocess.run([sys.executable, "-W", "ignore", "-m", "megatron_cp_plugin.bench.launch_plan", *argv],
                         capture_output=True, text=True, cwd=REPO, env={**os.environ, "MEGATRON_LM": str(mlm)})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[lines.index("--megatron-fsdp-main-grads-dtype") + 1] == "fp32"


def test_offloaded_layer_inputs_leave_no_layer_on_the_gpu():
    """+offload (training/offload.py): full recompute's kept layer input (e h t a layer) waits in host memory, so the
    loss moment and the backward's first layer hold L such inputs less (L - 1: the running one is on the GPU); the
    layout needs full recompute and no pipeline stages, and names its flag."""
    m = plan.Model(layers=4, hidden=64, heads=8, groups=2, ffn=256, vocab=128, seq=4096)
    rc, off = plan.Layout("fsdp-optim_grads", 1, True), plan.Layout("fsdp-optim_grads", 1, True, True)
    lb = {x: plan_terms.layer_bytes(m, x, 2, "ring") for x in (rc, off)}
    t = m.seq // 2
    assert lb[rc].kept == m.elem * m.hidden * t and lb[off].kept == 0
    mo = {x: plan_terms.moments(m, x, lb[x], m.params, m.root_params, m.layers, 1, True) for x in (rc, off)}
    assert mo[rc]["loss"] - mo[off]["loss"] == m.layers * m.elem * m.hidden * t
    assert mo[rc]["step"] == mo[off]["step"]
    assert plan.estimate(m, off, 2).total < plan.estimate(m, rc, 2).total
    assert off.name == "fsdp-optim_grads +recompute +offload" and "--offload-layer-inputs" in off.flags()
    assert off in plan.layouts(m, 2)
    for bad in (dict(recompute=False), dict(pp=2)):
        with pytest.raises(ValueError, match="only with full recompute and no pipeline stages"):
            plan.Layout(**{"zero": "zero1", "pp": 1, "recompute": True, "offload": True, **bad})


# ------------------------------------------------------- Attention2D's group cap, the largest that fits (memory.fit)
GPT3_13B_128K = ["--config", str(REPO / "configs/gpt3-13b.toml"), "--seq-length", "131072", "--context-parallel-algo",
                 "attention2d-no"]


def test_the_planner_lowers_attention2ds_group_cap_where_the_default_does_not_fit():
    """GPT-3 13B at 128k on 16 GPUs of 79.1 GiB, attention2d-no on 4 x 4 (8k tokens a rank): with the default rule's
    calls (4 chunks, 32768 query rows) its fsdp-optim_grads_params peak misses, with 16384 (2 chunks) it fits, so
    the planner keeps that layout at 16384 and says so in its flags; a 139.8-GiB GPU keeps the default (no flag);
    ring has no cap; a cap the flags fix is planned as given. Red when `fit` takes the default rule."""
    from dataclasses import replace

    m = plan.model_from_args(parse_args(GPT3_13B_128K))
    zero3 = plan.Layout("fsdp-optim_grads_params")
    at = {cap: plan.estimate(replace(m, group_tokens=cap), zero3, 16).total / plan.GiB for cap in (None, 16384)}
    assert at[None] + 4 > 79.1 >= at[16384] + 4 and at[None] - at[16384] > 1.0, at
    assert plan.estimate(replace(m, group_tokens=32768), zero3, 16).total / plan.GiB == at[None]   # the rule's 4
    assert plan.fit(m, zero3, 16, 79.1).group_tokens == 16384
    est = plan.fit(m, zero3, 16, 139.8)
    assert est.grouped and est.group_tokens is None
    assert plan.recommend(m, 16, 79.1) == "fsdp-optim_grads_params"
    row = next(r for r in plan.plan(m, 16, 79.1) if r["layout"] == zero3.name)
    assert row["fits"] and row["group_tokens"] == 16384 and row["flags"].endswith(" --cp-group-tokens 16384")
    row = next(r for r in plan.plan(m, 16, 139.8) if r["layout"] == zero3.name)
    assert row["group_tokens"] == "default" and "--cp-group-tokens" not in row["flags"]
    assert not plan.fit(replace(m, algo="ring"), zero3, 16, 79.1).grouped
    assert plan.fit(replace(m, group_tokens=32768), zero3, 16, 79.1).group_tokens == 32768


def test_the_default_group_rule_keeps_ungrouped_shards_ungrouped():
    """cp_grid.GROUP_TOKENS' default rule: the largest cap (32768), except where the smallest (16384) groups nothing,
    whose pairs keep the overlapped schedule (attention2d.pair_order): 1M over 8 x 8 (16k tokens) one chunk a call,
    128k over 4 x 4 (8k) 4, 128k over 8 x 8 (2k) 8; an explicit cap as given. The same for Attention2D-O's batches.
    The cost model follows (Problem.group_tokens): 1M P = 64 as at 16384, 128k P = 16 as at 32768."""
    from megatron_cp_plugin import cp_grid
    from megatron_cp_plugin.cost import HARDWARE, Problem
    from megatron_cp_plugin.cost import model as cm

    assert [cp_grid.group_chunks(8, 8, 16384), cp_grid.group_chunks(4, 4, 8192), cp_grid.group_chunks(8, 8, 2048)] == [1, 4, 8]
    assert [cp_grid.group_chunks(8, 8, 16384, 32768), cp_grid.group_chunks(4, 4, 8192, 16384)] == [2, 2]
    assert [cp_grid.batch_chunks(8, 16384), cp_grid.batch_chunks(4, 8192), cp_grid.batch_chunks(8, 16384, 32768)] == [1, 4, 2]

    def t(S, P, grid, cap):
        return cm.predict("attention2d-no", Problem(S, P, 32, grid=grid, node_aware=False, group_tokens=cap),
                          HARDWARE["h100-ib"]).total_s
    assert t(1 << 20, 64, (8, 8), None) == t(1 << 20, 64, (8, 8), 16384) < t(1 << 20, 64, (8, 8), 32768)
    assert t(1 << 17, 16, (4, 4), None) == t(1 << 17, 16, (4, 4), 32768) < t(1 << 17, 16, (4, 4), 16384)


def test_the_launch_scripts_pass_the_planned_group_cap(capsys):
    """launch_plan's training arguments carry the cap the plan was sized at (both trainers), not where the flags
    give one or the algorithm has no grouped calls."""
    out = {}
    for trainer in ("plugin", "megatron-lm"):
        for extra in ([], ["--cp-group-tokens", "8192"], ["--context-parallel-algo", "ring"]):
            assert launch_plan.main(["--trainer", trainer, "--gpus", "16", "--gpu-mem", "79.1", "--",
                                     *GPT3_13B_128K, *extra]) == 0
            args = capsys.readouterr().out.splitlines()[1:]
            out[trainer, tuple(extra)] = [args[i + 1] for i, x in enumerate(args) if x == "--cp-group-tokens"]
    assert out["plugin", ()] == ["16384"] and out["megatron-lm", ()] == ["16384"], out
    assert all(out[t, ("--cp-group-tokens", "8192")] == ["8192"] for t in ("plugin", "megatron-lm")), out
    assert all(out[t, ("--context-parallel-algo", "ring")] == [] for t in ("plugin", "megatron-lm")), out
