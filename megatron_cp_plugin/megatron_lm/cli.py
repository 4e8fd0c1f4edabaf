"""megatron-cp-megatron-lm: our patch on a Megatron-LM checkout, and the parity harness.

    megatron-cp-megatron-lm patch DIR [--force]   # apply the patch made for DIR's release (idempotent)
    megatron-cp-megatron-lm check DIR [--force]   # only say whether it is applied / would apply; changes nothing
    megatron-cp-megatron-lm revert DIR            # take our patch out again
    megatron-cp-megatron-lm parity DIR [...]      # the parity harness (megatron_lm/parity.py; needs GPUs)

A release line whose patch has not passed the parity harness on GPUs (core_v0.17, 0.18: patching.VERIFIED) is
refused with a line saying so, and --force applies its own patch; a line no patch was made for (the patches:
top-level patches/) is refused with the releases we have, and --force tries the nearest patch that applies.
`check` exits 0 when the patch is applied, 1 when it is not but would apply, 2 on a refusal or error.
"""
from __future__ import annotations

import argparse
import sys

from .patching import apply_patch, patch_for, revert_patch

PROG = "megatron-cp-megatron-lm"
# `check` ran the parity harness before it became `parity`: its flags name the old use in the error
_PARITY_FLAGS = ("--cp", "--algos", "--pp-run", "--fsdp-run", "--dtype", "--tol", "--iters", "--workdir", "--out",
                 "--runs-per-gpu", "--num-layers", "--hidden-size", "--seq-length", "--global-batch-size",
                 "--timeout")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--verbose", action="store_true", help="also show megatron-core's fallback warnings")
    sub = p.add_subparsers(dest="cmd", required=True)
    for verb, text in (("patch", "apply the patch made for a Megatron-LM checkout's release (idempotent)"),
                       ("check", "say whether the patch is applied or would apply; changes nothing"),
                       ("revert", "take our patch out of a checkout (nothing to do when it is not applied)")):
        sp = sub.add_parser(verb, help=text, description=text)
        sp.add_argument("megatron_lm", metavar="MEGATRON_LM_DIR")
        if verb != "revert":
            sp.add_argument("--force", action="store_true",
                            help="a release line whose patch is not yet verified on GPUs: its own patch; one no "
                                 "patch was made for: the nearest patch that applies")
    sub.add_parser("parity", help=f"the parity harness: see `{PROG} parity --help`", add_help=False)
    return p


def _check(mlm: str, force: bool) -> int:
    patch, applied = patch_for(mlm, force)
    if applied:
        print(f"{PROG}: {patch.name} is applied to {mlm}")
        return 0
    print(f"{PROG}: {patch.name} is not applied to {mlm}; `{PROG} patch {mlm}{' --force' if force else ''}` would "
          "apply it cleanly")
    return 1


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args, rest = build_parser().parse_known_args(argv)
    if args.cmd == "parity":
        from .parity import main as parity_main  # noqa: PLC0415 (imports torch; the other verbs do not)

        return parity_main(rest)
    if rest:
        old = [a for a in rest if a.split("=")[0] in _PARITY_FLAGS]
        hint = f" (the parity harness is `{PROG} parity` now)" if args.cmd == "check" and old else ""
        print(f"{PROG} {args.cmd}: error: unrecognized arguments: {' '.join(rest)}{hint}", file=sys.stderr)
        return 2
    try:
        if args.cmd == "check":
            return _check(args.megatron_lm, args.force)
        if args.cmd == "revert":
            patch = revert_patch(args.megatron_lm)
            print(f"{PROG}: " + (f"{patch.name} is reverted in {args.megatron_lm}" if patch else
                                 f"none of our patches is applied to {args.megatron_lm}: nothing to revert"))
            return 0
        patch, applied = patch_for(args.megatron_lm, args.force)
        if not applied:
            apply_patch(args.megatron_lm, args.force)
    except (ValueError, RuntimeError) as e:
        print(f"{PROG} {args.cmd}: error: {e}", file=sys.stderr)
        return 2
    print(f"{PROG}: {patch.name} {'was already' if applied else 'is now'} applied to {args.megatron_lm}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
