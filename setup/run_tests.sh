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
# Each tier runs in its own process group (set -m): background jobs would otherwise ignore SIGINT, and Ctrl-C or
# a SIGTERM to this script is forwarded to both as SIGINT, so pytest stops its launches and reports.
set -m
tier() {  # pytest (exec: the job's pid is its own), with KeyboardInterrupt even where SIGINT came in ignored
  exec "$VENV/bin/python" -c 'import signal, sys, pytest
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.exit(pytest.main())' -q "$@" < /dev/null
}
fast_dir=$(mktemp -d)
tier -m "not slow" -p no:cacheprovider --basetemp "$fast_dir/tmp" > "$fast_dir/log" 2>&1 &
fast_pid=$!
tier -m slow --durations=15 &  # the slowest launches listed: what to trim when CI nears its budget
slow_pid=$!
trap 'kill -INT "$slow_pid" "$fast_pid" 2>/dev/null || true' INT TERM
report_fast_tier() {
  echo; echo "=== the fast tier (pytest -m 'not slow'), run beside the slow tier ==="
  cat "$fast_dir/log"; rm -rf "$fast_dir"
}
trap report_fast_tier EXIT  # also when this script is stopped: the fast tier's output is not lost
exit_status_of() {  # a tier's exit status; a trapped signal interrupts `wait`, which then waits again
  local rc
  while :; do
    rc=0; wait "$1" || rc=$?
    if [ "$rc" -gt 128 ] && kill -0 "$1" 2>/dev/null; then continue; fi
    return "$rc"
  done
}
slow_rc=0; exit_status_of "$slow_pid" || slow_rc=$?
fast_rc=0; exit_status_of "$fast_pid" || fast_rc=$?
echo "=== slow tier exit status $slow_rc, fast tier $fast_rc (the fast tier's report follows) ==="
[ "$slow_rc" = 0 ] && [ "$fast_rc" = 0 ] && exit 0
exit 1
