#!/usr/bin/env bash
# The main job (README's run command): builds if needed, then trains a router and the expert-parallel
# MoE layer (AdamW, fp32 masters, bf16 experts) onto a fixed random teacher MoE - one MPI rank per GPU
# over NCCL when GPUs are present, else 4 CPU mock ranks - printing progress lines and writing
# $BUILD_DIR/train.json and $BUILD_DIR/train.png. Extra arguments go to epmoe_train (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup_deps.sh
source launch/env.sh
# torch's CMake package where python3's torch is a pip / venv one (the H200 machines'); Debian's
# libtorch-dev is found without a prefix.
torch_cmake=$(python3 -c 'import os, torch; p = torch.utils.cmake_prefix_path; print(p if os.path.isdir(p) else "")' \
  2>/dev/null || true)
[ -n "$torch_cmake" ] && CMAKE_ARGS="${CMAKE_ARGS:-} -DCMAKE_PREFIX_PATH=$torch_cmake"
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release ${CMAKE_ARGS:-} >/dev/null
cmake --build "$BUILD_DIR" -j "$(nproc)" --target epmoe_train
json="$BUILD_DIR/train.json" png="$BUILD_DIR/train.png"
ngpu=0
command -v nvidia-smi >/dev/null && ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if [ "$ngpu" -ge 1 ]; then
  echo "[run] $ngpu GPU(s): mpirun -np $ngpu, NCCL"
  mpirun -np "$ngpu" -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST -x NVSHMEM_DISABLE_NVLS \
    "$BUILD_DIR/src/programs/epmoe_train" --tokens 8192 --hidden 2048 --ffn 1024 --experts 32 --topk 4 \
    --steps 200 --json "$json" "$@"
else
  echo "[run] no GPU: 4 CPU mock ranks"
  "$BUILD_DIR/src/programs/epmoe_train" --mock-ranks 4 --json "$json" "$@"
fi
py=python3
/usr/bin/python3 -c 'import matplotlib' 2>/dev/null && py=/usr/bin/python3
"$py" launch/plot_train.py "$json" --png "$png" || echo "[run] no plot (matplotlib missing)"
