"""choice: per fetch, pick a stored representation — or recompute — with a cost model.

The model is deliberately small: a fetch of ``B`` stored bytes restoring ``K`` bytes of KV
takes ``latency + max(B / bandwidth, K / decode_rate)`` (download and decode are
pipelined, so the slower stage dominates), and whatever prefix it does not restore is
recomputed after it, as long as the engine's :class:`~kvfetcher.fetch.prefill.PrefillModel` says
(superlinear: the recomputed tokens attend over the fetched ones). The option with the least total
time wins; recompute of everything is always an option, so a fetch is never planned to be slower
than recompute. A load also costs the engine time the model leaves out (noticing the load's end,
scheduling the request again): the engine measures it and every load option pays it
(``Rates.load_overhead_s``), so a near-tie goes to recompute. And the prefill model is itself
only as good as its recent predictions: a load is taken only when it beats recompute by more than
the model was lately off the engine's whole prefills (``Rates.prefill_error``, a share of
recompute's time, at most :data:`MAX_PREFILL_ERROR`), so a young or unsettled model cannot sell a
load that its own error could turn into a loss.

Plans can still be wrong (a rate learnt on a link that has since slowed): a load is
given until its break-even, :data:`BREAKEVEN_SLACK` times the predicted recompute (or the TTFT
budget; :data:`MIN_BREAKEVEN_S` at least), and stops there keeping what it loaded, so a wrong plan costs a bounded loss, not a stall.

With a TTFT budget, the least time is not the goal on a busy GPU: a recomputed prefix takes the
GPU from every request decoding beside it, a fetch takes none. Then the fetch that recomputes
the fewest tokens while its predicted time stays within the budget wins, and only when no fetch
fits does the fastest option win.

``choose`` is pure; :class:`Estimator` holds the measured rates (per store endpoint and per
bitstream format) that feed it, and is updated from every fetch's actual timings. The model
leaves out the pipeline's fill and drain and imperfect overlap, so each preset also keeps a
:class:`Fit` of its fetches' actual times to the modelled ones, ``actual = scale * modelled +
overhead``: both terms, because fill and drain are fixed seconds while imperfect overlap grows
with the fetch. The fit is kept per (preset, endpoint), falling back to the preset's fit over all
endpoints: how well download and decode overlap depends on which of them is the slower.

Rates are ratios of decayed sums (bytes over seconds), not averages of per-fetch ratios, so each
fetch counts by its size (a fit is a least-squares line over decayed sums, each fetch one
point): a small cold fetch must not hold down the rate predicted for large warm ones.

Read rates are the *link's*: the node's link is shared by every fetch on it (the ranks of a
tensor-parallel group fetch at once, :mod:`kvfetcher.fetch.linkshare` counts them), so a fetch
that shared it ``k`` ways teaches ``k`` times the rate it saw, and a fetch expected to share it
``k`` ways is predicted at the link's rate over ``k``. Exact whenever a fetch shares the link as
the fetches it learnt from did, whatever bounds the read; a decode-bound read learnt alone and
predicted shared comes out pessimistic. A fetch whose reads set its pace sets a ceiling on every
read rate of its endpoint, the rate it saw: a link that slowed is believed at once (a format's old,
faster rate would plan a load that loses). Any read faster than the ceiling lifts it, and it lapses
after :data:`CEILING_TTL_S`, so one slow spell cannot make ``auto`` recompute for good. A link that
got faster is believed at once too: a read :data:`FASTER` times faster than the endpoint's rate
drops the rates learnt on the slower link (the endpoint's, and each format's that much slower)
before it teaches its own; otherwise rates learnt during a slow spell would make ``auto`` recompute,
so never read, so never learn. Since only reads teach, a rate no read renewed for
:data:`REFRESH_S` is :meth:`Estimator.stale` (the link probe then reads).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvfetcher.fetch.prefill import PrefillModel

RECOMPUTE = "recompute"

#: KV bytes restored per second by decoding, before anything is measured; a preset's first
#: measured fetch replaces its format's prior. For raw, "decoding" is the direct path minus the
#: read (its CRC-32 runs in the read's thread, so it counts in the store bandwidth): one copy into
#: the KV buffer. CPU: HEVC through libavcodec.
DECODE_PRIOR = {"raw": 3e9, "hevc": 2.5e7, "zstd": 1e8}
#: GPU: HEVC is one NVDEC session (worker processes reach several times more once measured); raw is
#: the direct path's copy, far above any compressed preset's restore rate: on links faster than
#: those rates raw wins, on slower ones the smaller representation or recompute. The entropy
#: formats decode on the GPU's SMs with nvCOMP (``ans`` only there), zstd on a CPU with the
#: zstandard package, each followed by the unpack.
GPU_DECODE_PRIOR = {"raw": 1e10, "hevc": 5e8, "zstd": 1e10, "ans": 2e10}


@dataclass(frozen=True)
class Fit:
    """A preset's measured time against the model's: ``actual = scale * modelled + overhead_s``."""

    scale: float = 1.0
    overhead_s: float = 0.0

    def apply(self, modelled_s: float) -> float:
        return self.scale * modelled_s + self.overhead_s


#: a fetch whose reads were in flight this many times longer than its decodes was paced by the link
READ_BOUND = 1.5
#: seconds a read-bound fetch's rate caps the endpoint's read rates (unless a faster read lifts it)
CEILING_TTL_S = 120.0
#: a read this many times faster than the endpoint's rate shows a faster link, not noise: the rates
#: learnt on the slower one are dropped (a decayed mean would take many fetches to catch up)
FASTER = 4.0
#: seconds after the last read that taught an endpoint's rate before it is stale (worth a probe)
REFRESH_S = CEILING_TTL_S
#: a planned load that has not finished this many times the time recompute was predicted to take
#: (or the TTFT budget, if longer), and at least :data:`MIN_BREAKEVEN_S`, has lost: it stops,
#: keeping what it loaded (the floor spares a short prompt's load a cold start's one-time costs)
BREAKEVEN_SLACK = 1.25
#: the largest share of recompute's time a load must win by for the prefill model's error (``Rates.prefill_error``)
MAX_PREFILL_ERROR = 0.25
MIN_BREAKEVEN_S = 0.25

NO_FIT = Fit()
NO_PREFILL = PrefillModel.linear(1.0)  # a slow prefill, where only the fetch's side of the model is asked
#: fetch sizes must differ by this much (coefficient of variation of the modelled times) before
#: the fit's two terms are told apart; until then the excess is taken as fixed overhead
FIT_SPREAD = 0.25


@dataclass(frozen=True)
class Rates:
    bandwidth_Bps: float  # stored bytes per second from the store endpoint
    latency_s: float  # first-byte latency of a request
    decode_Bps: Mapping[str, float]  # KV bytes restored per second, by preset (measured) or format (prior)
    prefill: PrefillModel  # the engine's prefill time
    fit: Mapping[str, Fit] = field(default_factory=dict)  # by preset, where measured
    list_s: float | None = None  # one round of a lookup's parallel LISTs, measured (None: take the latency)
    format_bandwidth: Mapping[str, float] = field(default_factory=dict)  # by bitstream format, where measured
    overlap: bool = True  # decode pipelined with the download (False: the engine decodes after the sidecar's fetch)
    ratios: Mapping[str, float] = field(default_factory=dict)  # KV bytes per stored byte, by preset, where measured
    load_overhead_s: float = 0.0  # the engine's seconds per load beyond the fetch and the prefill after it (it measures them)
    prefill_error: float = 0.0  # the prefill model's recent error on whole prefills, a share of their time (it measures it)

    def beats_recompute(self, load_s: float, recompute_s: float) -> bool:
        """Whether a load of ``load_s`` predicted seconds beats recomputing in ``recompute_s`` by more
        than the prefill model's error (:data:`MAX_PREFILL_ERROR` at most)."""
        return load_s < recompute_s * (1.0 - min(MAX_PREFILL_ERROR, max(0.0, self.prefill_error)))


