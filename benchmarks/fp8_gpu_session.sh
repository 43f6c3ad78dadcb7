#!/usr/bin/env bash
# FP8 on one GPU: the two FP8 benchmarks, a small GPT trained in FP8 and in bf16, and the
# same training four more ways, each changing one thing the FP8 arm does on a GPU (the pass
# replay, the compiled kernels, the TP communication: TP=1 has none; the bf16 arm beside it:
# the FP8 arm alone; gloo cannot stand in for symm here, it has no CUDA send/recv), to find
# what makes FP8 train differently there. From the repo root, with .whl/ carried (ignored by
# git: megatron-core 0.19.2 as ../shared/device/wheels.sh fetches it, torchao 0.18.0).
# In two device calls (each under the 600 s a call may run, every piece under its timeout):
#
#   OUT=$OUT PART=bench bash benchmarks/fp8_gpu_session.sh   # ~5-6 min, at most 10
#   OUT=$OUT PART=diag bash benchmarks/fp8_gpu_session.sh    # ~4-5 min, at most ~7
#   OUT=$OUT PART=leak bash benchmarks/fp8_gpu_session.sh    # in two calls (LEAK_RUNS, below; not in all)
#   OUT=$OUT PART=tune bash benchmarks/fp8_gpu_session.sh    # the transpose probe, the tuner in FP8, then
#                                                            # fp8_compute at its picks (~4-6 min; not in all)
#   OUT=$OUT bash benchmarks/fp8_gpu_session.sh              # both (PART=all: over 600 s at worst)
#
# Estimated wall time per piece on one H200 (timeouts in brackets):
#   wheels into /tmp/site                                       ~10-20 s
#   tests/gpu/test_fp8_gpu.py, only with TESTS=1 (make test-gpu runs it)  ~60-90 s (150)
#   bench: benchmarks/fp8_compute.py (24 passes x 4 arms, graphed)   ~40-60 s on the H200, over 70 on the H100 (120)
#          benchmarks/fp8_layer.py   (2 shapes x 5 arms, a profile)  ~100-160 s (220)
#          benchmarks/fp8_train.py   (2 ranks, 2 arms x 200 steps)   ~150 s     (200)
#          (2026-12-05: ~310 ms a bf16 step, ~345 ms an FP8 step, ranks sharing the GPU)
#   diag:  fp8_train.py x 4, 80 steps: MEGATRON_OVERLAP_GRAPHS=0, --eager-kernels, --tp 1,
#          --arms fp8 (the FP8 arm alone)                            ~40-75 s each (100)
# Every fp8_train run ends with a causality check per arm (the loss before the middle of a
# batch when the tokens after it change: ~1e-2 at most from FP8's per-tensor scales).
# $OUT gets: session_<PART>.log (everything printed), fp8_compute_gpu.json, fp8_layer_gpu.json,
# fp8_train_{shared_gpu_tp2,noreplay,eager_kernels,tp1,fp8_alone}.{json,txt,png}
# (and fp8_gpu_tests.log with TESTS=1); PART=leak: fp8_train_leak_<run>.{json,txt,png} and
# probe_fp8_tp_leak_probe_rank{0,1}.json; PART=tune: probe_fp8_transpose.{json,log},
# fp8_compute_gpu_fp8_picks.json and tune_fp8.tgz (the tunes' json, yaml and log). REPS / REPEAT / STEPS / DIAG_STEPS change the lengths.
# A device call brings back at most 8 files: for PART=diag (13) write to a folder of its own and
# tar it into $OUT (OUT=/tmp/d PART=diag bash ...; tar czf $OUT/diag.tgz -C /tmp/d .).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fp8_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# torchao's float8 scaling is Python; its optional C++ extensions are not needed here
export TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1
export NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0
case "${PART:-all}" in all|bench|diag|leak|tune) ;; *) echo "PART=${PART}: all, bench, diag, leak or tune" >&2; exit 2;; esac
failed=0
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
echo "sources $(find megatron_overlap tests benchmarks -name '*.py' | LC_ALL=C sort | xargs cat | sha1sum | cut -c1-12)"
step() { echo "== $1 rc=$2 in $(( $(date +%s) - t )) s"; [ "$2" = 0 ] || failed=$((failed + 1)); }

