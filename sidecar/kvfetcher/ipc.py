"""ipc: share the model's KV buffers with the sidecar, without copying them.

One protocol, two transports. The model side allocates (or already has) a buffer
``[layers, 2, kv_heads, capacity, head_dim]`` and gives the sidecar a *handle*, a small JSON
object; the sidecar opens the handle and gets a tensor aliasing the same memory:

* CPU: a memfd (anonymous shared memory, never a name in a directory) sealed against shrinking
  and growing, its seals sealed (``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``). Its fd crosses to
  the sidecar only as ``SCM_RIGHTS`` over the sidecar's buffer socket (:func:`pass_buffer`,
  :func:`receive_buffer`), never as a number or a path. So a peer can neither swap the memory
  between a check and an open, nor make a mapped page vanish (a shrunk file would SIGBUS whoever
  touches the page past its end). The handle names the fd in the process that holds it
  (``pid``, ``fd``, and the inode it must be); that process opens it by ``dup`` and its
  children through ``/proc/<pid>/fd/<fd>``, checked to be that inode, a tmpfs memfd of exactly
  the buffer's size with those seals, mapped read-write (a read-only fd is refused, never upgraded).
* GPU: a CUDA IPC handle of the buffer's storage, as produced by
  ``torch.multiprocessing.reductions.reduce_tensor`` and opened with its rebuild function;
  the arguments are encoded field by field (no pickle crosses the socket). The handle also names
  the GPU by its UUID, so that a process that sees the GPUs otherwise numbered (a sidecar pinned
  to its tensor-parallel rank's GPU with ``CUDA_VISIBLE_DEVICES``) opens it on the same GPU.

A paged buffer (:class:`kvbuffer.PagedKV`: a serving engine's KV blocks, one tensor per layer or
one for all) is one handle of kind ``paged`` (:func:`paged_handle`) holding its layout and a handle
per tensor; opening it opens them all, releasing it releases them all.
"""

from __future__ import annotations

import base64
import ctypes
import fcntl
import functools
import json
import mmap
import os
import socket
import stat
import threading
import time
from dataclasses import dataclass, field

import torch

from kvfetcher.errors import NoDeviceError
from kvfetcher.kvbuffer import DTYPES, PagedKV, PagedLayout, dtype_name

#: the seals a registered memfd must carry: it cannot shrink or grow, and no seal can be added or removed
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_TMPFS_MAGIC = 0x01021994  # hugetlbfs is refused: a fault in a hole there may SIGBUS when the pool is empty
MAX_MESSAGE = 64 << 10  # bytes of a registration message on the buffer socket


@dataclass
class SharedBuffer:
    """A buffer allocated for sharing, and the handle that names it. ``close`` drops this
    process's fd (the memory lives as long as a mapping or another fd of it)."""

    tensor: torch.Tensor
    handle: dict
    _fd: int | None = field(default=None, repr=False)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def allocate(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device = "cpu") -> SharedBuffer:
    """Model side: a zeroed buffer the sidecar can open (a sealed memfd on CPU, CUDA IPC on GPU)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        t = torch.zeros(shape, dtype=dtype, device=dev)
        return SharedBuffer(t, cuda_handle(t))
    fd = os.memfd_create("kvfetcher-kv", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, _nbytes(shape, dtype))
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
        handle = memfd_handle(fd, shape, dtype_name(dtype))
        t = _map(fd, handle)
    except BaseException:
        os.close(fd)
        raise
    return SharedBuffer(t, handle, fd)


def pin(t: torch.Tensor) -> bool:
    """Page-lock host tensor ``t``'s memory for the GPU's copies (``cudaHostRegister``: a copy between
    it and a GPU is then DMA, not staged through the driver); whether it is. False without CUDA,
    or when CUDA refuses (the memory stays pageable, and works as before). A pinned tensor must be
    :func:`unpin`-ned before its memory is unmapped: CUDA refuses to register an address twice."""
    if t.device.type != "cpu" or not torch.cuda.is_available() or not t.numel():
        return False
    rt, device, out = torch.cuda.cudart(), torch.cuda.current_device(), []

    def register() -> None:  # on the caller's device: a new thread's would be device 0, whose context it would create
        torch.cuda.set_device(device)
        out.append(rt.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0))

    # In a thread of its own: a refusal stays CUDA's "last error" of the thread that made the call,
    # where the next kernel launch checked by torch would raise it.
    worker = threading.Thread(target=register)
    worker.start()
    worker.join()
    return bool(out) and out[0] == rt.cudaError.success


def unpin(t: torch.Tensor) -> None:
    """Undo :func:`pin` of ``t`` (its memory stays mapped and usable, pageable again)."""
    torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


def memfd_handle(fd: int, shape, dtype: str) -> dict:
    """The handle of memfd ``fd`` of this process, holding a ``shape`` buffer of ``dtype``."""
    st = os.fstat(fd)
    return {"kind": "memfd", "pid": os.getpid(), "fd": fd, "inode": [st.st_dev, st.st_ino], "shape": list(shape), "dtype": dtype}


def memfd_path(h: dict) -> str:
    """The path by which the memfd handle ``h`` names opens in its process's children."""
    return f"/proc/{int(h['pid'])}/fd/{int(h['fd'])}"


