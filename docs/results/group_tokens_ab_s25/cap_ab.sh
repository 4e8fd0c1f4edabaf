# dbg: Attention2D's group cap A/B on one GPU (rank replay), 16384 against 32768, same rank, passes alternating.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0
nvidia-smi -L > $OUT/dev.txt
B="python3 -m megatron_cp_plugin.bench rank --cp 16 64 --seq-len 131072 1048576 --max-local 16384 --heads 32 --kv-heads 32 8 --algos ring attention2d-no attention2d-o --grids square --rank 1 --iters 6 --passes 2 --budget-s 2 --ideal-max-seq 262144"
for round in 1 2; do
  for cap in 16384 32768; do
    [ $round = 2 ] && [ $cap = 16384 ] && continue
    echo "== cap $cap round $round"; timeout 150 $B --group-tokens $cap --out $OUT/g${cap}_r$round 2>&1 | tail -40
  done
done > $OUT/ab.txt 2>&1
timeout 150 $B --group-tokens 16384 --out $OUT/g16384_r2 >> $OUT/ab.txt 2>&1
cd $OUT && tar czf ab.tgz ab.txt dev.txt g* && ls
