"""The memory plan of a run the launch scripts are about to start (launch/prepare.sh calls this):

    python -m megatron_cp_plugin.bench.launch_plan --trainer plugin --layout auto --gpus 16 --gpu-mem 80 \\
        -- --config configs/gpt3-13b.toml --seq-length 65536 ...

prints `plan: <X> GiB per GPU of <Y> GiB (<layout>)`, then the training command's arguments, one per line:
megatron-cp-pretrain's (the given ones plus the layout's flags) or, with --trainer megatron-lm, pretrain_gpt.py's
(megatron_lm/flags.py with the layout). --layout:
  auto     what the configs and flags say while it fits; else the planner's first layout that fits
           (plan.recommend's order: less sharding first, then recompute, then pipeline stages, which only
           Megatron-LM has), among those the configs and flags force: full recompute if they ask for it,
           Megatron-FSDP (and its strategy) if they ask for it
  config   what the configs and flags say (Megatron's distributed optimizer in every GPT-3 config)
  NAME     one of the planner's layouts: zero1, fsdp-optim, fsdp-optim_grads, fsdp-optim_grads_params, ppN-zero1
           (megatron-lm), each optionally +recompute, or (plugin) +recompute+offload (--offload-layer-inputs);
           fsdp = fsdp-optim_grads_params
Nothing fits (or the named layout does not): one line on stderr and exit 3, unless --force (the planner is an
estimate). The planner models TP = 1 and every GPU of a stage in CP; with --tensor-model-parallel-size > 1 the
line says it did not check.
"""
from __future__ import annotations

import argparse
import os
import re
import sys

from . import plan
from ..training.memory_check import RECOMPUTE, candidates, config_layout, layout_args  # noqa: F401

def parse_layout(name: str, trainer: str) -> plan.Layout:
    """A planner layout from its name ("fsdp-optim_grads_params+recompute", "pp8-zero1 +recompute", "fsdp")."""
    base = name.replace(" ", "")
    offload = trainer == "plugin" and base.endswith("+recompute+offload")
    base = base.removesuffix("+offload") if offload else base
    recompute = base.endswith("+recompute")
    base = base.removesuffix("+recompute")
    base = {"fsdp": "fsdp-optim_grads_params"}.get(base, base)
    pp = re.fullmatch(r"pp(\d+)-zero1", base)
    if pp and trainer == "megatron-lm" and int(pp.group(1)) >= 1:
        return plan.Layout("zero1", int(pp.group(1)), recompute)
    if base in plan.ZERO_LAYOUTS and base != "ddp":
        return plan.Layout(base, 1, recompute, offload)
    names = "zero1, fsdp-optim, fsdp-optim_grads, fsdp-optim_grads_params" + (", ppN-zero1" if trainer ==
                                                                              "megatron-lm" else "")
    extra = " or +recompute+offload (the layer inputs on the host)" if trainer == "plugin" else ""
    raise ValueError(f"LAYOUT {name!r}: expected auto, config or one of {names}, each optionally +recompute{extra}")


