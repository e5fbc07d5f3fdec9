#!/bin/sh
# Regenerates the hash-locked requirements the images install with `pip install --require-hashes`
# (run from the repository root after changing pyproject.toml's dependencies; needs uv).
# operator.txt: the `operator` extra; sidecar.txt: the core dependencies, the `gpu` extra and the `hf` one
# (the calibration Job runs `kvfetcher calibrate` in the sidecar image), with
# torch held to 2.11, a CUDA 13 build (the sidecar image's CUDA runtime, vLLM 0.26's torch, and nvCOMP's cu13 wheels).
# Both are resolved for the images' interpreter (CPython 3.12, x86_64 Linux), and include the
# build backend so that the project itself installs without fetching anything unpinned.
set -eu
deps() {
    echo "$PINS"
    python3 -c "import sys, tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']
for extra in sys.argv[1:]: print('\n'.join(p['dependencies'] if extra == 'core' else p['optional-dependencies'][extra]))
print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['build-system']['requires']))" "$@"
}
compile() {
    out=$1; shift
    deps "$@" | uv pip compile - --generate-hashes --python-version 3.12 \
        --python-platform x86_64-manylinux_2_28 --custom-compile-command requirements/compile.sh \
        --quiet -o "$out"
}
PINS= compile requirements/operator.txt operator
PINS="torch==2.11.*" compile requirements/sidecar.txt core gpu hf
