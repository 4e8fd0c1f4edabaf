# burst's slowest ranks at 128k P = 64: the surrogate's shipped launch against the sweep's fastest (read from the
# bench JSON), alternating, median of 7 after 3; ring beside; then every rank of ring and burst, median of 3.
import json, sys, statistics, torch
from megatron_cp_plugin.bench.rank_replay import RankReplay, _shards
from megatron_cp_plugin.kernels import surrogate as sg
rows = json.load(open(sys.argv[1]))["rows"]
best = min((r for r in rows if r.get("rows") == 524288 and r["kernel"].startswith("kernel") and r.get("ms")),
           key=lambda r: r["ms"])
print("fastest at 524288 rows:", best["kernel"], best["ms"], flush=True)
parts = best["kernel"].split(", ")
sel, nw, rpp, pps = parts[1], sg.NUM_WARPS, sg.ELEMS_PER_PROGRAM // 128, sg.PROGRAMS_PER_SM
for p in parts[2:]:
    if p.endswith("warps"): nw = int(p.split()[0])
    if p.endswith("rows/program"): rpp = int(p.split()[0])
    if p.endswith("programs/SM"): pps = int(p.split()[0])
ship = (sg.SELECT, sg.NUM_WARPS, sg.ELEMS_PER_PROGRAM, sg.PROGRAMS_PER_SM)
cand = (sel, nw, rpp * 128, pps)
print("candidate", cand, "shipped", ship, flush=True)
dev = torch.device("cuda")
shards = _shards(131072, 64, 32, 32, 128, dev, torch.bfloat16)
def t(algo, cfg, rank, warm=3, n=7):
    sg.SELECT, sg.NUM_WARPS, sg.ELEMS_PER_PROGRAM, sg.PROGRAMS_PER_SM = cfg
    rep = RankReplay(algo, 64, rank, *shards)
    for _ in range(warm): rep()
    ts = []
    for _ in range(n):
        e = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        e[0].record(); rep(); e[1].record(); e[1].synchronize(); ts.append(e[0].elapsed_time(e[1]))
    del rep; torch.cuda.empty_cache()
    return statistics.median(ts)
for rank in (5, 0):
    for rnd in range(2):
        a, b = t("burst", ship, rank), t("burst", cand, rank)
        print(f"rank {rank} round {rnd}: burst shipped {a:.2f} ms, candidate {b:.2f} ms, "
              f"ring {t('ring', ship, rank):.2f} ms", flush=True)
for algo, cfg in (("ring", ship), ("burst", cand)):
    ts = [t(algo, cfg, r, warm=1, n=3) for r in range(64)]
    print(algo, "every rank (median of 3):", " ".join(f"{x:.2f}" for x in ts), flush=True)
    print(algo, "slowest", max(range(64), key=ts.__getitem__), f"{max(ts):.2f}", "fastest", f"{min(ts):.2f}", flush=True)
