#!/usr/bin/env bash
# Set up the environment (idempotent) and run the whole test suite: bash setup/run_tests.sh [pytest args]
# VENV=path uses or creates another virtualenv (default .venv), as setup/create_env.sh and setup/demo.sh do.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
VENV="$VENV" bash setup/create_env.sh
# The suite starts hundreds of python processes; where PYTHONDONTWRITEBYTECODE is set (as on our machines) none
# of them keeps its compiled modules, so each would compile this repository's code again: compile it once here.
"$VENV/bin/python" -m compileall -qq apps lingua setup tests || true
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
exec "$VENV/bin/python" -m pytest -q "$@"