def paged_handle(handles: list[dict], layout: PagedLayout) -> dict:
    """The handle of a paged buffer: its tensors' ``handles`` (one per layer, or one holding every
    layer) seen through ``layout``."""
    return {"kind": "paged", "dims": layout.dims, "block_size": layout.block_size, "handles": list(handles)}


def _paged_parts(handle: dict) -> tuple[list[dict], PagedLayout]:
    handles = handle["handles"]
    if not isinstance(handles, list) or not handles or any(not isinstance(h, dict) or h.get("kind") == "paged" for h in handles):
        raise ValueError("a paged handle holds a non-empty list of tensor handles")
    return handles, PagedLayout(handle["dims"], handle["block_size"])


def open_handle(handle: dict) -> torch.Tensor | PagedKV:
    """The tensor a handle names: a CUDA handle, or a memfd of this process or its parent; for a
    paged handle, the :class:`PagedKV` of its tensors. Raises ``ValueError`` for a bad handle
    (``KeyError`` / ``TypeError`` for a malformed one)."""
    kind = handle.get("kind")
    if kind == "paged":
        handles, layout = _paged_parts(handle)
        return PagedKV([open_handle(h) for h in handles], layout)
    if kind == "memfd":
        fd = _reopen(handle)
        try:
            return _map(fd, handle)
        finally:
            os.close(fd)
    if kind == "cuda":
        return _open_cuda(handle)
    raise ValueError(f"unknown buffer handle kind {kind!r} (expected 'memfd', 'cuda' or 'paged')")


def adopt(handle: dict) -> tuple[torch.Tensor | PagedKV, dict]:
    """The sidecar's side of a registration: the tensor (or paged KV) ``handle`` names, and a handle
    of its own that this process and its children (the decode workers) open. For a memfd that is a
    new fd of this process, held until :func:`release`; a CUDA handle is its own; a paged handle
    adopts each of its tensors' (all released again if one fails)."""
    if handle.get("kind") == "paged":
        handles, layout = _paged_parts(handle)
        adopted: list[tuple[torch.Tensor, dict]] = []
        try:
            for h in handles:
                adopted.append(adopt(h))
            own = paged_handle([h for _, h in adopted], layout)
            return PagedKV([t for t, _ in adopted], layout), own
        except BaseException:
            for _, h in adopted:
                release(h)
            raise
    if handle.get("kind") != "memfd":
        return open_handle(handle), handle
    fd = _reopen(handle)
    try:
        t = _map(fd, handle)
        return t, memfd_handle(fd, handle["shape"], handle["dtype"])
    except BaseException:
        os.close(fd)
        raise


def release(handle: dict) -> None:
    """Close the fd(s) of a handle :func:`adopt` returned (its mappings stay valid)."""
    if handle.get("kind") == "memfd":
        os.close(handle["fd"])
    elif handle.get("kind") == "paged":
        for h in handle["handles"]:
            release(h)


def _nbytes(shape, dtype: torch.dtype) -> int:
    return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()