@dataclass(frozen=True)
class Decision:
    preset: str  # a preset name, or RECOMPUTE
    chunks: int  # leading chunks to fetch
    tokens: int  # tokens they restore
    predicted_s: float  # predicted fetch time of those chunks (0 for recompute)
    total_s: float  # predicted time until the whole requested prefix is in the KV buffers (fetched, or prefilled)
    options: dict[str, float] = field(default_factory=dict)  # total_s of every option considered
    breakeven_s: float | None = None  # a load: seconds after which it has lost (see BREAKEVEN_SLACK); None for recompute


def decode_rate(preset: str, fmt: str, rates: Rates) -> float:
    """A preset's measured decode rate, else its format's prior (``exact`` decodes two samples per
    fp16 value where ``q8`` decodes one, so the same format restores KV at different rates)."""
    return rates.decode_Bps.get(preset) or rates.decode_Bps.get(fmt) or DECODE_PRIOR.get(fmt, 1e7)


def read_rate(fmt: str | None, rates: Rates) -> float:
    """Stored bytes per second for a format's fetches: measured on that format's own fetches where
    there are any (a decode-bound fetch reads slower than the link, and a raw fetch's reads carry
    its CRC), else the endpoint's."""
    return rates.format_bandwidth.get(fmt or "", 0.0) or rates.bandwidth_Bps


