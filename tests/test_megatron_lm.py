"""The Megatron-LM route: the hooks our patches call, the shipped patches, the parity harness's logic, the config
-> pretrain_gpt.py flags, the launch scripts' dry run; with MEGATRON_LM=<checkout>, the patch applied to a copy
of it, its --help and every config's flags through its own parser, and (with GPUs) the harness itself."""
from __future__ import annotations

import os
import subprocess
import sys
import warnings
from argparse import Namespace
from pathlib import Path

import pytest
import torch

from megatron_cp_plugin.algos import registry
from megatron_cp_plugin.megatron import lm
from megatron_cp_plugin.megatron_lm.parity import LOSS_RE, Run, build_parser, plan_runs, report
from megatron_cp_plugin.megatron_lm.flags import main as flags_main
from megatron_cp_plugin.megatron_lm.patching import patches, release_of

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted(p.stem for p in (REPO / "configs").glob("gpt3-*.toml") if "stage" not in p.stem)
MEGATRON_LM = os.environ.get("MEGATRON_LM")
needs_checkout = pytest.mark.skipif(not MEGATRON_LM, reason="MEGATRON_LM is not set: the real Megatron-LM checks "
                                    "(patch, --help, flags through its parser, the GPU harness) did not run")
if not MEGATRON_LM:
    warnings.warn("MEGATRON_LM is not set: tests against a real Megatron-LM checkout are skipped", stacklevel=1)


def _args(**kw):
    base = dict(context_parallel_algo="auto", context_parallel_size=4, seq_length=4096, num_attention_heads=16,
                num_query_groups=4, group_query_attention=True, hidden_size=1024, micro_batch_size=1, bf16=True,
                tensor_model_parallel_size=1, cp_grid=None, cp_gpus_per_node=None, cp_hardware="h200-nvlink",
                spec=None, multi_latent_attention=False, experimental_attention_variant=None,
                heterogeneous_layers_config_path=None, mtp_num_layers=None, hybrid_context_parallel=False,
                attention_backend=None)
    base.update(kw)
    return Namespace(**base)


def test_resolve_chooses_once_and_writes_the_choice_back(capsys):
    args = _args()
    cfg = lm.resolve(args)
    assert cfg.algo in registry.names() and set(cfg.predicted) == set(registry.names())   # issue 27's three too
    assert args.context_parallel_algo == cfg.algo and args.context_parallel_algo_requested == "auto"
    assert "--context-parallel-algo auto ->" in capsys.readouterr().out
    assert lm.resolve(args).algo == cfg.algo and capsys.readouterr().out == ""      # no cost model the 2nd time


def test_flags_that_bypass_our_attention_are_refused_by_name():
    with pytest.raises(ValueError, match="--mtp-num-layers.*--multi-latent-attention|--multi-latent-attention.*--mtp"):
        lm.resolve(_args(context_parallel_algo="ring", mtp_num_layers=1, multi_latent_attention=True))
    with pytest.raises(ValueError, match="--attention-backend local"):
        lm.resolve(_args(context_parallel_algo="ring", attention_backend=Namespace(name="local")))


class _CPGroup:
    """Rank `rank` of a CP group of `size`, as shard_batch sees it."""

    def __init__(self, rank, size=2):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size


