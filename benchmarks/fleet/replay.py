"""replay: a production hour of requests through kvfetcher's retention policy and preset choice.

The trace (Mooncake FAST'25 conversation trace: arrival, input length and the prompt's 512-token
blocks as prefix hashes; see ../shared/traces/README.md) is replayed with a simulated clock. Each
request reuses the longest leading run of its blocks the store holds, then every block it lacks is
stored; the store is kept within a budget by

- ``kvfetcher``: the project's own :class:`kvfetcher.store.retention.Index` (leaves only, least
  recently fetched and deepest first, so no prefix ever gets a hole), or
- ``lru``: plain least-recently-used over all blocks, the reference FACTS.md quotes (it may evict a
  prefix's first block and strand the rest),

per store policy (which representations every block gets, at the measured size ratios). For each
request the sidecar's own cost model (:func:`kvfetcher.fetch.choice.choose`) picks a stored preset
or recompute at a stated link, which gives an expected TTFT; the recompute side is the project's
prefill model (:mod:`kvfetcher.eval.costmodel`) fitted to vLLM's measured H100 prefill. Sizes are
Llama-3-8B's (128 KiB of fp16 KV a token). As in FACTS.md, every block (a prompt's partial last
one too) is stored and counts 512 tokens of KV, and a request is served ``min(hit blocks x 512,
input length)`` tokens.

    python -m benchmarks.fleet.replay [--trace ../shared/traces/conversation_trace.jsonl] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import OrderedDict, defaultdict
from dataclasses import dataclass
from pathlib import Path

from kvfetcher.eval import costmodel
from kvfetcher.fetch import choice
from kvfetcher.fetch.prefill import PrefillModel
from kvfetcher.store.retention import Index

HERE = Path(__file__).resolve().parent
TRACE = HERE.parents[1] / ".." / "shared" / "traces" / "conversation_trace.jsonl"
BLOCK_TOKENS = 512  # the trace's block
KV_PER_TOKEN = costmodel.LLAMA3_8B.kv_bytes_per_token()  # 128 KiB of fp16
BLOCK_KV = BLOCK_TOKENS * KV_PER_TOKEN
#: stored bytes per KV byte: GPU-entropy ratios measured on an H200 (FACTS.md, nvCOMP ANS)
RATIO = {"raw": 1.0, "balanced-ans": 3.50, "compact-ans": 5.34, "coded-3.9x": 3.9}
FORMATS = {"raw": "raw", "balanced-ans": "ans", "compact-ans": "ans", "coded-3.9x": "ans"}
POLICIES = {
    "raw": ("raw",),
    "balanced-ans": ("balanced-ans",),  # the pool's default store preset
    "compact-ans": ("compact-ans",),
    "raw+balanced-ans": ("raw", "balanced-ans"),
    "coded-3.9x": ("coded-3.9x",),  # FACTS.md's coded reference
}
#: vLLM 0.26 prefill of Llama-3-8B (bf16, one request) on an H100: tokens -> seconds (FACTS.md)
PREFILL_H100 = ((8192, 0.21), (16384, 0.49), (32768, 1.18), (65536, 3.24))
H100_BF16_TFLOPS = 989.0
ANS_ENCODE_Bps = 360e9  # nvCOMP ANS encode of balanced's planes per H200, fp16 KV (FACTS.md)
X265_Bps_PER_CORE = 9e6 / 2  # CPU x265 encode of a preset, fp16 KV (FACTS.md: ~9 MB/s on 2 cores)


@dataclass(frozen=True)
class Request:
    t: float  # arrival, seconds
    tokens: int
    blocks: tuple[int, ...]


def load_trace(path: Path, limit: int | None = None) -> list[Request]:
    out = []
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            out.append(Request(r["timestamp"] / 1000.0, r["input_length"], tuple(r["hash_ids"])))
            if limit and len(out) >= limit:
                break
    return out


class TreeStore:
    """The project's policy: :class:`Index` keyed by block, parent = the block before it."""

    def __init__(self, budget: float, block_bytes: int):
        self.index, self.budget, self.size, self.evicted = Index(), budget, block_bytes, 0

    def __contains__(self, block: int) -> bool:
        return block in self.index

    def use(self, blocks, hit: int, t: float) -> int:
        for b in blocks[:hit]:
            self.index.touch(b, t)
        new = 0
        for i in range(hit, len(blocks)):
            if blocks[i] not in self.index:
                self.index.add(blocks[i], blocks[i - 1] if i else None, self.size, t, depth=i)
                new += 1
        return new

    def enforce(self, now: float) -> None:
        self.evicted += sum(1 for _ in self.index.victims(self.budget))


