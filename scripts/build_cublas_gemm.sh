#!/usr/bin/env bash
# Build src/runtime/cublas_gemm.cc alone into a tvm-ffi extension (no CUDA headers or libraries
# needed), for GPU runs before the runtime library's CMake build carries it.
# Usage: scripts/build_cublas_gemm.sh OUT.so [PYTHON]
set -euo pipefail
out=${1:?usage: build_cublas_gemm.sh OUT.so [PYTHON]}
py=${2:-python}
inc=$("$py" -c "import tvm_ffi.libinfo as l; print(l.find_include_path())")
libdir=$("$py" -c "import tvm_ffi.libinfo as l, os; print(os.path.dirname(l.find_libtvm_ffi()))")
root=$(cd "$(dirname "$0")/.." && pwd)
${CXX:-g++} -std=c++17 -O2 -fPIC -shared "$root/src/runtime/cublas_gemm.cc" -o "$out" \
  -I"$inc" -L"$libdir" -ltvm_ffi -ldl -Wl,--no-undefined
