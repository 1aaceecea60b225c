#!/usr/bin/env bash
# gpu_check.sh: build epmoe on the H200 machine and run every GPU check in one call.
#
#   bash launch/gpu_check.sh            (from the repo root; $OUT is the folder that comes back)
#
# Stages (each with its own log and a time guard; a failure never stops the stages after it):
#   build          cmake -G Ninja Release, sm_90a, NCCL from the torch venv -> build-gpu/ ($OUT/build.log)
#   cpu            ctest -L cpu -LE torch          (quick sanity, parallel)
#   gpu            ctest -L gpu -LE "mpi|torch"    (1-GPU suites)
#   torch          ctest -L torch                  (the libtorch bindings against the machine's torch:
#                                                   mock ranks, CUDA tensors, opcheck, torch.compile)
#   mpi            ctest -L mpi                    (np 2 GPU suites with >= 2 GPUs; with 1 GPU, -LE gpu)
#   train          mpirun epmoe_train (the main job's training step), 100 steps at E=32 k=4 2048/1024
#   sass           cuobjdump --dump-sass of libepmoe, kernels named *sm90_up* / *sm90_down* / *sm90_wgrad* / *sm90_dgrad* / swap / fused:
#                  PASS iff HGMMA > 0 and no LDL/STL (local memory) in them
#   sanitizer      compute-sanitizer memcheck + racecheck on test_sm90_experts --gtest_filter=*Small*
#                  and test_layout_gpu, and on test_backward_gpu's small cases; initcheck + synccheck
#                  on the small sm90 case of every kernel form and on test_layout_gpu; memcheck on
#                  test_capturable_gpu (one graph replay test, bad token counts) and test_forward_gpu
#                  (all but the past-2^31 case); all four tools on test_capturable_backward_gpu's
#                  bf16-gradient case (the dgrad kernels, the device-bounded backward kernels);
#                  memcheck + initcheck on test_capturable_fp8_gpu (block-128 replays, bad ids, mock ranks)
#   bench_experts  epmoe_bench_experts + launch/baseline_moe.py + launch/compare_experts.py
#   bench_decode   epmoe_bench_experts --forms at issue 48's decode shapes (auto, 128-row, swap-AB and fused
#                  side by side with the weight floor) + baseline_moe.py on them (compare_decode.txt)
#   bench_mxfp8    epmoe_bench_mxfp8: the MXFP8 layer beside the bf16 one at decode sizes, both weight
#                  floors, L2 evicted per replay (logs/bench_mxfp8.json), + launch/baseline_fp8.py (torch's
#                  scaled grouped GEMM, E4M3 rowwise) joined by launch/compare_fp8.py
#   bench_dims16   epmoe_bench_experts at hidden / ffn multiples of 16 beside the nearest multiples of 128
#                  (same E, k, T), launch/dims16_compare.py: time per FLOP ratio (issue 48, goal <= 1.10)
#   bench_capturable  epmoe_bench_capturable: forward_capturable under graph replay at T = 0..512 vs the
#                  regular forward vs the weight-streaming floor (logs/bench_capturable.json)
#   bench_ep       mpirun epmoe_bench_ep + launch/ep_baseline.py + launch/compare_ep.py
#   bench_train    mpirun -np 1 epmoe_bench_train (fwd, fwd+save, fwd+bwd, bwd per save policy) +
#                  launch/train_baseline.py (torch autograd) + launch/compare_train.py
#   scaling        launch/scaling_bench.py: weak / strong scaling of fwd and fwd+bwd over the GPUs
#                  present, ours and the torch EP baseline (logs/scaling/: table, JSON, PNG)
#   ncu            (only when named in GPU_CHECK_STAGES, not in "all") launch/ncu_compare.sh: Nsight
#                  Compute counters per MAC of our UP/DOWN beside cuBLAS's dense GEMMs of the shapes
#                  in GPU_CHECK_NCU_SHAPES (default 16k and 7168/T=2k); the table goes to summary.txt
#
# Environment:
#   GPU_CHECK_STAGES=cpu,gpu,...   run these stages only (default all; the build always runs unless
#                                  the list holds "nobuild"; "bench" = every bench_* stage)
#   GPU_CHECK_QUICK=1              shorter benches (EP: --shapes default instead of all; train:
#                                  150 ms per phase and 200 ms warm-up instead of 400 and 500)
#   GPU_CHECK_BUDGET_S=580         the whole run's time budget; stages are cut to fit it (a device call
#                                  allows 600 s; at 560 a full check once cut bench_ep after 532 s of
#                                  the other stages, and bench_ep alone takes ~46 s)
#   GPU_CHECK_EXPERTS_SHAPES=full  --shapes for epmoe_bench_experts and baseline_moe.py
#
# summary.txt also prints the reliability matrix (issue 49): every test's "[matrix] case | expected |
# observed" rows from the ctest stages' JUnit files (launch/reliability_matrix.py).
#
# $OUT gets at most 8 files: build.log, summary.txt, logs.tar.gz (every stage's log, the SASS
# excerpt, the compare tables, the training bench's own JSONs and speedup plot) and the bench JSONs
# (bench_experts, baseline_moe, bench_ep, ep_baseline, and train_compare: ours and torch's training
# rows joined, both inputs in full; bench_train.json instead when there is nothing to compare).
set -euo pipefail
cd "$(dirname "$0")/.."

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_btl_vader_single_copy_mechanism=none  # no CMA/ptrace needs for host messages
export PYTHONUNBUFFERED=1
export PATH=/usr/local/cuda/bin:$PATH
source launch/env.sh  # also: the compiler with a shared libstdc++ for the torch bindings

