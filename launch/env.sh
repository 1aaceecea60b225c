# Sourced by launch/run.sh and launch/test.sh: the environment every epmoe process runs in.
# mpirun as root (containers, CI) and oversubscription for CPU mock/MPI ranks; NVLink multicast off
# in NCCL, torch and NVSHMEM (the shared H200 hosts require it); the CUDA 13 toolkit when present.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
BUILD_DIR=${BUILD_DIR:-build}
if [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH=/usr/local/cuda/bin:$PATH CUDACXX=${CUDACXX:-/usr/local/cuda/bin/nvcc}
fi
