"""estimator_replay: replay a GPU run's estimator observations through the current choice.Estimator.

``auto_scale_bench`` journals every observation the sidecar's estimator received, in order, with
the fetches between them (``estimator_journal`` in its JSON). Fed through an estimator offline,
they show what that estimator would have predicted at each automatic decision: a change to the
estimator can be checked on real GPU timings without the GPU. Predictions are for 64K-token
fetches of ``raw`` and ``balanced`` with the sizes of that run.

    python -m benchmarks.lib.estimator_replay tests/data/estimator_journals/auto70b_64k_h100_a.json
"""

from __future__ import annotations

import argparse
import json

from kvfetcher.fetch import choice

FORMATS = {"raw": "raw", "balanced": "hevc", "q8": "hevc"}


def replay(journal: list, stored: dict[str, int], kv_bytes: int, context: int, settle: bool) -> list[dict]:
    """The predictions at each automatic fetch of ``context`` tokens; ``settle``: leave out each
    format's first fetch, as the sidecar does (:meth:`choice.Estimator.settled`)."""
    e = choice.Estimator(gpu=True)
    out, group = [], []
    for ev in journal:
        if ev[0] == "observe_lookup":
            continue
        if ev[0] != "fetch":
            group.append(ev)
            continue
        _, ctx, preset, endpoint, _, _ = ev
        if ctx == context and preset is None:  # the decision, made before this fetch's observations
            r = e.rates(endpoint)
            pred = {p: choice.fetch_seconds(n, kv_bytes, choice.decode_rate(p, FORMATS[p], r), r, r.fit.get(p, choice.NO_FIT), FORMATS[p])
                    for p, n in stored.items()}
            out.append({"endpoint": endpoint, "predicted_s": pred, "choice": min(pred, key=pred.get)})
        fmt = next((g[4] for g in group if g[0] == "observe_read"), None)
        learn = e.settled(fmt) if settle and fmt else True
        for g in group:
            if g[0] == "observe_latency" or learn:
                getattr(e, g[0])(*g[1:])
        group = []
    return out


def decisions(res: dict, context: int, settle: bool) -> list[dict]:
    """:func:`replay` on an ``auto_scale_bench`` result, each decision with its cell's measured
    seconds of raw and balanced (``measured``)."""
    cells = {c["gbps"]: c for c in res["cells"] if c["context"] == context}
    stored = {p: int(c[p]["bytes_read"]) for c in cells.values() for p in ("raw", "balanced") if c[p].get("bytes_read")}
    kv = context // 256 * res["bytes_per_chunk"]["kv_bf16"]
    out = replay(res["estimator_journal"], stored, int(kv), context, settle)
    for d in out:
        c = cells[float(d["endpoint"].split("-")[1])]
        d["measured"] = {p: round(c[p]["seconds"], 2) for p in ("raw", "balanced")}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", help="an auto_scale_bench result with estimator_journal")
    ap.add_argument("--context", type=int, default=65536)
    a = ap.parse_args()
    res = json.loads(open(a.json).read())
    for settle in (False, True):
        for d in decisions(res, a.context, settle):
            print(f"{'first fetches left out' if settle else 'every fetch learned':24s} {d['endpoint']:9s} predicted "
                  + ", ".join(f"{p} {s:.2f} s" for p, s in d["predicted_s"].items()) + f" -> {d['choice']:8s} (measured {d['measured']})")


if __name__ == "__main__":
    main()
