#!/usr/bin/env bash
# The whole GPU suite (tests/gpu) in one command, its tests spread over pytest-xdist
# workers so that it ends well inside the GPU machine's 10 minutes per command (one
# file at a time it took about 10). Ranks share the one GPU (torch symmetric memory,
# gloo); the one-rank-per-GPU variants skip, saying so, where there is a single GPU.
#
#   make test-gpu                      # or: bash tests/gpu/suite.sh [pytest args]
#
# PYTHON: the interpreter (default python3); GPU_WORKERS: xdist workers (default 4);
# GPU_DIST: how xdist spreads the tests (default loadgroup: like load, except that tests
# marked with one xdist_group share a worker, so a module fixture they share runs once);
# GPU_SUITE_TIMEOUT: seconds for the whole run (default 540: the last 60 for the tests marked
# `alone`, which read the whole device and run by themselves after); OUT: where the log goes.
# Wheels in .whl/ (../shared/device/wheels.sh: megatron-core, nvshmem4py, ...) are
# installed into /tmp/site first, for a machine that has no megatron-core of its own.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/gpu_suite}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 2
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# NVLink multicast stays off (shared hosts); nothing here needs it
export NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0
if ! "$PY" -c "import xdist, torch; assert torch.cuda.is_available()" 2>/dev/null; then
  echo "tests/gpu/suite.sh: needs a CUDA GPU and pytest-xdist under $PY" >&2
  exit 2
fi
# what ran: a fingerprint of the package's and the tests' sources (the git metadata a copy of
# the tree carries may be older than the files), comparable with the same command anywhere
# (C collation: a locale that sorts `_` elsewhere gives another order, another digest)
echo "sources $(find megatron_overlap tests -name '*.py' | LC_ALL=C sort | xargs cat | sha1sum | cut -c1-12)" \
  | tee "$OUT/gpu_suite.log"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$OUT/gpu_suite.log"
start=$(date +%s)
limit=${GPU_SUITE_TIMEOUT:-540}
timeout "$((limit - 60))" "$PY" -m pytest -q -p no:cacheprovider -n "${GPU_WORKERS:-4}" \
  --dist "${GPU_DIST:-loadgroup}" -rfEs --durations=12 -m "not alone" tests/gpu "$@" 2>&1 \
  | tee -a "$OUT/gpu_suite.log"
rc=${PIPESTATUS[0]}
# tests that read the whole device (its free memory) run after, by themselves
timeout 60 "$PY" -m pytest -q -p no:cacheprovider -rfEs -m alone tests/gpu "$@" 2>&1 \
  | tee -a "$OUT/gpu_suite.log"
alone=${PIPESTATUS[0]}
[ "$rc" = 0 ] && [ "$alone" != 5 ] && rc=$alone  # (5: none selected, by the caller's args)
echo "tests/gpu/suite.sh: rc=$rc in $(( $(date +%s) - start )) s" | tee -a "$OUT/gpu_suite.log"
exit "$rc"