if [ "${TESTS:-0}" = 1 ]; then
  t=$(date +%s)
  timeout 150 python3 -m pytest -q -p no:cacheprovider -rfEs --tb=short --durations=5 \
    tests/gpu/test_fp8_gpu.py > "$OUT/fp8_gpu_tests.log" 2>&1
  step "tests/gpu/test_fp8_gpu.py" $?; tail -25 "$OUT/fp8_gpu_tests.log"
fi

if [ "${PART:-all}" = all ] || [ "${PART}" = bench ]; then
t=$(date +%s)
timeout 120 python3 benchmarks/fp8_compute.py --reps "${REPS:-20}" --repeat "${REPEAT:-3}" \
  --out "$OUT" --tag gpu
step "benchmarks/fp8_compute.py" $?

t=$(date +%s)
timeout 220 python3 benchmarks/fp8_layer.py --reps "${REPS:-10}" --repeat "${REPEAT:-5}" --out "$OUT" --tag gpu
step "benchmarks/fp8_layer.py" $?

t=$(date +%s)
timeout 240 python3 benchmarks/fp8_train.py --steps "${STEPS:-200}" --agree-every 50 --data markov \
  --out "$OUT"
step "benchmarks/fp8_train.py" $?
fi

if [ "${PART:-all}" = all ] || [ "${PART}" = diag ]; then
# one change each: pass replay off, eager FP8 kernels, no TP communication (TP=1), no bf16 arm
DIAG=${DIAG_STEPS:-80}
t=$(date +%s)
MEGATRON_OVERLAP_GRAPHS=0 timeout 100 python3 benchmarks/fp8_train.py --steps "$DIAG" --out "$OUT" --tag noreplay
step "fp8_train.py, pass replay off" $?
t=$(date +%s)
timeout 100 python3 benchmarks/fp8_train.py --steps "$DIAG" --out "$OUT" --tag eager_kernels --eager-kernels
step "fp8_train.py, eager FP8 kernels" $?
t=$(date +%s)
timeout 100 python3 benchmarks/fp8_train.py --steps "$DIAG" --out "$OUT" --tag tp1 --tp 1
step "fp8_train.py, TP=1 (no TP communication)" $?
t=$(date +%s)
timeout 100 python3 benchmarks/fp8_train.py --steps "$DIAG" --out "$OUT" --tag fp8_alone --arms fp8
step "fp8_train.py, the FP8 arm alone" $?
fi

