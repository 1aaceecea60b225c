#!/usr/bin/env bash
# The main job (README's run command): builds if needed, then runs the EP forward on synthetic
# data — on the GPUs present (one MPI rank per GPU, NCCL), else on 4 CPU mock ranks — and prints
# the per-rank table and the max error against the dense reference. Extra arguments go to
# epmoe_run (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup_deps.sh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
BUILD_DIR=${BUILD_DIR:-build}
[ -x /usr/local/cuda/bin/nvcc ] && export PATH=/usr/local/cuda/bin:$PATH CUDACXX=${CUDACXX:-/usr/local/cuda/bin/nvcc}
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release ${CMAKE_ARGS:-} >/dev/null
cmake --build "$BUILD_DIR" -j "$(nproc)" --target epmoe_run
ngpu=0
command -v nvidia-smi >/dev/null && ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if [ "$ngpu" -ge 1 ]; then
  echo "[run] $ngpu GPU(s): mpirun -np $ngpu, NCCL"
  exec mpirun -np "$ngpu" -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST -x NVSHMEM_DISABLE_NVLS \
    "$BUILD_DIR/src/programs/epmoe_run" --tokens 4096 --hidden 2048 --ffn 1024 --check-tokens 32 "$@"
else
  echo "[run] no GPU: 4 CPU mock ranks"
  exec "$BUILD_DIR/src/programs/epmoe_run" --mock-ranks 4 "$@"
fi