def stages(read_s: float, decode_s: float, rates: Rates) -> float:
    """Seconds of a download and a decode: overlapped (the slower), or one after the other."""
    return max(read_s, decode_s) if rates.overlap else read_s + decode_s


def fetch_seconds(stored_bytes: int, kv_bytes: int, decode_Bps: float, rates: Rates, fit: Fit = NO_FIT, fmt: str | None = None) -> float:
    return fit.apply(rates.latency_s + stages(stored_bytes / read_rate(fmt, rates), kv_bytes / decode_Bps, rates))


def choose(
    stored: Sequence[Mapping[str, int]],
    chunk_tokens: int,
    chunk_kv_bytes: int,
    formats: Mapping[str, str],
    rates: Rates,
    allowed: set[str] | None = None,
    budget_s: float | None = None,
) -> Decision:
    """Choose for a prefix of ``len(stored)`` chunks; ``stored[i]`` maps preset -> object size.

    ``formats`` maps each preset this reader can decode to its bitstream format; others are
    ignored. A preset is usable for the leading run of chunks that all have it. ``budget_s``: the
    TTFT budget within which a fetch is preferred to a faster recompute (see the module's doc).
    """
    total_tokens = len(stored) * chunk_tokens
    recompute_all = rates.prefill.seconds(0, total_tokens)
    best = Decision(RECOMPUTE, 0, 0, 0.0, recompute_all)
    fits: Decision | None = None  # the fetch within the budget that recomputes least
    options = {RECOMPUTE: recompute_all}
    candidates = {p for reps in stored[:1] for p in reps if p in formats and (allowed is None or p in allowed)}
    for preset in sorted(candidates):
        n, size = 0, 0
        while n < len(stored) and preset in stored[n]:
            size += stored[n][preset]
            n += 1
        fit = rates.fit.get(preset, NO_FIT)
        fetch = fetch_seconds(size, n * chunk_kv_bytes, decode_rate(preset, formats[preset], rates), rates, fit, formats[preset])
        total = fetch + rates.prefill.seconds(n * chunk_tokens, total_tokens - n * chunk_tokens) + rates.load_overhead_s
        options[preset] = total
        d = Decision(preset, n, n * chunk_tokens, fetch, total)
        if total < best.total_s and rates.beats_recompute(total, recompute_all):
            best = d
        if budget_s is not None and total <= budget_s and (fits is None or (-d.tokens, d.total_s) < (-fits.tokens, fits.total_s)):
            fits = d
    best = fits or best
    breakeven = None if best.preset == RECOMPUTE else max(MIN_BREAKEVEN_S, BREAKEVEN_SLACK * max(recompute_all, budget_s or 0.0))
    return Decision(best.preset, best.chunks, best.tokens, best.predicted_s, best.total_s, options, breakeven)


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
) -> bool:
    """True when even the best case loses to recompute (and misses ``budget_s``, see :func:`choose`),
    so the store need not be asked at all.

    Best case: every chunk stored in every allowed preset, ``slack`` times smaller than its ratio
    (this sidecar's fetches of it, ``rates.ratios``, else the table ``ratios``), no latency; the
    preset's fit (measured overheads) still counts. A coded preset of unknown ratio is never ruled
    out. Optimistic on purpose: a wrong "no" would skip a fetch that pays; a wrong "yes" costs a lookup.
    """
    if n_chunks == 0:
        return True
    recompute_all = rates.prefill.seconds(0, n_chunks * chunk_tokens)
    after = rates.prefill.seconds(n_chunks * chunk_tokens, 0) + rates.load_overhead_s  # what a full fetch still costs the engine
    kv = n_chunks * chunk_kv_bytes
    for preset, fmt in formats.items():
        if allowed is not None and preset not in allowed:
            continue
        ratio = rates.ratios.get(preset) or ratios.get(preset)
        if fmt != "raw" and not ratio:
            return False  # its size is unknown: it may pay
        stored = kv / (max(ratio, 1.0) * slack) if fmt != "raw" else kv  # raw's size is known, a codec's varies with content
        fetch = rates.fit.get(preset, NO_FIT).apply(stages(stored / read_rate(fmt, rates), kv / decode_rate(preset, fmt, rates), rates)) + after
        if rates.beats_recompute(fetch, recompute_all) or (budget_s is not None and fetch <= budget_s):
            return False
    return True


