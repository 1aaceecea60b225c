#!/usr/bin/env bash
# ab_steady.sh: steady-state A/Bs of two sm_90a kernel plans on an H200, with an A/A control.
#
#   bash launch/ab_steady.sh [-b BENCH] [-n BLOCKS] [-w WARMUP_MS] [-i ITERS] [-r REGION] [-N]
#                            -p 'SPEC_A/SPEC_B' SHAPE [SHAPE ...]
#     -p SPEC_A/SPEC_B  two plan overrides (epmoe_bench_experts --ab-plan; an empty side is the
#                       shape's default plan): e.g. -p 'down=single/down=cluster', -p '/split=none'
#     SHAPE             E,k,hidden,ffn,T
#     -r REGION         full (default), up or down: what the blocks replay (--ab-region)
#     -N                skip the A/A control SPEC_A/SPEC_A (run by default first, on the same
#                       shapes: the noise of this board today)
#   defaults: BENCH build-gpu/src/programs/epmoe_bench_experts (gpu_check's build), 6 blocks per
#   variant, 1200 ms warm-up per block, 72 timed replays per variant.
#
# Why blocks: interleaved A/B replays share one clock, which the power cap sets from the mix, so the
# variant that draws more power is timed above its own steady state. Here each plan
# runs in its own blocks (AB, BA, ...), each after its own warm-up; launch/ab_summary.py prints B/A,
# the rounds B won, each variant's block spread and what B's plan changes per shape. Logs and the
# summary go to $OUT (or ./ab_out).
set -euo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

usage() { sed -n 2,19p "$0" >&2; exit 2; }
BENCH=build-gpu/src/programs/epmoe_bench_experts
BLOCKS=6
WARMUP=1200
ITERS=72
REGION=full
CONTROL=1
SPEC=""
while getopts "b:n:w:i:r:p:N" opt; do
  case $opt in
    b) BENCH=$OPTARG ;;
    n) BLOCKS=$OPTARG ;;
    w) WARMUP=$OPTARG ;;
    i) ITERS=$OPTARG ;;
    r) REGION=$OPTARG ;;
    p) SPEC=$OPTARG ;;
    N) CONTROL=0 ;;
    *) usage ;;
  esac
done
shift $((OPTIND - 1))
# One '/' between the two specs (either may be empty); at least one shape.
[[ $# -ge 1 && $SPEC == */* && ${SPEC#*/} != */* ]] || usage
SHAPES=()
for s in "$@"; do SHAPES+=(--shape "$s"); done
[[ -x $BENCH ]] || { echo "ab_steady: no bench at $BENCH (build first, or -b PATH)" >&2; exit 2; }

OUTDIR=${OUT:-$PWD/ab_out}
mkdir -p "$OUTDIR"
tag=$(printf %s "${SPEC:-default}" | tr -c 'A-Za-z0-9_.-' '_' | cut -c1-80)  # $OUT takes plain names only
run() {  # A/B spec, log
  echo "[ab_steady] --ab-plan '$1' ($REGION) on ${SHAPES[*]}"
  "$BENCH" --no-check --ab-only --ab-plan "$1" --ab-blocks "$BLOCKS" --ab-region "$REGION" --warmup-ms "$WARMUP" \
    --iters "$ITERS" "${SHAPES[@]}" > "$2" 2>&1 || { echo "[ab_steady] bench failed (rc $?), see $2" >&2; tail -5 "$2" >&2; return 1; }
}
logs=()
if [[ $CONTROL == 1 ]]; then
  a=${SPEC%%/*}
  run "$a/$a" "$OUTDIR/ab_${tag}_control.txt"
  logs+=("$OUTDIR/ab_${tag}_control.txt")
fi
run "$SPEC" "$OUTDIR/ab_${tag}.txt"
logs+=("$OUTDIR/ab_${tag}.txt")
python3 launch/ab_summary.py "${logs[@]}" | tee -a "$OUTDIR/ab_summary.txt"