OUT=${OUT:-$PWD/gpu_check_out}
LOGS=$OUT/logs
BUILD=build-gpu
STAGES=${GPU_CHECK_STAGES:-all}
QUICK=${GPU_CHECK_QUICK:-0}
BUDGET=${GPU_CHECK_BUDGET_S:-580}
EXPERTS_SHAPES=${GPU_CHECK_EXPERTS_SHAPES:-full}
EP_SHAPES=all
[[ $QUICK == 1 ]] && EP_SHAPES=default
NCCL_DIR=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl
TORCH_CMAKE=/opt/torch/.venv/lib/python3.12/site-packages/torch/share/cmake
NCPU=$(nproc)
mkdir -p "$OUT" "$LOGS"
[[ -d $NCCL_DIR/lib ]] && export LD_LIBRARY_PATH=$NCCL_DIR/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

declare -A STATUS=() SECS=() KEY=()
ORDER=()
T0=$SECONDS
KEY_FIG=""
CUR_LOG=/dev/null
STAGE_DEADLINE=0
TMO_FLAG=$LOGS/.command_timed_out
NGPU=0
TORCH_CONFIGURE_FAILED=0

log() { echo "[gpu_check $(( SECONDS - T0 ))s] $*"; }

want() {
  local s=",$STAGES,"
  [[ $1 == ncu ]] && { [[ $s == *",ncu,"* ]]; return; }  # a diagnostic: only when named
  [[ $s == *",all,"* || $s == *",$1,"* ]] && return 0
  [[ $1 == bench_* && $s == *",bench,"* ]] && return 0
  return 1
}

# tmo [--max S] cmd...: run cmd under the current stage's deadline (at most S seconds), killing
# its whole process group at the limit; echoes the command first.
tmo() {
  local cap=100000
  if [[ $1 == --max ]]; then cap=$2; shift 2; fi
  local left=$(( STAGE_DEADLINE - SECONDS ))
  (( left > cap )) && left=$cap
  (( left < 5 )) && left=5
  echo "+ [limit ${left}s] $*" >&2
  local rc=0
  timeout -k 10 "$left" "$@" || rc=$?
  # Remembered for run_stage: a stage whose command hit its limit was cut, even if the stage went on.
  (( rc == 124 || rc == 137 )) && : > "$TMO_FLAG"
  return $rc
}

# run_stage NAME LIMIT_S FUNCTION: records STATUS (PASS/FAIL/SKIP), SECS, KEY. The function returns
# 0 = PASS, 77 = SKIP, anything else = FAIL, and may set KEY_FIG.
run_stage() {
  local name=$1 limit=$2 fn=$3 rc=0 start=$SECONDS cut=0
  ORDER+=("$name")
  if [[ $name == build ]]; then
    [[ ",$STAGES," == *",nobuild,"* ]] && { STATUS[$name]=SKIP; SECS[$name]=0; KEY[$name]="nobuild"; return; }
  elif ! want "$name"; then
    STATUS[$name]=SKIP; SECS[$name]=0; KEY[$name]="not selected"; return
  fi
  local left=$(( BUDGET - (SECONDS - T0) ))
  if (( left < 30 )); then
    STATUS[$name]=SKIP; SECS[$name]=0; KEY[$name]="time budget spent"; log "$name: SKIP (budget)"; return
  fi
  (( limit > left - 15 )) && { limit=$(( left - 15 )); cut=$2; }
  STAGE_DEADLINE=$(( SECONDS + limit ))
  KEY_FIG=""
  rm -f "$TMO_FLAG"
  local logf=$LOGS/$name.log
  [[ $name == build ]] && logf=$OUT/build.log
  CUR_LOG=$logf
  log "$name: start (limit ${limit}s, log ${logf#$OUT/})"
  "$fn" > "$logf" 2>&1 || rc=$?
  local st=FAIL
  (( rc == 0 )) && st=PASS
  (( rc == 77 )) && st=SKIP
  local timed_out=0
  [[ -e $TMO_FLAG ]] && timed_out=1
  rm -f "$TMO_FLAG"
  local fig=$KEY_FIG
  (( rc == 124 || rc == 137 )) && KEY_FIG="timed out (${limit}s) ${fig}"
  (( rc != 0 && rc != 124 && rc != 137 && timed_out )) && KEY_FIG="a command hit its time limit: ${fig}"
  # A failure at a limit the budget shortened is named as such: the stage was not verified, not broken.
  # (The bench command can be cut at its share of a shortened stage while the stage itself is not.)
  (( rc != 0 && cut > 0 && (timed_out || SECONDS - start >= limit - 2) )) &&
    KEY_FIG="cut by the time budget (${limit}s of its ${cut}s): ${fig}"
  STATUS[$name]=$st; SECS[$name]=$(( SECONDS - start )); KEY[$name]=${KEY_FIG:-rc=$rc}
  log "$name: $st in ${SECS[$name]}s: ${KEY[$name]}"
  if [[ $st == FAIL ]]; then
    echo "----- tail of ${logf#$OUT/} -----"; tail -n 25 "$logf" || true; echo "-----"
  fi
}

# ---- stages --------------------------------------------------------------------------------------

