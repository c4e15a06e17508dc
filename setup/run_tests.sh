#!/usr/bin/env bash
# Set up the environment (idempotent) and run the whole test suite: bash setup/run_tests.sh [pytest args]
# (with pytest args: one pytest with them; without: the slow and the fast tier at once, both must pass).
# VENV=path uses or creates another virtualenv (default .venv), as setup/create_env.sh and setup/demo.sh do.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
VENV="$VENV" bash setup/create_env.sh
# The suite starts hundreds of python processes; where PYTHONDONTWRITEBYTECODE is set (as on our machines) none
# of them keeps its compiled modules, so each would compile this repository's code again: compile it once here.
"$VENV/bin/python" -m compileall -qq apps lingua setup tests || true
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
if [ $# -gt 0 ]; then
  exec "$VENV/bin/python" -m pytest -q "$@"
fi
# Everything: the two tiers at once. The slow tier's launches leave about a third of two cores idle (imports,
# rendezvous, deliberate timeouts), which the fast tier's in-process tests fill; its report follows the slow one.
fast_dir=$(mktemp -d)
"$VENV/bin/python" -m pytest -q -m "not slow" -p no:cacheprovider --basetemp "$fast_dir/tmp" > "$fast_dir/log" 2>&1 &
fast_pid=$!
trap 'kill "$fast_pid" 2>/dev/null || true; rm -rf "$fast_dir"' EXIT  # interrupted: the fast tier stops too
slow_rc=0
"$VENV/bin/python" -m pytest -q -m slow || slow_rc=$?
fast_rc=0
wait "$fast_pid" || fast_rc=$?
echo; echo "=== the fast tier (pytest -m 'not slow'), run beside the slow tier ==="
cat "$fast_dir/log"
echo "=== slow tier exit status $slow_rc, fast tier $fast_rc ==="
[ "$slow_rc" = 0 ] && [ "$fast_rc" = 0 ] && exit 0
exit 1