def test_packed_batches_are_sharded_per_document():
    """core_v0.19's get_batch keeps cu_seqlens [1, n] in the batch; core_v0.16's packed branch calls
    shard_thd_batch. Both: every document in the algorithm's layout (zigzag: TE's THD), 2 x CP per document."""
    args = _args(context_parallel_algo="ring", context_parallel_size=2)
    cu = torch.tensor([[0, 8, 12]], dtype=torch.int32)
    batch = {"tokens": torch.arange(12)[None], "labels": torch.arange(12)[None] + 1, "cu_seqlens": cu,
             "cu_seqlens_padded": None, "max_seqlen": torch.tensor([8]), "local_cp_size": None}
    out = lm.shard_batch(batch, args, cp_group=_CPGroup(0))
    assert out["tokens"].tolist() == [[0, 1, 6, 7, 8, 11]] and out["cu_seqlens"] is cu
    assert list(out) == list(batch)
    mine, params = lm.shard_thd_batch({"tokens": batch["tokens"], "labels": batch["labels"]}, args, cu, None,
                                      torch.tensor([8]), cp_group=_CPGroup(1))
    assert list(mine) == ["tokens", "labels"] and mine["labels"].tolist() == [[3, 4, 5, 6, 10, 11]]
    assert params.qkv_format == "thd" and params.cu_seqlens_q.tolist() == [0, 8, 12] and params.max_seqlen_q == 8
    # core_v0.17's get_batch squeezes cu_seqlens to [n] before its packed branch: the same shard
    mine17, params17 = lm.shard_thd_batch({"tokens": batch["tokens"], "labels": batch["labels"]}, args, cu[0], None,
                                          torch.tensor([8]), cp_group=_CPGroup(1))
    assert mine17["labels"].tolist() == mine["labels"].tolist() and params17.cu_seqlens_q.tolist() == [0, 8, 12]
    with pytest.raises(ValueError, match=r"cu_seqlens: document 1 .*length 2, not a multiple of 4"):
        lm.shard_batch(dict(batch, cu_seqlens=torch.tensor([[0, 8, 10, 12]])), args, cp_group=_CPGroup(0))


def test_a_patch_per_verified_release_ships_with_the_package():
    from megatron_cp_plugin.megatron_lm.patching import VERIFIED, supported_lines  # noqa: PLC0415

    have = patches()
    assert {(0, 16, 1), (0, 17, 1), (0, 18, 2), (0, 19, 0)} <= set(have) and set(VERIFIED) <= set(have)
    assert supported_lines() == sorted({v[:2] for v in VERIFIED})
    for p in have.values():
        text = p.read_text()
        assert "megatron_cp_plugin.megatron import lm as cp_plugin" in text and "cp_plugin.shard_batch" in text


def test_release_of_reads_package_info_and_names_a_non_checkout(tmp_path):
    (tmp_path / "megatron" / "core").mkdir(parents=True)
    (tmp_path / "megatron" / "core" / "package_info.py").write_text("MAJOR = 0\nMINOR = 19\nPATCH = 1\n")
    assert release_of(tmp_path) == (0, 19, 1)
    with pytest.raises(ValueError, match="MEGATRON_LM_DIR .*not a Megatron-LM checkout"):
        release_of(tmp_path / "megatron")


@pytest.fixture()
def toy_checkout(tmp_path, monkeypatch):
    """A two-file "checkout" of release 0.16.1 and a shipped patch made for it (no Megatron-LM code here)."""
    from megatron_cp_plugin.megatron_lm import patching  # noqa: PLC0415

    tree, shipped = tmp_path / "mlm", tmp_path / "patches"
    (tree / "megatron" / "core").mkdir(parents=True)
    shipped.mkdir()
    (tree / "pretrain_gpt.py").write_text("x = 1\n")
    (shipped / "megatron-lm-core_v0.16.1-context-parallel-algo.patch").write_text(
        "--- a/pretrain_gpt.py\n+++ b/pretrain_gpt.py\n@@ -1 +1 @@\n-x = 1\n+x = 2\n")
    monkeypatch.setattr(patching, "patch_dir", lambda: shipped)

    def release(minor, patch=0):
        (tree / "megatron" / "core" / "package_info.py").write_text(f"MAJOR = 0\nMINOR = {minor}\nPATCH = {patch}\n")
    release(16, 1)
    return tree, release


