"""Verdicts of the resume runs of scripts/gpu_trainer_check.sh and scripts/gpu_one_gpu_check.sh, as a table.

    python3 -m tests.resume_compare WORK OUT.md NAME [NAME ...]

For each NAME the work directory holds NAME_ref (saved at 3, went on to 6), NAME_ref2 (the same run again)
and NAME_res (resumed from NAME_ref's iteration 3): their --log-json files and checkpoints. A run is
deterministic when ref and ref2 log the same losses bit for bit; resume is exact when res's losses equal
ref's 4-6 and every tensor of the two iteration-6 checkpoints (model, fp32 main weights, Adam moments and
steps, generators) is equal. Exits non-zero unless every NAME is both.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from tests.ckpt_compare import read_checkpoint, same


def verdict(w: Path, name: str) -> tuple[bool, list[str]]:
    losses = {r: [json.loads(x)["loss"] for x in open(w / f"{name}_{r}.jsonl")] if (w / f"{name}_{r}.jsonl").exists()
              else [] for r in ("ref", "ref2", "res")}
    ref, ref2, res = losses["ref"], losses["ref2"], losses["res"]
    det, equal = len(ref) == 6 and ref == ref2, len(res) == 3 and res == ref[3:]
    try:
        a = read_checkpoint(w / f"{name}_ref/iter_0000006", w)
        b = read_checkpoint(w / f"{name}_res/iter_0000006", w)
        bad = [k for k in a if k not in b or not same(a[k], b[k])]
        worst = max((float((a[k].float() - b[k].float()).abs().max()) for k in bad
                     if isinstance(a[k], torch.Tensor) and k in b and a[k].shape == b[k].shape), default=0.0)
        ck = f"{len(a) - len(bad)} / {len(bad)} ({worst:.3g}); {sum('exp_avg' in k for k in a)} Adam tensors"
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        bad, ck = ["?"], f"not compared: {type(e).__name__}"
    ok = det and equal and not bad
    text = ("FAIL: a run failed (see its log)" if len(ref) < 6 or len(res) < 3 else
            "PASS (bit-exact)" if ok else "FAIL: reruns differ (not deterministic)" if not det else "FAIL")
    lines = [f"| {name} | {det} | {equal} {ref[3:]} vs {res} | {ck} | {text} |"]
    if not det:
        lines.append(f"| {name} | uninterrupted {ref} vs 2nd {ref2} | | | |")
    return ok, lines


def main(argv) -> int:
    w, out, names = Path(argv[0]), argv[1], argv[2:]
    lines = ["| run | uninterrupted = 2nd uninterrupted | resumed = uninterrupted (losses 4-6) | checkpoint "
             "tensors equal / differing (max abs diff) | verdict |", "|---|---|---|---|---|"]
    oks = []
    for name in names:
        ok, rows = verdict(w, name)
        oks.append(ok)
        lines += rows
    Path(out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(oks) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
