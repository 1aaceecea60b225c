set -u
source launch/env.sh
mkdir -p $OUT
cmake --preset h200 > $OUT/cfg.log 2>&1 || { tail -30 $OUT/cfg.log; exit 1; }
cmake --build build-gpu -j16 --target epmoe_bench_mxfp8 > $OUT/build0.log 2>&1 || { grep -E "error" $OUT/build0.log | head -30; exit 1; }
B=$(find build-gpu -name epmoe_bench_mxfp8 -type f | head -1)
timeout 150 $B --shapes "32,4,2048,1024;128,8,2048,768" --tokens 1,8,64,128 --json $OUT/mx.json 2>&1 | tail -12
GPU_CHECK_STAGES=build,gpu GPU_CHECK_QUICK=1 GPU_CHECK_BUDGET_S=380 OUT=/tmp/gc bash launch/gpu_check.sh > /tmp/gc.log 2>&1
cp /tmp/gc/summary.txt /tmp/gc/logs.tar.gz $OUT/ 2>/dev/null
grep -E "^(build|gpu) " /tmp/gc/summary.txt; grep -E "Failed|\*\*\*" /tmp/gc.log | head; tar xzf /tmp/gc/logs.tar.gz -C /tmp/gc 2>/dev/null; grep -E "mx swap\]|tests passed|FAILED" -r /tmp/gc/logs/gpu.log | head -20