def test_patch_check_and_revert_verbs(toy_checkout, capsys):
    from megatron_cp_plugin.megatron_lm.cli import main  # noqa: PLC0415

    tree, _ = toy_checkout
    src = tree / "pretrain_gpt.py"
    assert main(["check", str(tree)]) == 1 and "would apply it cleanly" in capsys.readouterr().out
    assert src.read_text() == "x = 1\n"                                    # check changes nothing
    assert main(["patch", str(tree)]) == 0 and "is now applied" in capsys.readouterr().out
    assert src.read_text() == "x = 2\n"
    assert main(["patch", str(tree)]) == 0 and "was already applied" in capsys.readouterr().out
    assert main(["check", str(tree)]) == 0 and "is applied" in capsys.readouterr().out
    assert main(["revert", str(tree)]) == 0 and "is reverted" in capsys.readouterr().out
    assert src.read_text() == "x = 1\n"
    assert main(["revert", str(tree)]) == 0 and "nothing to revert" in capsys.readouterr().out
    assert main(["check", str(tree), "--pp-run", "ring"]) == 2
    assert "megatron-cp-megatron-lm parity" in capsys.readouterr().err     # the harness's old verb, redirected


def test_patch_refuses_a_release_it_was_not_made_for_unless_forced(toy_checkout, capsys):
    from megatron_cp_plugin.megatron_lm.cli import main  # noqa: PLC0415

    tree, release = toy_checkout
    release(16, 3)                                                # the same release line: supported
    assert main(["check", str(tree)]) == 1
    capsys.readouterr()
    release(20)                                                   # Megatron-LM main after 0.19
    for verb in ("patch", "check"):
        assert main([verb, str(tree)]) == 2
        err = capsys.readouterr().err
        assert "Megatron-LM 0.20.0" in err and "core_v0.16.1" in err and "--force" in err, err
    assert (tree / "pretrain_gpt.py").read_text() == "x = 1\n"
    assert main(["patch", str(tree), "--force"]) == 0 and (tree / "pretrain_gpt.py").read_text() == "x = 2\n"


def test_a_patch_not_yet_verified_on_gpus_is_used_only_when_forced(toy_checkout, capsys, monkeypatch):
    """A release line whose patch ships but has not passed the GPU parity harness (patching.VERIFIED) is refused
    with a line that names that patch and --force; forced, its own patch is the one applied."""
    from megatron_cp_plugin.megatron_lm import patching  # noqa: PLC0415
    from megatron_cp_plugin.megatron_lm.cli import main  # noqa: PLC0415

    tree, release = toy_checkout
    (patching.patch_dir() / "megatron-lm-core_v0.17.1-context-parallel-algo.patch").write_text(
        "--- a/pretrain_gpt.py\n+++ b/pretrain_gpt.py\n@@ -1 +1 @@\n-x = 1\n+x = 3\n")
    monkeypatch.setattr(patching, "VERIFIED", ((0, 16, 1),))
    release(17, 1)
    assert patching.supported_lines() == [(0, 16)]
    assert main(["patch", str(tree)]) == 2
    err = capsys.readouterr().err
    assert "core_v0.17.1 ships" in err and "not been run on GPUs" in err and "--force" in err, err
    assert (tree / "pretrain_gpt.py").read_text() == "x = 1\n"
    assert main(["check", str(tree), "--force"]) == 1
    assert f"patch {tree} --force` would" in capsys.readouterr().out
    assert main(["patch", str(tree), "--force"]) == 0 and (tree / "pretrain_gpt.py").read_text() == "x = 3\n"
    monkeypatch.setattr(patching, "VERIFIED", ((0, 16, 1), (0, 17, 1)))
    assert main(["check", str(tree)]) == 0                         # verified: taken without --force


