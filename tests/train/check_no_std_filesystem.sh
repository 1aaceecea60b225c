#!/usr/bin/env bash
# Fails when a binary that links libtorch imports std::filesystem: pip's libtorch.so exports its own
# copies of those functions, and the binary binds to them ahead of libstdc++'s (on the H200 machines'
# torch 2.11, std::filesystem::remove_all there jumped to a null address: src/programs/posix_files.h).
#   check_no_std_filesystem.sh BINARY...
set -euo pipefail
command -v nm >/dev/null || { echo "nm not found"; exit 1; }
bad=0
for bin in "$@"; do
  n=$(nm -D -u --demangle "$bin" | grep -c 'std::filesystem::' || true)
  echo "$bin: std::filesystem imports: $n"
  if (( n )); then nm -D -u --demangle "$bin" | grep 'std::filesystem::' | head -5; bad=1; fi
done
(( bad == 0 )) || { echo "FAIL: use src/programs/posix_files.h instead"; exit 1; }
echo PASS
