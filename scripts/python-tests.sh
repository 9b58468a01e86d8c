#!/usr/bin/env bash
# Runs the Python tests when the Python package is present (python/tests). Nothing to do otherwise.
set -euo pipefail
if [ -d python/tests ] && ls python/tests/test_*.py >/dev/null 2>&1; then
  python3 -m pytest -q python/tests
fi
