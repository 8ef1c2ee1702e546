#!/usr/bin/env bash
# `make test`: the real-engine tests that start vLLM instances (marker `vllm` and not
# `vllm_light`: ~19 min here, mostly vLLM starting and computing) and every other test (~17 min
# beside them, the `vllm_light` ones included: they only run the vLLM venv's Python) run as two
# pytest processes at once, so the suite takes about as long as its real-engine half instead
# of both halves in a row. Each process hands out ports from its own band (DUALPATH_PORT_BAND,
# tools/cluster/config.free_port); the real-engine half's output is printed after the rest's.
# Exit: the first failing half's status (5 only when both collected nothing). Extra arguments
# go to both pytest runs.
# A half that dies of a signal (a crash in an extension: exit 128+N) is summarised last — its
# fatal-error dump with pytest's own frames left out, so the test and the thread that crashed
# show in the tail of a long log.
set -u
PY=${PY:-.venv/bin/python}
# Python 3.11's ast module keeps its recursion counter per interpreter, not per thread: an
# ast.parse in one thread while another formats a traceback (3.11 calls ast.parse for the
# ^^^ markers) fails with "SystemError: AST constructor recursion depth mismatch" — it killed
# a real-engine half with INTERNALERROR while pytest reported a failure (CPython gh-106905,
# fixed in 3.12 only). Without column positions, traceback formatting never parses.
export PYTHONNODEBUGRANGES=1
# faulthandler from the interpreter's start, so a crash after pytest's own handler is undone
# (at exit) still dumps the threads' stacks
export PYTHONFAULTHANDLER=1
log=$(mktemp -t dualpath-vllm-tests.XXXXXX)
restlog=$(mktemp -t dualpath-rest-tests.XXXXXX)
DUALPATH_PORT_BAND=1/2 "$PY" -m pytest -q --durations=15 -m "vllm and not vllm_light" "$@" >"$log" 2>&1 &
engine_pid=$!
trap 'kill "$engine_pid" 2>/dev/null; rm -f "$log" "$restlog"' INT TERM
echo "== make test: the real-engine tests (-m \"vllm and not vllm_light\") run beside the rest (pid $engine_pid); their output follows the rest's"
DUALPATH_PORT_BAND=0/2 "$PY" -m pytest -q --durations=15 -m "not vllm or vllm_light" "$@" 2>&1 \
    | tee "$restlog"
rest=${PIPESTATUS[0]}
wait "$engine_pid"
engine=$?
echo
echo "== the real-engine tests (-m \"vllm and not vllm_light\"), run beside the rest:"
cat "$log"
for half in "rest:$restlog:$rest" "real-engine:$log:$engine"; do
    IFS=: read -r name file rc <<<"$half"
    if [ "$rc" -gt 128 ]; then
        echo "== the $name tests died of signal $((rc - 128)); their fatal-error dump without pytest's frames:"
        # the dump's first line follows pytest's progress dots on the same line: unanchored
        if grep -q 'Fatal Python error' "$file"; then
            awk '/Fatal Python error/{p=1} /^Extension modules/{p=0} p' "$file" \
                | grep -Ev 'site-packages/(_pytest|pluggy|pytest)/|^  File "<frozen runpy>"' \
                | head -150
        else    # aborted in native code with no Python handler left: what it printed last
            echo "== (no Python fatal-error dump in its log; its last 40 lines:)"
            tail -n 40 "$file"
        fi
    fi
done
rm -f "$log" "$restlog"
echo "== make test: the rest exited $rest, the real-engine tests $engine"
for rc in "$rest" "$engine"; do
    if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then exit "$rc"; fi
done
if [ "$rest" -eq 5 ] && [ "$engine" -eq 5 ]; then exit 5; fi
exit 0
