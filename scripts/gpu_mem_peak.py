"""The peak of scripts/gpu_tests.sh's GPU memory log: for each GPU, the sample with the most memory in use and the
processes that held the most of it then (one line each). Usage: python3 scripts/gpu_mem_peak.py OUT/gpu_mem.tsv"""
import collections
import sys


def peaks(lines, top=5):
    by = collections.defaultdict(list)                   # (gpu, time) -> [(MiB, pid, command)]
    for ln in lines:
        parts = ln.rstrip("\n").split("\t")
        if len(parts) == 5 and parts[3].isdigit():
            t, gpu, pid, mib, cmd = parts
            by[(gpu, int(t))].append((int(mib), pid, cmd))
    out = []
    for gpu in sorted({g for g, _ in by}):
        t, procs = max(((t, p) for (g, t), p in by.items() if g == gpu), key=lambda tp: sum(m for m, *_ in tp[1]))
        procs.sort(reverse=True)
        out.append(f"GPU ...{gpu} peak {sum(m for m, *_ in procs)} MiB in {len(procs)} processes at {t}; largest: "
                   + "; ".join(f"{m} MiB pid {pid} {cmd[:120]}" for m, pid, cmd in procs[:top]))
    return out


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print("\n".join(peaks(f)))
