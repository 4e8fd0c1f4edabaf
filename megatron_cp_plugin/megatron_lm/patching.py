"""Megatron-LM checkouts: which of our patches fits, applying, checking and reverting it, and the flags a
machine without TransformerEngine / Apex needs. The command line is megatron_lm/cli.py.

The patches live in the repository's top-level patches/ (one per Megatron-LM release line: core_v0.16.1,
core_v0.17.1, core_v0.18.2, core_v0.19.0); the wheel ships a copy inside this package (setup.py's build step). A
release line is supported once its patch has passed the loss-parity harness on GPUs (`VERIFIED`). A checkout of any
other line is refused, naming the releases we have and saying whether a patch for its line ships unverified, unless
forced; forced, it gets the first patch that `git apply --check`s, nearest release first.
"""
from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

PATCH_RE = re.compile(r"megatron-lm-core_v(\d+)\.(\d+)\.(\d+)-context-parallel-algo\.patch")


def patch_dir() -> Path:
    """Where the patches are: the copy an installed wheel ships inside this package, else the top-level
    patches/ of the source checkout this package is imported from (an editable install or PYTHONPATH)."""
    shipped = Path(__file__).with_name("patches")
    return shipped if shipped.is_dir() else Path(__file__).resolve().parents[2] / "patches"


NO_TE_FLAGS = ("--transformer-impl", "local", "--no-rope-fusion", "--no-gradient-accumulation-fusion",
               "--no-masked-softmax-fusion", "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion",
               "--no-persist-layer-norm")
"""What Megatron-LM's pretrain_gpt.py needs where TransformerEngine and Apex are not installed: Megatron's local
layers, and no fused kernel that exists only in TE or Apex."""


def have_te() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def release_of(mlm_dir: str | Path) -> tuple[int, int, int]:
    """(major, minor, patch) of a Megatron-LM checkout, from megatron/core/package_info.py."""
    info = Path(mlm_dir) / "megatron" / "core" / "package_info.py"
    if not info.is_file():
        raise ValueError(f"MEGATRON_LM_DIR {mlm_dir}: no megatron/core/package_info.py, not a Megatron-LM checkout")
    text = info.read_text()
    try:
        return tuple(int(re.search(rf"^{k}\s*=\s*(\d+)", text, re.M).group(1))
                     for k in ("MAJOR", "MINOR", "PATCH"))
    except AttributeError:
        raise ValueError(f"{info}: MAJOR / MINOR / PATCH not found") from None


VERIFIED = ((0, 16, 1), (0, 19, 0))
"""Releases whose patch passed `megatron-cp-megatron-lm parity` on GPUs (loss against CP = 1 for every algorithm,
docs/megatron_lm.md): their release lines are supported. The core_v0.17.1 and core_v0.18.2 patches (2026-11-29)
apply to their releases and were checked on a CPU (`--help`, every config through Megatron-LM's own parser; the
plugin's megatron-core tests against megatron-core 0.17.1 and 0.18.2); their GPU parity has not run yet, so they
are used with --force only."""


def patches() -> dict[tuple[int, int, int], Path]:
    """Every shipped patch by the Megatron-LM release it was made on."""
    out = {}
    for p in patch_dir().glob("*.patch"):
        m = PATCH_RE.fullmatch(p.name)
        if m:
            out[tuple(int(x) for x in m.groups())] = p
    return dict(sorted(out.items()))


def _git_apply(mlm_dir: Path, patch: Path, *extra: str) -> bool:
    r = subprocess.run(["git", "apply", *extra, str(patch)], cwd=mlm_dir, capture_output=True, text=True)
    return r.returncode == 0


def release_name(v: tuple[int, int, int]) -> str:
    return "core_v" + ".".join(map(str, v))


def supported_lines() -> list[tuple[int, int]]:
    """The (major, minor) release lines of the shipped patches that passed the GPU parity harness (VERIFIED)."""
    return sorted({v[:2] for v in patches() if v in VERIFIED})


