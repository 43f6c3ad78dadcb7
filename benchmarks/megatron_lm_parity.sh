#!/usr/bin/env bash
# Loss parity of real Megatron-LM trees on one GPU: pretrain_gpt.py with mock data and the
# null tokenizer, TP=2 with both ranks sharing GPU 0 (gloo process group, symm transport),
# bf16, ITERS iterations, --transformer-impl local, --sequence-parallel; run twice through
# `python -m megatron_overlap.megatron_lm` (benchmarks/megatron_lm_shared_gpu.py adds the
# shared-GPU shims): ON with --tp-comm-overlap (our overlapped linears on symm), OFF
# without it (Megatron's own linears; install() still gives the SP torch norms). Then
# benchmarks/megatron_lm_parity.py asserts equal losses at every iteration.
#
# From the project root, with the trees from benchmarks/megatron_lm_trees.sh and the
# wheels in .whl/mlm/ (carry ".mlm" and ".whl"):
#   bash benchmarks/megatron_lm_parity.sh .mlm/core_v0.14.0 .mlm/core_v0.16.1 .mlm/core_v0.19.0
# The wheels (Python 3.12; Megatron-LM imports pydantic at start-up, core_v0.14's tokenizers
# six and regex), fetched here with the platform flags of shared/device/wheels.sh:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl/mlm pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
#     typing-inspection==0.4.5 typing-extensions==4.16.0 six regex psutil
# Env: OUT (logs, default /tmp/out), ITERS (20), GRAPHS (1: two more runs under Megatron's own
# CUDA graphs, overlap on and off, whose losses must be equal; each also compared with its eager
# run, reported), ARMS (the runs to make, default "on off" plus those two; attn_megatron: the
# overlap on with --megatron-overlap-attention megatron, whose losses must agree with "on"
# within bf16 tolerance: torch's attention against Megatron's; packed / packed_off: on and off
# with --dataloader-inter-document-masking, trees that have it (core_v0.19+): documents packed
# into each sequence, THD batches through pretrain_gpt.py's get_batch as --sft gives them, whose
# losses must be equal, each having run our attention on packed sequences; sft / sft_off: the
# same with Megatron-LM's --sft on conversations benchmarks/sft_standins.py writes, trees
# whose SFT dataset packs), RUN_TIMEOUT (s per
# run, 240), MLM_DETERMINISTIC (1: torch's deterministic algorithms in every run, with a fixed
# cuBLAS workspace; the packed and sft arms always), EXTRA_ARGS (appended to every run's flags:
# the last of a flag wins), MODEL_ARGS
# (replaces the model size flags). Exit code: the number of trees that failed.
set -uo pipefail
OUT=${OUT:-/tmp/out}; ITERS=${ITERS:-20}; mkdir -p "$OUT"
if ls .whl/mlm/*.whl >/dev/null 2>&1; then  # pydantic & co.: Megatron-LM imports them at start-up
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site_mlm .whl/mlm/*.whl || exit 100
fi
export TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1 CUDA_DEVICE_MAX_CONNECTIONS=1 NO_VCS_VERSION=1 \
  PYTHONUNBUFFERED=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0
MODEL_ARGS=${MODEL_ARGS:---num-layers 4 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 \
  --max-position-embeddings 1024 --micro-batch-size 2 --global-batch-size 2 --vocab-size 8192}
ARGS="$MODEL_ARGS --tensor-model-parallel-size 2 --sequence-parallel --transformer-impl local
  --bf16 --train-iters $ITERS --lr 3e-4 --lr-decay-style constant --weight-decay 0.01
  --clip-grad 1.0 --attention-dropout 0 --hidden-dropout 0 --seed 1234
  --num-workers 0 --log-interval 1 --eval-interval 1000
  --eval-iters 0 --distributed-backend gloo --local-rank 0 --no-persist-layer-norm
  --no-gradient-accumulation-fusion --no-masked-softmax-fusion
  --tp-comm-overlap-impl megatron_overlap --tp-comm-overlap-backend symm"
failed=0
for tree in "$@"; do
  tag=$(basename "$tree"); tree=$(cd "$tree" && pwd)
  # Megatron's own CUDA graphs (GRAPHS=1): the overlap on, transformer layers graphed by
  # Megatron's CudaGraphManager (--cuda-graph-impl local; --enable-cuda-graph in core_v0.14)
  graph_flag=$(grep -q "'--cuda-graph-impl'" "$tree/megatron/training/arguments.py" \
    && echo "--cuda-graph-impl local" || echo "--enable-cuda-graph")
  packed_flag=$(grep -q "'--dataloader-inter-document-masking'" "$tree/megatron/training/arguments.py" \
    && echo "--dataloader-inter-document-masking")
  # --sft where the tree's SFT dataset packs (core_v0.16 on); its SFTTokenizer through the
  # legacy tokenizers where megatron.core's have none (core_v0.16); Hugging Face's loaders
  # stood in for (benchmarks/sft_standins.py); one packed sequence a micro-batch
  # turns short enough that no 1024-token pack is truncated (core_v0.16.1's truncation
  # extends a list by an int); empty where the tree's SFT dataset does not pack
  sft_args=$(python3 benchmarks/sft_standins.py "$OUT/sft.jsonl" --conversations 256 --words 8 \
    --args-for "$tree") || exit 2
  [ -n "$sft_args" ] && sft_args="$sft_args --micro-batch-size 1 --global-batch-size 1"
  for arm in ${ARMS:-on off ${GRAPHS:+graphs graphs_off}}; do
    case $arm in on) flag=--tp-comm-overlap;; off) flag=;; graphs) flag="--tp-comm-overlap $graph_flag";;
      graphs_off) flag="$graph_flag";; attn_megatron) flag="--tp-comm-overlap --megatron-overlap-attention megatron";;
      packed) flag="--tp-comm-overlap $packed_flag";; packed_off) flag="$packed_flag";;
      sft) flag="--tp-comm-overlap $sft_args";; sft_off) flag="$sft_args";;
    esac
    if [ -z "$packed_flag" ] && [ "${arm#packed}" != "$arm" ]; then
      echo "== $tag $arm: skipped (this tree has no --dataloader-inter-document-masking)"; continue
    fi
    if [ -z "$sft_args" ] && [ "${arm#sft}" != "$arm" ]; then
      echo "== $tag $arm: skipped (this tree's --sft does not pack sequences)"; continue
    fi
    data="--mock-data --tokenizer-type NullTokenizer"; [ "${arm#sft}" != "$arm" ] && data=
    flag="$data $flag"
    # packed sequences run torch's varlen flash attention, whose backward is deterministic
    # only under torch's deterministic algorithms (without them the two runs part in the
    # 5th-6th digit from iteration 2 on, H100)
    det=${MLM_DETERMINISTIC:-0}; case $arm in packed*|sft*) det=1;; esac
    denv=(); [ "$det" = 1 ] && denv=(MLM_DETERMINISTIC=1 CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8})
    env ${denv[@]+"${denv[@]}"} PYTHONPATH="$tree:$PWD:/tmp/site_mlm:${PYTHONPATH:-}" timeout "${RUN_TIMEOUT:-240}" \
      python3 -m torch.distributed.run --standalone --nproc-per-node 2 \
      benchmarks/megatron_lm_shared_gpu.py "$tree/pretrain_gpt.py" $ARGS $flag ${EXTRA_ARGS:-} \
      > "$OUT/mlm_${tag}_$arm.log" 2>&1
    rc=$?; echo "== $tag $arm: rc=$rc ($(grep -c ' iteration ' "$OUT/mlm_${tag}_$arm.log") iteration lines)"
    [ $rc = 0 ] || grep -E "Error|error:|Traceback" "$OUT/mlm_${tag}_$arm.log" | grep -v Warning | tail -6
  done
  case " ${ARMS:-on off} " in *" off "*)
    python3 benchmarks/megatron_lm_parity.py "$OUT/mlm_${tag}_on.log" "$OUT/mlm_${tag}_off.log" \
      --iters "$ITERS" --label "$tag" --json "$OUT/mlm_${tag}_parity.json" || failed=$((failed + 1));; esac
  case " ${ARMS:-} " in *" attn_megatron "*)  # torch's attention against Megatron's, both overlapped
    python3 benchmarks/megatron_lm_parity.py "$OUT/mlm_${tag}_on.log" "$OUT/mlm_${tag}_attn_megatron.log" \
      --iters "$ITERS" --label "$tag attention: torch vs Megatron's" --attention \
      --json "$OUT/mlm_${tag}_attention.json" || failed=$((failed + 1));; esac
  case " ${ARMS:-} " in *" packed_off "*) [ -n "$packed_flag" ] &&  # packed sequences, on vs off
    { python3 benchmarks/megatron_lm_parity.py "$OUT/mlm_${tag}_packed.log" "$OUT/mlm_${tag}_packed_off.log" \
      --iters "$ITERS" --label "$tag packed sequences" --packed --json "$OUT/mlm_${tag}_packed.json" \
      || failed=$((failed + 1)); };; esac
  case " ${ARMS:-} " in *" sft_off "*) [ -n "$sft_args" ] &&  # Megatron-LM's SFT, on vs off
    { python3 benchmarks/megatron_lm_parity.py "$OUT/mlm_${tag}_sft.log" "$OUT/mlm_${tag}_sft_off.log" \
      --iters "$ITERS" --label "$tag --sft" --packed --json "$OUT/mlm_${tag}_sft.json" \
      || failed=$((failed + 1)); };; esac
  if [ -n "${GRAPHS:-}" ]; then  # the overlap under Megatron's graphs against Megatron's linears under them
    python3 benchmarks/megatron_lm_parity.py "$OUT/mlm_${tag}_graphs.log" "$OUT/mlm_${tag}_graphs_off.log" \
      --iters "$ITERS" --label "$tag graphs: overlap on vs off" --json "$OUT/mlm_${tag}_graphs_parity.json" \
      || failed=$((failed + 1))
    # and what the graphs change against the eager run, reported (not a pass/fail of ours)
    python3 benchmarks/megatron_lm_parity.py "$OUT/mlm_${tag}_graphs.log" "$OUT/mlm_${tag}_on.log" \
      --iters "$ITERS" --label "$tag overlap: graphs vs eager" --second-overlapped \
      --json "$OUT/mlm_${tag}_graphs_vs_eager.json"
    python3 benchmarks/megatron_lm_parity.py "$OUT/mlm_${tag}_graphs_off.log" "$OUT/mlm_${tag}_off.log" \
      --iters "$ITERS" --label "$tag Megatron's linears: graphs vs eager" --losses-only \
      --json "$OUT/mlm_${tag}_graphs_off_vs_eager.json"
  fi
done
exit $failed
