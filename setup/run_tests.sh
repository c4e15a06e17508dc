#!/usr/bin/env bash
# Set up the environment (idempotent) and run the whole test suite: bash setup/run_tests.sh [pytest args]
# (with pytest args: one pytest with them; without: the slow and the fast tier at once, both must pass).
# The bench tier (benchmarks and studies run end to end, marked `bench`) is never part of it: tests/conftest.py
# leaves it out unless -m names it, so `bash setup/run_tests.sh -m bench` runs that tier alone.
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
# Everything, in four pytest runs on two cores, all of which must pass:
# - the slow tier's launches (torchrun jobs) from the start;
# - beside them the fast tier; once it is done, two runs beside the launches: the SLURM tests (one cluster, its
#   scheduler's waits) followed by the launches of LAUNCHES_AFTER_SLURM, and the other slow tests that wait most
#   (deliberate timeouts, signals and dead peers, spawned pools). The launches leave part of two cores idle, and
#   these fill it; the lists are chosen so that the three sides end together (docs/tests.md has the times).
# Each run is its own process group (set -m): background jobs would otherwise ignore SIGINT, and Ctrl-C or
# a SIGTERM to this script is forwarded to each as SIGINT, so pytest stops its launches and reports.
SLURM_SLOW=(tests/slurm)
LAUNCHES_AFTER_SLURM=(tests/dist/test_recovery.py tests/dist/test_several_teachers.py tests/dist/test_lingua_configs.py)
WAITING_SLOW=(tests/dist/test_hang_matrix.py tests/dist/test_startup_diag.py tests/unit/lingua/distillation/cache/test_writer.py
              tests/unit/lingua/loading/test_producer.py tests/unit/lingua/parallel/test_debug_switch.py tests/unit/apps/debug/test_postmortem.py
              tests/gpu/test_gpu_check.py tests/dist/test_peer_death.py
              tests/dist/test_lost.py)  # not the real teacher's tests: the demo's session converts it once for both
ignore_others=(); for path in "${SLURM_SLOW[@]}" "${LAUNCHES_AFTER_SLURM[@]}" "${WAITING_SLOW[@]}"; do ignore_others+=(--ignore "$path"); done
set -m
tier() {  # pytest (exec: the job's pid is its own), with KeyboardInterrupt even where SIGINT came in ignored
  exec "$VENV/bin/python" -c 'import signal, sys, pytest
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.exit(pytest.main())' -q "$@" < /dev/null
}
logs=$(mktemp -d)
tier -m "not slow" -p no:cacheprovider --basetemp "$logs/fast" > "$logs/fast.log" 2>&1 &
fast_pid=$!
tier -m slow --durations=15 "${ignore_others[@]}" &  # the slowest launches listed: what to trim near the budget
slow_pid=$!
slurm_pid= waiting_pid= interrupted=
trap 'interrupted=1; kill -INT $slow_pid $fast_pid $slurm_pid $waiting_pid 2>/dev/null || true' INT TERM
report_others() {
  echo; echo "=== the fast tier (pytest -m 'not slow'), run beside the slow launches ==="; cat "$logs/fast.log"
  if [ -f "$logs/slurm.log" ]; then
    echo; echo "=== ${SLURM_SLOW[*]} then ${LAUNCHES_AFTER_SLURM[*]}, run after the fast tier ==="; cat "$logs/slurm.log"
  fi
  if [ -f "$logs/waiting.log" ]; then
    echo; echo "=== the waiting slow tests (${WAITING_SLOW[*]}), run after the fast tier ==="; cat "$logs/waiting.log"
  fi
  rm -rf "$logs"
}
trap report_others EXIT  # also when this script is stopped: the other runs' output is not lost
exit_status_of() {  # a run's exit status; a trapped signal interrupts `wait`, which then waits again
  local rc
  while :; do
    rc=0; wait "$1" || rc=$?
    if [ "$rc" -gt 128 ] && kill -0 "$1" 2>/dev/null; then continue; fi
    return "$rc"
  done
}
fast_rc=0; exit_status_of "$fast_pid" || fast_rc=$?
slurm_rc=130 waiting_rc=130  # not started once this script was stopped: that counts as a failure
if [ -z "$interrupted" ]; then
  tier -m slow --durations=10 -p no:cacheprovider --basetemp "$logs/slurm" "${SLURM_SLOW[@]}" "${LAUNCHES_AFTER_SLURM[@]}" \
    > "$logs/slurm.log" 2>&1 &
  slurm_pid=$!
  tier -m slow --durations=10 -p no:cacheprovider --basetemp "$logs/waiting" "${WAITING_SLOW[@]}" > "$logs/waiting.log" 2>&1 &
  waiting_pid=$!
fi
slow_rc=0; exit_status_of "$slow_pid" || slow_rc=$?
[ -n "$slurm_pid" ] && { slurm_rc=0; exit_status_of "$slurm_pid" || slurm_rc=$?; }
[ -n "$waiting_pid" ] && { waiting_rc=0; exit_status_of "$waiting_pid" || waiting_rc=$?; }
echo "=== exit status: slow launches $slow_rc, fast tier $fast_rc, SLURM tests and the launches after them $slurm_rc," \
     "waiting slow tests $waiting_rc (their reports follow) ==="
[ "$slow_rc" = 0 ] && [ "$fast_rc" = 0 ] && [ "$slurm_rc" = 0 ] && [ "$waiting_rc" = 0 ] && exit 0
exit 1