def _unsupported(mlm_dir: Path, rel: tuple[int, int, int]) -> str:
    lines = ", ".join(f"{a}.{b}.x" for a, b in supported_lines())
    names = ", ".join(release_name(v) for v in patches() if v in VERIFIED)
    mine = [release_name(v) for v in patches() if v[:2] == rel[:2]]
    if mine:
        return (f"MEGATRON_LM_DIR {mlm_dir} is Megatron-LM {'.'.join(map(str, rel))}; the patch made for "
                f"{mine[0]} ships, but its loss parity against CP = 1 has not been run on GPUs yet (verified: "
                f"{names}): pass --force to use it, or check out one of the verified releases")
    return (f"MEGATRON_LM_DIR {mlm_dir} is Megatron-LM {'.'.join(map(str, rel))}; our patches were verified on "
            f"{names} (release lines {lines}): check out one of those, or pass --force to try the nearest "
            f"patch that applies (untested on this release)")


def patch_for(mlm_dir: str | Path, force: bool = False) -> tuple[Path, bool]:
    """(patch, already_applied) for a checkout: the nearest release's patch that applies (or is applied).
    ValueError for a release line no patch was made for (unless `force`) and when none applies."""
    mlm_dir = Path(mlm_dir)
    rel = release_of(mlm_dir)
    have = patches()
    if not force and rel[:2] not in supported_lines():
        raise ValueError(_unsupported(mlm_dir, rel))
    order = sorted(have, key=lambda v: (abs((v[0] - rel[0]) * 100 + v[1] - rel[1]), v != rel, -v[2]))
    for v in order:
        if _git_apply(mlm_dir, have[v], "--reverse", "--check"):
            return have[v], True
        if _git_apply(mlm_dir, have[v], "--check"):
            return have[v], False
    names = ", ".join(release_name(v) for v in have)
    raise ValueError(f"MEGATRON_LM_DIR {mlm_dir} (megatron-core {'.'.join(map(str, rel))}): none of our patches "
                     f"({names}) applies{' (a modified checkout?)' if rel[:2] in supported_lines() else ''}; use a clean "
                     f"checkout of one of those releases")


def applied_patch(mlm_dir: str | Path) -> Path | None:
    """The shipped patch that is applied to a checkout (its reverse applies), or None."""
    for p in patches().values():
        if _git_apply(Path(mlm_dir), p, "--reverse", "--check"):
            return p
    return None


def apply_patch(mlm_dir: str | Path, force: bool = False) -> Path:
    """Apply the fitting patch to a checkout unless it is applied already; returns the patch used."""
    patch, applied = patch_for(mlm_dir, force)
    if not applied and not _git_apply(Path(mlm_dir), patch):
        raise RuntimeError(f"git apply {patch} failed in {mlm_dir} after its --check passed")
    return patch


def revert_patch(mlm_dir: str | Path) -> Path | None:
    """Take our applied patch out of a checkout; returns it, or None when none of ours was applied."""
    release_of(mlm_dir)                          # a one-line error for a directory that is no checkout
    patch = applied_patch(mlm_dir)
    if patch is not None and not _git_apply(Path(mlm_dir), patch, "--reverse"):
        raise RuntimeError(f"git apply --reverse {patch} failed in {mlm_dir} after its --check passed")
    return patch


def copy_checkout(src: str | Path, dst: str | Path) -> Path:
    """The parts of a checkout pretrain_gpt.py needs (no .git, docs, tests, examples), into dst."""
    src, dst = Path(src), Path(dst)
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", "docs", "tests", "examples", "images", "docker", "__pycache__", "*.pyc"))
    _provide_dataset_helpers(dst)
    return dst


def _provide_dataset_helpers(tree: Path) -> None:
    """Megatron-LM compiles megatron/core/datasets/helpers.cpp with `make` at start-up (pybind11 and a compiler
    needed); the megatron-core wheel ships it prebuilt for this interpreter, so copy that one when the checkout
    has none (the copy is newer than helpers.cpp, so `make` has nothing to do)."""
    dst = tree / "megatron" / "core" / "datasets"
    if list(dst.glob("helpers_cpp*.so")):
        return
    code = ("import importlib.util, pathlib; s = importlib.util.find_spec('megatron.core.datasets'); "
            "print(pathlib.Path(s.origin).parent if s else '')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    found = sorted(Path(r.stdout.strip()).glob("helpers_cpp*.so")) if r.stdout.strip() else []
    if found:
        shutil.copy2(found[0], dst / found[0].name)
