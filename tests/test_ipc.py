import json
import subprocess
import sys
import threading

import pytest
import torch

from kvfetcher import ipc


def test_shared_memory_aliases_across_processes():
    b = ipc.allocate((2, 2, 1, 8, 4), torch.float16)
    try:
        t = ipc.open_handle(b.handle)
        t[1, 0, 0, 3] = 7.0
        assert b.tensor[1, 0, 0, 3].tolist() == [7.0] * 4
        code = (
            "import json,sys,torch; from kvfetcher import ipc; "
            "t = ipc.open_handle(json.loads(sys.argv[1])); t[0, 1, 0, 5] = 3.0"
        )
        import json

        subprocess.run([sys.executable, "-c", code, json.dumps(b.handle)], check=True)
        assert b.tensor[0, 1, 0, 5].tolist() == [3.0] * 4
    finally:
        b.close()


@pytest.mark.parametrize(
    "bad",
    [
        {"kind": "shm", "path": "/etc/passwd", "shape": [1], "dtype": "float16"},
        {"kind": "shm", "path": "/dev/shm/kvfetcher-missing", "shape": [1], "dtype": "float16"},
        {"kind": "nfs"},
    ],
)
def test_bad_handles_are_refused(bad):
    with pytest.raises(ValueError):
        ipc.open_handle(bad)


def test_size_mismatch_is_refused():
    b = ipc.allocate((4, 4), torch.float16)
    try:
        with pytest.raises(ValueError, match="bytes"):
            ipc.open_handle(dict(b.handle, shape=[8, 8]))
    finally:
        b.close()


@pytest.mark.gpu
def test_cuda_ipc_handle_round_trips_in_another_process():
    b = ipc.allocate((2, 2, 1, 8, 4), torch.float16, "cuda")
    import json

    code = "import json,sys; from kvfetcher import ipc; t = ipc.open_handle(json.loads(sys.argv[1])); t.fill_(5); import torch; torch.cuda.synchronize()"
    subprocess.run([sys.executable, "-c", code, json.dumps(b.handle)], check=True)
    assert bool((b.tensor == 5).all())


@pytest.mark.gpu
def test_a_cuda_handle_opens_in_a_process_pinned_to_its_gpu():
    """A sidecar pinned to its tensor-parallel rank's GPU (``CUDA_VISIBLE_DEVICES=r``) sees the
    model's device ``r`` as its device 0: the handle's UUID finds it there."""
    import os

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    b = ipc.allocate((2, 2, 1, 8, 4), torch.float16, "cuda:1")
    code = ("import json,sys,torch; from kvfetcher import ipc; t = ipc.open_handle(json.loads(sys.argv[1])); "
            "assert t.device.index == 0, t.device; t.fill_(6); torch.cuda.synchronize()")
    subprocess.run([sys.executable, "-c", code, json.dumps(b.handle)], check=True, env=dict(os.environ, CUDA_VISIBLE_DEVICES="1"))
    assert bool((b.tensor == 6).all())
    hidden = ("import json,sys; from kvfetcher import ipc, errors\ntry:\n    ipc.open_handle(json.loads(sys.argv[1]))\n"
              "except errors.NoDeviceError:\n    sys.exit(0)\nsys.exit(1)")
    subprocess.run([sys.executable, "-c", hidden, json.dumps(b.handle)], check=True, env=dict(os.environ, CUDA_VISIBLE_DEVICES="0"))


def _open_fds() -> int:
    """This process's open fds, once unreachable mappings are gone (each mapping holds a dup of its fd)."""
    import gc
    import os

    gc.collect()
    return len(os.listdir("/proc/self/fd"))


