# Sourced by launch/run.sh and launch/test.sh: the environment every epmoe process runs in.
# mpirun as root (containers, CI) and oversubscription for CPU mock/MPI ranks; NVLink multicast off
# in NCCL, torch and NVSHMEM (the shared H200 hosts require it); the CUDA 13 toolkit when present.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
BUILD_DIR=${BUILD_DIR:-build}
if [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH=/usr/local/cuda/bin:$PATH CUDACXX=${CUDACXX:-/usr/local/cuda/bin/nvcc}
fi
# A C++ compiler whose runtime is the shared libstdc++ (libtorch's): the H200 image's CXX and
# CUDAHOSTCXX (/opt/gcc) have only libstdc++.a, and a second C++ runtime beside torch's crashes
# (CMakeLists.txt refuses it for the torch bindings). Keep $CXX where it finds libstdc++.so.
epmoe_cxx=${CXX:-c++}
if command -v "$epmoe_cxx" >/dev/null 2>&1 &&
   [[ $("$epmoe_cxx" -print-file-name=libstdc++.so 2>/dev/null) != /* ]] &&
   [ -x /usr/bin/g++ ] && [[ $(/usr/bin/g++ -print-file-name=libstdc++.so) == /* ]]; then
  echo "[env] $epmoe_cxx has no shared libstdc++: building with /usr/bin/g++" >&2
  export CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++
fi
unset epmoe_cxx