class Estimator:
    """Measured throughputs per store endpoint (bandwidth, latency, LIST rounds), per bitstream
    format and endpoint (read rate), per preset (decode rate) and per (preset, endpoint) (fit).

    Rates are ratios of decayed sums: each observation adds its amount and its seconds after the
    sums so far are scaled by ``1 - alpha``, so the latest fetches dominate in proportion to
    their size (``alpha=1``: the latest fetch alone). Latencies are per request, an EWMA. Read
    rates are kept as the link's, apart from how many fetches shared it (see the module's doc).
    """

    def __init__(self, alpha: float = 0.3, bandwidth_Bps: float = 1.25e8, latency_s: float = 0.005, gpu: bool = False):
        self.alpha = alpha
        self._prior = (bandwidth_Bps, latency_s)
        self._bw: dict[str, tuple[float, float]] = {}
        self._lat: dict[str, float] = {}
        self._decode_prior = dict(GPU_DECODE_PRIOR if gpu else DECODE_PRIOR)
        self._decode: dict[str, tuple[float, float]] = {}  # a first measurement replaces the prior
        self._engine_decode: dict[str, tuple[float, float]] = {}  # by preset: an engine decoding itself (engine-decode mode)
        self._fit: dict[tuple[str, str | None], tuple[float, ...]] = {}  # (preset, endpoint | None for all)
        self._list: dict[str, float] = {}
        self._fmt_bw: dict[tuple[str, str], tuple[float, float]] = {}  # (format, endpoint)
        self._ratio: dict[str, tuple[float, float]] = {}  # by preset: KV bytes over stored bytes fetched
        self._seen: set[str] = set()  # bitstream formats this process has fetched
        self._ceiling: dict[str, tuple[float, float]] = {}  # endpoint -> (the link's rate at most, when seen)
        self._renewed: dict[str, float] = {}  # endpoint -> when a read last taught its rate
        self.clock = time.monotonic

    def _ewma(self, table: dict, key, value: float) -> None:
        old = table.get(key)
        table[key] = value if old is None else (1 - self.alpha) * old + self.alpha * value

    def _add(self, table: dict, key, amount: float, seconds: float) -> None:
        keep = 1 - self.alpha
        a, s = table.get(key, (0.0, 0.0))
        table[key] = (keep * a + amount, keep * s + seconds)

    @staticmethod
    def _rate(table: dict, key) -> float | None:
        a, s = table.get(key, (0.0, 0.0))
        return a / s if s > 0 else None

    def settled(self, fmt: str) -> bool:
        """Whether a fetch of this bitstream format should teach the rates: not a process' first, which
        pays one-time set-up (pinned staging buffers for raw's direct path, decoders and CUDA contexts
        where workers were not warmed) and, weighted by its size, would skew the rates for long."""
        if fmt in self._seen:
            return True
        self._seen.add(fmt)
        return False

    def observe_read(self, endpoint: str, nbytes: int, busy_s: float, fmt: str | None = None, sharers: float = 1.0,
                     bound: bool = False, probe: bool = False) -> None:
        """A fetch read ``nbytes`` in ``busy_s`` seconds while ``sharers`` fetches (itself included)
        shared the link: the link delivered ``sharers`` times that. ``bound``: reading, not decoding,
        set the fetch's pace, so the link delivers no more than that now: it is the endpoint's
        :meth:`ceiling`. ``probe``: a link probe's reads, which no faster than the ceiling renew it.
        A read :data:`FASTER` times the endpoint's rate first drops what the slower link taught."""
        if nbytes > 0 and busy_s > 0:
            link, ceiling = nbytes * sharers / busy_s, self.ceiling(endpoint)
            if self.measured(endpoint) and link > FASTER * self.bandwidth(endpoint):
                self._forget_slower(endpoint, link / FASTER)
            self._renewed[endpoint] = self.clock()
            self._add(self._bw, endpoint, nbytes * sharers, busy_s)
            if fmt:
                self._add(self._fmt_bw, (fmt, endpoint), nbytes * sharers, busy_s)
            if bound or (ceiling is not None and link > ceiling):  # the link's rate now (a faster read: at least that)
                self._ceiling[endpoint] = (link, self.clock())
            elif probe and ceiling is not None:  # the link is still no faster
                self._ceiling[endpoint] = (ceiling, self.clock())

    def _forget_slower(self, endpoint: str, rate: float) -> None:
        """Drop the endpoint's rate and each of its formats' read rates below ``rate``: learnt on a slower link."""
        self._bw.pop(endpoint, None)
        for key in [k for k in self._fmt_bw if k[1] == endpoint and (self._rate(self._fmt_bw, k) or 0.0) < rate]:
            del self._fmt_bw[key]

    def ceiling(self, endpoint: str) -> float | None:
        """The most the link to ``endpoint`` delivers now, as the latest read-bound fetch saw it
        (None: none within :data:`CEILING_TTL_S`)."""
        rate, when = self._ceiling.get(endpoint, (None, 0.0))
        return rate if rate is not None and self.clock() - when < CEILING_TTL_S else None

    def observe_latency(self, endpoint: str, seconds: float) -> None:
        self._ewma(self._lat, endpoint, seconds)

    def observe_decode(self, preset: str, kv_bytes: int, busy_s: float) -> None:
        if kv_bytes > 0 and busy_s > 0:
            self._add(self._decode, preset, kv_bytes, busy_s)

    def observe_engine_decode(self, preset: str, kv_bytes: int, busy_s: float) -> None:
        """An engine that decodes itself restored ``kv_bytes`` of ``preset`` in ``busy_s`` seconds."""
        if kv_bytes > 0 and busy_s > 0:
            self._add(self._engine_decode, preset, kv_bytes, busy_s)

    def observe_lookup(self, endpoint: str, seconds: float, rounds: int) -> None:
        if rounds > 0 and seconds > 0:
            self._ewma(self._list, endpoint, seconds / rounds)

    def observe_fit(self, endpoint: str, preset: str, fmt: str, stored_bytes: int, kv_bytes: int, actual_s: float,
                    sharers: float = 1.0) -> Fit:
        """A whole fetch's time against the model's, with the rates as they stand after this fetch
        updated them and the link shared as it was (``sharers``): the fit keeps only what the rates
        cannot explain. Its bytes teach the preset's ratio too. Returns the preset's fit on this endpoint."""
        if stored_bytes > 0 and kv_bytes > 0:
            self._add(self._ratio, preset, kv_bytes, stored_bytes)
        if stored_bytes > 0 and kv_bytes > 0 and actual_s > 0:
            r = self.rates(endpoint, sharers=sharers)
            m = fetch_seconds(stored_bytes, kv_bytes, decode_rate(preset, fmt, r), r, fmt=fmt)
            keep = 1 - self.alpha
            for key in ((preset, endpoint), (preset, None)):  # decayed sums for a least-squares line
                w, sm, sa, smm, sma = self._fit.get(key, (0.0,) * 5)
                self._fit[key] = (keep * w + 1, keep * sm + m, keep * sa + actual_s, keep * smm + m * m, keep * sma + m * actual_s)
        return self.fit(preset, endpoint)

    def fit(self, preset: str, endpoint: str) -> Fit:
        """The preset's fit on this endpoint, else on any (:data:`NO_FIT` if none): a least-squares
        line through its fetches (decayed) once their sizes differ, else their mean excess as
        overhead. Bounded so that at the fetches' mean size it predicts 0.5-4x the model: one
        stalled fetch must not rule a preset out."""
        sums = self._fit.get((preset, endpoint)) or self._fit.get((preset, None))
        if sums is None:
            return NO_FIT
        w, sm, sa, smm, sma = sums
        m, a = sm / w, sa / w
        var = smm / w - m * m
        if var > (FIT_SPREAD * m) ** 2:
            scale = (sma / w - m * a) / var
        else:  # one size: a fixed overhead, or a scale where the fetches ran faster than modelled
            scale = 1.0 if a >= m else a / m
        scale = min(4.0, max(0.5, scale))
        return Fit(scale, min(max(0.0, a - scale * m), (4.0 - scale) * m))

    def ratio(self, preset: str) -> float | None:
        """KV bytes per stored byte of ``preset``'s fetches (decayed; None before its first)."""
        return self._rate(self._ratio, preset)

    def measured(self, endpoint: str) -> bool:
        """Whether a read from ``endpoint`` has taught the link's rate (else :meth:`bandwidth` is the prior)."""
        return self._rate(self._bw, endpoint) is not None

    def stale(self, endpoint: str) -> bool:
        """Whether the link's rate wants a read to be trusted: never measured, not renewed by a read
        for :data:`REFRESH_S`, or a :meth:`ceiling` in force past half its time (a read renews or
        lifts it before it lapses)."""
        _, when = self._ceiling.get(endpoint, (None, 0.0))
        now = self.clock()
        return (not self.measured(endpoint) or now - self._renewed.get(endpoint, now) > REFRESH_S
                or (self.ceiling(endpoint) is not None and now - when > CEILING_TTL_S / 2))

    def bandwidth(self, endpoint: str) -> float:
        """The link's rate to ``endpoint``: what one fetch gets alone (at most its :meth:`ceiling`)."""
        return min(self._rate(self._bw, endpoint) or self._prior[0], self.ceiling(endpoint) or float("inf"))

    def rates(self, endpoint: str, prefill: PrefillModel = NO_PREFILL, sharers: float = 1.0, engine: str | None = None) -> Rates:
        """The rates a fetch from ``endpoint`` can expect while ``sharers`` fetches (itself included)
        share the link, with the engine's ``prefill`` model. ``engine`` (``cuda`` or ``cpu``): the
        engine decodes itself there, after the fetch: its measured decode rates (else that device's
        priors), not overlapped with the download, and no fit (the fits are of this sidecar's decodes)."""
        share = max(1.0, sharers)
        if engine is None:
            prior, table = self._decode_prior, self._decode
        else:
            prior, table = (GPU_DECODE_PRIOR if engine == "cuda" else DECODE_PRIOR), self._engine_decode
        decode = {**prior, **{p: v for p in table if (v := self._rate(table, p))}}
        top = self.ceiling(endpoint) or float("inf")
        by_format = {fmt: min(v, top) / share for (fmt, ep) in self._fmt_bw if ep == endpoint and (v := self._rate(self._fmt_bw, (fmt, ep)))}
        fits = {p: self.fit(p, endpoint) for p, _ in self._fit} if engine is None else {}
        ratios = {p: v for p in self._ratio if (v := self.ratio(p))}
        return Rates(self.bandwidth(endpoint) / share, self._lat.get(endpoint, self._prior[1]), decode, prefill, fits,
                     self._list.get(endpoint), by_format, overlap=engine is None, ratios=ratios)