if [ "${PART:-all}" = leak ]; then
# after PART=diag: TP=1 trains FP8 as bf16, replay and compiled kernels change nothing. Each
# run starts with the agreement check (FP8 vs bf16 logits and every parameter's gradient on
# the same weights and batch: the worst names the pass) and ends with the look-ahead check
# (the logits at j-1, j-2 when token j changes: a leak of the next token, the label) and the
# loss on sequences never trained on (a leak brings it below log vocab; memorizing cannot).
# One change each, LEAK_RUNS picks (~65 s each at 60 steps, blocking ~2-3x; the default:
# probe no_sp blocking rowwise, the four that split the candidates most):
#   probe               TP=2, every FP8 GEMM, shared amax, gather and reduction of the first
#                       3 steps checked in place (benchmarks/probe_fp8_tp.py; replay off)
#   tp1                 TP=1
#   no_sp               TP=2 without sequence parallelism (no FP8 gathers, no amax exchange)
#   rowwise             row-wise scales (no amax exchange; exactly causal per token)
#   megatron_attention  Megatron's attention (its mask explicit)
#   bf16_wgrad          the wgrads in bf16
#   blocking            TP=2 under CUDA_LAUNCH_BLOCKING=1 (a race between streams, or not)
#   seed2, seed3        TP=2 with other seeds (another model, other batches)
#   cpu_init, tp1_cpu_init  TP=2 and TP=1 from the same whole model (Megatron's
#                       use_cpu_initialization; by default each TP size draws another one)
# Run so far (docs/results.md#fp8): the default, then LEAK_RUNS="tp1 megatron_attention bf16_wgrad";
# next: LEAK_RUNS="cpu_init tp1_cpu_init seed2 seed3" (each run also repeats the agreement
# check on the FP8 arm's weights every 10 steps and scores each arm's weights under both
# arms' models). More than
# 8 files: OUT=/tmp/d PART=leak bash ...; tar czf $OUT/leak.tgz -C /tmp/d . (as for diag).
DIAG=${DIAG_STEPS:-60}
for run in ${LEAK_RUNS:-probe no_sp blocking rowwise}; do
  script=benchmarks/fp8_train.py; env=; limit=120
  case $run in
    probe) script=benchmarks/probe_fp8_tp.py; set --;;
    tp1) set -- --tp 1;; no_sp) set -- --no-sp;; rowwise) set -- --fp8-scaling rowwise;;
    megatron_attention) set -- --attention megatron;; bf16_wgrad) set -- --no-fp8-wgrad;;
    blocking) env=CUDA_LAUNCH_BLOCKING=1; limit=200; set --;;
    seed2) set -- --seed 2;; seed3) set -- --seed 3;;
    cpu_init) set -- --cpu-init;; tp1_cpu_init) set -- --tp 1 --cpu-init;;
    *) echo "LEAK_RUNS: unknown run '$run'" >&2; failed=$((failed + 1)); continue;;
  esac
  t=$(date +%s)
  env $env timeout "$limit" python3 "$script" --steps "$DIAG" --out "$OUT" --tag "leak_$run" "$@"
  step "$script, $run" $?
done
fi
if [ "${PART:-all}" = tune ]; then
# first, FP8's transposed copies: the library's Triton kernels against the compiled ones
# they replaced, at every tensor a 70B / 8B layer transposes (benchmarks/probe_fp8_transpose.py)
t=$(date +%s)
timeout 110 python3 benchmarks/probe_fp8_transpose.py --out "$OUT" > "$OUT/probe_fp8_transpose.log" 2>&1
step "benchmarks/probe_fp8_transpose.py" $?; tail -30 "$OUT/probe_fp8_transpose.log"
# fp8_compute's default picks are the bf16 tuner's; these are the tuner's own in FP8 (its
# one-GPU mode: every candidate's GEMM side measured through the FP8 pass, the transfers
# modelled), so chunked / whole is read at the picks an FP8 model gets
for m in "70b 8" "8b 2"; do
  set -- $m
  t=$(date +%s)
  timeout 240 python3 -m megatron_overlap.cli tune --model "$1" --tp "$2" --measure compute --fp8 hybrid \
    --reps 5 --json "$OUT/tune_fp8_${1}_tp$2.json" --yaml "$OUT/tune_fp8_${1}_tp$2.yaml" \
    --no-cache --wandb off --no-progress > "$OUT/tune_fp8_${1}_tp$2.log" 2>&1
  step "megatron-overlap tune --model $1 --tp $2 --fp8 hybrid" $?; tail -4 "$OUT/tune_fp8_${1}_tp$2.log"
done
t=$(date +%s)
timeout 120 python3 benchmarks/fp8_compute.py --tune "$OUT/tune_fp8_70b_tp8.json" "$OUT/tune_fp8_8b_tp2.json" \
  --reps "${REPS:-20}" --repeat "${REPEAT:-3}" --out "$OUT" --tag gpu_fp8_picks
step "benchmarks/fp8_compute.py at the FP8 picks" $?
# a device call brings back 8 files: the tunes' json, yaml and log in one
tar czf "$OUT/tune_fp8.tgz" -C "$OUT" $(cd "$OUT" && ls tune_fp8_*) && rm -f "$OUT"/tune_fp8_*_tp*.*
fi
ls -la "$OUT"
echo "== $failed step(s) failed"
return "$failed"
}
main > >(tee "$OUT/session_${PART:-all}.log") 2>&1
rc=$?
sleep 1  # the log's tee
exit "$rc"
