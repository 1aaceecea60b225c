#!/usr/bin/env bash
# Fails when a shared library defines libstdc++'s own symbols (std::locale, std::ostream's inserters,
# the codecvt facets): a statically linked C++ runtime beside libtorch's shared one.
#   check_shared_libstdcxx.sh LIB.so
set -euo pipefail
lib=$1
command -v nm >/dev/null || { echo "nm not found"; exit 1; }
defs=$(nm -D --defined-only "$lib" | grep -cE ' (_ZNSt6locale|_ZNSo9_M_insert|_ZNKSt7codecvt|_ZNSt7codecvt)' || true)
needed=$(readelf -d "$lib" | grep -c 'NEEDED.*libstdc++' || true)
echo "$lib: libstdc++ symbols defined: $defs; NEEDED libstdc++: $needed"
[[ $defs == 0 && $needed -ge 1 ]] || { echo "FAIL: $lib carries its own libstdc++"; exit 1; }
echo PASS
