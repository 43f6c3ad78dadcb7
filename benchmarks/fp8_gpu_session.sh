#!/usr/bin/env bash
# FP8 on one GPU, in one device call: its GPU tests, the two FP8 benchmarks and
# a small GPT trained in FP8 and in bf16. From the repo root, with .whl/ carried (ignored by
# git: megatron-core 0.19.2 as ../shared/device/wheels.sh fetches it, torchao 0.18.0):
#
#   OUT=$OUT bash benchmarks/fp8_gpu_session.sh          # about 5 minutes on one H200
#
# Estimated wall time per piece on one H200 (each under its own timeout, which together
# with the wheels keep the whole under 9 minutes even when every piece runs to its limit):
#   wheels into /tmp/site                                       ~10-20 s
#   tests/gpu/test_fp8_gpu.py (2 ranks share the GPU, symm)     ~60-90 s   (timeout 150)
#   benchmarks/fp8_compute.py (24 passes x 4 arms, graphed)     ~40-60 s   (timeout 100)
#   benchmarks/fp8_layer.py   (2 layer shapes x 2 arms)         ~40-70 s   (timeout 120)
#   benchmarks/fp8_train.py   (2 ranks, 2 arms x 200 steps)     ~60-100 s  (timeout 140)
# $OUT gets 7 files: session.log (everything printed), fp8_gpu_tests.log,
# fp8_compute_gpu.json, fp8_layer_gpu.json, fp8_train_shared_gpu_tp2.{json,txt,png}.
# REPS / REPEAT / STEPS shorten or lengthen the benchmarks (defaults below).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fp8_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# torchao's float8 scaling is Python; its optional C++ extensions are not needed here
export TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1
export NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0
main() {
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --no-cache-dir \
    --target /tmp/site .whl/*.whl || exit 2
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader
python3 -c "import torch, torchao, megatron.core as m; print('torch', torch.__version__, 'torchao', \
torchao.__version__, 'megatron-core', getattr(m, '__version__', '?'), 'capability', torch.cuda.get_device_capability())" \
  2>&1 | grep -v "^W"
echo "sources $(find megatron_overlap tests benchmarks -name '*.py' | sort | xargs cat | sha1sum | cut -c1-12)"
step() { echo "== $1 rc=$2 in $(( $(date +%s) - t )) s"; }

t=$(date +%s)
timeout 150 python3 -m pytest -q -p no:cacheprovider -rfEs --tb=short --durations=5 \
  tests/gpu/test_fp8_gpu.py > "$OUT/fp8_gpu_tests.log" 2>&1
step "tests/gpu/test_fp8_gpu.py" $?; tail -25 "$OUT/fp8_gpu_tests.log"

t=$(date +%s)
timeout 100 python3 benchmarks/fp8_compute.py --reps "${REPS:-20}" --repeat "${REPEAT:-3}" \
  --out "$OUT" --tag gpu
step "benchmarks/fp8_compute.py" $?

t=$(date +%s)
timeout 120 python3 benchmarks/fp8_layer.py --reps "${REPS:-10}" --repeat "${REPEAT:-5}" --out "$OUT" --tag gpu
step "benchmarks/fp8_layer.py" $?

t=$(date +%s)
timeout 140 python3 benchmarks/fp8_train.py --steps "${STEPS:-200}" --out "$OUT"
step "benchmarks/fp8_train.py" $?
ls -la "$OUT"
}
main 2>&1 | tee "$OUT/session.log"
exit "${PIPESTATUS[0]}"
