set -u
source launch/env.sh
mkdir -p $OUT
cmake --preset h200 > $OUT/cfg.log 2>&1 || { tail -30 $OUT/cfg.log; exit 1; }
cmake --build build-gpu -j16 --target test_sm90_mx_swap test_layout_gpu epmoe_bench_mxfp8 > $OUT/build.log 2>&1 || { grep -E "error" $OUT/build.log | head -30; exit 1; }
timeout 120 build-gpu/tests/gpu/test_sm90_mx_swap 2>&1 | grep -E "^\[mx swap\]|OK|FAILED|Failure|want" | head -40
timeout 60 build-gpu/tests/gpu/test_layout_gpu --gtest_filter='*Mx*' 2>&1 | tail -3
B=$(find build-gpu -name epmoe_bench_mxfp8 -type f | head -1)
timeout 150 $B --shapes "32,4,2048,1024;128,8,2048,768" --tokens 1,8,64,128 --json $OUT/mx.json 2>&1 | tail -12
M=gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed
for T in 1 8; do
timeout 100 ncu --clock-control none --cache-control all --kernel-name regex:mx_swap --launch-skip 55 --launch-count 2 --metrics $M --csv $B --shapes 32,4,2048,1024 --tokens $T > $OUT/ncu_mx_$T.csv 2>&1
timeout 100 ncu --clock-control none --cache-control all --kernel-name regex:swap_ab --launch-count 2 --metrics $M --csv $B --shapes 32,4,2048,1024 --tokens $T > $OUT/ncu_bf_$T.csv 2>&1
done
for f in $OUT/ncu_*.csv; do echo "== $f"; grep -E '"(gpu__time|dram__bytes|dram__thr|sm__thr)' $f | awk -F'","' '{print $5" | "$(NF-2)" "$(NF-1)" "$NF}' | cut -c1-150; done
