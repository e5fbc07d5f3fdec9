"""runs_kernel: the kernel copies exactly the runs asked for, back to back (as torch's copy does).

On CPU the kernel runs under Triton's interpreter in a subprocess (the interpreter is chosen when
the kernel is defined); on a GPU it is compiled.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvtest import REPO
from kvfetcher.codec import runs_kernel

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")


def cases() -> list[tuple[int, list[int], list[int]]]:
    """(source bytes, starts, lengths): nvCOMP's slots (runs shorter than their slot, one empty),
    a run longer than a program's piece, runs out of order and overlapping."""
    slots = [1000, 16, 0, 4096, 64]
    piece = runs_kernel.PIECE * runs_kernel.WORD
    return [(5 * 4096, [i * 4096 for i in range(5)], slots),
            (3 * piece + 64, [16, 0], [3 * piece + 32, 48]),
            (256, [128, 0, 64], [64, 128, 128])]


def compare(device: str) -> list[bool]:
    """Per case, whether the kernel's copy equals the runs' bytes joined by torch."""
    res = []
    for size, starts, lengths in cases():
        src = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(size)).to(device)
        assert runs_kernel.enabled(src)
        got = runs_kernel.gather(src, starts, lengths)
        want = torch.cat([src[s : s + n] for s, n in zip(starts, lengths)])
        res.append(got.dtype == torch.uint8 and torch.equal(got.cpu(), want.cpu()))
    return res


@needs_triton
def test_the_interpreted_kernel_copies_the_runs_back_to_back():
    here = str(Path(__file__).parent)
    path = [here] + [str(REPO / d) for d in ("sidecar", "tests", ".")] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(path))
    r = subprocess.run([sys.executable, "-c", "import json, test_runs_kernel as t; print(json.dumps(t.compare('cpu')))"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == [True] * len(cases())


@pytest.mark.gpu
@needs_triton
def test_the_compiled_kernel_copies_the_runs_back_to_back():
    assert compare("cuda") == [True] * len(cases())


def test_torch_copies_runs_where_the_kernel_does_not_serve_and_misaligned_runs_are_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    src = torch.arange(64, dtype=torch.uint8)
    assert not runs_kernel.enabled(src)
    assert runs_kernel.gather(src, [8, 0], [4, 8]).tolist() == [8, 9, 10, 11, 0, 1, 2, 3, 4, 5, 6, 7]
    assert runs_kernel.gather(src, [], []).numel() == 0
    with pytest.raises(ValueError, match="multiples of 4"):
        runs_kernel.gather(src, [2], [4])
