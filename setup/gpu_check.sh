#!/usr/bin/env bash
# The GPU self-check, the first thing to run on a GPU machine: every test marked `cuda`, then a pass/fail table,
# written with every check's logs to the folder it names on its first line (dumps/gpu_check/<UTC time>).
#   bash setup/gpu_check.sh [--quick] [--out DIR] [pytest args]   (--quick: one GPU's in-process checks, ~1 min)
#   bash setup/gpu_check.sh --list   every check with the GPUs it needs (1, 2 or 3) and what it checks; runs nothing
#   bash setup/gpu_check.sh --bench [--out DIR]   the loss bench against Liger-Kernel at two shapes, then the feeding
#                                                 bench and whole steps, CE-only vs KD from a cache (apps/debug/gpu_bench.py)
#   VENV=path for another virtualenv (default .venv); CREATE_ENV=0 uses it as it is (an offline machine).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
if [ "${CREATE_ENV:-1}" != 0 ]; then
  VENV="$VENV" bash setup/create_env.sh
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
if [ "${1:-}" = "--bench" ]; then
  shift
  # The feeding bench reads the corpus and SmolLM2's tokenizer (both offline, once; outside the bench's clock).
  "$VENV/bin/python" -m setup.prepare_corpus > /dev/null
  "$VENV/bin/python" -m setup.prepare_teacher > /dev/null
  exec "$VENV/bin/python" -m apps.debug.gpu_bench "$@"
fi
exec "$VENV/bin/python" -m apps.debug.gpu_check "$@"
