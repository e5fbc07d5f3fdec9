"""restore_procs: an engine's own processes that restore its engine-decode loads.

In engine-decode mode the serving engine's process restores the stored objects the sidecar placed
in its arenas. A thread of that process shares the GIL with the engine's loop, which holds it
between steps, and restores at a small fraction of its rate beside it (docs/architecture.md has
the measure, ``benchmarks/paged_restore/engine_restore`` takes it). :class:`RestoreProcs` restores in
processes of the engine's own (:class:`~kvfetcher.fetch.workers.DecodeWorkers`: a GIL and a CUDA
context each, about 0.5 GiB of the GPU's memory), which map the arena (a memfd of the engine) and
the engine's KV blocks (CUDA IPC) and write each verified object straight into its blocks; a store's
copy of its blocks into the staging memory is theirs too (:meth:`RestoreProcs.copy_out`).

They start in the background when the KV cache registers (also from a daemonic process, as vLLM's
tensor-parallel workers are: :func:`~kvfetcher.fetch.workers.may_start_children`); until they are
ready, or where they cannot start or cannot map the blocks, the engine's thread restores as before.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from kvfetcher import ipc, kvbuffer
from kvfetcher.errors import ContainerError, GeometryMismatchError
from kvfetcher.fetch.workers import BufferOpenError, DecodeWorkers, warmup_object
from kvfetcher.format import container, presets

log = logging.getLogger("kvfetcher.integrations.staged")

#: the presets whose small objects warm the processes, one per bitstream format an engine may decode
WARM_PRESETS = ("raw", "q8-zstd", "compact-ans", "balanced")


def cuda_paged_handle(tensors: torch.Tensor | Sequence[torch.Tensor], layout: kvbuffer.PagedLayout) -> dict:
    """The handle of paged KV ``tensors`` on a GPU (seen through ``layout``), as the processes open it."""
    return ipc.paged_handle([ipc.cuda_handle(t) for t in ([tensors] if isinstance(tensors, torch.Tensor) else tensors)], layout)


def _runs(items: Sequence, k: int) -> list[Sequence]:
    """``items`` in at most ``k`` runs of consecutive ones, as even as whole items allow."""
    per = max(1, -(-len(items) // k))
    return [items[i : i + per] for i in range(0, len(items), per)]


class RestoreProcs:
    """``procs`` restore processes for the paged KV that ``handle`` names (:func:`cuda_paged_handle`;
    on a CPU, memfd handles), started in a background thread and warmed with a small object of each
    bitstream format of ``formats`` (the CUDA context, the decoders); :meth:`ready` once they can take
    objects."""

    def __init__(self, handle: dict, procs: int, formats: Sequence[str] = ()):
        self.handle, self.formats = handle, tuple(formats)
        self.restored, self.copied = 0, 0  # objects restored and store pieces copied out in the processes
        self.procs = DecodeWorkers(procs)
        self.pool = ThreadPoolExecutor(procs, thread_name_prefix="kvfetcher-restore")  # one caller per process
        self._ready = threading.Event()
        self._closed = False
        threading.Thread(target=self._start, daemon=True, name="kvfetcher-restore-start").start()

    def _start(self) -> None:
        try:
            self.procs.start()
            self.procs.open(self.handle)
            warm = [p for p in WARM_PRESETS if presets.get(p).codec.format in self.formats]
            done = self.procs.warm("cuda" if torch.cuda.is_available() else "cpu", [warmup_object(p) for p in warm]) if warm else None
            if done is not None and done.errors:  # (the first load of that format sets up instead)
                log.warning("kvfetcher: warming the restore processes failed: %s", done.errors[0])
        except Exception as e:  # noqa: BLE001 — without them the engine's thread restores, as before
            if self._closed:
                return
            log.warning("kvfetcher: the engine's restore processes did not start (%s: %s); loads are restored in the engine's own "
                        "thread, slower beside its loop", type(e).__name__, e)
            return
        if not self._closed:
            self._ready.set()
            log.info("kvfetcher: %d restore processes ready for engine-decode loads", self.procs.procs)

    def ready(self) -> bool:
        return self._ready.is_set()

    def restore(self, dest: kvbuffer.PagedDestination, objects: Sequence[tuple[int, int, int]], first: int, n: int, memory: memoryview,
                arena: ipc.SharedBuffer, fingerprint: str, stop_at: float | None = None) -> tuple[int, list[tuple[container.Header, int]]]:
        """Restore ``objects`` ((token, offset, size) of whole chunks of ``n`` tokens from ``first`` on,
        in order, in ``arena``, which ``memory`` maps here) into ``dest``: one run of consecutive
        objects per process, each sent as one message (a thread here pays the GIL per message, not
        per object). The end of the tokens written in order from ``first`` and the (header, KV bytes)
        of each object restored. An object that fails, or is not started by ``stop_at`` (monotonic
        seconds), ends what counts; every run has ended when this returns, so no process reads the
        arena after it. Where the processes cannot map the blocks they stop being :meth:`ready`."""
        items: list[tuple[int, container.Header, tuple]] = []
        for start, offset, size in objects:
            if start != first + len(items) * n or offset < 0 or size < 0 or offset + size > len(memory):
                log.warning("kvfetcher: the sidecar named a stored object the arena does not hold in order (token %d, bytes %d+%d)",
                            start, offset, size)
                break
            try:
                h = container.parse_header(memory[offset : offset + size], None)
                container.check_fingerprint(h, fingerprint)
                container.check_size(h, size)
            except (ContainerError, GeometryMismatchError, ValueError) as e:
                log.warning("kvfetcher: a stored object for tokens %d.. did not restore here, recomputing from there: %s", start, e)
                break
            parts = ([h.side] if h.side else []) + list(h.segments)
            spans = [(offset + h.header_size + p.offset, offset + h.header_size + p.offset + p.length) for p in parts]
            items.append((start, h, (bytes(memory[offset : offset + h.header_size]), spans, dest.where(kvbuffer.ChunkRef("", size, start, n)))))
        runs = _runs(items, self.procs.procs)
        where = (ipc.memfd_path(arena.handle), len(memory))
        asked = [self.pool.submit(self.procs.restore_many_at, self.handle, where, [it for _, _, it in run], stop_at) for run in runs]
        done, restored, ended = first, [], False
        for run, f in zip(runs, asked):
            try:
                kv_bytes, failed = f.result()
            except Exception as e:  # noqa: BLE001 — a dead process, a CUDA error: recompute from this run
                kv_bytes, failed = [], e
            if isinstance(failed, BufferOpenError):
                self._unmappable(failed)
            elif failed is not None:
                log.warning("kvfetcher: a stored object for tokens %d.. did not restore, recomputing from there: %s",
                            run[len(kv_bytes)][0], failed)
            for (start, h, _), b in zip(run, kv_bytes):
                if not ended and start == done:
                    restored.append((h, b))
                    done = start + n
            ended = ended or len(kv_bytes) < len(run)
        self.restored += len(restored)
        if ended and self._ready.is_set():  # (else the engine's thread restores the rest)
            log.warning("kvfetcher: restoring stored objects ended at token %d (deadline, break-even or a failed object): "
                        "recomputing from there", done)
        return done, restored

    def copy_out(self, pieces: Sequence[tuple[list[int], int]], shared: ipc.SharedBuffer, slots: int) -> bool:
        """Copy the KV of each piece's blocks into the flat buffer ``shared`` (``slots`` token slots),
        from its slot on, in the processes, side by side (a run of pieces per process, one message
        each); True once every piece is there. False if one failed (logged; where the processes
        cannot map the blocks they stop being :meth:`ready`): the caller copies them itself. Every
        piece started has ended when this returns."""
        where = (ipc.memfd_path(shared.handle), shared.tensor.numel() * shared.tensor.element_size())
        asked = [self.pool.submit(self.procs.copy_out_at, self.handle, run, where, slots) for run in _runs(pieces, self.procs.procs)]
        ok = True
        for f in asked:
            try:
                f.result()
            except BufferOpenError as e:
                self._unmappable(e)
                ok = False
            except Exception as e:  # noqa: BLE001 — a dead process, a CUDA error: the caller copies instead
                log.warning("kvfetcher: a restore process could not copy blocks out (%s: %s): the engine's thread copies", type(e).__name__, e)
                ok = False
        self.copied += len(pieces) if ok else 0
        return ok

    def _unmappable(self, e: Exception) -> None:
        if self._ready.is_set():
            log.warning("kvfetcher: the restore processes cannot map the KV blocks (%s): the engine's thread restores and copies", e)
        self._ready.clear()

    def close(self) -> None:
        self._closed = True
        self._ready.clear()
        self.pool.shutdown(wait=True)
        self.procs.close()
