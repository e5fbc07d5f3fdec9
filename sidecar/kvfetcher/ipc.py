"""ipc: share the model's KV buffers with the sidecar, without copying them.

One protocol, two transports. The model side allocates (or already has) a buffer
``[layers, 2, kv_heads, capacity, head_dim]`` and sends the sidecar a *handle*, a small JSON
object; the sidecar opens the handle and gets a tensor aliasing the same memory:

* CPU: the buffer lives in a file under ``/dev/shm`` (``KVFETCHER_SHM_DIR``), memory-mapped by
  both processes. (In Kubernetes both containers mount the same memory-backed ``emptyDir``.)
* GPU: a CUDA IPC handle of the buffer's storage, as produced by
  ``torch.multiprocessing.reductions.reduce_tensor`` and opened with its rebuild function;
  the arguments are encoded field by field (no pickle crosses the socket).
"""

from __future__ import annotations

import base64
import mmap
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from kvfetcher import config
from kvfetcher.kvbuffer import DTYPES, dtype_name

SHM_PREFIX = "kvfetcher-"


def shm_dir() -> Path:
    return Path(config.SHM_DIR.read())


@dataclass
class SharedBuffer:
    """A buffer allocated for sharing, and the handle that names it. ``close`` frees it."""

    tensor: torch.Tensor
    handle: dict
    _mm: mmap.mmap | None = None
    _path: Path | None = None

    def close(self) -> None:
        if self._path is not None:
            self._path.unlink(missing_ok=True)
            self._path = None


def allocate(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device = "cpu") -> SharedBuffer:
    """Model side: a zeroed buffer the sidecar can open (shared memory on CPU, CUDA IPC on GPU)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        t = torch.zeros(shape, dtype=dtype, device=dev)
        return SharedBuffer(t, cuda_handle(t))
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    path = shm_dir() / f"{SHM_PREFIX}{uuid.uuid4().hex}"
    with open(path, "w+b") as f:
        f.truncate(nbytes)
        mm = mmap.mmap(f.fileno(), nbytes)
    t = torch.frombuffer(mm, dtype=dtype).view(shape)
    handle = {"kind": "shm", "path": str(path), "shape": list(shape), "dtype": dtype_name(dtype)}
    return SharedBuffer(t, handle, mm, path)


def open_handle(handle: dict) -> torch.Tensor:
    """Sidecar side: the tensor a handle names. Raises ``ValueError`` for a bad handle."""
    kind = handle.get("kind")
    if kind == "shm":
        return _open_shm(handle)
    if kind == "cuda":
        return _open_cuda(handle)
    raise ValueError(f"unknown buffer handle kind {kind!r} (expected 'shm' or 'cuda')")


def _open_shm(h: dict) -> torch.Tensor:
    path = Path(h["path"]).resolve()
    if path.parent != shm_dir().resolve() or not path.name.startswith(SHM_PREFIX):
        raise ValueError(f"shared buffer must be a {SHM_PREFIX}* file in {shm_dir()}, not {path}")
    if h.get("dtype") not in DTYPES:
        raise ValueError(f"unsupported buffer dtype {h.get('dtype')!r}")
    dtype, shape = DTYPES[h["dtype"]], tuple(int(x) for x in h["shape"])
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    try:
        with open(path, "r+b") as f:
            if os.fstat(f.fileno()).st_size != nbytes:
                raise ValueError(f"shared buffer {path} is not {nbytes} bytes")
            mm = mmap.mmap(f.fileno(), nbytes)
    except FileNotFoundError:
        raise ValueError(f"shared buffer {path} does not exist") from None
    return torch.frombuffer(mm, dtype=dtype).view(shape)


# --- CUDA IPC -------------------------------------------------------------------------------

def _classes() -> dict[str, type]:
    import torch.nn

    return {
        "torch.Tensor": torch.Tensor,
        "torch.nn.Parameter": torch.nn.Parameter,
        "torch.UntypedStorage": torch.UntypedStorage,
        "torch.storage.TypedStorage": torch.storage.TypedStorage,
    }


def _enc(x):
    if isinstance(x, type):
        for name, cls in _classes().items():
            if x is cls:
                return {"class": name}
        raise ValueError(f"cannot share a handle naming {x}")
    if isinstance(x, torch.dtype):
        return {"dtype": dtype_name(x)}
    if isinstance(x, torch.device):
        return {"device": str(x)}
    if isinstance(x, (bytes, bytearray)):
        return {"bytes": base64.b64encode(bytes(x)).decode()}
    if isinstance(x, (tuple, list, torch.Size)):
        return {"tuple": [_enc(v) for v in x]}
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    raise ValueError(f"cannot encode {type(x).__name__} in a CUDA handle")


def _dec(x):
    if not isinstance(x, dict):
        return x
    if "class" in x:
        return _classes()[x["class"]]
    if "dtype" in x:
        return DTYPES[x["dtype"]]
    if "device" in x:
        return torch.device(x["device"])
    if "bytes" in x:
        return base64.b64decode(x["bytes"])
    if "tuple" in x:
        return tuple(_dec(v) for v in x["tuple"])
    raise ValueError(f"bad CUDA handle field {x!r}")


def cuda_handle(t: torch.Tensor) -> dict:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

    rebuild, args = reduce_tensor(t)
    if rebuild is not rebuild_cuda_tensor:
        raise ValueError("tensor is not a shareable CUDA tensor")
    return {"kind": "cuda", "args": _enc(args), "shape": list(t.shape), "dtype": dtype_name(t.dtype)}


def _open_cuda(h: dict) -> torch.Tensor:
    if not torch.cuda.is_available():
        raise ValueError("a CUDA buffer handle needs a sidecar with CUDA")
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    t = rebuild_cuda_tensor(*_dec(h["args"]))
    if list(t.shape) != list(h["shape"]) or dtype_name(t.dtype) != h["dtype"]:
        raise ValueError("CUDA handle does not describe the buffer it claims")
    return t
