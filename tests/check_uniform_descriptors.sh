#!/usr/bin/env bash
# The sm_90a kernels' wgmma descriptors stay in the uniform datapath (measured: one
# loop bound ptxas could not prove warp-uniform put ~4 R2UR before every HGMMA and cost the 16k layer
# 0.6-1.8%). Compiles the kernel files that issue HGMMA (the core's k loop) to cubins with the
# release flags and checks with launch/sass_opcodes.py that no kernel copies its descriptors with
# R2UR in its k loops. No GPU.
#   check_uniform_descriptors.sh NVCC PYTHON SOURCE_DIR GENERATED_DIR WORK_DIR
set -euo pipefail
nvcc=$1 py=$2 src=$3 gen=$4 work=$5
mkdir -p "$work"
# Every kernel file under kernels/sm90 that runs the core's k loop (core/mainloop.cuh: mainloop<Tile128>,
# mainloop<Tile192>, directly or through work_items.cuh's consume_item): a new one is checked too.
mapfile -t files < <(find "$src/kernels/sm90" -name '*.cu' -print0 | sort -z |
                     xargs -0 grep -l 'mainloop<\|consume_item(')
if (( ${#files[@]} == 0 )); then
  echo "no kernel file running the core's mainloop found under $src/kernels/sm90"
  exit 1
fi
echo "checking ${#files[@]} kernel files: ${files[*]##*/}"
cubins=()
pids=()
for path in "${files[@]}"; do
  f=$(basename "$path" .cu)
  "$nvcc" -I"$src" -I"$src/src" -I"$gen" -O3 -DNDEBUG -gencode=arch=compute_90a,code=sm_90a \
          --expt-relaxed-constexpr -std=c++20 -cubin "$path" -o "$work/$f.cubin" &
  pids+=($!)
  cubins+=("$work/$f.cubin")
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
if (( rc != 0 )); then
  echo "nvcc failed on a kernel file"
  exit 1
fi
exec "$py" "$src/launch/sass_opcodes.py" uniform "${cubins[@]}"