class LRUStore:
    """Plain LRU over blocks (the reference): a hit moves a block to the back, eviction takes the front."""

    def __init__(self, budget: float, block_bytes: int):
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.budget, self.size, self.evicted = budget, block_bytes, 0

    def __contains__(self, block: int) -> bool:
        return block in self.blocks

    def use(self, blocks, hit: int, t: float) -> int:
        new = 0
        for b in blocks:
            if b in self.blocks:
                self.blocks.move_to_end(b)
            else:
                self.blocks[b] = None
                new += 1
        return new

    def enforce(self, now: float) -> None:
        while self.blocks and len(self.blocks) * self.size > self.budget:
            self.blocks.popitem(last=False)
            self.evicted += 1


EVICTORS = {"kvfetcher": TreeStore, "lru": LRUStore}


def prefill_model() -> costmodel.Gpu:
    eff = costmodel.fit_efficiency([(costmodel.LLAMA3_8B, t, s) for t, s in PREFILL_H100], H100_BF16_TFLOPS)
    return costmodel.Gpu("H100", H100_BF16_TFLOPS, *eff)


def ttft(tokens: int, hit_blocks: int, presets, gpu: costmodel.Gpu, link_Bps: float, restore_Bps: dict) -> tuple[float, str]:
    """Expected TTFT of a request of ``tokens`` whose first ``hit_blocks`` blocks are stored in
    ``presets``: the sidecar's choice among them and recompute, plus the recompute of the rest."""
    prefill = gpu.prefill_seconds(costmodel.LLAMA3_8B, tokens)
    if hit_blocks == 0:
        return prefill, choice.RECOMPUTE
    tps = tokens / prefill
    sizes = {p: int(BLOCK_KV / RATIO[p]) for p in presets}
    rates = choice.Rates(link_Bps, 0.005, {p: restore_Bps[FORMATS[p]] for p in presets}, PrefillModel.linear(tps))
    d = choice.choose([sizes] * hit_blocks, BLOCK_TOKENS, BLOCK_KV, {p: FORMATS[p] for p in presets}, rates)
    return d.total_s + max(0, tokens - hit_blocks * BLOCK_TOKENS) / tps, d.preset


