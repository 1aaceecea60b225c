#!/usr/bin/env bash
# Builds everything and runs every test (README's test command). On a machine without a GPU the
# GPU suites report themselves skipped. Then the CPU suites again under AddressSanitizer and
# UndefinedBehaviorSanitizer (CMake preset asan, build-asan/) and, without the mpirun suites, under
# ThreadSanitizer (preset tsan: the mock ranks are threads); EPMOE_TEST_SANITIZERS=0 skips both.
# BUILD_DIR (default build), JOBS (default nproc).
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup_deps.sh
source launch/env.sh
JOBS=${JOBS:-$(nproc)}
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release ${CMAKE_ARGS:-}
cmake --build "$BUILD_DIR" -j "$JOBS"
(cd "$BUILD_DIR" && ctest --output-on-failure -j "$JOBS" --timeout 900)
if [[ ${EPMOE_TEST_SANITIZERS:-1} != 0 ]]; then
  for preset in asan tsan; do
    echo "[test] the CPU suites under the $preset preset"
    cmake --preset "$preset"
    cmake --build --preset "$preset" -j "$JOBS"
    ctest --preset "$preset" -j "$JOBS" --timeout 900
  done
fi