def choose(a, trainer: str, layout: str, gpus: int, gpu_mem: float, headroom: float, force: bool):
    """(layout or None when unchecked, the plan line, an error line or None). Each layout is sized at the group
    cap it gets (plan.fit); where the flags leave the cap open and the chosen layout's algorithm makes grouped
    calls (Attention2D) at a cap other than the default rule, a.cp_group_tokens is set to it, and the training
    command passes it."""
    try:
        m = plan.model_from_args(a)
    except ValueError as e:                       # TP > 1: the planner cannot say
        lay = None if layout in ("auto", "config") else parse_layout(layout, trainer)
        return lay, f"plan: not checked ({e})", None
    cp_gpus = a.context_parallel_size or gpus     # a smaller CP leaves DP > 1: sharded over CP only (more bytes)
    fused = False if trainer == "megatron-lm" else None   # Megatron-LM without TE / Apex: torch's foreach Adam
    if layout == "auto":                          # the configs' own layout while it fits: change only what must
        options = [config_layout(a)] + [lay for lay in candidates(a, m, cp_gpus, trainer) if lay != config_layout(a)]
    else:
        options = [config_layout(a) if layout == "config" else parse_layout(layout, trainer)]
    fitted = {lay: plan.fit(m, lay, cp_gpus, gpu_mem, headroom, fused) for lay in options
              if cp_gpus % lay.pp == 0 and m.layers % lay.pp == 0}
    sized = [(lay, est.total / plan.GiB) for lay, est in fitted.items()]
    if not sized:
        return None, "plan: -", f"launch: LAYOUT={layout}: no layout applies to {cp_gpus} GPUs and {m.layers} layers"
    fits = [(lay, gib) for lay, gib in sized if gib + headroom <= gpu_mem]
    lay, gib = fits[0] if fits else min(sized, key=lambda x: x[1])
    cap = fitted[lay].group_tokens
    line = f"plan: {gib:.1f} GiB per GPU of {gpu_mem:g} GiB ({lay.name})"      # launch/prepare.sh's format
    if fits or force:
        if cap is not None and m.group_tokens is None:              # the default rule needs no flag
            a.cp_group_tokens = cap
        return lay, line, None
    what = f"{m.params / 1e9:.1f}B parameters, sequence {m.seq}, {cp_gpus} GPUs"
    if layout == "auto":
        err = (f"launch: no layout fits {gpu_mem:g} GiB GPUs ({what}): the smallest, {lay.name}, needs {gib:.1f} "
               f"GiB + {headroom:g} GiB headroom; use more GPUs or a shorter SEQ (PLAN_FORCE=1 starts it anyway)")
    else:
        others = candidates(a, m, cp_gpus, trainer)
        alt = next((o.name for o in others
                    if plan.fit(m, o, cp_gpus, gpu_mem, headroom, fused).total / plan.GiB + headroom <= gpu_mem), None)
        err = (f"launch: LAYOUT={layout} ({lay.name}) needs {gib:.1f} GiB + {headroom:g} GiB headroom per GPU of "
               f"{gpu_mem:g} GiB ({what}); " + (f"{alt} fits (LAYOUT=auto picks it)" if alt else "nothing fits")
               + "; PLAN_FORCE=1 starts it anyway")
    return lay, line, err


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="python -m megatron_cp_plugin.bench.launch_plan")
    p.add_argument("--trainer", choices=("plugin", "megatron-lm"), required=True)
    p.add_argument("--layout", default="auto")
    p.add_argument("--gpus", type=int, required=True, help="GPUs of the run")
    p.add_argument("--gpu-mem", type=float, required=True, help="GiB per GPU")
    p.add_argument("--headroom", type=float, default=4.0)
    p.add_argument("--force", action="store_true")
    ns = p.parse_args(own)
    if ns.gpus < 1:
        print(f"launch: --gpus {ns.gpus}: must be at least 1", file=sys.stderr)
        return 2
    if ns.gpu_mem <= 0:
        print(f"launch: GPU_MEM {ns.gpu_mem:g}: must be a positive number of GiB", file=sys.stderr)
        return 2
    from ..training.config import build_parser, parse_args
    try:
        a = parse_args(rest)
        given = a.cp_group_tokens
        lay, line, err = choose(a, ns.trainer, ns.layout, ns.gpus, ns.gpu_mem, ns.headroom, ns.force)
        if err:
            print(err, file=sys.stderr)
            return 3
        if ns.trainer == "plugin":
            out = rest + (layout_args(lay) if lay is not None and ns.layout != "config" else [])
            out += ["--cp-group-tokens", str(a.cp_group_tokens)] if a.cp_group_tokens != given else []
        else:
            from ..megatron_lm.flags import megatron_lm_flags
            from ..megatron_lm.patching import release_of
            release = None                                  # launch/prepare.sh's checkout: its release picks flags
            try:
                release = release_of(os.environ["MEGATRON_LM"]) if os.environ.get("MEGATRON_LM") else None
            except ValueError:                              # not a checkout: the patch step says so (dry run: none)
                pass
            out = megatron_lm_flags(a, build_parser(), world_size=ns.gpus, layout=lay.name if lay else "auto",
                                    release=release)
    except ValueError as e:
        print(f"launch: {e}", file=sys.stderr)
        return 2
    print(line)
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