def replay(requests: list[Request], policy: str, budget_bytes: float, evictor: str, *, gpu: costmodel.Gpu,
           link_Bps: float, restore_Bps: dict, every_s: float = 0.0) -> dict:
    """One run: shares of input tokens served, expected TTFT, and what storing cost."""
    presets = POLICIES[policy]
    block_bytes = int(sum(BLOCK_KV / RATIO[p] for p in presets))
    store = EVICTORS[evictor](budget_bytes, block_bytes)
    served = total = new_blocks = 0
    ttfts, base, chosen = [], [], defaultdict(int)
    per_minute: dict[int, int] = defaultdict(int)
    last_enforce = -1e18
    t0 = time.perf_counter()
    for r in requests:
        hit = 0
        while hit < len(r.blocks) and r.blocks[hit] in store:
            hit += 1
        served += min(hit * BLOCK_TOKENS, r.tokens)
        total += r.tokens
        s, p = ttft(r.tokens, hit, presets, gpu, link_Bps, restore_Bps)
        ttfts.append(s)
        base.append(gpu.prefill_seconds(costmodel.LLAMA3_8B, r.tokens))
        chosen[p] += 1
        n = store.use(r.blocks, hit, r.t)
        new_blocks += n
        per_minute[int(r.t // 60)] += n
        if r.t - last_enforce >= every_s:
            store.enforce(r.t)
            last_enforce = r.t
    span = max(1.0, requests[-1].t - requests[0].t)
    coded = [p for p in presets if FORMATS[p] != "raw"]
    encoded_Bps = new_blocks * BLOCK_KV * len(coded) / span
    return {
        "policy": policy, "evictor": evictor, "budget_GB": budget_bytes / 1e9,
        "served_share": served / total,
        "ttft_mean_s": statistics.fmean(ttfts), "ttft_p50_s": statistics.median(ttfts),
        "ttft_p90_s": statistics.quantiles(ttfts, n=10)[-1], "recompute_ttft_mean_s": statistics.fmean(base),
        "choices": dict(chosen),
        "new_blocks": new_blocks, "evicted_blocks": store.evicted,
        "stored_GBps": new_blocks * block_bytes / span / 1e9,
        "stored_GBps_peak_minute": max(per_minute.values(), default=0) * block_bytes / 60 / 1e9,
        "encoded_GBps": encoded_Bps / 1e9,
        "encoded_GBps_peak_minute": max(per_minute.values(), default=0) * BLOCK_KV * len(coded) / 60 / 1e9,
        "ans_gpus": encoded_Bps / ANS_ENCODE_Bps,  # H200s' worth of ANS encoding, all the time
        "x265_cores": encoded_Bps / X265_Bps_PER_CORE,  # CPU cores if the same were coded by x265
        "replay_s": time.perf_counter() - t0,
    }


def table(rows: list[dict], link_gbps: float) -> str:
    """The Markdown sizing table: share of input tokens served per policy and budget."""
    budgets = sorted({r["budget_GB"] for r in rows})
    ours = {(r["policy"], r["budget_GB"]): r for r in rows if r["evictor"] == "kvfetcher"}
    lru = {(r["policy"], r["budget_GB"]): r for r in rows if r["evictor"] == "lru"}
    mid_gb = budgets[len(budgets) // 2]
    at = " / ".join(f"{b:g}" for b in budgets)
    lines = [f"| store policy | input tokens served, {at} GB | plain LRU, {at} GB | mean TTFT at {mid_gb:g} GB, {link_gbps:g} Gbit/s "
             f"(recompute only) | written to the store, GB/s | KV encoded, GB/s | H200s of ANS / x265 cores for it |",
             "|---|---|---|---|---|---|---|"]
    for policy in dict.fromkeys(r["policy"] for r in rows):
        mid = ours[(policy, mid_gb)]
        served = " / ".join(f"{100 * ours[(policy, b)]['served_share']:.1f}%" for b in budgets)
        ref = " / ".join(f"{100 * lru[(policy, b)]['served_share']:.1f}%" for b in budgets if (policy, b) in lru) or "-"
        enc = f"{mid['encoded_GBps']:.2f}" if mid["encoded_GBps"] else "-"
        coders = f"{mid['ans_gpus']:.3f} / {mid['x265_cores']:.0f}" if mid["encoded_GBps"] else "-"
        lines.append(f"| `{policy}` | {served} | {ref} | {mid['ttft_mean_s']:.3f} s ({mid['recompute_ttft_mean_s']:.3f} s) "
                     f"| {mid['stored_GBps']:.2f} | {enc} | {coders} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, default=TRACE, help="the conversation trace (JSON lines)")
    ap.add_argument("--limit", type=int, help="replay only the first N requests")
    ap.add_argument("--budgets-gb", default="100,250,500", help="store budgets in GB (10^9 bytes), comma-separated")
    ap.add_argument("--policies", default=",".join(POLICIES), help="store policies, comma-separated: " + ", ".join(POLICIES))
    ap.add_argument("--link-gbps", type=float, default=100.0, help="the link between the store and a GPU node, Gbit/s")
    ap.add_argument("--raw-restore-gbps", type=float, default=11.9, help="raw direct-path restore, GB/s (H100, measured)")
    ap.add_argument("--ans-restore-gbps", type=float, default=40.0,
                    help="ANS restore incl. unpack, GB/s of KV (the entropy back end's target, not yet measured)")
    ap.add_argument("--every-s", type=float, default=0.0, help="enforce the budget every S simulated seconds (0: after every request)")
    ap.add_argument("--no-lru", action="store_true", help="skip the plain-LRU reference runs")
    ap.add_argument("--out", type=Path, default=HERE, help="folder for result_cpu.json and result_cpu.md")
    a = ap.parse_args(argv)
    requests = load_trace(a.trace, a.limit)
    gpu = prefill_model()
    restore = {"raw": a.raw_restore_gbps * 1e9, "ans": a.ans_restore_gbps * 1e9}
    rows = []
    for policy in a.policies.split(","):
        for gb in (float(x) for x in a.budgets_gb.split(",")):
            for evictor in ("kvfetcher",) if a.no_lru else ("kvfetcher", "lru"):
                row = replay(requests, policy, gb * 1e9, evictor, gpu=gpu, link_Bps=a.link_gbps * 1e9 / 8,
                             restore_Bps=restore, every_s=a.every_s)
                rows.append(row)
                print(f"{policy:>17} {evictor:>9} {gb:5g} GB: served {100 * row['served_share']:5.1f}%  "
                      f"TTFT {row['ttft_mean_s']:.3f} s (recompute {row['recompute_ttft_mean_s']:.3f} s)  "
                      f"encoded {row['encoded_GBps']:.2f} GB/s  [{row['replay_s']:.1f} s]", flush=True)
    unbounded = replay(requests, "raw", float("inf"), "kvfetcher", gpu=gpu, link_Bps=a.link_gbps * 1e9 / 8, restore_Bps=restore)
    result = {
        "trace": str(a.trace.name), "requests": len(requests), "span_s": requests[-1].t - requests[0].t,
        "input_tokens": sum(r.tokens for r in requests), "reusable_share_unbounded": unbounded["served_share"],
        "model": "Llama-3-8B shape, 128 KiB of fp16 KV a token", "block_tokens": BLOCK_TOKENS,
        "ratios": RATIO, "link_gbps": a.link_gbps, "restore_GBps": {k: v / 1e9 for k, v in restore.items()},
        "prefill": {"gpu": "H100", "fitted_to": PREFILL_H100}, "every_s": a.every_s, "rows": rows,
    }
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "result_cpu.json").write_text(json.dumps(result, indent=1) + "\n")
    md = table(rows, a.link_gbps)
    (a.out / "result_cpu.md").write_text(
        f"# Fleet replay: {len(requests)} requests, {result['input_tokens'] / 1e6:.1f} M input tokens "
        f"({100 * result['reusable_share_unbounded']:.1f}% reusable with an unbounded store)\n\n{md}\n")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
