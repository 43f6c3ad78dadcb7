#!/usr/bin/env bash
# One device call: the CPU test suite against megatron-core 0.19 and 0.14 (which
# need Python 3.12, as the GPU machine has), then the compute-side benchmark.
# Run from the repo root with .whl carried (see ../shared/device/wheels.sh):
#   bash benchmarks/gpu_session.sh        ($OUT receives the logs and JSON)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
TESTS=${TESTS:-tests}
VERSIONS=${VERSIONS:-mc019 mc014}
export PYTHONUNBUFFERED=1 TORCH_NCCL_ASYNC_ERROR_HANDLING=1 CUDA_DEVICE_MAX_CONNECTIONS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
PYTHONPATH=/tmp/site:$PYTHONPATH
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site_mc019 .whl/mc019/*.whl
[ -n "${SKIP_BENCH:-}" ] || PYTHONPATH=/tmp/site_mc019:$PYTHONPATH python3 benchmarks/compute_side.py --out "$OUT/compute_side.json" 2>&1 | tee "$OUT/compute_side.log"
for v in $VERSIONS; do
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site_$v .whl/$v/*.whl
  echo "== megatron-core $(ls .whl/$v)"
  CUDA_VISIBLE_DEVICES= PYTHONPATH=/tmp/site_$v:/tmp/site:$PWD timeout 280 python3 -m pytest -q \
    -p no:cacheprovider -n 6 --dist loadfile -rfE --tb=short $TESTS \
    --ignore=tests/test_telemetry.py --ignore=tests/test_ab_demo.py > "$OUT/tests_$v.log" 2>&1
  tail -8 "$OUT/tests_$v.log"
done