def test_a_paged_handle_opens_every_layer_in_another_process():
    from kvfetcher.kvbuffer import PagedLayout, read_blocks

    layers = [ipc.allocate((2, 6, 4, 2, 8), torch.float16) for _ in range(3)]  # KBTHD, one per layer
    layout = PagedLayout("KBTHD", 4)
    try:
        handle = ipc.paged_handle([b.handle for b in layers], layout)
        code = (
            "import json,sys,torch; from kvfetcher import ipc; "
            "kv = ipc.open_handle(json.loads(sys.argv[1])); "
            "kv.write(kv.blocks_of([5, 2], 0, 8), torch.arange(3 * 2 * 2 * 8 * 8, dtype=torch.float16).view(3, 2, 2, 8, 8))"
        )
        subprocess.run([sys.executable, "-c", code, json.dumps(handle)], check=True)
        got = read_blocks([b.tensor for b in layers], layout, [5, 2], 0, 8)
        assert torch.equal(got, torch.arange(3 * 2 * 2 * 8 * 8, dtype=torch.float16).view(3, 2, 2, 8, 8))
        assert not layers[1].tensor[:, [0, 1, 3, 4]].any()
    finally:
        for b in layers:
            b.close()


def test_adopting_a_paged_handle_holds_one_fd_per_layer_and_releases_them_all():
    from kvfetcher.kvbuffer import PagedKV, PagedLayout

    layers = [ipc.allocate((2, 6, 4, 2, 8), torch.float16) for _ in range(3)]
    try:
        before = _open_fds()
        kv, own = ipc.adopt(ipc.paged_handle([b.handle for b in layers], PagedLayout("KBTHD", 4)))
        assert isinstance(kv, PagedKV) and kv.shape == (3, 2, 8) and len({h["fd"] for h in own["handles"]}) == 3
        ipc.release(own)
        del kv
        assert _open_fds() == before
        bad = ipc.paged_handle([layers[0].handle, layers[1].handle, {"kind": "nfs"}], PagedLayout("KBTHD", 4))
        with pytest.raises(ValueError):
            ipc.adopt(bad)
        assert _open_fds() == before  # the two adopted before the bad one were released
        mismatched = ipc.paged_handle([b.handle for b in layers], PagedLayout("KBHTD", 4))  # T is not the 3rd axis
        with pytest.raises(ValueError, match="does not fit"):
            ipc.adopt(mismatched)
        assert _open_fds() == before
    finally:
        for b in layers:
            b.close()


@pytest.mark.parametrize("handles", [[], "x", [{"kind": "paged", "handles": []}]])
def test_a_paged_handle_holds_a_list_of_tensor_handles(handles):
    with pytest.raises(ValueError, match="list of tensor handles"):
        ipc.open_handle({"kind": "paged", "dims": "KBTHD", "block_size": 4, "handles": handles})


class FakeCudart:
    """Records cudaHostRegister / cudaHostUnregister calls; registers answer ``answer``."""

    class cudaError:
        success = 0

    def __init__(self, answer=0):
        self.answer, self.calls, self.threads = answer, [], []

    def cudaHostRegister(self, ptr, size, flags):
        self.calls.append(("register", ptr, size))
        self.threads.append(threading.get_ident())
        return self.answer

    def cudaHostUnregister(self, ptr):
        self.calls.append(("unregister", ptr))
        return 0


def test_pinning_registers_the_whole_buffer_with_cuda_and_unpinning_unregisters_it(monkeypatch):
    b = ipc.allocate((2, 2, 1, 8, 4), torch.bfloat16)
    assert not ipc.pin(b.tensor) or torch.cuda.is_available()  # without CUDA: nothing to do, pageable
    rt = FakeCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    devices = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_device", devices.append)
    assert ipc.pin(b.tensor)
    assert devices == [3]  # registered on the caller's device, not a new thread's default
    ipc.unpin(b.tensor)
    assert rt.calls == [("register", b.tensor.data_ptr(), 2 * 2 * 8 * 4 * 2), ("unregister", b.tensor.data_ptr())]
    rt.answer = 712  # cudaErrorHostMemoryAlreadyRegistered: refused, stays pageable
    assert not ipc.pin(b.tensor)
    # registered from a thread of its own: a refusal, CUDA's last error of that thread, cannot reach the caller's next launch
    assert threading.get_ident() not in rt.threads
    b.close()
