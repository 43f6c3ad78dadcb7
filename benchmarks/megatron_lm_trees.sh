#!/usr/bin/env bash
# Lay out Megatron-LM trees for benchmarks/megatron_lm_parity.sh under .mlm/<ref> at the
# project root (ignored: added to .git/info/exclude; never committed), each with only what
# pretrain_gpt.py needs (megatron/, pretrain_gpt.py, and gpt_builders.py / model_provider.py
# where the ref has them) plus the prebuilt C++ dataset helpers for Python 3.12, taken from
# a megatron-core wheel (their source is the same in core_v0.16 .. main, and differs in
# core_v0.14 only by an assert). Then lists the sizes (the device carry is 64 MiB in all).
#
#   bash benchmarks/megatron_lm_trees.sh GIT_DIR REF...     (a bare clone works: `fetch`'s mirror)
# e.g. bash benchmarks/megatron_lm_trees.sh /work/.mirror/NVIDIA+Megatron-LM/repo \
#        core_v0.14.0 core_v0.16.1 core_v0.19.0 main
# Env: DEST (default <project root>/.mlm), HELPERS_WHEEL (a megatron-core cp312 wheel;
# default: pip download megatron-core==0.19.2 for Python 3.12 / manylinux x86_64).
set -euo pipefail
git_dir=$1; shift
root=$(git rev-parse --show-toplevel)
dest=${DEST:-$root/.mlm}
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qx '/.mlm/' "$exclude" 2>/dev/null || echo '/.mlm/' >> "$exclude"
wheel=${HELPERS_WHEEL:-}
if [ -z "$wheel" ]; then
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 -d "$tmp" megatron-core==0.19.2
  wheel=$(ls "$tmp"/megatron_core-*.whl)
fi
so=$(python3 -c "import sys, zipfile; print(next(n for n in zipfile.ZipFile(sys.argv[1]).namelist() if 'datasets/helpers_cpp' in n and n.endswith('.so')))" "$wheel")
for ref in "$@"; do
  out="$dest/$ref"; rm -rf "$out"; mkdir -p "$out"
  paths=(megatron pretrain_gpt.py)
  for f in gpt_builders.py model_provider.py; do
    git --git-dir="$git_dir" cat-file -e "$ref:$f" 2>/dev/null && paths+=("$f")
  done
  git --git-dir="$git_dir" archive "$ref" "${paths[@]}" | tar -x -C "$out"
  python3 -c "import sys, zipfile; open(sys.argv[3], 'wb').write(zipfile.ZipFile(sys.argv[1]).read(sys.argv[2]))" \
    "$wheel" "$so" "$out/megatron/core/datasets/$(basename "$so")"
  commit=$(git --git-dir="$git_dir" rev-parse "$ref^{commit}")
  version=$(cd "$out" && NO_VCS_VERSION=1 python3 -c "import runpy; print(runpy.run_path('megatron/core/package_info.py')['__version__'])")
  echo "$ref $commit megatron-core $version (helpers from $(basename "$wheel"))" > "$out/MLM_TREE"
  cat "$out/MLM_TREE"
done
du -shc "$dest"/*
