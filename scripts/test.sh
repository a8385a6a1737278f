#!/usr/bin/env bash
# The test suite: Python tests (CPU; GPU tests skip without a GPU), then the C++ tests (ctest).
set -euo pipefail
cd "$(dirname "$0")/.."
# Test files run in parallel, one per worker (pytest-xdist; a file's fixtures compile once): as many
# workers as cores, at most 4 (each holds torch and TVM). `scripts/test.sh -n 0` runs in one process.
jobs=$(.venv/bin/python -c "import os; print(min(4, len(os.sched_getaffinity(0))))")
.venv/bin/python -m pytest -q -n "$jobs" --dist loadfile tests/python "$@"
# C++ unit tests of the page pool bookkeeping (ctest); cmake/ninja come with setup.sh.
PATH="$PWD/.venv/bin:$PATH" cmake -S . -B build/cpp-tests -G Ninja -DMLC_LORA_BUILD_TESTS=ON \
  -DPython_EXECUTABLE="$PWD/.venv/bin/python" > /dev/null
PATH="$PWD/.venv/bin:$PATH" cmake --build build/cpp-tests --target test_page_pool > /dev/null
PATH="$PWD/.venv/bin:$PATH" ctest --test-dir build/cpp-tests --output-on-failure
# The C++ embedding API (cpp/): tokenizer vs the tokenizers library, the example chat app vs the
# Python engine, bad-input handling.
PATH="$PWD/.venv/bin:$PATH" cmake -S cpp -B build/cpp -G Ninja -DMLC_LORA_PYTHON="$PWD/.venv/bin/python" > /dev/null
PATH="$PWD/.venv/bin:$PATH" cmake --build build/cpp > /dev/null
PATH="$PWD/.venv/bin:$PATH" ctest --test-dir build/cpp -j2 --output-on-failure
