#!/usr/bin/env bash
# The GPU self-check, the first thing to run on a GPU machine: every test marked `cuda`, then a pass/fail table.
#   bash setup/gpu_check.sh [pytest args]     (VENV=path for another virtualenv, default .venv)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
VENV="$VENV" bash setup/create_env.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
exec "$VENV/bin/python" -m apps.debug.gpu_check "$@"
