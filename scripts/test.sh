#!/usr/bin/env bash
# The test suite: Python tests (CPU; GPU tests skip without a GPU) and the C++ unit tests.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m pytest -q tests/python "$@"
