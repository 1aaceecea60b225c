#!/usr/bin/env bash
# ab_steady.sh: steady-state A/Bs of the sm_90a kernels' knobs on an H200, with an A/A control.
#
#   bash launch/ab_steady.sh [-b BENCH] [-n BLOCKS] [-w WARMUP_MS] [-i ITERS] [-c] VAR=A,B SHAPE [SHAPE ...]
#     VAR=A,B   an epmoe_bench_experts --ab spec (VAR1+VAR2=A,B switches several knobs at once)
#     SHAPE     E,k,hidden,ffn,T
#     -c        also run the A/A control VAR=A,A on the same shapes (the noise of this board today)
#   defaults: BENCH build-gpu/src/programs/epmoe_bench_experts (gpu_check's build), 6 blocks per
#   variant, 1200 ms warm-up per block, 72 timed replays per variant.
#
# Why blocks: interleaved A/B replays share one clock, which the power cap sets from the mix, so the
# variant that draws more power is timed above its own steady state (docs/PERF.md, session 13). Here
# each variant runs in its own blocks (AB, BA, ...), each after its own warm-up; launch/ab_summary.py
# prints B/A, the rounds B won and each variant's block spread. Logs and the summary go to $OUT (or
# ./ab_out).
set -euo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

BENCH=build-gpu/src/programs/epmoe_bench_experts
BLOCKS=6
WARMUP=1200
ITERS=72
CONTROL=0
while getopts "b:n:w:i:c" opt; do
  case $opt in
    b) BENCH=$OPTARG ;;
    n) BLOCKS=$OPTARG ;;
    w) WARMUP=$OPTARG ;;
    i) ITERS=$OPTARG ;;
    c) CONTROL=1 ;;
    *) sed -n 2,15p "$0" >&2; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
if [[ $# -lt 2 || $1 != *=*,* ]]; then
  sed -n 2,15p "$0" >&2
  exit 2
fi
SPEC=$1
shift
SHAPES=()
for s in "$@"; do SHAPES+=(--shape "$s"); done
[[ -x $BENCH ]] || { echo "ab_steady: no bench at $BENCH (build first, or -b PATH)" >&2; exit 2; }

OUTDIR=${OUT:-$PWD/ab_out}
mkdir -p "$OUTDIR"
tag=$(printf %s "$SPEC" | tr -c 'A-Za-z0-9_.-' '_' | cut -c1-80)  # $OUT takes plain names only
run() {  # spec, log
  echo "[ab_steady] $1 on ${SHAPES[*]}"
  "$BENCH" --no-check --ab-only --ab "$1" --ab-blocks "$BLOCKS" --warmup-ms "$WARMUP" --iters "$ITERS" "${SHAPES[@]}" \
    > "$2" 2>&1 || { echo "[ab_steady] bench failed (rc $?), see $2" >&2; tail -5 "$2" >&2; return 1; }
}
logs=()
if [[ $CONTROL == 1 ]]; then
  var=${SPEC%%=*}
  vals=${SPEC#*=}
  a=${vals%%,*}
  run "$var=$a,$a" "$OUTDIR/ab_${tag}_control.txt"
  logs+=("$OUTDIR/ab_${tag}_control.txt")
fi
run "$SPEC" "$OUTDIR/ab_${tag}.txt"
logs+=("$OUTDIR/ab_${tag}.txt")
python3 launch/ab_summary.py "${logs[@]}" | tee -a "$OUTDIR/ab_summary.txt"
