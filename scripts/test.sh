#!/usr/bin/env bash
# The test suite: Python tests (CPU; GPU tests skip without a GPU) and the C++ unit tests.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m pytest -q tests/python "$@"
# C++ unit tests of the page pool bookkeeping (ctest); cmake/ninja come with setup.sh.
PATH="$PWD/.venv/bin:$PATH" cmake -S . -B build/cpp-tests -G Ninja -DMLC_LORA_BUILD_TESTS=ON \
  -DPython_EXECUTABLE="$PWD/.venv/bin/python" > /dev/null
PATH="$PWD/.venv/bin:$PATH" cmake --build build/cpp-tests --target test_page_pool > /dev/null
PATH="$PWD/.venv/bin:$PATH" ctest --test-dir build/cpp-tests --output-on-failure
