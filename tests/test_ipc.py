import subprocess
import sys

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
