"""choice: per fetch, pick a stored representation — or recompute — with a cost model.

The model is deliberately small: a fetch of ``B`` stored bytes restoring ``K`` bytes of KV
takes ``latency + max(B / bandwidth, K / decode_rate)`` (download and decode are
pipelined, so the slower stage dominates), and whatever prefix it does not restore is
recomputed at the model's prefill rate. The option with the least total time wins; recompute
of everything is always an option, so a fetch is never planned to be slower than recompute.

With a TTFT budget, the least time is not the goal on a busy GPU: a recomputed prefix takes the
GPU from every request decoding beside it (goodput_bench measured the running requests' TPOT p99
at 0.6-1.4 s during 16K-token prefills), a fetch takes none. Then the fetch that recomputes
the fewest tokens while its predicted time stays within the budget wins, and only when no fetch
fits does the fastest option win.

A fetch may also **mix** two stored presets, chunk by chunk: the link is shared, but presets of
different formats decode on different engines (HEVC on NVDEC, raw by a copy), so on a link too
slow for raw and too fast for NVDEC to keep up, sending some chunks raw and the rest compressed
uses both at once. The split is the one that balances the slower of link and engines
(:func:`split`); ``choose`` weighs every mix of two usable presets beside the single ones.

``choose`` is pure; :class:`Estimator` holds the measured rates (EWMA per store endpoint and
per bitstream format) that feed it, and is updated from every fetch's actual timings. The model
leaves out the pipeline's fill and drain and imperfect overlap, so each preset also keeps a fit:
an EWMA of actual / modelled time of its fetches, which scales its predictions (measured on an
H100: 1.09-1.23 for ``balanced`` over 32K tokens, enough to turn a predicted 0.7% win over
recompute into a 19% loss).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

RECOMPUTE = "recompute"

#: KV bytes restored per second by decoding, before anything is measured; a preset's first
#: measured fetch replaces its format's prior. For raw, "decoding" is the pipeline's direct path
#: minus the read: its CRC-32 runs in the read's thread (so it counts in the store bandwidth),
#: what is left is one copy into the KV buffer. CPU: 3.0-3.8 GB/s end to end on the 2-core CPU
#: machine (bench/fetch_bench.py, Llama-3-8B shape, local store), taken as the prior; HEVC through
#: libavcodec.
DECODE_PRIOR = {"raw": 3e9, "hevc": 2.5e7}
#: GPU: HEVC is one NVDEC session (~0.5 GB/s; worker processes reach 2.6-3.3 GB/s once measured).
#: raw: 10 GB/s, what the whole direct path restored on an H100 (10.1 GB/s end to end from a
#: local store, docs/benchmarks/fetch_raw_h100.json; the copy alone is faster), far above any
#: compressed preset's restore rate: on links faster than those rates raw wins, on slower ones
#: the smaller representation or recompute.
GPU_DECODE_PRIOR = {"raw": 1e10, "hevc": 5e8}


@dataclass(frozen=True)
class Rates:
    bandwidth_Bps: float  # stored bytes per second from the store endpoint
    latency_s: float  # first-byte latency of a request
    decode_Bps: Mapping[str, float]  # KV bytes restored per second, by preset (measured) or format (prior)
    recompute_tps: float  # tokens per second the model prefills
    fit: Mapping[str, float] = field(default_factory=dict)  # by preset: actual / modelled fetch time (1 if unmeasured)
    list_s: float | None = None  # one round of a lookup's parallel LISTs, measured (None: take the latency)
    format_bandwidth: Mapping[str, float] = field(default_factory=dict)  # by bitstream format, where measured


@dataclass(frozen=True)
class Decision:
    preset: str  # a preset name, "a+b" for a mix of two, or RECOMPUTE
    chunks: int  # leading chunks to fetch
    tokens: int  # tokens they restore
    predicted_s: float  # predicted fetch time of those chunks (0 for recompute)
    total_s: float  # predicted time until the whole requested prefix is in the KV buffers
    options: dict[str, float] = field(default_factory=dict)  # total_s of every option considered
    plan: tuple[str, ...] = ()  # the preset of each fetched chunk


@dataclass(frozen=True)
class Part:
    """One preset's share of a fetch: the stored bytes it reads and the KV bytes it restores."""

    preset: str
    fmt: str
    stored_bytes: float
    kv_bytes: float


