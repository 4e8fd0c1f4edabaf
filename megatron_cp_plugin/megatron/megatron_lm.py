"""Megatron-LM checkouts: which patch fits, applying it, and the flags a machine without TE / Apex needs.

    megatron-cp-megatron-lm patch DIR          # apply the patch that fits DIR's release (idempotent)
    megatron-cp-megatron-lm check DIR [...]    # the parity harness (megatron_cp_plugin.megatron.lm_check)

The patches ship with the package (megatron_cp_plugin/megatron/patches/), one per Megatron-LM release line we
have verified; a checkout of another release gets the first one that `git apply --check`s, nearest release
first, and a one-line error naming the releases we have when none does.
"""
from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

PATCH_DIR = Path(__file__).with_name("patches")
PATCH_RE = re.compile(r"megatron-lm-core_v(\d+)\.(\d+)\.(\d+)-context-parallel-algo\.patch")

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


def patches() -> dict[tuple[int, int, int], Path]:
    """Every shipped patch by the Megatron-LM release it was made on."""
    out = {}
    for p in PATCH_DIR.glob("*.patch"):
        m = PATCH_RE.fullmatch(p.name)
        if m:
            out[tuple(int(x) for x in m.groups())] = p
    return dict(sorted(out.items()))


def _git_apply(mlm_dir: Path, patch: Path, *extra: str) -> bool:
    r = subprocess.run(["git", "apply", *extra, str(patch)], cwd=mlm_dir, capture_output=True, text=True)
    return r.returncode == 0


def patch_for(mlm_dir: str | Path) -> tuple[Path, bool]:
    """(patch, already_applied) for a checkout: the nearest release's patch that applies (or is applied)."""
    mlm_dir = Path(mlm_dir)
    rel = release_of(mlm_dir)
    have = patches()
    order = sorted(have, key=lambda v: (abs((v[0] - rel[0]) * 100 + v[1] - rel[1]), v != rel, -v[2]))
    for v in order:
        if _git_apply(mlm_dir, have[v], "--reverse", "--check"):
            return have[v], True
        if _git_apply(mlm_dir, have[v], "--check"):
            return have[v], False
    names = ", ".join(f"core_v{a}.{b}.{c}" for a, b, c in have)
    raise ValueError(f"MEGATRON_LM_DIR {mlm_dir} (megatron-core {'.'.join(map(str, rel))}): none of our patches "
                     f"({names}) applies; use one of those Megatron-LM releases")


def apply_patch(mlm_dir: str | Path) -> Path:
    """Apply the fitting patch to a checkout unless it is applied already; returns the patch used."""
    patch, applied = patch_for(mlm_dir)
    if not applied and not _git_apply(Path(mlm_dir), patch):
        raise RuntimeError(f"git apply {patch} failed in {mlm_dir} after its --check passed")
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


def main(argv=None) -> int:
    import argparse  # noqa: PLC0415

    p = argparse.ArgumentParser(prog="megatron-cp-megatron-lm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--verbose", action="store_true", help="also show megatron-core's fallback warnings")
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("patch", help="apply the fitting patch to a Megatron-LM checkout (idempotent)")
    pp.add_argument("megatron_lm", metavar="MEGATRON_LM_DIR")
    sub.add_parser("check", help="the parity harness: see `megatron-cp-megatron-lm check --help`", add_help=False)
    args, rest = p.parse_known_args(argv)
    if args.cmd == "check":
        from .lm_check import main as check_main  # noqa: PLC0415

        return check_main(rest)
    try:
        patch, applied = patch_for(args.megatron_lm)
        if not applied:
            apply_patch(args.megatron_lm)
    except ValueError as e:
        print(f"megatron-cp-megatron-lm: error: {e}", file=sys.stderr)
        return 2
    print(f"megatron-cp-megatron-lm: {patch.name} {'was already' if applied else 'is now'} applied to "
          f"{args.megatron_lm}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
