#!/bin/bash
# Packs LMCache 0.5.6 for the GPU machine (Python 3.12, torch 2.11, no network): its PyPI source
# distribution (built there against the image's torch; the prebuilt wheel's ops do not load against
# torch 2.11) and the wheels in lmcache-gpu-requirements.txt, in carry folders of at most 50 MiB:
# DEST_1, DEST_2, ... (a wheel above 50 MiB, cupy, travels split as <name>.part.NN). Run from the
# project root; DEST must be git-ignored:
#   benchmarks/vllm_ttft/lmcache-wheels.sh .lmcache-wheels
# benchmarks/vllm_ttft/README.md ("Peers") has the device calls.
set -euo pipefail
dest=${1:?usage: lmcache-wheels.sh DEST}
here=$(cd "$(dirname "$0")" && pwd)
dl="$dest.download"; mkdir -p "$dl"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --abi cp312 --abi abi3 --abi none --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$dl" -r "$here/lmcache-gpu-requirements.txt"
if [ ! -f "$dl/lmcache-0.5.6.tar.gz" ]; then
  # pip downloads an sdist only after reading its metadata: a throwaway venv with LMCache's build
  # tools reads it without torch or CUDA (NO_GPU_EXT) and without git (the pretend version).
  meta=$(mktemp -d); python3 -m venv "$meta"
  "$meta/bin/python" -m pip install -q 'setuptools>=77.0.3,<81' 'setuptools_scm>=8' 'packaging>=24.2' wheel
  SETUPTOOLS_SCM_PRETEND_VERSION=0.5.6 NO_GPU_EXT=1 NO_NATIVE_EXT=1 "$meta/bin/python" -m pip download -q --no-deps \
    --no-binary=:all: --no-build-isolation -d "$dl" lmcache==0.5.6
  rm -rf "$meta"
fi
rm -rf "${dest}"_[0-9]* "$dl"/*.part.*
for f in "$dl"/*.whl; do
  if (( $(stat -c %s "$f") > 50 * 1024 * 1024 )); then split -b 50M -d "$f" "$f.part."; fi
done
n=1; size=0; mkdir -p "${dest}_$n"
for f in $(ls -S "$dl"/*.part.* "$dl"/*.tar.gz "$dl"/*.whl); do
  if [ -f "$f.part.00" ]; then continue; fi  # travels split
  s=$(stat -c %s "$f")
  if (( size + s > 50 * 1024 * 1024 )); then n=$((n + 1)); size=0; mkdir -p "${dest}_$n"; fi
  cp "$f" "${dest}_$n/"; size=$((size + s))
done
rm -f "$dl"/*.part.*
echo "carry folders: $(ls -d "${dest}"_[0-9]* | tr '\n' ' ')"
