# fwd+bwd ms of chosen ranks of a replayed P (ring, burst), median of N after warm-ups
import sys, torch, statistics
from megatron_cp_plugin.bench.rank_replay import RankReplay, _shards
S, P = int(sys.argv[1]), int(sys.argv[2]); ranks = [int(x) for x in sys.argv[3].split(",")]
algos = sys.argv[4].split(",") if len(sys.argv) > 4 else ["ring", "burst"]
dev = torch.device("cuda")
shards = _shards(S, P, 32, 32, 128, dev, torch.bfloat16)
for r in ranks:
    row = []
    for algo in algos:
        rep = RankReplay(algo, P, r, *shards)
        for _ in range(3): rep()
        ts = []
        for _ in range(7):
            e = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            e[0].record(); rep(mark=e[1].record); e[2].record(); e[2].synchronize()
            ts.append((e[0].elapsed_time(e[1]), e[1].elapsed_time(e[2])))
        f = statistics.median(t[0] for t in ts); b = statistics.median(t[1] for t in ts)
        row.append(f"{algo} fwd {f:.2f} bwd {b:.2f} tot {f+b:.2f}")
        del rep; torch.cuda.empty_cache()
    print(f"S={S} P={P} rank {r}: " + " | ".join(row), flush=True)