def test_harness_parses_megatron_log_lines_and_fails_past_the_tolerance():
    line = (" [2026-11-22 18:13:53.161072] iteration        3/      10 | consumed samples:           12 | "
            "elapsed time per iteration (ms): 46.7 | learning rate: 1.0E-03 | lm loss: 5.311743E+00 | loss scale: 1.0")
    assert LOSS_RE.findall(line) == [("3", "5.311743E+00")]
    ns = build_parser().parse_args(["x", "--cp", "2", "4", "--pp-run", "ring", "--fsdp-run", "burst"])
    runs, notes = plan_runs(ns, 2)
    names = [r.name for r in runs]
    assert "ring CP=2" in names and not any("CP=4" in n for n in names) and not any("PP" in n for n in names)
    assert any("CP=4: not run" in n for n in notes)
    for r in runs:
        r.rc, r.losses = 0, {i: 5.0 - 0.1 * i for i in range(1, 4)}
    text, ok = report(runs, 3, 1e-5)
    assert ok and text.count("PASS") == len(runs) - 1
    runs[2].losses[2] += 1e-3                                      # one run off by 1e-3 at one step
    text, ok = report(runs, 3, 1e-5)
    assert not ok and f"{runs[2].name}: FAIL" in text
    runs[2].losses[2] -= 1e-3
    runs[1].rc = 1                                                 # a crashed run fails too
    assert not report(runs, 3, 1e-5)[1]
    assert report([Run("cp1", 1, rc=0, losses={1: 5.0}), Run("ring CP=2", 2, rc=0, losses={1: 5.0})], 2, 1e-5)[1] is False


def _flags(capsys, *argv):
    assert flags_main(list(argv)) == 0
    return capsys.readouterr().out.split("\n")


@pytest.mark.parametrize("config", CONFIGS)
def test_every_config_becomes_pretrain_gpt_flags(capsys, config):
    flags = _flags(capsys, "--world-size", "16", "--config", f"configs/{config}.toml", "configs/algo/burst.toml")
    opts = [f for f in flags if f.startswith("--")]
    assert len(opts) == len(set(opts)), "a flag given twice"
    i = flags.index
    assert flags[i("--context-parallel-algo") + 1] == "burst" and flags[i("--context-parallel-size") + 1] == "16"
    big = config in ("gpt3-13b", "gpt3-66b", "gpt3-175b")
    assert ("--use-megatron-fsdp" in flags) == big and "--use-distributed-optimizer" in flags
    assert "--result-json" not in flags and "--config" not in flags


def test_flags_errors_name_the_flag(capsys):
    assert flags_main(["--world-size", "6", "--config", "configs/tiny.toml", "--context-parallel-size", "4"]) == 2
    assert "--context-parallel-size 4" in capsys.readouterr().err