def _reopen(h: dict) -> int:
    """A new fd of this process for the memfd handle ``h`` names, checked to be its inode: a dup of
    this process's fd (same access mode), or a parent's reopened through ``/proc`` (read-write: a
    parent hands its children only buffers it mapped read-write itself)."""
    pid, fd, inode = int(h["pid"]), int(h["fd"]), list(h["inode"])
    if pid not in (os.getpid(), os.getppid()):
        raise ValueError("a memfd handle opens only in the process that holds it or its children: pass the fd itself")
    try:
        new = os.dup(fd) if pid == os.getpid() else os.open(memfd_path(h), os.O_RDWR | os.O_CLOEXEC)
    except OSError as e:
        raise ValueError(f"memfd handle {pid}/{fd} cannot be opened: {e.strerror}") from None
    st = os.fstat(new)
    if [st.st_dev, st.st_ino] != inode:
        os.close(new)
        raise ValueError(f"memfd handle {pid}/{fd} names another file now")
    return new


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _fs_type(fd: int) -> int:
    buf = ctypes.create_string_buffer(512)  # struct statfs; f_type is its first word
    if _libc().fstatfs(fd, buf) != 0:
        raise OSError(ctypes.get_errno(), "fstatfs failed")
    return ctypes.c_long.from_buffer(buf).value


def check_memfd(fd: int, nbytes: int) -> None:
    """Refuse (``ValueError``) an fd that is not a tmpfs memfd of ``nbytes`` bytes carrying :data:`SEALS`:
    only such memory can be mapped without a peer being able to fault the mapping."""
    st = os.fstat(fd)
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = 0  # not a memfd
    if not stat.S_ISREG(st.st_mode) or seals & SEALS != SEALS or _fs_type(fd) != _TMPFS_MAGIC:
        raise ValueError("a host buffer must be a tmpfs memfd sealed with F_SEAL_SHRINK|F_SEAL_GROW|F_SEAL_SEAL (ipc.allocate)")
    if st.st_size != nbytes:
        raise ValueError(f"shared buffer is {st.st_size} bytes, not {nbytes}")


def _map(fd: int, h: dict) -> torch.Tensor:
    if h.get("dtype") not in DTYPES:
        raise ValueError(f"unsupported buffer dtype {h.get('dtype')!r}")
    dtype, shape = DTYPES[h["dtype"]], tuple(int(x) for x in h["shape"])
    nbytes = _nbytes(shape, dtype)
    check_memfd(fd, nbytes)
    try:
        mm = mmap.mmap(fd, nbytes)
    except OSError as e:  # e.g. an fd opened read-only
        raise ValueError(f"shared buffer cannot be mapped read-write: {e.strerror}") from None
    return torch.frombuffer(mm, dtype=dtype).view(shape)


# --- the buffer socket: a registration message with its memfd (SCM_RIGHTS) ------------------------

def fd_socket(api_socket: str) -> str:
    """The buffer socket beside the sidecar's API socket ``api_socket``."""
    return f"{api_socket}.fd"


def pass_buffer(path: str, message: dict, handle: dict, timeout: float) -> dict:
    """Client side: send ``message`` (JSON) with the memfd ``handle`` names to the buffer socket at
    ``path``; the sidecar's JSON reply."""
    fd = _reopen(handle)
    try:
        return pass_fd(path, message, fd, timeout)
    finally:
        os.close(fd)


