set -u
source launch/env.sh
cmake --preset h200 > /dev/null 2>&1 || exit 1
cmake --build build-gpu -j16 --target test_mxfp8_gpu > /tmp/b.log 2>&1 || { grep error /tmp/b.log | head; exit 1; }
timeout 150 build-gpu/tests/gpu/test_mxfp8_gpu 2>&1 | grep -E "OK|FAILED|Failure|Actual" | head -20
