#!/usr/bin/env bash
# The test command: install (idempotent), then the whole suite. The real vLLM server is
# started once by the test session (minutes on CPU); set POLAR_TEST_BACKEND to reuse one.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
.venv/bin/ruff check polar_mitm tests scripts polar_addon.py
.venv/bin/python -m mypy   # the typed contracts between packages ([tool.mypy] in pyproject.toml)
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