stage_build() {
  # The torch bindings against the machine's torch 2.11 (CUDA) when its CMake package is there
  # (AUTO); ninja -k 0 builds everything else when they fail, and the torch stage then fails.
  local args=(-S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a -DEPMOE_ENABLE_TORCH=AUTO)
  if [[ -d $NCCL_DIR ]]; then
    ls -l "$NCCL_DIR/lib" || true
    args+=(-DNCCL_ROOT="$NCCL_DIR")
  else
    echo "warning: $NCCL_DIR not found; FindNCCL searches its default places"
  fi
  [[ -d $TORCH_CMAKE ]] && args+=(-DCMAKE_PREFIX_PATH="$TORCH_CMAKE")
  local rc=0
  tmo --max 120 cmake "${args[@]}" || rc=$?
  if (( rc )); then
    echo "configure with torch failed: configuring again without the torch bindings"
    rm -rf "$BUILD"; rc=0
    tmo --max 120 cmake "${args[@]}" -DEPMOE_ENABLE_TORCH=OFF || rc=$?
    if (( rc )); then KEY_FIG="configure failed"; return $rc; fi
    TORCH_CONFIGURE_FAILED=1
  fi
  tmo cmake --build "$BUILD" -j "$NCPU" -- -k 0 || rc=$?
  local failed; failed=$(grep -c '^FAILED:' "$CUR_LOG" || true)
  if (( rc )); then KEY_FIG="$failed target(s) failed (ninja -k 0: the rest was built)"; return $rc; fi
  KEY_FIG="$(grep -E '^-- epmoe:' "$CUR_LOG" | tail -1 | sed 's/^-- epmoe: //')"
  (( TORCH_CONFIGURE_FAILED )) && { KEY_FIG="torch configure failed; $KEY_FIG"; return 1; }
  return 0
}

