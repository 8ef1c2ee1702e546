#!/usr/bin/env bash
# The GPU check (docs/performance.md, "GPU memory"): run on a host with a CUDA device, in the
# repository root, with Python's cupy installed. Under 5 minutes:
#   1. `python -m bench.gpu_bench`: pages GPU->GPU, host->GPU (pageable and pinned: through the
#      transport's pinned staging + one H2D copy per message) and GPU->host through the transport
#      between two processes, and host->GPU unstaged (UCX's own cuda_copy path, for comparison),
#      byte-exact, GB/s against cudaMemcpy of the same bytes in the same direction;
#   2. the data path with a node's pool on the device (tests/test_gpu_datapath.py: the PE's
#      buffer, then the DE's: both read paths, write-backs from device memory), the transport's
#      device-arena test (direct from a device sender, staged from a host one) and the staging
#      logic's own tests (tests/test_transport_device_staging.py, no GPU needed: this UCX).
# Results go to $OUT (default: a new temporary folder): gpu_bench.json, gpu_bench.log,
# gpu_tests.log. A host without network access installs the Python packages it lacks from the
# wheels in $WHEELS (pip download them elsewhere: ucxx-cu12 and its libraries, msgspec,
# structlog, pytest-asyncio), into /tmp/dualpath-site.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d -t dualpath-gpu-check.XXXXXX)}
PY=${PY:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -n "${WHEELS:-}" ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/dualpath-site "$WHEELS"/*.whl || { echo "installing $WHEELS failed" >&2; exit 1; }
    export PYTHONPATH="/tmp/dualpath-site:$PYTHONPATH"
fi
echo "== gpu check: $(date -u +%FT%TZ), results in $OUT"
nvidia-smi -L 2>&1 | head -4
"$PY" -c "import sys, cupy, ucxx; print('python', sys.version.split()[0], 'cupy', cupy.__version__, 'ucxx', ucxx.__version__, 'devices', cupy.cuda.runtime.getDeviceCount())" \
    || { echo "cupy or ucxx missing: nothing to check" >&2; exit 2; }
rc=0
echo "== 1. bench gpu (transport, two processes, vs cudaMemcpy)"
timeout 240 "$PY" -m bench.gpu_bench --out "$OUT/gpu_bench.json" 2>&1 | tee "$OUT/gpu_bench.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
echo "== 2. the data path with a pool on the device (PE, DE); the transport's device-arena tests"
timeout 220 "$PY" -m pytest -q -p no:cacheprovider -rs --timeout 150 tests/test_gpu_datapath.py \
    "tests/test_transport.py::test_device_arena_direct_messages" \
    tests/test_transport_device_staging.py 2>&1 | tee "$OUT/gpu_tests.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
echo "== gpu check done: exit $rc"
exit "$rc"