def pass_fd(path: str, message: dict, fd: int, timeout: float) -> dict:
    """Client side: send ``message`` (JSON) with ``fd`` (``SCM_RIGHTS``) to the buffer socket at
    ``path``; the sidecar's JSON reply. The caller still holds its ``fd``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        socket.send_fds(s, [json.dumps(message).encode()], [fd])
        s.shutdown(socket.SHUT_WR)
        return json.loads(_read_all(s) or b"{}")


def lease_fd() -> int | None:
    """A pidfd of this process (readable once it exits), the lease a registration passes; None where
    the kernel (before Linux 5.3) or Python has none."""
    try:
        return os.pidfd_open(os.getpid())
    except (AttributeError, OSError):
        return None


def is_pidfd(fd: int) -> bool:
    """Whether ``fd`` is a pidfd (what a lease must pass: it names a process, and nothing else it could be reads ready then)."""
    try:
        link = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return False
    return link == "anon_inode:[pidfd]" or link.startswith("pidfd:")  # (kernels with pidfs may name it so)


def receive_buffer(conn: socket.socket, timeout_s: float) -> tuple[dict, int | None]:
    """Sidecar side, blocking: a client's message and the fd it passed (None without one; the caller
    closes it), all within ``timeout_s`` (``TimeoutError`` after: a slow client holds a thread no
    longer, however it paces its bytes). Raises ``ValueError`` for a malformed message."""
    deadline = time.monotonic() + timeout_s
    _until(conn, deadline)
    data, fds, flags, _ = socket.recv_fds(conn, MAX_MESSAGE, 1)
    try:
        if flags & socket.MSG_CTRUNC:
            raise ValueError("one fd per registration")
        message = json.loads(data + _read_all(conn, MAX_MESSAGE - len(data), deadline))
    except RecursionError:
        for fd in fds:
            os.close(fd)
        raise ValueError("the registration nests too deep") from None
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return message, (fds[0] if fds else None)


def _until(s: socket.socket, deadline: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the client did not send its message in time")
    s.settimeout(left)


def _read_all(s: socket.socket, limit: int = MAX_MESSAGE, deadline: float | None = None) -> bytes:
    out = b""
    while True:
        if deadline is not None:
            _until(s, deadline)
        chunk = s.recv(65536)
        if not chunk:
            return out
        out += chunk
        if len(out) > limit:
            raise ValueError(f"message over {limit} bytes")


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
    return {"kind": "cuda", "args": _enc(args), "shape": list(t.shape), "dtype": dtype_name(t.dtype), "device_uuid": _uuid(args[DEVICE_ARG])}


DEVICE_ARG = 6  # the place of ``storage_device`` (the GPU's index in the exporting process) in rebuild_cuda_tensor's arguments


def _uuid(index: int) -> str:
    """The UUID of this process's CUDA device ``index`` (the same GPU has the same UUID in every process)."""
    return str(torch.cuda.get_device_properties(index).uuid)


def _local_index(h: dict, index: int) -> int:
    """This process's index of the GPU a CUDA handle's buffer is on. The handle names it by the
    exporting process's ``index`` and by its UUID (``device_uuid``; a handle without one: ``index``
    as it is): ``index`` where this process's device ``index`` has that UUID, else the visible
    device that has it (a process whose ``CUDA_VISIBLE_DEVICES`` differs from the model's: a
    sidecar pinned to its tensor-parallel rank's GPU sees it as device 0). :class:`NoDeviceError`
    where no visible device has it."""
    want = h.get("device_uuid")
    count = torch.cuda.device_count()
    if want is None or (0 <= index < count and _uuid(index) == want):
        return index
    for i in range(count):
        if _uuid(i) == want:
            return i
    raise NoDeviceError(f"this sidecar cannot open the CUDA buffer handle: its GPU ({want}) is not one this process sees")


def _open_cuda(h: dict) -> torch.Tensor:
    """The tensor of a CUDA handle; :class:`NoDeviceError` where this process has no CUDA device, or
    CUDA cannot open the handle here (not this process's GPU)."""
    if not torch.cuda.is_available():
        raise NoDeviceError("a CUDA buffer handle needs a sidecar with CUDA: this one sees no CUDA device")
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    args = _dec(h["args"])
    if not isinstance(args, tuple) or len(args) <= DEVICE_ARG or not isinstance(args[DEVICE_ARG], int):
        raise TypeError("a CUDA handle's 'args' are rebuild_cuda_tensor's, its device an index")
    args = list(args)
    args[DEVICE_ARG] = _local_index(h, args[DEVICE_ARG])
    try:
        t = rebuild_cuda_tensor(*args)
    except RuntimeError as e:  # a CUDA error: the handle's device is not one this process can open
        raise NoDeviceError(f"this sidecar cannot open the CUDA buffer handle (not its GPU?): {e}") from None
    if list(t.shape) != list(h["shape"]) or dtype_name(t.dtype) != h["dtype"]:
        raise ValueError("CUDA handle does not describe the buffer it claims")
    return t
