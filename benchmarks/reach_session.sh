#!/usr/bin/env bash
# Issue 13's proof and the GPU fault cases in one device call (one H200, ranks sharing it):
#  - Megatron-LM loss parity (benchmarks/megatron_lm_parity.sh) on the trees named in TREES
#    (GRAPH_TREES also run the overlap under Megatron's own CUDA graphs);
#  - beside it, on the CPU: the CPU suite against megatron-core 0.19 (.whl/mc019) and
#    tests/test_megatron_lm.py against each tree in CPU_TREES; on the GPU: FAULT_TESTS.
# From the project root, carrying ".mlm" (benchmarks/megatron_lm_trees.sh) and ".whl"
# (.whl/mc019: megatron-core 0.19.2 for Python 3.12; .whl/mlm: see megatron_lm_parity.sh):
#   TREES="core_v0.14.0 main" GRAPH_TREES="core_v0.16.1" CPU_TREES="main core_v0.19.0" \
#     bash benchmarks/reach_session.sh
# $OUT gets every log; the last lines summarise.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site_mc019 .whl/mc019/*.whl || exit 100
date -u +"start %F %T UTC" | tee "$OUT/reach.txt"
pytest_cpu() {  # the CPU suite (or a part) on megatron-core 0.19, no GPU visible
  CUDA_VISIBLE_DEVICES= PYTHONPATH=/tmp/site_mc019:$PWD timeout "${CPU_TIMEOUT:-420}" \
    python3 -m pytest -q -p no:cacheprovider -rfEs --tb=short "$@"
}
pids=()
pytest_cpu -n "${CPU_WORKERS:-6}" --dist loadfile tests --ignore=tests/gpu > "$OUT/cpu_mc019.log" 2>&1 &
pids+=($!)
for t in ${CPU_TREES:-}; do
  MEGATRON_LM_DIR=$PWD/.mlm/$t pytest_cpu tests/test_megatron_lm.py > "$OUT/cpu_mlm_$t.log" 2>&1 &
  pids+=($!)
done
if [ -n "${FAULT_TESTS:-}" ]; then
  CUDA_DEVICE_MAX_CONNECTIONS=1 PYTHONPATH=/tmp/site_mc019:$PWD timeout 420 python3 -m pytest -q \
    -p no:cacheprovider -rfE --tb=short $FAULT_TESTS > "$OUT/gpu_faults.log" 2>&1 &
  pids+=($!)
fi
fails=0
[ -n "${TREES:-}" ] && { bash benchmarks/megatron_lm_parity.sh $(printf ".mlm/%s " $TREES); fails=$((fails + $?)); }
[ -n "${GRAPH_TREES:-}" ] && { GRAPHS=1 bash benchmarks/megatron_lm_parity.sh $(printf ".mlm/%s " $GRAPH_TREES); fails=$((fails + $?)); }
echo "== parity: $fails tree(s) failed" | tee -a "$OUT/reach.txt"
for p in "${pids[@]}"; do wait "$p"; done
for f in "$OUT"/cpu_*.log "$OUT"/gpu_faults.log; do
  [ -f "$f" ] || continue
  echo "== $(basename "$f"): $(grep -E '(passed|failed|error)' "$f" | tail -1)" | tee -a "$OUT/reach.txt"
  grep -E '^(FAILED|ERROR)' "$f" | head -12
done
cat "$OUT"/mlm_*parity.json 2>/dev/null | head -c 3000; echo
date -u +"end %F %T UTC" | tee -a "$OUT/reach.txt"
