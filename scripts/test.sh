#!/usr/bin/env bash
# The test command: install (idempotent), lint, type-check, then the whole suite in parallel
# (pytest-xdist, $POLAR_TEST_WORKERS workers). The real vLLM server is started once, in the
# background, as soon as the run knows a test needs it (tests/support/scheduling.py); the tests that
# need it run one after another in one worker. Set POLAR_TEST_BACKEND to reuse a server.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# The loop tests hold ~2 GB of checkpoints under $TMPDIR at once (2.07 GB measured): a full disk would show up as
# dozens of unrelated errors, so say it first.
free_gb=$(df -Pk "${TMPDIR:-/tmp}" | awk 'NR == 2 { print int($4 / 1048576) }')
if [ "${free_gb:-99}" -lt 5 ]; then
  echo "warning: ${free_gb} GB free under ${TMPDIR:-/tmp}; the suite needs about 5 GB" >&2
fi
.venv/bin/ruff check polar_mitm tests scripts polar_addon.py
.venv/bin/python -m mypy   # the typed contracts between packages ([tool.mypy] in pyproject.toml)
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n "${POLAR_TEST_WORKERS:-3}" "$@"
