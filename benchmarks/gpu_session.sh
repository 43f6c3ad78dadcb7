#!/usr/bin/env bash
# One device call on the GPU machine (Python 3.12, no megatron-core there: carry
# .whl/ as ../shared/device/wheels.sh fetches it). Run from the repo root:
#   GPU_TESTS=1 BENCH=1 CPU_VERSIONS="mc019 mc014" bash benchmarks/gpu_session.sh
# GPU_TESTS: `make test-gpu` (ranks sharing the one GPU); BENCH: compute_side.py;
# NVSHMEM_PROBE: benchmarks/probe_nvshmem.py with 1 and 2 PEs; BENCH_SUITE: layer_overlap.py
# (unless SKIP_LAYER_OVERLAP) + step_ab.py with 2 shared-GPU ranks (JSON + PNG into $OUT);
# TUNE: `megatron-overlap tune` on this machine (TUNE_MODEL, TUNE_TP); EMULATED_NODES: layer_overlap.py
# over 2 emulated nodes (several GPUs); CPU_VERSIONS: the CPU suite against those megatron-core wheels;
# HOST_TIME: benchmarks/host_time.py, one run per TP in HT_TP (default "2 4 8"; each under its own
# timeout HT_TIMEOUT, results host_time_tpN.json); TUNE_CHECK: the tuner in its one-GPU mode for
# 70b/TP8 and 8b/TP2, then benchmarks/tune_check.py on its picks. $OUT gets the logs.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1
pipi() { python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --no-cache-dir --target "$@"; }
ls .whl/*.whl >/dev/null 2>&1 && pipi /tmp/site .whl/*.whl
pipi /tmp/site_mc019 .whl/mc019/*.whl
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
# nvshmem4py and cuda-core for the nvshmem transport (tests/gpu/test_nvshmem.py)
ls .whl/nvshmem/*.whl >/dev/null 2>&1 && pipi /tmp/site_nvs .whl/nvshmem/*.whl
export PYTHONPATH=/tmp/site_mc019:/tmp/site:/tmp/site_nvs:$PWD
export NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0
if [ -n "${NVSHMEM_PROBE:-}" ]; then
  for w in 1 2; do
    NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo timeout 90 python3 benchmarks/probe_nvshmem.py $w > "$OUT/probe_nvshmem_$w.log" 2>&1
    echo "== nvshmem probe, $w PE(s): rc=$?"; grep -E "OK|FAIL" "$OUT/probe_nvshmem_$w.log" | sort | uniq | head -30
  done
fi
if [ -n "${GPU_TESTS:-}" ]; then  # one pytest per file: a hang in one keeps the others' reports
  for f in ${GPU_TEST_FILES:-tests/gpu/test_nvshmem.py tests/gpu/test_gpt_symm.py tests/gpu/test_symm.py tests/test_tune.py::test_compute_side_measure_on_one_gpu}; do
    log="$OUT/tests_$(echo $f | sed "s#tests/gpu/##; s#[:/]#_#g; s#\.py##").log"
    timeout ${GPU_TESTS_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider -rfEs --tb=short \
      --durations=8 $f ${GPU_TEST_ARGS:-} > "$log" 2>&1
    echo "== $f rc=$?"; tail -${TAIL:-15} "$log"
  done
fi
if [ -n "${BENCH:-}" ]; then
  timeout ${BENCH_TIMEOUT:-240} python3 benchmarks/compute_side.py --reps ${REPS:-30} \
    --out "$OUT/compute_side.json" > "$OUT/compute_side.log" 2>&1
  echo "bench rc=$?"; cat "$OUT/compute_side.log"
fi
# Several GPUs: one rank per GPU over NCCL, TP = the GPU count (issue 7); one GPU: 2 ranks
# sharing it, functional numbers only.
NGPU=$(nvidia-smi -L | wc -l)
MULTI=$([ "$NGPU" -gt 1 ] && echo 1 || true)
SUITE_TP=${SUITE_TP:-$([ -n "$MULTI" ] && echo "$NGPU" || echo 2)}
SUITE_SCALE=${SUITE_SCALE:-$([ -n "$MULTI" ] && echo 1 || echo 2)}
if [ -n "${BENCH_SUITE:-}" ]; then  # issue 6's benchmark suite (~60 s on one GPU)
  if [ -z "${SKIP_LAYER_OVERLAP:-}" ]; then
    timeout ${SUITE_TIMEOUT:-75} python3 benchmarks/layer_overlap.py --tp $SUITE_TP --scale $SUITE_SCALE \
      --reps ${SUITE_REPS:-10} --warmup 2 ${SUITE_ARGS:-} --out "$OUT" > "$OUT/layer_overlap.log" 2>&1
    echo "== layer_overlap rc=$?"; tail -${SUITE_TAIL:-70} "$OUT/layer_overlap.log"
  fi
  timeout ${SUITE_TIMEOUT:-75} python3 benchmarks/step_ab.py --tp $SUITE_TP --layers 4 --hidden 1024 --heads 16 \
    --seq 1024 --micro-batch 2 --vocab 8192 --steps 12 --warmup 3 --out "$OUT" > "$OUT/step_ab.log" 2>&1
  echo "== step_ab rc=$?"; tail -16 "$OUT/step_ab.log"
fi
if [ -n "${EMULATED_NODES:-}" ]; then  # issue 7: the TP group as 2 emulated nodes, NCCL over sockets between them
  timeout ${SUITE_TIMEOUT:-150} python3 benchmarks/layer_overlap.py --tp $SUITE_TP --gpus-per-node $((SUITE_TP / 2)) \
    --scale $SUITE_SCALE --reps ${SUITE_REPS:-10} --warmup 2 --out "$OUT" > "$OUT/layer_overlap_nodes.log" 2>&1
  echo "== layer_overlap over 2 emulated nodes rc=$?"; tail -${SUITE_TAIL:-70} "$OUT/layer_overlap_nodes.log"
fi
if [ -n "${TUNE:-}" ]; then  # issue 6's tuner: several GPUs -> measured for real; one GPU -> compute side + cost model
  TUNE_TP=${TUNE_TP:-$([ -n "$MULTI" ] && echo "$NGPU" || echo 8)}
  LAUNCH="python3"
  [ -n "$MULTI" ] && [ "$TUNE_TP" = "$NGPU" ] && LAUNCH="python3 -m torch.distributed.run --standalone --nproc-per-node $NGPU"
  tag="${TUNE_MODEL:-70b}_tp${TUNE_TP}"
  timeout ${TUNE_TIMEOUT:-200} $LAUNCH -m megatron_overlap.cli tune --model ${TUNE_MODEL:-70b} --tp $TUNE_TP \
    --measure auto --reps ${TUNE_REPS:-10} --yaml "$OUT/tune_$tag.yaml" --json "$OUT/tune_$tag.json" \
    --cache "$OUT/tune_cache.jsonl" --wandb off --no-progress > "$OUT/tune.log" 2>&1
  echo "== tune rc=$?"; tail -${TUNE_TAIL:-40} "$OUT/tune.log"
fi
for v in ${CPU_VERSIONS:-}; do
  pipi /tmp/site_$v .whl/$v/*.whl
  CUDA_VISIBLE_DEVICES= PYTHONPATH=/tmp/site_$v:/tmp/site:$PWD timeout 280 python3 -m pytest -q \
    -p no:cacheprovider -n 6 --dist loadfile -rfE --tb=short tests --ignore=tests/gpu \
    --ignore=tests/test_telemetry.py --ignore=tests/test_ab_demo.py > "$OUT/tests_$v.log" 2>&1
  echo "== megatron-core $v"; tail -8 "$OUT/tests_$v.log"
done
if [ -n "${HOST_TIME:-}" ]; then  # issue 14: host time per call; a TP that hangs says where (--stage-timeout)
  for tp in ${HT_TP:-2 4 8}; do
    timeout ${HT_TIMEOUT:-240} python3 benchmarks/host_time.py --tp $tp --reps ${HT_REPS:-8} --inner ${HT_INNER:-20} \
      --stage-timeout ${HT_STAGE_TIMEOUT:-90} --out "$OUT/host_time_tp$tp.json" > "$OUT/host_time_tp$tp.log" 2>&1
    echo "== host_time TP=$tp rc=$?"; grep -E "^  TP=|done in|FAILED" "$OUT/host_time_tp$tp.log" | tail -4
    [ -f "$OUT/host_time_tp$tp.json" ] && python3 benchmarks/host_time.py --report "$OUT/host_time_tp$tp.json" | tail -12
  done
fi
if [ -n "${TUNE_CHECK:-}" ]; then  # issue 14: the tuner's predicted compute side against the picked passes run
  for m in "70b 8" "8b 2"; do set -- $m
    timeout 150 python3 -m megatron_overlap.cli tune --model $1 --tp $2 --measure compute --reps 5 \
      --yaml "$OUT/tune_$1_tp$2.yaml" --json "$OUT/tune_$1_tp$2.json" --no-cache --wandb off --no-progress \
      > "$OUT/tune_$1_tp$2.log" 2>&1
    echo "== tune $1 tp$2 rc=$?"
  done
  timeout 150 python3 benchmarks/tune_check.py --tune "$OUT/tune_70b_tp8.json" "$OUT/tune_8b_tp2.json" --reps 20 \
    --out "$OUT/tune_check_h200.json" > "$OUT/tune_check.log" 2>&1
  echo "== tune_check rc=$?"; grep -A30 "^shape" "$OUT/tune_check.log"
fi