def _dry_run(script, **env):
    e = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    e.update(DRY_RUN="1", PYTHON=sys.executable, RESULT_DIR=str(env.pop("result_dir")), **env)
    return subprocess.run(["bash", f"launch/{script}"], cwd=REPO, env=e, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("config", CONFIGS)
def test_slurm_dry_run_drives_pretrain_gpt_for_every_config(tmp_path, config):
    fake = tmp_path / "Megatron-LM"
    fake.mkdir()
    (fake / "pretrain_gpt.py").write_text("")
    # PLAN_FORCE: 66B and 175B do not fit 8 GPUs (the refusal is tests/test_slurm.py's); here: the flags
    r = _dry_run("run.sh", TRAINER="megatron-lm", MEGATRON_LM=str(fake), CONFIG=f"configs/{config}.toml",
                 ALGO="attention2d-no", NNODES="2", NPROC_PER_NODE="4", PLAN_FORCE="1", result_dir=tmp_path)
    assert r.returncode == 0, r.stderr
    cmd = r.stdout.strip().splitlines()[-1]
    assert f"cd {fake} &&" in cmd and "pretrain_gpt.py" in cmd and "--nnodes 2 --nproc-per-node 4" in cmd
    assert "--context-parallel-algo attention2d-no" in cmd and "--context-parallel-size 8" in cmd


def test_dry_run_of_the_plugin_trainer(tmp_path):
    r = _dry_run("run.sh", CONFIG="configs/gpt3-13b.toml", NNODES="2", NPROC_PER_NODE="4", result_dir=tmp_path)
    assert r.returncode == 0 and "-m megatron_cp_plugin.pretrain --config configs/gpt3-13b.toml" in r.stdout


def test_dry_run_refuses_a_missing_checkout(tmp_path):
    r = _dry_run("local.sh", TRAINER="megatron-lm", MEGATRON_LM=str(tmp_path), result_dir=tmp_path)
    assert r.returncode == 2 and "MEGATRON_LM" in r.stderr


# ------------------------------------------------------------------ with a real checkout (MEGATRON_LM=...)
@pytest.fixture(scope="module")
def patched(tmp_path_factory):
    from megatron_cp_plugin.megatron_lm.patching import apply_patch, copy_checkout  # noqa: PLC0415

    from megatron_cp_plugin.megatron_lm.patching import release_of  # noqa: PLC0415

    tree = copy_checkout(MEGATRON_LM, tmp_path_factory.mktemp("mlm") / "Megatron-LM")
    # forced: the CPU checks of a patch not yet verified on GPUs (patching.VERIFIED) run too; the patch applied
    # must still be the one made for the checkout's release line, or, for a checkout newer than every patch
    # (Megatron-LM's main between releases), the newest
    patch = apply_patch(tree, force=True)
    rel, shipped = release_of(tree), sorted(patches())
    own = [v for v in shipped if v[:2] == rel[:2]]
    want = own[-1] if own else shipped[-1] if rel > shipped[-1] else None
    assert want is not None and patch == patches()[want], (rel, patch.name)
    return tree


def _in_checkout(tree, code):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), str(REPO)]))
    return subprocess.run([sys.executable, "-W", "ignore", "-c", code], cwd=tree, env=env, capture_output=True,
                          text=True, timeout=600)


@needs_checkout
def test_patched_pretrain_gpt_lists_our_flags_in_help(patched):
    r = subprocess.run([sys.executable, "-W", "ignore", "pretrain_gpt.py", "--help"], cwd=patched, timeout=600,
                       capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "--context-parallel-algo" in r.stdout and "--cp-grid" in r.stdout


@needs_checkout
def test_every_config_parses_with_megatron_lms_own_parser(patched):
    code = (
        "import os, sys, subprocess\n"
        "from megatron.training.arguments import parse_args\n"
        "from megatron_cp_plugin.megatron import lm\n"
        f"for c in {CONFIGS!r}:\n"
        "    f = subprocess.run([sys.executable, '-W', 'ignore', '-m', 'megatron_cp_plugin.megatron_lm.flags',\n"
        "                        '--world-size', '8', '--config', f'configs/{c}.toml'], capture_output=True,\n"
        f"                       text=True, cwd={str(REPO)!r}, check=True).stdout.split()\n"
        "    sys.argv = ['pretrain_gpt.py', *f]\n"
        "    a = parse_args(lm.add_args)\n"
        "    print(c, a.context_parallel_algo, a.context_parallel_size)\n"
        # Megatron-FSDP with this checkout's release: fp32 main gradients where the flag exists (issue 35)
        "f = subprocess.run([sys.executable, '-W', 'ignore', '-m', 'megatron_cp_plugin.megatron_lm.flags',\n"
        "                    '--world-size', '8', '--layout', 'fsdp', '--megatron-lm', os.getcwd(),\n"
        f"                    '--config', 'configs/gpt3-13b.toml'], capture_output=True, text=True, cwd={str(REPO)!r},\n"
        "                   check=True).stdout.split()\n"
        "sys.argv = ['pretrain_gpt.py', *f]\n"
        "a = parse_args(lm.add_args)\n"
        "print('fsdp', a.use_megatron_fsdp, getattr(a, 'megatron_fsdp_main_grads_dtype', 'no such flag'))\n")
    r = _in_checkout(patched, code)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    assert len(lines) == len(CONFIGS) + 1
    # core_v0.16: no such flag; core_v0.17 and 0.18 keep the name until validate_args maps it; core_v0.19 maps it in
    # parse_args
    assert lines[-1] in ("fsdp True no such flag", "fsdp True fp32", "fsdp True torch.float32"), lines[-1]


@needs_checkout
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="the parity harness needs >= 2 GPUs "
                    "(Megatron-LM's training loop requires CUDA)")
