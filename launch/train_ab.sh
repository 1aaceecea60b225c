#!/usr/bin/env bash
# train_ab.sh: A/B of two epmoe_bench_train variants (its flags: --wgrad, --dgrad, --path) on one H200,
# in alternating rounds (A B B A ...), beside torch autograd (launch/train_baseline.py) in the same
# run, and optionally the backward's kernels under Nsight Compute.
#
#   bash launch/train_ab.sh [-b BUILD] [-r ROUNDS] [-s SHAPES] [-a A] [-B B] [-n NCU_SHAPE]
#     -b BUILD   build folder with src/programs/epmoe_bench_train (default build-gpu, gpu_check's)
#     -r ROUNDS  rounds of (A, B) in alternating order (default 2)
#     -s SHAPES  epmoe_bench_train --shapes (default: the issue's 16k and 7168/2048 shapes)
#     -a / -B    the two variants' flags (default '--wgrad cublas' / '--wgrad sm90')
#     -n SHAPE   E,k,hidden,ffn,T: also profile one backward's kernels of that shape with ncu
#                (per-kernel time table; base clocks, so compare shares, not absolute times)
# Logs, JSONs and the summary go to ${OUT:-./train_ab_out}.
# Why rounds: the power cap sets the clock from the recent mix, so each variant runs as its own
# process, in both orders, and the summary gives each variant's per-round fwd+bwd and bwd medians.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=build-gpu ROUNDS=2 A="--wgrad cublas" B="--wgrad sm90" NCU_SHAPE=""
SHAPES='32,4,2048,1024,16384;32,8,7168,2048,8192'
while getopts "b:r:s:a:B:n:" o; do
  case $o in
    b) BUILD=$OPTARG ;; r) ROUNDS=$OPTARG ;; s) SHAPES=$OPTARG ;; a) A=$OPTARG ;; B) B=$OPTARG ;;
    n) NCU_SHAPE=$OPTARG ;; *) sed -n 2,15p "$0"; exit 2 ;;
  esac
done
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
OUTD=${OUT:-$PWD/train_ab_out}
mkdir -p "$OUTD"
BIN=$BUILD/src/programs/epmoe_bench_train
[[ -x $BIN ]] || { echo "train_ab: no $BIN (build first)" >&2; exit 1; }

run_variant() {  # run_variant VARIANT(a|b) ROUND
  local flags=$A
  [[ $1 == b ]] && flags=$B
  # shellcheck disable=SC2086  # the variant's flags are words
  mpirun -np 1 --bind-to none -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST -x NVSHMEM_DISABLE_NVLS \
    -x LD_LIBRARY_PATH "$BIN" --shapes "$SHAPES" --policy both $flags --budget-ms 200 --warmup-ms 400 \
    --json "$OUTD/train_$1_r$2.json" > "$OUTD/train_$1_r$2.txt"
  echo "[train_ab] round $2 variant $1 ($flags) done"
}
for (( r = 0; r < ROUNDS; ++r )); do
  if (( r % 2 == 0 )); then run_variant a "$r"; run_variant b "$r"; else run_variant b "$r"; run_variant a "$r"; fi
done
python3 launch/train_baseline.py --json "$OUTD/train_baseline.json" > "$OUTD/train_baseline.txt" 2>&1 ||
  echo "[train_ab] train_baseline.py failed (see train_baseline.txt)"

python3 - "$OUTD" a b "$ROUNDS" "$A" "$B" <<'EOF' | tee "$OUTD/train_ab_summary.txt"
import json, statistics, sys, os
d, a, b, rounds = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
def rows(v):
    out = {}
    for r in range(rounds):
        for row in json.load(open(f"{d}/train_{v}_r{r}.json"))["results"]:
            key = (tuple(row[k] for k in ("E", "k", "hidden", "ffn", "T")), row["policy"])
            out.setdefault(key, []).append(row)
    return out
ra, rb = rows(a), rows(b)
print(f"# a: {sys.argv[5]}   b: {sys.argv[6]}   ({rounds} rounds each, medians)")
base = {}
bp = f"{d}/train_baseline.json"
if os.path.exists(bp):
    for row in json.load(open(bp))["rows"]:
        base[tuple(row[k] for k in ("E", "k", "hidden", "ffn", "T"))] = row
print(f"| shape | policy | torch fwd+bwd ms | {a} fwd+bwd ms | {b} fwd+bwd ms | {b}/{a} | {a} bwd ms | {b} bwd ms |")
print("|---|---|---|---|---|---|---|---|")
for key in sorted(ra):
    fa = statistics.median(x["fwd_bwd_ms"] for x in ra[key]); fb = statistics.median(x["fwd_bwd_ms"] for x in rb[key])
    ba = statistics.median(x["bwd_ms"] for x in ra[key]); bb = statistics.median(x["bwd_ms"] for x in rb[key])
    t = base.get(key[0], {}).get("fwd_bwd_ms", float("nan"))
    print(f"| {','.join(map(str, key[0]))} | {key[1]} | {t:.3f} | {fa:.3f} | {fb:.3f} | {fb / fa:.3f} | {ba:.3f} | {bb:.3f} |")
EOF

if [[ -n $NCU_SHAPE ]] && command -v ncu > /dev/null; then
  # One backward's kernels (the NVTX range "backward" of the engine) of variant b, a few passes.
  # shellcheck disable=SC2086
  ncu --nvtx --nvtx-include "backward/" --launch-count 60 --print-summary per-kernel \
    "$BIN" --shapes "$NCU_SHAPE" --policy preact $B --iters 2 --warmup-ms 0 > "$OUTD/ncu_backward.txt" 2>&1 ||
    echo "[train_ab] ncu failed (see ncu_backward.txt)"
  grep -E "^  [a-zA-Z_].*\(|gpu__time_duration|Duration" "$OUTD/ncu_backward.txt" | head -80 > "$OUTD/ncu_backward_short.txt" || true
fi
