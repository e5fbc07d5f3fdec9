#!/usr/bin/env bash
# Run a command with CUDA MPS: start a private MPS control daemon, run "$@" as its client,
# then stop the daemon (whatever the command's outcome). The GPU's own settings (compute
# mode, MIG) are left as they are. Prints "mps: unavailable" and exits 3 if the daemon
# binary is missing or does not start.
set -u
export CUDA_MPS_PIPE_DIRECTORY=${CUDA_MPS_PIPE_DIRECTORY:-/tmp/kvfetcher-mps/pipe}
export CUDA_MPS_LOG_DIRECTORY=${CUDA_MPS_LOG_DIRECTORY:-/tmp/kvfetcher-mps/log}
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
if ! command -v nvidia-cuda-mps-control >/dev/null || ! nvidia-cuda-mps-control -d; then
  echo "mps: unavailable"; exit 3
fi
trap 'echo quit | nvidia-cuda-mps-control; sleep 1; tail -n 5 "$CUDA_MPS_LOG_DIRECTORY"/control.log' EXIT
"$@"
