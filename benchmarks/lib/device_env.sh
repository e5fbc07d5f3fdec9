# Source on a lent GPU machine (repo root): installs the carried wheels (.whl and any .whl_* folder
# carried beside it, see the device tool's README) into /tmp/site and puts them and this checkout's
# sources on PYTHONPATH. (av and nvCOMP together exceed what a call may carry: .whl_av or .whl_nvc.)
# The machine's own python3 has torch with CUDA; it lacks PyNvVideoCodec, av, minio, zstandard, isal.
stamp=$(ls -l .whl .whl_* 2>/dev/null | md5sum | cut -c1-16)
if ls .whl/*.whl >/dev/null 2>&1 && [ "$(cat /tmp/site/.stamp 2>/dev/null)" != "$stamp" ]; then
  rm -rf /tmp/site && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl $(ls .whl_*/*.whl 2>/dev/null) && echo "$stamp" >/tmp/site/.stamp
fi
export PYTHONPATH=/tmp/site:$PWD/sidecar:$PWD/operator:$PWD:$PWD/tests
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c 'import torch, PyNvVideoCodec; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'