def decode_rate(preset: str, fmt: str, rates: Rates) -> float:
    """A preset's measured decode rate, else its format's prior (``exact`` decodes two samples per
    fp16 value where ``q8`` decodes one, so the same format restores KV at different rates)."""
    return rates.decode_Bps.get(preset) or rates.decode_Bps.get(fmt) or DECODE_PRIOR.get(fmt, 1e7)


def read_rate(fmt: str | None, rates: Rates) -> float:
    """Stored bytes per second for a format's fetches: measured on that format's own fetches where
    there are any (a decode-bound fetch reads slower than the link, and a raw fetch's reads carry
    its CRC), else the endpoint's."""
    return rates.format_bandwidth.get(fmt or "", 0.0) or rates.bandwidth_Bps


def link_rate(rates: Rates) -> float:
    """The link's capacity for a mix: the fastest any fetch read (a decode-bound format's own
    read rate is its decoder's pace, not the link's)."""
    return max([rates.bandwidth_Bps, *rates.format_bandwidth.values()])


def mix_fit(presets: Sequence[str], rates: Rates) -> float:
    """A mix's measured fit, else the worst of its presets' (its overheads are at least theirs)."""
    return rates.fit.get("+".join(presets)) or max(rates.fit.get(p, 1.0) for p in presets)


def fetch_seconds(parts: Sequence[Part], rates: Rates, fit: float = 1.0) -> float:
    """Predicted time of a fetch: first byte, then the slower of the download and the busiest
    decoding engine (they are pipelined). One preset reads at its format's measured rate; a mix
    shares the link (:func:`link_rate`), and its presets of one format take turns on one engine."""
    if len(parts) == 1:
        link = parts[0].stored_bytes / read_rate(parts[0].fmt, rates)
    else:
        link = sum(p.stored_bytes for p in parts) / link_rate(rates)
    engines: dict[str, float] = {}
    for p in parts:
        engines[p.fmt] = engines.get(p.fmt, 0.0) + p.kv_bytes / decode_rate(p.preset, p.fmt, rates)
    return fit * (rates.latency_s + max([link, *engines.values()]))


def split(n: int, chunk_kv_bytes: float, a: tuple[str, str, float], b: tuple[str, str, float], rates: Rates) -> tuple[int, float]:
    """The best mix of ``n`` chunks, ``k`` of preset ``a`` and the rest of ``b`` (each ``(preset,
    format, stored bytes per chunk)``), 0 < k < n: returns ``(k, seconds)``, or ``(0, inf)`` if n < 2.

    The time is a maximum of functions linear in ``k``, so convex: a binary search on its slope
    finds the least in O(log n) evaluations (the decision stays well under a millisecond).
    """
    if n < 2:
        return 0, float("inf")
    fit = mix_fit((a[0], b[0]), rates)

    def t(k: int) -> float:
        return fetch_seconds([Part(a[0], a[1], k * a[2], k * chunk_kv_bytes), Part(b[0], b[1], (n - k) * b[2], (n - k) * chunk_kv_bytes)], rates, fit)

    lo, hi = 1, n - 1
    while lo < hi:  # the first k where the time stops falling
        mid = (lo + hi) // 2
        if t(mid + 1) < t(mid):
            lo = mid + 1
        else:
            hi = mid
    return lo, t(lo)