def test_harness_on_gpus(tmp_path):
    from megatron_cp_plugin.megatron_lm.parity import main  # noqa: PLC0415

    assert main([MEGATRON_LM, "--cp", "2", "--workdir", str(tmp_path), "--out", str(tmp_path / "report.md")]) == 0


def _imports(path: Path) -> set[str]:
    """megatron_cp_plugin modules a file imports (absolute names), module level or inside functions."""
    import ast  # noqa: PLC0415

    pkg = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = pkg.rsplit(".", node.level - 1)[0] if node.level else ""
            mod = ".".join(x for x in (base, node.module) if x)
            out |= {mod} | {f"{mod}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return {m for m in out if m.startswith("megatron_cp_plugin")}


def test_megatron_lm_tooling_sits_above_the_runtime_with_no_import_running_back_up():
    """Issue 25: the tooling (megatron_lm/) may import the runtime; nothing in the runtime imports it, nor does
    the runtime integration import the trainer, nor the trainer the benchmarks; no circle inside the tooling."""
    pkg = REPO / "megatron_cp_plugin"
    graph = {".".join(p.relative_to(REPO).with_suffix("").parts): _imports(p) for p in pkg.rglob("*.py")}
    below = {"megatron_cp_plugin.megatron_lm": ("megatron_cp_plugin.megatron", "megatron_cp_plugin.training",
                                                "megatron_cp_plugin.algos", "megatron_cp_plugin.comm",
                                                "megatron_cp_plugin.kernels", "megatron_cp_plugin.sharding"),
             "megatron_cp_plugin.bench": ("megatron_cp_plugin.training",),
             "megatron_cp_plugin.training": ("megatron_cp_plugin.megatron",)}
    def within(mod, pkgs):
        return any(mod == p or mod.startswith(p + ".") for p in pkgs)

    for upper, lowers in below.items():
        for mod, deps in graph.items():
            if within(mod, lowers):
                assert not any(within(d, (upper,)) for d in deps), (mod, "imports", upper)
    tooling = {m: {d for d in deps if d in graph and d.startswith("megatron_cp_plugin.megatron_lm.")}
               for m, deps in graph.items() if m.startswith("megatron_cp_plugin.megatron_lm.")}
    for a, deps in tooling.items():
        for b in deps:
            assert a not in tooling.get(b, ()), ("import circle", a, b)


def test_overlap_grad_reduce_and_bucket_size_reach_megatron_lm_by_their_names():
    """--overlap-grad-reduce and --ddp-bucket-size are Megatron-LM's flags: megatron-cp-pretrain's translation
    passes them through as they were given (and not when they were not)."""
    from megatron_cp_plugin.megatron_lm.flags import megatron_lm_flags
    from megatron_cp_plugin.training.config import build_parser, parse_args

    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8", "--use-distributed-optimizer"]
    on = megatron_lm_flags(parse_args(base + ["--overlap-grad-reduce", "--ddp-bucket-size", "5000"]), build_parser(),
                           world_size=1, layout="zero1")
    off = megatron_lm_flags(parse_args(base), build_parser(), world_size=1, layout="zero1")
    assert on.count("--overlap-grad-reduce") == 1 and on[on.index("--ddp-bucket-size") + 1] == "5000"
    assert "--overlap-grad-reduce" not in off and "--ddp-bucket-size" not in off
