#!/usr/bin/env bash
# Set up the environment (idempotent) and run the whole test suite: bash setup/run_tests.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash setup/create_env.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest -q "$@"