def interleave(n: int, k: int, a: str, b: str) -> tuple[str, ...]:
    """``k`` of ``n`` chunks to ``a``, spread evenly among ``b``'s, so both engines work all along."""
    return tuple(a if (i + 1) * k // n > i * k // n else b for i in range(n))


def choose(
    stored: Sequence[Mapping[str, int]],
    chunk_tokens: int,
    chunk_kv_bytes: int,
    formats: Mapping[str, str],
    rates: Rates,
    allowed: set[str] | None = None,
    budget_s: float | None = None,
    mixes: bool = True,
) -> Decision:
    """Choose for a prefix of ``len(stored)`` chunks; ``stored[i]`` maps preset -> object size.

    ``formats`` maps each preset this reader can decode to its bitstream format; others are
    ignored. A preset is usable for the leading run of chunks that all have it. ``budget_s``: the
    TTFT budget within which a fetch is preferred to a faster recompute (see the module's doc).
    ``mixes``: weigh mixes of two presets too (a caller that cannot fetch a mix says False).
    """
    total_tokens = len(stored) * chunk_tokens
    recompute_all = total_tokens / rates.recompute_tps
    best = Decision(RECOMPUTE, 0, 0, 0.0, recompute_all)
    fits: Decision | None = None  # the fetch within the budget that recomputes least
    options = {RECOMPUTE: recompute_all}
    candidates = sorted({p for reps in stored[:1] for p in reps if p in formats and (allowed is None or p in allowed)})
    runs: dict[str, tuple[int, int]] = {}  # preset -> (leading chunks that have it, their bytes)

    def consider(d: Decision) -> None:
        nonlocal best, fits
        options[d.preset] = d.total_s
        if d.total_s < best.total_s:
            best = d
        if budget_s is not None and d.total_s <= budget_s and (fits is None or (-d.tokens, d.total_s) < (-fits.tokens, fits.total_s)):
            fits = d

    for preset in candidates:
        n, size = 0, 0
        while n < len(stored) and preset in stored[n]:
            size += stored[n][preset]
            n += 1
        runs[preset] = (n, size)
        fetch = fetch_seconds([Part(preset, formats[preset], size, n * chunk_kv_bytes)], rates, rates.fit.get(preset, 1.0))
        consider(Decision(preset, n, n * chunk_tokens, fetch, fetch + (total_tokens - n * chunk_tokens) / rates.recompute_tps, plan=(preset,) * n))
    for i, a in enumerate(candidates if mixes else ()):
        for b in candidates[i + 1 :]:
            n = min(runs[a][0], runs[b][0])
            k, fetch = split(n, chunk_kv_bytes, (a, formats[a], runs[a][1] / runs[a][0]), (b, formats[b], runs[b][1] / runs[b][0]), rates)
            if k:
                total = fetch + (total_tokens - n * chunk_tokens) / rates.recompute_tps
                consider(Decision(f"{a}+{b}", n, n * chunk_tokens, fetch, total, plan=interleave(n, k, a, b)))
    best = fits or best
    return Decision(best.preset, best.chunks, best.tokens, best.predicted_s, best.total_s, options, best.plan)


def hopeless(
    n_chunks: int,
    chunk_tokens: int,
    chunk_kv_bytes: int,
    ratios: Mapping[str, float],
    formats: Mapping[str, str],
    rates: Rates,
    allowed: set[str] | None = None,
    slack: float = 1.5,
    budget_s: float | None = None,
    lookup_s: float = 0.0,
) -> bool:
    """True when even the best case loses to recompute (and misses ``budget_s``, see :func:`choose`),
    so the store need not be asked at all.

    Best case: every chunk stored in every allowed preset, ``slack`` times smaller than its
    measured ratio says, no latency; the preset's fit (measured overheads) still counts, and so
    does ``lookup_s``, what asking the store would cost first. A lookup costs a LIST per chunk:
    10–18% of an 8B model's prefill on an H200 (docs/benchmarks/ttft_h200.md), 0.18 s of a 32K
    prefix over a 10 Gbit/s link on an H100, where recompute won anyway.
    Optimistic on purpose: a wrong "no" would skip a fetch that pays; a wrong "yes" costs a lookup.
    """
    if n_chunks == 0:
        return True
    recompute_all = n_chunks * chunk_tokens / rates.recompute_tps
    kv = n_chunks * chunk_kv_bytes
    best: dict[str, tuple[str, str, float]] = {}  # preset -> (preset, format, best-case bytes per chunk)
    for preset, fmt in formats.items():
        if allowed is not None and preset not in allowed:
            continue
        ratio = max(ratios.get(preset, 1.0), 1.0)
        chunk = chunk_kv_bytes / (ratio * slack) if fmt != "raw" else chunk_kv_bytes  # raw's size is known, a codec's varies with content
        best[preset] = (preset, fmt, chunk)
    options = [lookup_s + fetch_seconds([Part(p, f, c * n_chunks, kv)], replace(rates, latency_s=0.0), rates.fit.get(p, 1.0))
               for p, f, c in best.values()]
    names = sorted(best)
    options += [lookup_s + split(n_chunks, chunk_kv_bytes, best[a], best[b], replace(rates, latency_s=0.0))[1]
                for i, a in enumerate(names) for b in names[i + 1 :]]
    return not any(t < recompute_all or (budget_s is not None and t <= budget_s) for t in options)


def lookup_seconds(n_chunks: int, rates: Rates, parallel: int) -> float:
    """A lookup's time: one LIST per chunk, ``parallel`` at a time (a round as measured, else a latency)."""
    return -(-n_chunks // parallel) * (rates.list_s or rates.latency_s)


class Estimator:
    """Measured throughputs: an EWMA per store endpoint (bandwidth, latency) and per preset (decode)."""

    def __init__(self, alpha: float = 0.3, bandwidth_Bps: float = 1.25e8, latency_s: float = 0.005, gpu: bool = False):
        self.alpha = alpha
        self._prior = (bandwidth_Bps, latency_s)
        self._bw: dict[str, float] = {}
        self._lat: dict[str, float] = {}
        self._decode_prior = dict(GPU_DECODE_PRIOR if gpu else DECODE_PRIOR)
        self._decode: dict[str, float] = {}  # a first measurement replaces the prior
        self._fit: dict[str, float] = {}
        self._list: dict[str, float] = {}
        self._fmt_bw: dict[tuple[str, str], float] = {}  # (format, endpoint)

    def _ewma(self, table: dict, key, value: float) -> None:
        old = table.get(key)
        table[key] = value if old is None else (1 - self.alpha) * old + self.alpha * value

    def observe_read(self, endpoint: str, nbytes: int, busy_s: float, fmt: str | None = None) -> None:
        if nbytes > 0 and busy_s > 0:
            self._ewma(self._bw, endpoint, nbytes / busy_s)
            if fmt:
                self._ewma(self._fmt_bw, (fmt, endpoint), nbytes / busy_s)

    def observe_latency(self, endpoint: str, seconds: float) -> None:
        self._ewma(self._lat, endpoint, seconds)

    def observe_decode(self, preset: str, kv_bytes: int, busy_s: float) -> None:
        if kv_bytes > 0 and busy_s > 0:
            self._ewma(self._decode, preset, kv_bytes / busy_s)

    def observe_lookup(self, endpoint: str, seconds: float, rounds: int) -> None:
        if rounds > 0 and seconds > 0:
            self._ewma(self._list, endpoint, seconds / rounds)

    def observe_fit(self, endpoint: str, key: str, parts: Sequence[Part], actual_s: float) -> float:
        """A whole fetch's time against the model's, with the rates as they stand after this fetch
        updated them: the fit keeps only what the rates cannot explain. ``key``: the preset, or the
        mix (``a+b``) the parts came from. Returns its fit."""
        if parts and all(p.stored_bytes > 0 and p.kv_bytes > 0 for p in parts) and actual_s > 0:
            modelled = fetch_seconds(parts, self.rates(endpoint, 1.0))
            self._ewma(self._fit, key, min(4.0, max(0.5, actual_s / modelled)))
        return self._fit.get(key, 1.0)

    def bandwidth(self, endpoint: str) -> float:
        return self._bw.get(endpoint, self._prior[0])

    def rates(self, endpoint: str, recompute_tps: float) -> Rates:
        decode = {**self._decode_prior, **self._decode}
        by_format = {fmt: v for (fmt, ep), v in self._fmt_bw.items() if ep == endpoint}
        return Rates(self.bandwidth(endpoint), self._lat.get(endpoint, self._prior[1]), decode, recompute_tps, dict(self._fit),
                     self._list.get(endpoint), by_format)
