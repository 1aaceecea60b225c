#!/usr/bin/env bash
# The main job (README's run command): builds if needed, then runs the EP forward on synthetic
# data — on the GPUs present (one MPI rank per GPU, NCCL), else on 4 CPU mock ranks — and prints
# the per-rank table and the max error against the dense reference. Extra arguments go to
# epmoe_run (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup_deps.sh
source launch/env.sh
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