# ctest_stage ARGS...: PASS when ctest passes, SKIP when no test matched. Every test's output goes to
# the stage's JUnit file too (all of it where this ctest can say so): the reliability matrix's rows.
CTEST_JUNIT_SIZE=()
ctest --help 2>/dev/null | grep -q -- --test-output-size-passed && CTEST_JUNIT_SIZE=(--test-output-size-passed 262144)
ctest_stage() {
  local rc=0 junit=${CUR_LOG%.log}.junit.xml
  [[ $junit == /* ]] || junit=$PWD/$junit  # (ctest reads a relative path against the build folder)
  tmo ctest --test-dir "$BUILD" --output-on-failure --no-tests=ignore --output-junit "$junit" \
    "${CTEST_JUNIT_SIZE[@]}" "$@" || rc=$?
  if grep -q "No tests were found" "$CUR_LOG"; then KEY_FIG="no tests matched"; return 77; fi
  KEY_FIG=$(grep -E "tests passed" "$CUR_LOG" | tail -1 || true)
  local skipped; skipped=$(grep -c "\*\*\*Skipped" "$CUR_LOG" || true)
  (( skipped > 0 )) && KEY_FIG="$KEY_FIG; $skipped skipped"
  return $rc
}
stage_cpu() { ctest_stage -L cpu -LE torch -j "$NCPU"; }
# The libtorch bindings (torch 2.11 here): mock-rank CPU suites, the CUDA suites, opcheck, compile.
stage_torch() {
  local rc=0
  ctest_stage -L torch -j 4 || rc=$?
  return $rc
}
stage_gpu() { ctest_stage -L gpu -LE "mpi|torch" -j 4; }  # independent processes; timing is not measured here
stage_mpi() {
  if (( NGPU >= 2 )); then
    ctest_stage -L mpi -LE torch -j 1
  else
    echo "1 GPU: the gpu-labelled mpirun suites are left out"
    ctest_stage -L mpi -LE "gpu|torch" -j 1
  fi
}

# The main job (README's run command) on the GPUs present: EP forward + max error vs reference.
stage_run() {
  local np=$(( NGPU >= 2 ? 2 : 1 ))
  tmo --max 120 mpirun -np "$np" --bind-to none -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST \
    -x NVSHMEM_DISABLE_NVLS -x LD_LIBRARY_PATH "$BUILD/src/programs/epmoe_run" --tokens 4096 --hidden 2048 \
    --ffn 1024 --check-tokens 16
  KEY_FIG=$(grep -o 'max error vs dense reference: .*' "$CUR_LOG" | head -1)
}

# The main job's training step (epmoe_train) on the GPUs present: loss, tokens/s, TFLOP/s.
stage_train() {
  local np=$(( NGPU >= 2 ? 2 : 1 )) bin=$BUILD/src/programs/epmoe_train
  [[ -x $bin ]] || { KEY_FIG="no $bin (built only with the torch bindings)"; return 1; }
  tmo --max 200 mpirun -np "$np" --bind-to none -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST \
    -x NVSHMEM_DISABLE_NVLS -x LD_LIBRARY_PATH "$bin" --tokens 8192 --hidden 2048 --ffn 1024 --experts 32 \
    --topk 4 --steps 100 --log-every 10 --json "$LOGS/train.json"
  KEY_FIG=$(grep -E '^# final' "$CUR_LOG" | tail -1)
  [[ -n $KEY_FIG ]]
}

# The scaling benchmark over the GPUs present (weak and strong; world 1 alone on one GPU, where the
# two coincide: weak only), ours and the torch EP baseline: table, JSON and plot in logs/scaling/.
stage_scaling() {
  local modes=weak,strong
  (( NGPU < 2 )) && modes=weak
  tmo --max 240 python3 launch/scaling_bench.py --build "$BUILD" --modes "$modes" --out-dir "$LOGS/scaling"
  KEY_FIG=$(grep -E '^ +(weak|strong) ' "$LOGS/scaling/scaling.txt" 2>/dev/null | tail -1 | tr -s ' ')
  [[ -n $KEY_FIG ]]
}

stage_sass() {
  local inputs=() dump=/tmp/gpu_check_sass.txt rc=0
  rm -f "$dump"
  for f in "$BUILD/libepmoe.a" "$BUILD/libepmoe.so"; do [[ -f $f ]] && inputs+=("$f"); done
  if (( ${#inputs[@]} )); then tmo --max 60 cuobjdump --dump-sass "${inputs[@]}" > "$dump" || rc=$?; fi
  if (( ${#inputs[@]} == 0 || rc != 0 )) || ! grep -q "Function : " "$dump"; then
    echo "no SASS from the library (rc=$rc); trying the object files"
    mapfile -t inputs < <(find "$BUILD" -path '*epmoe.dir*' -name '*.cu.o' | sort)
    (( ${#inputs[@]} )) || { KEY_FIG="no libepmoe and no .cu.o objects"; return 1; }
    rc=0
    tmo --max 60 cuobjdump --dump-sass "${inputs[@]}" > "$dump" || rc=$?
    (( rc )) && { KEY_FIG="cuobjdump failed (rc=$rc)"; return 1; }
  fi
  echo "inputs: ${inputs[*]}"
  echo "kernels in the dump: $(grep -c 'Function : ' "$dump" || true)"
  # Per kernel named *sm90_up* / *sm90_down* / *sm90_wgrad* / *sm90_dgrad* / *sm90_swap_ab* / *sm90_fused_swap* / *sm90_mx_swap* / *sm90_fused_mx* / *sm90_mx_tile* / *sm90_fp8b_tile*: HGMMA (and FP8 QGMMA) lines, LDL/STL lines; the excerpt keeps their SASS.
  awk -v excerpt="$LOGS/sass_sm90.txt" '
    /Function : / { name = $NF; keep = (name ~ /sm90_up|sm90_down|sm90_wgrad|sm90_dgrad|sm90_swap_ab|sm90_fused_swap|sm90_mx_swap|sm90_fused_mx|sm90_mx_tile|sm90_fp8b_tile/)
                    if (keep && !(name in seen)) { seen[name] = 1; order[++nk] = name } }
    keep { print > excerpt
           if ($0 ~ /[HQ]GMMA/) h[name]++
           if ($0 !~ /Function : / && $0 ~ /(^|[^A-Za-z0-9_])(LDL|STL)([^A-Za-z0-9_]|$)/) l[name]++ }
    END { for (i = 1; i <= nk; i++) { n = order[i]; printf "%8d %8d  %s\n", h[n] + 0, l[n] + 0, n; th += h[n]; tl += l[n] }
          printf "TOTAL %d %d %d\n", nk, th, tl }' "$dump" > /tmp/gpu_check_sass_sum.txt
  echo "   HGMMA  LDL/STL  kernel"
  if command -v c++filt > /dev/null; then
    grep -v '^TOTAL' /tmp/gpu_check_sass_sum.txt | while read -r h l n; do
      printf "%8s %8s  %s\n" "$h" "$l" "$(c++filt "$n" | cut -c1-160)"; done
  else
    grep -v '^TOTAL' /tmp/gpu_check_sass_sum.txt
  fi
  local nk th tl
  read -r _ nk th tl < <(grep '^TOTAL' /tmp/gpu_check_sass_sum.txt)
  KEY_FIG="$nk kernels: HGMMA $th, LDL/STL $tl"
  echo "$KEY_FIG"
  (( nk > 0 )) || { KEY_FIG="no kernel named *sm90_up* / *sm90_down* in the SASS"; return 1; }
  (( th > 0 && tl == 0 ))
}

# sanitize_one BINARY FILTER SHARE_S TOOLS [OPTION...]: each compute-sanitizer tool of TOOLS (a comma
# list: memcheck, racecheck, initcheck, synccheck) on one test binary and filter, each under SHARE_S seconds, with the extra
# sanitizer OPTIONs; appends "name (n): tool <summary> (rc), ..." to SAN_FIGS and returns nonzero on a
# finding, a failed test or a timeout. A missing binary or an empty filter is noted, not failed.
sanitize_one() {
  local name=$1 filter=$2 share=$3 tools=$4 bin=$BUILD/tests/gpu/$1
  shift 4
  [[ -x $bin ]] || { SAN_FIGS+="$name: not built; "; return 0; }
  local n; n=$("$bin" --gtest_list_tests --gtest_filter="$filter" 2>/dev/null | grep -c '^  ' || true)
  (( n > 0 )) || { SAN_FIGS+="$name: no test matches; "; return 0; }
  echo "$n test(s) of $name match $filter"
  local tool rc bad=0 log=/tmp/gpu_check_san_$name.log figs=""
  for tool in ${tools//,/ }; do
    echo "===== $tool $name $*"
    rc=0
    tmo --max "$share" compute-sanitizer --tool "$tool" --error-exitcode 99 "$@" "$bin" --gtest_filter="$filter" \
      > "$log" 2>&1 || rc=$?
    cat "$log"
    local sum; sum=$(grep -E "(ERROR|RACECHECK) SUMMARY" "$log" | tail -1 | sed 's/.*SUMMARY: //' || true)
    figs+="$tool ${sum:-?} (rc $rc), "
    (( rc == 0 )) || bad=1
  done
  SAN_FIGS+="$name ($n): ${figs%, }; "
  return $bad
}

# The sm90 kernels' small cases (both tools); the engine's layout, pack and reduce kernels (both);
# the 1-GPU forward, memcheck only: its kernels are the ones racechecked above, racecheck would need
# minutes more, and the past-2^31 case (8 GB buffers) is left out. NCCL's communicator setup probes
# its kernels with cudaFuncGetAttributes and gets cudaErrorNoKernelImageForDevice for the ones its
# build has no image of (8 such reports seen, all in ncclInitKernelsForDevice): API errors
# are not reported there (--report-api-errors no); the tests check every call of ours themselves.
stage_sanitizer() {
  command -v compute-sanitizer > /dev/null || { KEY_FIG="no compute-sanitizer"; return 77; }
  [[ -x $BUILD/tests/gpu/test_sm90_experts ]] || { KEY_FIG="no $BUILD/tests/gpu/test_sm90_experts"; return 77; }
  SAN_FIGS=""
  local rc=0 left=$(( STAGE_DEADLINE - SECONDS ))
  sanitize_one test_sm90_experts '*Small*' $(( left * 3 / 10 )) memcheck,racecheck || rc=1
  sanitize_one test_layout_gpu '*' $(( left / 10 )) memcheck,racecheck || rc=1
  # uninitialized reads and barrier misuse: the small case under every kernel form (the variant rows
  # named *SmallE4K2H256F256T64: single, pairs, clusters, by expert, split, tail halves, zero-out,
  # swap-AB) and the layout kernels
  sanitize_one test_sm90_experts '*SmallE4K2H256F256T64*' $(( left / 10 )) initcheck,synccheck || rc=1
  sanitize_one test_layout_gpu '*' $(( left / 20 )) initcheck,synccheck || rc=1
  # the MX swap-AB kernels (UP with the act requantization, DOWN): one and two k stages, N 8 and 64
  sanitize_one test_sm90_mx_swap '*SmallestShape*:*SixtyFiveRows*:*FiveTwelve*' $(( left / 10 )) memcheck,racecheck || rc=1
  sanitize_one test_sm90_mx_swap '*SmallestShape*' $(( left / 20 )) initcheck,synccheck || rc=1
  sanitize_one test_sm90_fp8b_tile '*SmallestShape*:*TileAndOneRow*' $(( left / 10 )) memcheck,racecheck || rc=1
  sanitize_one test_sm90_fp8b_tile '*SmallestShape*' $(( left / 20 )) initcheck,synccheck || rc=1
  # the backward's kernels: the sm_90 wgrad kernel (h/f 256 cases), the SwiGLU backward, the row-pair
  # map and reduce, the weight-gradient scatter; T = 0 / 1 and nothing routed
  sanitize_one test_backward_gpu '*h256_f256_w1_uniform_sm90*:*T1:*T0:*all_dropped*' $(( left / 5 )) \
    memcheck,racecheck --report-api-errors no || rc=1
  # the capturable backward's kernels (dgrad, the device-bounded SwiGLU backward, row_pair_map_ids,
  # the wgrad kernels on capacity-sized rows): one uncaptured forward(save) + two backwards
  sanitize_one test_capturable_backward_gpu '*Bf16GradientsAndAccumulate*' $(( left / 12 )) \
    memcheck,racecheck,initcheck,synccheck --report-api-errors no || rc=1
  # the capturable forward's kernels (layout, slot pack, UP zeroing y, DOWN into y): one graph replayed
  # at every T and the bad token counts; '*' (fused and mock-rank variants too) ran past its share of
  # a 575 s budget three sessions running
  sanitize_one test_capturable_gpu 'CapturableGpu.GraphReplaysAtEveryTokenCount:*BadTokenCount*' $(( left / 6 )) memcheck \
    --report-api-errors no || rc=1
  # the FP8 capturable forward (x quantized by the device count, packed FP8 rows through the slots,
  # the block-128 tile form and the MX swap-AB form under replay, bad ids and counts, device mock ranks)
  sanitize_one test_capturable_fp8_gpu '*Block*:*BadIds*:*Slots*' $(( left / 8 )) memcheck,initcheck \
    --report-api-errors no || rc=1
  sanitize_one test_forward_gpu '-*Past32BitOffsets*' $(( STAGE_DEADLINE - SECONDS )) memcheck \
    --report-api-errors no || rc=1
  KEY_FIG="${SAN_FIGS%; }"
  return $rc
}

stage_bench_experts() {
  local bin=$BUILD/src/programs/epmoe_bench_experts rc=0 rcb=0 rcc=0
  rm -f "$OUT/bench_experts.json" "$OUT/baseline_moe.json"
  if [[ -x $bin ]]; then
    tmo --max $(( (STAGE_DEADLINE - SECONDS) * 3 / 5 )) "$bin" --shapes "$EXPERTS_SHAPES" --json "$OUT/bench_experts.json" || rc=$?
  else
    echo "missing $bin"; rc=1
  fi
  if [[ -f launch/baseline_moe.py ]]; then
    tmo --max $(( STAGE_DEADLINE - SECONDS - 15 )) python3 launch/baseline_moe.py --json "$OUT/baseline_moe.json" --shapes "$EXPERTS_SHAPES" --dense-equiv || rcb=$?
  else
    echo "missing launch/baseline_moe.py"; rcb=1
  fi
  if [[ -f $OUT/bench_experts.json && -f $OUT/baseline_moe.json && -f launch/compare_experts.py ]]; then
    tmo python3 launch/compare_experts.py "$OUT/bench_experts.json" "$OUT/baseline_moe.json" > "$LOGS/compare_experts.txt" 2>&1 || rcc=$?
    cat "$LOGS/compare_experts.txt"
    KEY_FIG=$(grep "full region" "$LOGS/compare_experts.txt" | tail -1 | cut -c1-110)
  else
    rcc=1
  fi
  KEY_FIG="${KEY_FIG:-no comparison} [bench rc $rc, baseline rc $rcb, compare rc $rcc]"
  (( rc == 0 && rcb == 0 && rcc == 0 ))
}

# Decode sizes (issue 48's table): every expert-kernel form (auto, 128-row, swap-AB, fused) in one
# process beside the weight-streaming floor, and torch's grouped_mm on the same shapes.
DECODE_SHAPES="32,4,2048,1024,1 32,4,2048,1024,8 32,4,2048,1024,64 32,4,2048,1024,128 32,4,2048,1024,512 128,8,2048,768,512 32,8,7168,2048,256"
stage_bench_decode() {
  local bin=$BUILD/src/programs/epmoe_bench_experts rc=0 rcb=0 args=() sh
  for sh in $DECODE_SHAPES; do args+=(--shape "$sh"); done
  [[ -x $bin ]] || { KEY_FIG="missing $bin"; return 1; }
  tmo --max $(( (STAGE_DEADLINE - SECONDS) / 2 )) "$bin" "${args[@]}" --forms --json "$LOGS/bench_decode.json" || rc=$?
  tmo --max $(( STAGE_DEADLINE - SECONDS - 10 )) python3 launch/baseline_moe.py "${args[@]}" \
    --json "$LOGS/baseline_decode.json" || rcb=$?
  if [[ -f $LOGS/bench_decode.json && -f $LOGS/baseline_decode.json ]]; then
    python3 launch/compare_experts.py "$LOGS/bench_decode.json" "$LOGS/baseline_decode.json" > "$LOGS/compare_decode.txt" 2>&1 || rc=1
    cat "$LOGS/compare_decode.txt"
  fi
  KEY_FIG=$(grep -E '^ +32 +4 +2048 +1024 +1 \|' "$LOGS/compare_decode.txt" 2>/dev/null | tail -1 |
            awk -F'|' '{split($2, a, " "); split($3, b, " "); split($4, c, " "); printf "T=1: auto %s us, torch %s us, floor %s us", a[1], b[1], c[1]}')
  KEY_FIG="${KEY_FIG:-no table} [bench rc $rc, baseline rc $rcb]"
  (( rc == 0 && rcb == 0 ))
}

# The MXFP8 layer (MX swap-AB kernels) beside the bf16 one at decode sizes, both weight floors.
stage_bench_mxfp8() {
  local bin=$BUILD/src/programs/epmoe_bench_mxfp8 rc=0
  [[ -x $bin ]] || { KEY_FIG="missing $bin"; return 1; }
  tmo --max $(( (STAGE_DEADLINE - SECONDS) / 2 )) "$bin" --shapes "32,4,2048,1024;128,8,2048,768" --tokens 1,8,64,128,16384 \
    --json "$LOGS/bench_mxfp8.json" || rc=$?
  # torch's scaled grouped GEMM on the same shapes (E4M3 rowwise on sm_90), joined with ours
  tmo --max $(( STAGE_DEADLINE - SECONDS - 2 )) python3 launch/baseline_fp8.py --shapes "32,4,2048,1024;128,8,2048,768" \
    --tokens 1,8,64,128,16384 --json "$LOGS/baseline_fp8.json" || rc=$?
  [[ -f $LOGS/bench_mxfp8.json && -f $LOGS/baseline_fp8.json ]] &&
    python3 launch/compare_fp8.py "$LOGS/bench_mxfp8.json" "$LOGS/baseline_fp8.json"
  KEY_FIG=$(grep -E '^ +32 +4 +2048 +1024 +1 ' "$CUR_LOG" | head -1 | awk '{printf "T=1: mxfp8 %s us (%s; fused %s), bf16 auto %s us, mx floor %s us", $8, $9, $22, $6, $14}')
  KEY_FIG+=$(grep -E '^ +32 +4 +2048 +1024 +16384 ' "$CUR_LOG" | head -1 | awk '{printf "; T=16384: block-128 %s us = %sx bf16", $18, $19}')
  KEY_FIG="${KEY_FIG:-no table} [rc $rc]"
  return $rc
}

# Dims that are multiples of 16, not of 128, beside the nearest multiples of 128 (time per FLOP).
DIMS16_SHAPES="32,4,2048,1024,16384 32,4,2064,1040,16384 32,4,2048,1040,16384 32,4,2064,1024,16384
  32,4,2048,1024,128 32,4,2064,1040,128 32,4,2048,1024,1 32,4,2064,1040,1
  32,8,7168,2048,2048 32,8,7168,2064,2048 32,8,7184,2048,2048"
stage_bench_dims16() {
  local bin=$BUILD/src/programs/epmoe_bench_experts rc=0 args=() sh
  for sh in $DIMS16_SHAPES; do args+=(--shape "$sh"); done
  [[ -x $bin ]] || { KEY_FIG="missing $bin"; return 1; }
  tmo --max $(( STAGE_DEADLINE - SECONDS - 5 )) "$bin" "${args[@]}" --json "$LOGS/bench_dims16.json" || rc=$?
  [[ -f $LOGS/bench_dims16.json ]] && { python3 launch/dims16_compare.py "$LOGS/bench_dims16.json" || rc=1; }
  KEY_FIG=$(grep -E '^ +32 +4 +2064 +1040 +16384 \|' "$CUR_LOG" | tail -1 | awk -F'|' '{split($4, a, " "); printf "2064/1040 T=16k: time/FLOP %s x of 2048/1024", a[1]}')
  KEY_FIG="${KEY_FIG:-no table} [rc $rc]"
  return $rc
}

# The capturable forward at decode sizes (graph replay vs the regular forward vs the weight floor).
stage_bench_capturable() {
  local bin=$BUILD/src/programs/epmoe_bench_capturable
  [[ -x $bin ]] || { KEY_FIG="missing $bin"; return 1; }
  local rc=0
  tmo --max $(( STAGE_DEADLINE - SECONDS )) "$bin" --json "$LOGS/bench_capturable.json" || rc=$?
  KEY_FIG=$(grep -E '^ +1 ' "$CUR_LOG" | awk '{printf "T=1: graph %s us (floor %s), regular %s us", $4, $3, $6}')
  KEY_FIG="${KEY_FIG:-no table} [rc $rc]"
  return $rc
}

stage_bench_ep() {
  local bin=$BUILD/src/programs/epmoe_bench_ep np=1 rc=0 rcb=0 rcc=0
  (( NGPU >= 2 )) && np=2
  rm -f "$OUT/bench_ep.json" "$OUT/ep_baseline.json"
  if [[ -x $bin ]]; then
    tmo --max $(( (STAGE_DEADLINE - SECONDS) / 2 )) mpirun -np "$np" --oversubscribe --allow-run-as-root --bind-to none \
      -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST -x NVSHMEM_DISABLE_NVLS -x LD_LIBRARY_PATH -x PATH \
      "$bin" --shapes "$EP_SHAPES" --json "$OUT/bench_ep.json" > "$LOGS/bench_ep_table.txt" || rc=$?
    cat "$LOGS/bench_ep_table.txt"
  else
    echo "missing $bin"; rc=1
  fi
  tmo --max $(( STAGE_DEADLINE - SECONDS - 15 )) python3 launch/ep_baseline.py --world "$np" --shapes "$EP_SHAPES" \
    --json "$OUT/ep_baseline.json" || rcb=$?
  if [[ -f $OUT/bench_ep.json && -f $OUT/ep_baseline.json ]]; then
    tmo python3 launch/compare_ep.py "$OUT/bench_ep.json" "$OUT/ep_baseline.json" > "$LOGS/compare_ep.txt" 2>&1 || rcc=$?
    cat "$LOGS/compare_ep.txt"
    KEY_FIG=$(grep -E "^geomean" "$LOGS/compare_ep.txt" | tail -1 || true)
  else
    rcc=1
  fi
  KEY_FIG="np $np: ${KEY_FIG:-no comparison} [bench rc $rc, baseline rc $rcb, compare rc $rcc]"
  (( rc == 0 && rcb == 0 && rcc == 0 ))
}

# One rank: the torch baseline is one GPU. launch/train_baseline.py is our copy of
# ../shared/baselines/train_baseline.py (../shared does not travel to the device machine).
stage_bench_train() {
  local bin=$BUILD/src/programs/epmoe_bench_train rc=0 rcb=0 rcc=0 budget=400 warm=500 rev
  [[ $QUICK == 1 ]] && { budget=150; warm=200; }
  rev=$(git rev-parse --short HEAD 2> /dev/null || echo unknown)
  [[ $rev != unknown && -n $(git status --porcelain --untracked-files=no 2> /dev/null) ]] && rev+="-dirty"
  rm -f "$OUT/train_compare.json" "$OUT/bench_train.json"
  if [[ -x $bin ]]; then
    tmo --max $(( (STAGE_DEADLINE - SECONDS) / 2 )) mpirun -np 1 --oversubscribe --allow-run-as-root --bind-to none \
      -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST -x NVSHMEM_DISABLE_NVLS -x LD_LIBRARY_PATH -x PATH \
      "$bin" --budget-ms "$budget" --warmup-ms "$warm" --commit "$rev" --json "$LOGS/bench_train.json" \
      > "$LOGS/bench_train_table.txt" || rc=$?
    cat "$LOGS/bench_train_table.txt"
  else
    echo "missing $bin"; rc=1
  fi
  tmo --max $(( STAGE_DEADLINE - SECONDS - 15 )) python3 launch/train_baseline.py --json "$LOGS/train_baseline.json" || rcb=$?
  if [[ -f $LOGS/bench_train.json && -f $LOGS/train_baseline.json ]]; then
    tmo python3 launch/compare_train.py "$LOGS/bench_train.json" "$LOGS/train_baseline.json" \
      --json "$OUT/train_compare.json" --png "$LOGS/train_speedup.png" > "$LOGS/compare_train.txt" 2>&1 || rcc=$?
    cat "$LOGS/compare_train.txt"
    KEY_FIG=$(grep -E "^geomean" "$LOGS/compare_train.txt" | tail -1 || true)
  else
    rcc=1
  fi
  if [[ ! -f $OUT/train_compare.json && -f $LOGS/bench_train.json ]]; then cp "$LOGS/bench_train.json" "$OUT/"; fi
  KEY_FIG="${KEY_FIG:-no comparison} [bench rc $rc, baseline rc $rcb, compare rc $rcc]"
  (( rc == 0 && rcb == 0 && rcc == 0 ))
}

stage_ncu() {
  local shapes=${GPU_CHECK_NCU_SHAPES:-32,4,2048,1024,16384 32,8,7168,2048,2048} rc=0
  # shellcheck disable=SC2086  # the shapes are words
  NCU_DIR=$LOGS/ncu tmo bash launch/ncu_compare.sh "$BUILD" $shapes > "$LOGS/ncu_table.txt" 2>&1 || rc=$?
  cat "$LOGS/ncu_table.txt"
  KEY_FIG="$(grep -c ' | ' "$LOGS/ncu_table.txt" || true) table rows (ncu_table.txt)"
  return $rc
}

# ---- the end: summary, logs tarball, file count ----------------------------------------------------

FINISHED=0
finish() {
  (( FINISHED )) && return
  FINISHED=1
  set +eu
  {
    echo "# gpu_check $(date -u '+%Y-%m-%d %H:%M:%S UTC'): $NGPU GPU(s), stages '$STAGES', quick $QUICK, $(( SECONDS - T0 ))s"
    printf "%-14s | %-6s | %7s | %s\n" stage status seconds "key figure"
    printf -- "---------------+--------+---------+------------------------------------------\n"
    for s in "${ORDER[@]}"; do
      printf "%-14s | %-6s | %7s | %s\n" "$s" "${STATUS[$s]:-?}" "${SECS[$s]:-0}" "${KEY[$s]:-}"
    done
  } > "$OUT/summary.txt.head"
  {
    for f in compare_experts compare_decode compare_ep compare_train; do
      [[ -f $LOGS/$f.txt ]] && { echo; echo "## $f"; cat "$LOGS/$f.txt"; }
    done
    [[ -f $LOGS/bench_ep_table.txt ]] && { echo; echo "## epmoe_bench_ep"; cat "$LOGS/bench_ep_table.txt"; }
    [[ -f $LOGS/bench_train_table.txt ]] && { echo; echo "## epmoe_bench_train"; cat "$LOGS/bench_train_table.txt"; }
    [[ -f $LOGS/ncu_table.txt ]] && { echo; echo "## ncu_compare"; cat "$LOGS/ncu_table.txt"; }
    if [[ -f $LOGS/sass.log ]]; then echo; echo "## SASS (sm90 up/down kernels)"; sed -n '/HGMMA  LDL/,$p' "$LOGS/sass.log" | head -20; fi
    if compgen -G "$LOGS/*.junit.xml" > /dev/null; then
      echo; echo "## reliability matrix (issue 49: case, expected, observed)"
      python3 launch/reliability_matrix.py "$LOGS"/*.junit.xml
    fi
    echo
    cat "$OUT/summary.txt.head"
  } > "$OUT/summary.txt"
  rm -f "$OUT/summary.txt.head"
  tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$LOGS"
  local nfiles; nfiles=$(find "$OUT" -type f | wc -l)
  echo
  cat "$OUT/summary.txt"
  echo "# \$OUT holds $nfiles file(s): $(cd "$OUT" && ls | tr '\n' ' ')"
  (( nfiles <= 8 )) || echo "# WARNING: more than 8 files under \$OUT: some will not come back"
}
trap finish EXIT

# ---- run -----------------------------------------------------------------------------------------

log "repo $(pwd), OUT=$OUT, stages '$STAGES', quick $QUICK, budget ${BUDGET}s, $NCPU cores"
nvidia-smi -L || echo "nvidia-smi failed"
NGPU=$(nvidia-smi -L 2> /dev/null | grep -c '^GPU' || true)
NGPU=${NGPU:-0}
echo "GPU count: $NGPU"
nvcc --version | tail -2 || true
cmake --version | head -1 || true

run_stage build 330 stage_build
run_stage cpu 90 stage_cpu
run_stage gpu 220 stage_gpu
run_stage mpi 150 stage_mpi
run_stage torch 240 stage_torch
run_stage run 120 stage_run
run_stage train 200 stage_train
run_stage sass 60 stage_sass
run_stage sanitizer 270 stage_sanitizer
run_stage bench_experts 240 stage_bench_experts
run_stage bench_decode 120 stage_bench_decode
run_stage bench_mxfp8 150 stage_bench_mxfp8
run_stage bench_dims16 90 stage_bench_dims16
run_stage bench_capturable 90 stage_bench_capturable
run_stage bench_ep 180 stage_bench_ep
run_stage bench_train 240 stage_bench_train
run_stage scaling 240 stage_scaling
run_stage ncu 300 stage_ncu

overall=0
for s in "${ORDER[@]}"; do [[ ${STATUS[$s]} == FAIL ]] && overall=1; done
finish
exit $overall
