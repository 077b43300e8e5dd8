#!/usr/bin/env bash
# The trainer on a bare CUDA machine (torch and transformers, no vLLM, DuckDB or network):
# CPU float32 against CUDA flex attention (fp32, bf16) on the test groups, then tokens/s and
# MFU of one fwd+bwd step at a Qwen3-1.7B shape, per builder. See gpu_check.py.
#   bash scripts/gpu_check.sh            (from the repository root)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
PY=${PYTHON:-python3}
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
exec "$PY" scripts/gpu_check.py "$@"
