#!/usr/bin/env bash
# Builds everything and runs every test (README's test command). On a machine without a GPU the
# GPU suites report themselves skipped. BUILD_DIR (default build), JOBS (default nproc).
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup_deps.sh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
BUILD_DIR=${BUILD_DIR:-build}
JOBS=${JOBS:-$(nproc)}
[ -x /usr/local/cuda/bin/nvcc ] && export PATH=/usr/local/cuda/bin:$PATH CUDACXX=${CUDACXX:-/usr/local/cuda/bin/nvcc}
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release ${CMAKE_ARGS:-}
cmake --build "$BUILD_DIR" -j "$JOBS"
cd "$BUILD_DIR"
ctest --output-on-failure -j "$JOBS" --timeout 900
