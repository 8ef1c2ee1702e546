#!/usr/bin/env bash
# `make test`: the real-engine tests (marker `vllm`: ~23 min here in a row, mostly vLLM starting
# and computing) and every other test (~10 min) run as two lanes of pytest processes at once,
# so the suite takes about as long as its longer lane instead of all of it in a row:
#   lane 1: every other test, then the real-engine modules in $TAIL (the ones that only need a
#           cluster to come up and tolerate a busy host: faults, demo, start-up refusals);
#   lane 2: the rest of the real-engine tests.
# Each lane hands out ports from its own band (DUALPATH_PORT_BAND, tools/cluster/config.free_port);
# lane 2's output is printed after lane 1's. Exit: the first failing run's status (5 only when
# every run collected nothing). Extra arguments go to every pytest run.
set -u
PY=${PY:-.venv/bin/python}
TAIL="tests/test_vllm_faults.py tests/test_vllm_demo.py tests/test_vllm_failures.py"
ignore=()
for f in $TAIL; do ignore+=("--ignore=$f"); done
log=$(mktemp -t dualpath-vllm-tests.XXXXXX)
DUALPATH_PORT_BAND=1/2 "$PY" -m pytest -q --durations=15 -m vllm "${ignore[@]}" "$@" >"$log" 2>&1 &
engine_pid=$!
trap 'kill "$engine_pid" 2>/dev/null; rm -f "$log"' INT TERM
echo "== make test: lane 2, the real-engine tests but $TAIL (-m vllm), runs beside lane 1 (pid $engine_pid); its output follows"
DUALPATH_PORT_BAND=0/2 "$PY" -m pytest -q --durations=15 -m "not vllm" "$@"
rest=$?
echo
echo "== lane 1, then: $TAIL"
# shellcheck disable=SC2086
DUALPATH_PORT_BAND=0/2 "$PY" -m pytest -q --durations=5 -m vllm $TAIL "$@"
tail_rc=$?
wait "$engine_pid"
engine=$?
echo
echo "== lane 2, the real-engine tests (-m vllm) but $TAIL, run beside lane 1:"
cat "$log"
rm -f "$log"
echo "== make test: the rest exited $rest, the real-engine tail $tail_rc, the other real-engine tests $engine"
for rc in "$rest" "$tail_rc" "$engine"; do
    if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then exit "$rc"; fi
done
if [ "$rest" -eq 5 ] && [ "$tail_rc" -eq 5 ] && [ "$engine" -eq 5 ]; then exit 5; fi
exit 0
