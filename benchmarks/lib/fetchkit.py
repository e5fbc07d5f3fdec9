"""fetchkit: stored prefixes of a model shape and the ways to fetch them, for the benchmarks.

* kvfetcher: objects from ``chunk.encode_chunk`` (any preset), fetched by ``executor.fetch``.
* CacheGen (LMCache 0.5.x, ``lmcache.storage_backend.serde``): its GPU encoder and decoder as
  a peer codec, fetched by a plain pipelined loop (downloads in threads, decode on the GPU).

Timing only: values are synthetic (``kvsource.synthetic_kv``) and a prefix reuses a few distinct
chunks cyclically (byte-identical objects decode in the same time), because encoding gigabytes
with libx265 on CPU would take longer than the measurement. Compression ratios of real KV come
from ``kvfetcher/data/presets_measured.json``; the ratios of these objects are reported too.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import pickle
import time
from collections.abc import Sequence
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor

import torch

from kvfetcher import kvbuffer
from kvfetcher.codec import ENTROPY_FORMATS, nvcomp
from kvfetcher.fetch import executor
from kvfetcher.format import container, presets
from kvfetcher.format.mac import ObjectMAC
from benchmarks.lib.standin import encode_chunk  # a stand-in calibration for random-weight shapes
from kvfetcher.eval.costmodel import ModelShape
from benchmarks.lib.kvsource import synthetic_kv

FINGERPRINT = "scale-bench"


def _encode_one(args: tuple) -> bytes:
    shape, preset, chunk_tokens, seed, start, dtype, gpu = args
    kv = synthetic_kv(shape.layers, shape.kv_heads, chunk_tokens, shape.head_dim, dtype, seed)
    return encode_chunk(kv.cuda() if gpu else kv, preset, FINGERPRINT, start=start, rope_theta=shape.rope_theta)


def encode_objects(shape: ModelShape, preset: str, chunk_tokens: int = 256, distinct: int = 4, workers: int = 8,
                   dtype: torch.dtype = torch.bfloat16, gpu: bool = False) -> list[bytes]:
    """``distinct`` different stored chunks of ``shape`` in ``preset``, encoded in parallel processes, or
    with ``gpu`` and an entropy-coded preset on this process's GPU where nvCOMP runs, as a sidecar's
    writer does."""
    gpu = gpu and presets.get(preset).codec.format in ENTROPY_FORMATS and nvcomp.available()
    jobs = [(shape, preset, chunk_tokens, seed, seed * chunk_tokens, dtype, gpu) for seed in range(distinct)]
    if workers <= 1 or preset == "raw" or gpu:
        return [_encode_one(j) for j in jobs]
    # spawn, not fork: a process forked after torch has run its thread pools can hang
    with ProcessPoolExecutor(min(workers, distinct), mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(_encode_one, jobs))


def put_prefix(store, tag: str, objects: Sequence[bytes], chunks: int, chunk_tokens: int = 256,
               preset: str | None = None, object_key: bytes | None = None) -> list[kvbuffer.ChunkRef]:
    """Store a prefix of ``chunks`` chunks cycling over ``objects``; its refs, in order. With
    ``preset``, each object's name ends as a sidecar's do (``…/{preset}.kvfc``: the executor reads
    an entropy-coded preset's small objects whole); with ``object_key``, each is tagged for its name
    as a keyed sidecar's writer tags it."""
    refs = []
    for i in range(chunks):
        obj = objects[i % len(objects)]
        name = f"{tag}/{i}/{preset}.kvfc" if preset else f"{tag}/{i}.kvfc"
        if object_key is not None:
            obj = tagged(obj, ObjectMAC(object_key, name))
        store.put(name, obj)
        refs.append(kvbuffer.ChunkRef(name, len(obj), i * chunk_tokens, chunk_tokens))
    return refs


def tagged(obj: bytes, auth: ObjectMAC) -> bytes:
    """``obj`` (untagged) with its parts' and header's tags for ``auth``'s key and name."""
    h = container.parse_header(obj)
    side = bytes(container.slice_segment(obj, h, h.side)) if h.side else None
    return container.build(h.fields(), side, [(s.frames, container.slice_segment(obj, h, s)) for s in h.segments], auth)


async def fetch_kvfetcher(store, refs, buffer: torch.Tensor, offset: int, io_pool: Executor, decode_pool: Executor, window: int = 8,
                          workers=None, handle: dict | None = None) -> executor.Outcome:
    """``executor.fetch`` into ``buffer``; with ``workers`` (``decode_workers.DecodeWorkers``) and the
    buffer's IPC ``handle``, chunks are decoded and restored in worker processes (main's NVDEC path)."""
    dest = kvbuffer.Destination(buffer, offset=offset, tokens=sum(r.tokens for r in refs), handle=handle)
    return await executor.fetch(store, refs, dest, fingerprint=FINGERPRINT, io_pool=io_pool, decode_pool=decode_pool,
                                device=buffer.device, window=window, workers=workers if handle is not None else None)


# -- raw baseline: bytes straight into the KV buffer ----------------------------------------------


def raw_objects(shape: ModelShape, chunk_tokens: int = 256, distinct: int = 4) -> list[bytes]:
    """A chunk's KV bytes as they are ([layers, 2, H, T, D] bf16, no container): the raw-fetch baseline."""
    return [synthetic_kv(shape.layers, shape.kv_heads, chunk_tokens, shape.head_dim, torch.bfloat16, s).view(torch.uint8).numpy().tobytes()
            for s in range(distinct)]


def fetch_raw_direct(store, refs, buffer: torch.Tensor, offset: int, io_pool: ThreadPoolExecutor, window: int = 8) -> float:
    """The plain way to fetch raw KV: ranged GETs ``window`` chunks ahead, each copied host-to-device
    into its slots as it arrives (in the download threads); returns seconds."""
    L, _, H, _, D = buffer.shape

    def one(r) -> None:
        data = store.get(r.name)
        src = torch.frombuffer(bytearray(data), dtype=buffer.dtype).view(L, 2, H, r.tokens, D)
        a = offset + r.start
        buffer[:, :, :, a : a + r.tokens].copy_(src)
        if buffer.is_cuda:
            torch.cuda.current_stream(buffer.device).synchronize()

    t0 = time.perf_counter()
    futs = [io_pool.submit(one, r) for r in refs[:window]]
    for i in range(len(refs)):
        futs[i].result()
        if i + window < len(refs):
            futs.append(io_pool.submit(one, refs[i + window]))
    return time.perf_counter() - t0


# -- CacheGen (LMCache) -------------------------------------------------------------------------


class CacheGen:
    """LMCache's CacheGen codec on the GPU: per-layer bins (keys 32 for the first 10 layers then
    16, values 32 for the first 2 then 16: LMCache's setting for Llama-3-8B), a per-token scale
    and arithmetic coding of the quantised symbols with a CDF per channel."""

    def __init__(self, shape: ModelShape, device: str = "cuda"):
        from lmcache.storage_backend.serde import cachegen_decoder as dec
        from lmcache.storage_backend.serde import cachegen_encoder as enc
        from lmcache.storage_backend.serde.cachegen_basics import CacheGenConfig, QuantizationSpec

        self._enc, self._dec = enc, dec
        L = shape.layers
        self.config = CacheGenConfig(
            nlayers=L,
            kspecs=[QuantizationSpec(0, min(10, L), 32), QuantizationSpec(min(10, L), L, 16)],
            vspecs=[QuantizationSpec(0, min(2, L), 32), QuantizationSpec(min(2, L), L, 16)],
        )
        self.device = torch.device(device)
        self.key_bins = self._bins(self.config.kspecs, L)
        self.value_bins = self._bins(self.config.vspecs, L)
        self.shape = shape

    def _bins(self, specs, L: int) -> torch.Tensor:
        b = torch.zeros(L)
        for s in specs:
            b[s.start_layer : s.end_layer] = s.bins
        return b.to(self.device)

    def encode(self, kv: torch.Tensor) -> bytes:
        """kvfetcher-layout chunk [layers, 2, H, T, D] -> bytes (tensors moved to CPU, pickled)."""
        blob = kv.to(self.device).permute(0, 1, 3, 2, 4).contiguous()  # CacheGen's [layers, 2, T, H, D]
        out = self._enc.encode_function(blob, self.config, self.key_bins, self.value_bins, blob.shape[2])
        for c in out.data_chunks:
            c.bytestream, c.bytestream_lengths = c.bytestream.cpu(), c.bytestream_lengths.cpu()
        out.cdf, out.max_tensors_key, out.max_tensors_value = out.cdf.cpu(), out.max_tensors_key.cpu(), out.max_tensors_value.cpu()
        return pickle.dumps(out)

    def decode_into(self, data: bytes, view: torch.Tensor) -> None:
        """bytes -> the destination view [layers, 2, H, T, D] (on the GPU)."""
        out = pickle.loads(data)
        dev = self.device
        for c in out.data_chunks:
            c.bytestream, c.bytestream_lengths = c.bytestream.to(dev, non_blocking=True), c.bytestream_lengths.to(dev, non_blocking=True)
        cdf = out.cdf.to(dev)
        mk, mv = out.max_tensors_key.to(dev), out.max_tensors_value.to(dev)
        L, T = mk.shape[0], mk.shape[1]
        H, D = out.num_heads, out.head_size
        buf = torch.empty((T, 2 * L * H * D), dtype=torch.uint8, device=dev)
        key, value = self._dec.decode_function_gpu(cdf, out.data_chunks, L, T, buf)
        key = self._dec.do_dequantize(key, self.key_bins, mk)  # [L, T, H*D]
        value = self._dec.do_dequantize(value, self.value_bins, mv)
        view[:, 0].copy_(key.view(L, T, H, D).transpose(1, 2))
        view[:, 1].copy_(value.view(L, T, H, D).transpose(1, 2))


def fetch_cachegen(store, refs, buffer: torch.Tensor, offset: int, codec: CacheGen, io_pool: ThreadPoolExecutor, window: int = 8) -> float:
    """Download up to ``window`` chunks ahead while the GPU decodes, in order; returns seconds."""
    t0 = time.perf_counter()
    futs = [io_pool.submit(store.get, r.name) for r in refs[:window]]
    stream = torch.cuda.Stream(buffer.device) if buffer.is_cuda else None
    for i, r in enumerate(refs):
        data = futs[i].result()
        if i + window < len(refs):
            futs.append(io_pool.submit(store.get, refs[i + window].name))
        a = offset + r.start
        view = buffer[:, :, :, a : a + r.tokens]
        if stream is not None:
            with torch.cuda.stream(stream):
                codec.decode_into(data, view)
        else:
            codec.decode_into(data, view)
    if stream is not None:
        stream.synchronize()
    return time.perf_counter() - t0


def run(coro):
    """``asyncio.run`` for a coroutine from plain code."""
    return asyncio.run(coro)


async def fetch_once(store, refs, buf, device, window, decode_workers, workers=None, fingerprint: str = "bench"):
    """One ``executor.fetch`` of ``refs`` into the registered buffer ``buf`` (its tensor and IPC handle)."""
    with ThreadPoolExecutor(16) as io, ThreadPoolExecutor(decode_workers) as dec:
        dest = kvbuffer.Destination(buf.tensor, tokens=sum(r.tokens for r in refs), handle=buf.handle)
        return await executor.fetch(store, refs, dest, fingerprint=fingerprint, io_pool=io, decode_pool=dec, device=device,
                                    window=window, workers=workers)
