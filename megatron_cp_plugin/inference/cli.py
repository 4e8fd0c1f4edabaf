"""`megatron-cp-generate`: generate from a GPT with the KV cache sharded over the context-parallel group.

    megatron-cp-generate --nproc 4 --prompt "Once upon a time" --max-new-tokens 32
    torchrun --nproc-per-node 2 -m megatron_cp_plugin.inference.cli --load ckpt/ --prompt-file p.txt --bf16

The model flags are megatron-cp-pretrain's (a checkpoint from it loads with --load; without --load the
weights are random, seeded by --seed). The prompt is byte-level text (--prompt, --prompt-file) or token ids
(--prompt-ids). Prefill uses --context-parallel-algo, decoding `tree_decode`. Prints the tokens, the text and
the latency of every new token.
"""
from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from ..pretrain import _validate, build_parser, launch, transformer_config


def _args(argv=None):
    p = build_parser(__doc__)
    g = p.add_argument_group("generation")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (byte-level tokens)")
    src.add_argument("--prompt-file", help="file holding the prompt text")
    src.add_argument("--prompt-ids", help="comma-separated token ids")
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--decode-variant", choices=("allreduce3", "allreduce2", "allgather"), default=None)
    g.add_argument("--decoder", choices=("tree", "ring"), default="tree",
                   help="tree decoding, or the ring-decode baseline (K, V shards passed round every step)")
    return p.parse_args(argv)


def _generate(args) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from ..megatron.model import build_gpt
    from ..megatron.tokenizer import ByteTokenizer
    from .generate import DecodeState, generate, install_decode_state

    gpu = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    world, rank = dist.get_world_size(), dist.get_rank()
    tok = ByteTokenizer(args.vocab_size)
    if args.prompt_ids:
        ids = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
    else:
        text = args.prompt if args.prompt is not None else open(args.prompt_file, encoding="utf-8").read()
        ids = tok.tokenize(text)
    if not ids or max(ids) >= tok.vocab_size or min(ids) < 0:
        raise ValueError(f"--prompt: need at least one token id in [0, {tok.vocab_size}), got {len(ids)} tokens")
    args.seq_length = len(ids) + args.max_new_tokens
    args.seq_length += -args.seq_length % (2 * world)       # only sizes the RoPE table; prompts of any length
    cp_cfg = _validate(args, world)
    ps.initialize_model_parallel(tensor_model_parallel_size=args.tensor_model_parallel_size,
                                 context_parallel_size=args.context_parallel_size)
    cp_group = ps.get_context_parallel_group()
    torch.manual_seed(args.seed)
    if gpu:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
        model_parallel_cuda_manual_seed(args.seed)
    model = build_gpt(transformer_config(args, gpu), cp_cfg, vocab_size=tok.vocab_size,
                      seq_length=args.max_position_embeddings or args.seq_length, cp_group=cp_group).to(device)
    if args.load:
        with open(os.path.join(args.load, "latest_checkpointed_iteration.txt")) as f:
            it = int(f.read())
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict(prefix="model.")},
                                         os.path.join(args.load, f"iter_{it:07d}"))
        model.load_state_dict(loaded["model"], strict=False)
    state = DecodeState(cp_group, variant=args.decode_variant, decoder=args.decoder)
    install_decode_state(model, state)
    prompt = torch.tensor([ids], device=device)
    stamps = [time.perf_counter()]

    def on_token(step, t):
        if gpu:
            torch.cuda.synchronize()
        stamps.append(time.perf_counter())

    out = generate(model, prompt, max_new_tokens=args.max_new_tokens, state=state, algo=cp_cfg.algo,
                   temperature=args.temperature, top_p=args.top_p, seed=args.seed, on_token=on_token)
    lat = [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:])]
    if rank == 0:
        new = out[0].tolist()
        how = "ring-decode" if args.decoder == "ring" else f"tree_decode({args.decode_variant or 'default'})"
        print(f"megatron-cp-generate: {world} ranks, prefill {cp_cfg.algo}, decode {how}, prompt {len(ids)} tokens")
        print("tokens:", new)
        print("text:", repr(tok.detokenize(new)))
        print(f"latency: first token (prefill) {lat[0]:.1f} ms; then per token " +
              " ".join(f"{x:.1f}" for x in lat[1:]) + " ms")
    ps.destroy_model_parallel()


def main(argv=None) -> None:
    launch(_args(argv), _generate)


if __name__ == "__main__":
    main()
