#!/usr/bin/env bash
# ncu_compare.sh: Nsight Compute counters of our UP and DOWN kernels beside cuBLAS's dense GEMMs of
# the same shapes (the two bare GEMMs baseline_moe.py --dense-equiv times), per useful MAC.
#
#   bash launch/ncu_compare.sh BUILD_DIR SHAPE [SHAPE ...]      (H200 machine, from the repo root)
#
# SHAPE is E,k,hidden,ffn,T. Per shape it profiles (ncu --clock-control none --cache-control none):
#   dense_up    x[T k, hidden] @ w1[2 ffn, hidden]^T   (torch -> cuBLAS), 3 launches
#   dense_down  act[T k, ffn] @ w2[hidden, ffn]^T       3 launches
#   ours        every sm90_* kernel of epmoe_bench_experts --shape SHAPE (the layer's graphs and each
#               kernel alone), the first NCU_OURS_LAUNCHES (default 12) launches
# and prints launch/ncu_table.py's table: time, clock, cycles, and L2 / DRAM / shared-memory traffic
# and instructions per useful MAC, with cuBLAS's kernel names (tile and cluster shape). Why: at the
# 700 W cap our 16k layer takes cuBLAS's cycles at a 7% lower clock (measured), so
# the gap is energy per MAC, and these counters say where ours moves more than cuBLAS's.
# CSVs and logs go to ${NCU_DIR:-${OUT:-/tmp}}/ncu_* (the .ncu-rep reports too with NCU_KEEP_REP=1);
# metrics this ncu does not know are left out.
set -euo pipefail
[[ $# -ge 2 ]] || { sed -n 2,17p "$0"; exit 2; }
BUILD=$1
shift
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PATH=/usr/local/cuda/bin:$PATH
OUTD=${NCU_DIR:-${OUT:-/tmp}}
mkdir -p "$OUTD"
BENCH=$BUILD/src/programs/epmoe_bench_experts
[[ -x $BENCH ]] || { echo "ncu_compare: no $BENCH (build first)" >&2; exit 1; }
HERE=$(cd "$(dirname "$0")" && pwd)

WANT=(gpu__time_duration.sum sm__cycles_elapsed.avg.per_second sm__cycles_elapsed.max
      sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed
      sm__ops_path_tensor_src_bf16_dst_fp32.sum lts__t_bytes.sum lts__t_sectors_op_read.sum
      lts__t_sectors_op_write.sum lts__t_sectors_op_red.sum lts__t_sector_hit_rate.pct
      dram__bytes_read.sum dram__bytes_write.sum l1tex__data_pipe_lsu_wavefronts_mem_shared.sum
      smsp__inst_executed.sum smsp__inst_executed_op_ldgsts.sum)
# Keep the metrics whose base counter this ncu lists for the device (an unknown one fails the run).
known=$(ncu --query-metrics 2> /dev/null | awk '{print $1}' || true)
METRICS=""
for m in "${WANT[@]}"; do
  if [[ -z $known ]] || grep -qx "${m%%.*}" <<< "$known"; then METRICS+="${METRICS:+,}$m"
  else echo "ncu_compare: this ncu has no ${m%%.*}; left out" >&2; fi
done

NCU=(ncu --clock-control none --cache-control none --metrics "$METRICS")
DENSE_PY=$(mktemp --suffix .py)
trap 'rm -f "$DENSE_PY"' EXIT
cat > "$DENSE_PY" << 'PY'
# One dense GEMM of a layer shape, 3 launches after 2 unprofiled warm-up ones (random normal bf16).
import sys, torch
E, k, D, H, T = (int(v) for v in sys.argv[1].split(","))
M = T * k
g = torch.Generator(device="cuda").manual_seed(1)
if sys.argv[2] == "up":
    a, b = torch.randn(M, D, device="cuda", generator=g), torch.randn(2 * H, D, device="cuda", generator=g) * 0.02
else:
    a, b = torch.randn(M, H, device="cuda", generator=g), torch.randn(D, H, device="cuda", generator=g) * 0.02
a, b = a.bfloat16(), b.bfloat16()
torch.cuda.synchronize()
for i in range(5):
    c = a @ b.t()
torch.cuda.synchronize()
print(f"dense {sys.argv[2]} {sys.argv[1]}: {tuple(c.shape)} ok", flush=True)
PY

# export_csv REP: REP.ncu-rep -> REP.csv (raw page, base units); drops the report unless kept.
export_csv() {
  [[ -f $1.ncu-rep ]] || return 1
  ncu --import "$1.ncu-rep" --csv --page raw --print-units base > "$1.csv" || return 1
  [[ ${NCU_KEEP_REP:-0} == 1 ]] || rm -f "$1.ncu-rep"
}

fail=0
for shape in "$@"; do
  tag=${shape//,/_}
  args=()
  for which in up down; do
    rep=$OUTD/ncu_${tag}_dense_${which}
    # the GEMM kernels only (not torch's randn / cast kernels); skip the 2 warm-up launches
    "${NCU[@]}" -k regex:'gemm|nvjet|xmma|cutlass|sm90' --launch-skip 2 --launch-count 3 -f -o "$rep" \
      python3 "$DENSE_PY" "$shape" "$which" > "$rep.log" 2>&1 ||
      { fail=1; echo "ncu_compare: dense $which failed:"; tail -5 "$rep.log"; }
    export_csv "$rep" && args+=("dense_$which=$rep.csv")
  done
  rep=$OUTD/ncu_${tag}_ours
  "${NCU[@]}" -k regex:'sm90_' --launch-count "${NCU_OURS_LAUNCHES:-12}" -f -o "$rep" \
    "$BENCH" --shape "$shape" --no-check --iters 3 --warmup-ms 0 > "$rep.log" 2>&1 ||
    { fail=1; echo "ncu_compare: ours failed:"; tail -5 "$rep.log"; }
  export_csv "$rep" && args+=("ours=$rep.csv")
  if ((${#args[@]} == 3)); then python3 "$HERE/ncu_table.py" "$shape" "${args[@]}" || fail=1
  else fail=1; echo "ncu_compare: $shape: ${#args[@]} of 3 reports"; ((${#args[@]})) && python3 "$HERE/ncu_table.py" "$shape" "${args[@]}"; fi
  echo
done
exit $fail
