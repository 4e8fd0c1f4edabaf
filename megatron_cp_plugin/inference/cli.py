"""`megatron-cp-generate`: generate from a GPT with the KV cache sharded over the context-parallel group.

    megatron-cp-generate --nproc 4 --prompt "Once upon a time" --max-new-tokens 32
    torchrun --nproc-per-node 2 -m megatron_cp_plugin.inference.cli --load ckpt/ --prompt-file p.txt --bf16
    megatron-cp-generate --config configs/gpt3-760m.toml --prompt-ids 1,2,3 --decode-mode eager

The model and context-parallel flags are megatron-cp-pretrain's (its training flags are accepted, so that
--config reads the same TOML files, but not listed; keys = flag names; the command line overrides them). With --load the model arguments come from the checkpoint (a model flag that disagrees
with it is an error naming the flag); without, the weights are random (seeded by --seed; Q, K scaled and fc2
centred so that greedy tokens depend on the context and vary: inference/token_check.py). The prompt is
byte-level text (--prompt, --prompt-file) or token ids (--prompt-ids), repeated --batch-size times. Prefill
uses --context-parallel-algo; decoding is a static step (inference/static.py), replayed as one CUDA graph per
token (--decode-mode graph, the default on GPUs) or run eagerly (the same tokens). Reports the tokens, the
prefill time, the per-token latency, tokens/s and the bandwidth floor of the run: (weight bytes + this rank's
KV shard bytes) / the GPU's memory bandwidth.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
import torch.distributed as dist

from ..algos.registry import any_divisor
from ..algos.tree_decode import VARIANTS
from ..training.config import build_parser, parse_with_configs, transformer_config, validate_args
from .. import devices
from ..training.launch import launch
from .checkpoint import (MODEL_ARGS, apply_model_args, check_loadable, checkpoint_path, load_weights, model_args_of,
                         set_unless_given)


GENERATION_USES = MODEL_ARGS + (
    "help", "verbose", "max_position_embeddings", "context_parallel_size", "tensor_model_parallel_size", "bf16",
    "load", "seed", "tokenizer_type", "make_vocab_size_divisible_by", "dist_timeout", "nproc", "share_gpu",
    "deterministic_mode", "context_parallel_algo", "cp_grid", "cp_gpus_per_node", "cp_hardware")
"""megatron-cp-pretrain's flags that generation reads; --help lists these, the generation flags and --config. The
others still parse (a training --config file sets them) and do nothing here."""


def _args(argv=None):
    p = build_parser(__doc__)
    for action in p._actions:                      # argparse keeps no public list of a parser's flags
        if action.dest not in GENERATION_USES:
            action.help = argparse.SUPPRESS
    p.add_argument("--config", nargs="+", default=None, metavar="FILE",
                   help="TOML files of flag defaults (keys = flag names without --), as megatron-cp-pretrain's")
    g = p.add_argument_group("generation")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text (byte-level tokens)")
    src.add_argument("--prompt-file", help="file holding the prompt text")
    src.add_argument("--prompt-ids", help="comma-separated token ids")
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--batch-size", type=int, default=1, help="sequences decoded together (the prompt repeated)")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--decode-variant", choices=VARIANTS, default=None,
                   help="tree decoding's merge (default: the decode cost model's choice)")
    g.add_argument("--decoder", choices=("tree", "ring"), default="tree",
                   help="tree decoding, or the ring-decode baseline (K, V shards passed round every step)")
    g.add_argument("--decode-mlp", choices=("split", "whole"), default=None,
                   help="split each MLP's weights over the CP ranks for the decode step (default where CP > 1: each "
                        "rank reads 1/P of them, one reduce a layer) or run it whole on every rank")
    g.add_argument("--decode-mode", choices=("graph", "eager"), default=None,
                   help="replay the decode step as a CUDA graph (default on GPUs) or run it eagerly")
    g.add_argument("--mem-bw", type=float, default=None, metavar="TB/s",
                   help="memory bandwidth for the floor (default: measured in the run, the higher of a copy and a read)")
    g.add_argument("--result-json", default=None, metavar="PATH", help="rank 0 writes tokens and timings here")
    defaults = {name: p.get_default(name) for name in MODEL_ARGS}
    p.set_defaults(**{name: None for name in MODEL_ARGS})      # None = not given, so a checkpoint can fill it
    args = parse_with_configs(p, argv)
    if not (args.prompt is not None or args.prompt_file or args.prompt_ids):
        p.error("one of --prompt, --prompt-file, --prompt-ids is required")
    given = {name for name in MODEL_ARGS if getattr(args, name) is not None}
    try:
        if args.load:
            path = checkpoint_path(args.load)
            apply_model_args(args, model_args_of(path), given, defaults)
            check_loadable(path, args.tensor_model_parallel_size)
        else:
            set_unless_given(args, given, defaults)
    except ValueError as e:                        # one line naming the flag, before any process starts
        p.error(str(e))
    if args.decode_mode == "graph" and devices.shares_gpu(devices.sharing(args.share_gpu), args.nproc or 1):
        p.error("--decode-mode graph: ranks sharing a GPU (--share-gpu) talk gloo, which a CUDA graph cannot "
                "capture; use --decode-mode eager (the default there)")
    for name, lo in (("max_new_tokens", 1), ("batch_size", 1)):
        if getattr(args, name) < lo:
            p.error(f"--{name.replace('_', '-')} must be >= {lo}")
    return args


def _prompt_ids(args, tok) -> list[int]:
    if args.prompt_ids:
        ids = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
    else:
        text = args.prompt if args.prompt is not None else open(args.prompt_file, encoding="utf-8").read()
        ids = tok.tokenize(text)
    if not ids or max(ids) >= tok.vocab_size or min(ids) < 0:
        raise ValueError(f"--prompt: need at least one token id in [0, {tok.vocab_size}), got {len(ids)} tokens")
    return ids


def _generate(args) -> None:
    from megatron.core import parallel_state as ps

    from ..megatron.model import build_gpt
    from ..megatron.tokenizer import ByteTokenizer, padded_vocab_size
    from .floor import floor_line, memory_bandwidth
    from .static import StaticDecoder
    from .token_check import distinct, vary_greedy_tokens_

    gpu = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    world, rank = dist.get_world_size(), dist.get_rank()
    tok = ByteTokenizer(args.vocab_size)
    ids = _prompt_ids(args, tok)
    graphs = gpu and devices.graphs_capture_collectives()       # not with ranks sharing a GPU (gloo)
    graphed = (args.decode_mode or ("graph" if graphs else "eager")) == "graph"
    if graphed and not graphs:
        raise ValueError("--decode-mode graph needs a GPU per rank (CUDA graphs of NCCL collectives); use "
                         "--decode-mode eager")
    args.seq_length = len(ids) + args.max_new_tokens
    args.seq_length += -args.seq_length % any_divisor(world)   # only sizes the RoPE table; prompts of any length
    cp_cfg = validate_args(args, world)
    ps.initialize_model_parallel(tensor_model_parallel_size=args.tensor_model_parallel_size,
                                 context_parallel_size=args.context_parallel_size)
    cp_group = ps.get_context_parallel_group()
    torch.manual_seed(args.seed)
    if gpu:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
        model_parallel_cuda_manual_seed(args.seed)
    # the trainer's padded rows (a checkpoint records them as its vocab_size, which padding leaves as it is)
    rows = padded_vocab_size(tok.vocab_size, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size)
    model = build_gpt(transformer_config(args, gpu), cp_cfg, vocab_size=rows,
                      seq_length=args.max_position_embeddings or args.seq_length, cp_group=cp_group).to(device)
    if args.load:
        load_weights(model, checkpoint_path(args.load), args.tensor_model_parallel_size)
    else:                   # random weights whose greedy tokens vary, so that comparing runs' tokens means something
        vary_greedy_tokens_(model)
    P = cp_group.size()
    dec = StaticDecoder(model, cp_group, batch=args.batch_size, capacity=-(-(len(ids) + args.max_new_tokens) // P),
                        decoder=args.decoder, variant=args.decode_variant, graphed=graphed,
                        temperature=args.temperature, top_p=args.top_p, seed=args.seed, mlp=args.decode_mlp)
    prompt = torch.tensor([ids] * args.batch_size, device=device)
    try:
        out = dec.generate(prompt, max_new_tokens=args.max_new_tokens, algo=cp_cfg.algo)
        t = dec.timings
        lat = t["token_ms"]
        med = statistics.median(lat) if lat else None
        # The floor at the generation's mean context; the fullest rank holds ceil(context / P) tokens.
        mean_ctx = len(ids) + (args.max_new_tokens - 1) / 2
        kv = int(-(-mean_ctx // P)) * dec.cache.bytes_per_token()
        bw = memory_bandwidth(device, None if args.mem_bw is None else args.mem_bw * 1e12)
        weights = dec.weight_bytes_read()
        if rank == 0:
            how = f"tree, merge {dec.variant_note}" if args.decoder == "tree" and P > 1 else args.decoder
            how += f", MLPs {dec.mlp}" + (", peer kernels in one flag round" if dec.peer_rounds == 1 else "")
            print(f"megatron-cp-generate: {world} ranks (CP {P}), prefill {cp_cfg.algo}, decode {how}, "
                  f"{'CUDA graph' if graphed else 'eager'}, batch {args.batch_size}, prompt {len(ids)} tokens, "
                  f"{args.max_new_tokens} new")
            for row in out.tolist():
                print("tokens:", row)
                print("text:", repr(tok.detokenize(row)))
            print(f"prefill {t['prefill_s']:.3f} s ({len(ids)} tokens); graph capture {t['capture_s']:.3f} s")
            if med is not None:
                print(f"per-token latency: median {med:.2f} ms (min {min(lat):.2f}, max {max(lat):.2f}) over "
                      f"{len(lat)} steps; {args.batch_size * 1e3 / med:.1f} tokens/s (batch {args.batch_size})")
            print(floor_line(weights, kv, bw, med * 1e-3 if med else None))
            if args.result_json:
                with open(args.result_json, "w") as f:
                    json.dump({"tokens": out.tolist(), "world": world, "decoder": args.decoder,
                               "variant": dec.variant, "mlp": dec.mlp, "peer_rounds": dec.peer_rounds,
                               "graphed": graphed, "prompt_tokens": len(ids),
                               "batch": args.batch_size, "distinct_tokens": distinct(out),
                               "random_weights": not args.load, "prefill_s": t["prefill_s"], "token_ms": lat,
                               "median_token_ms": med, "weight_bytes": weights, "kv_shard_bytes": kv,
                               "bandwidth": bw, "device": torch.cuda.get_device_name(device) if gpu else "cpu",
                               "argv": sys.argv[1:]}, f, indent=1)
    finally:
        dec.close()                 # before the process group goes: NCCL waits for graphs holding its collectives
        ps.destroy_model_parallel()


def main(argv=None) -> None:
    launch(_args(argv), _generate, prog="megatron-cp-generate")


if __name__ == "__main__":
    main()
