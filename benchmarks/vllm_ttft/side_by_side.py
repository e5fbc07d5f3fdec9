"""side_by_side: kvfetcher and its peers in one table per regime, from the phases' JSON.

    python -m benchmarks.vllm_ttft.side_by_side DIR [DIR ...] [--out FILE]

Reads every ``ttft.json``, ``peer-<method>.json``, ``load.json`` and ``peer-load-<method>.json``
under the directories and writes one Markdown page (default ``side_by_side.md`` in the first):

* unloaded, per link and context: recompute, kvfetcher's ``auto`` (what it chose) and forced
  presets, LMCache raw and CacheGen, vLLM's CPU tier (host memory, the local bound), bytes stored
  per token. These cells must come from one run (same device, vLLM, model and date), else
  :class:`ValueError`; a peer cell missing from it stays blank.
* under load, one row per pass (the ``load`` phase's and each peer's), each naming its run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.vllm_ttft.report import _f, link_label, load_passes
from benchmarks.vllm_ttft.under_load import FORCED

PEER_NAMES = {"lmcache-raw": "LMCache raw", "lmcache-cachegen": "LMCache CacheGen", "native-cpu": "vLLM CPU tier"}
OVER_LINK = ("lmcache-raw", "lmcache-cachegen")  # the peers that read over the link, as kvfetcher does
LOAD_PASSES = {"recompute": "recompute", "kvfetcher-nosave": "kvfetcher `auto`, saves off", "kvfetcher": "kvfetcher `auto`, saves on"}
SAME_RUN = ("device", "vllm", "model", "date")


def collect(dirs: list[Path]) -> dict:
    """{'ttft': result | None, 'peers': {method: result}, 'load': result | None, 'peers_load': {method: result}},
    each result with ``source`` (its directory). Two results for the same slot are an error."""
    got: dict = {"ttft": None, "peers": {}, "load": None, "peers_load": {}}
    for d in dirs:
        for p in sorted(d.rglob("*.json")):
            slot, key = _slot(p.stem)
            if slot is None:
                continue
            res = dict(json.loads(p.read_text()), source=str(p.parent))
            held = got[slot].get(key) if key else got[slot]
            if held is not None:
                raise ValueError(f"two results for {p.stem}: {held['source']} and {res['source']}")
            if key:
                got[slot][key] = res
            else:
                got[slot] = res
    return got


def _slot(stem: str) -> tuple[str | None, str | None]:
    if stem in ("ttft", "load"):
        return stem, None
    if stem.startswith("peer-load-"):
        return "peers_load", stem.removeprefix("peer-load-")
    if stem.startswith("peer-"):
        return "peers", stem.removeprefix("peer-")
    return None, None


def same_run(results: list[dict]) -> None:
    """Refuse unloaded cells from different runs: every result must agree on :data:`SAME_RUN`."""
    for key in SAME_RUN:
        seen = {r.get(key) for r in results if not r.get("unavailable")}
        if len(seen) > 1:
            raise ValueError(f"the unloaded cells are not from one run: {key} differs ({', '.join(sorted(map(str, seen)))})")


def unloaded(ttft: dict, peers: dict[str, dict]) -> str:
    """The unloaded table: one row per (link, context) of the ``ttft`` phase, the peers beside it."""
    same_run([ttft, *peers.values()])
    forced = [m for m in dict.fromkeys(r["method"] for r in ttft["rows"]) if m not in ("recompute", "auto")]
    ran = [m for m in PEER_NAMES if m in peers and not peers[m].get("unavailable")]
    cells: dict[tuple, dict] = {}
    for r in ttft["rows"]:
        if "ttft_s" in r:
            cells.setdefault((r["link_gbit"], r["context"]), {})[r["method"]] = r
    for m in ran:
        for r in peers[m]["rows"]:
            if "ttft_s" in r:
                cells.setdefault((r["link_gbit"], r["context"]), {})[m] = r
    head = ["recompute", "kvfetcher `auto`", *(f"kvfetcher {m}" for m in forced), *(PEER_NAMES[m] for m in ran)]
    out = [f"## Unloaded: one prompt at a time\n\n{_run(ttft)}, model {ttft.get('model')} ({ttft.get('kv_dtype')}), vLLM's "
           "prefix cache cleared before each timed request. TTFT in seconds, medians where a cell repeated; `auto` names "
           "what its requests did. LMCache reads over the same paced link as kvfetcher; vLLM's CPU tier reads this "
           "machine's host memory, no link (the local bound, the same at every label). `auto` / best over the link: the "
           "fastest of LMCache's methods over `auto`'s TTFT (above 1: kvfetcher is faster).\n\n",
           f"| link (label) | context | {' | '.join(head)} | recompute / `auto` | best over the link / `auto` |\n",
           "|---|---|" + "---|" * (len(head) + 2) + "\n"]
    for (gbit, n), c in sorted(cells.items(), key=lambda kv: (-kv[0][0], kv[0][1])):
        auto = c.get("auto", {}).get("ttft_s")
        chose = _chose(c.get("auto", {}).get("chose_samples") or [])
        vals = [_s(c.get("recompute")), f"{_s(c.get('auto'))}{f' ({chose})' if chose else ''}",
                *(_s(c.get(m)) for m in forced), *(_s(c.get(m)) for m in ran)]
        rec = c.get("recompute", {}).get("ttft_s")
        link_best = min((c[m]["ttft_s"] for m in OVER_LINK if m in c), default=None)
        out.append(f"| {link_label(gbit)} | {n} | {' | '.join(vals)} | {_x(rec, auto)} | {_x(link_best, auto)} |\n")
    out.append("\n" + stored(ttft, {m: peers[m] for m in ran}))
    return "".join(out)


def stored(ttft: dict, peers: dict[str, dict]) -> str:
    """Bytes stored per prompt token: kvfetcher's per preset (its objects), each peer's as it measured them."""
    per = {f"kvfetcher {p}": b / ttft["chunk_tokens"] for p, b in (ttft.get("object_bytes_per_chunk") or {}).items()}
    for m, res in peers.items():
        vals = [r["stored_bytes_per_token"] for r in res["rows"] if r.get("stored_bytes_per_token")]
        if vals:
            per[PEER_NAMES[m]] = sorted(vals)[len(vals) // 2]
    if not per:
        return ""
    return ("Bytes stored per prompt token (a peer's median over its cells):\n\n| " + " | ".join(per) + " |\n|"
            + "---|" * len(per) + "\n| " + " | ".join(f"{v:.0f}" for v in per.values()) + " |\n")


def under_load(load: dict | None, peers: dict[str, dict]) -> str:
    """The under-load table: the ``load`` phase's passes and each peer's, each naming its run."""
    rows = [(_pass_name(k), load[k], load) for k in (load_passes(load) if load else []) if not load[k].get("skipped")]
    rows += [(PEER_NAMES[m], res, res) for m, res in peers.items() if not res.get("unavailable") and not res.get("skipped")]
    if not rows:
        return ""
    w = (load or next(iter(peers.values())))["workload"]
    out = [f"## Under load: the `load` phase's stream\n\n{w['requests']} requests at {w['rate']}/s, {int(w['shared'] * 100)}% one of "
           f"{w['prefixes']} stored {w['prefix']}-token prefixes plus {w['suffix']} fresh tokens, {w['output']} output tokens each, "
           f"{w['link']:g} Gbit/s, vLLM's prefix cache off. Every pass replays the same arrivals; vLLM's CPU tier reads host "
           "memory, no link.\n\n",
           "| pass | TTFT p50 s | TTFT p99 s | output tokens/s | tokens loaded | run |\n|---|---|---|---|---|---|\n"]
    for name, r, res in rows:
        out.append(f"| {name} | {_f(r.get('ttft_p50_s'))} | {_f(r.get('ttft_p99_s'))} | {_f(r.get('output_tokens_per_s'), 1)} | "
                   f"{r.get('loaded_tokens')} | {_run(res)} (`{_where(res)}`) |\n")
    return "".join(out)


def page(got: dict) -> str:
    parts = ["# vllm_ttft: kvfetcher beside LMCache and vLLM's CPU tier\n\n"]
    if got["ttft"]:
        parts.append(unloaded(got["ttft"], got["peers"]) + "\n")
    parts.append(under_load(got["load"], got["peers_load"]))
    return "".join(parts)


def _pass_name(m: str) -> str:
    return LOAD_PASSES.get(m) or f"kvfetcher forced `{m.removeprefix(FORCED)}`, saves off"


def _run(res: dict) -> str:
    return f"{res.get('device')}, vLLM {res.get('vllm')}, {res.get('date')}"


def _where(res: dict) -> str:
    p = Path(res["source"])
    return f"{p.parent.name}/{p.name}"


def _s(r: dict | None) -> str:
    return _f(r.get("ttft_s")) if r else ""


def _x(num: float | None, den: float | None) -> str:
    return f"{num / den:.2f}x" if num and den else ""


def _chose(choices: list[str]) -> str:
    counts = {m: choices.count(m) for m in dict.fromkeys(choices)}
    return ", ".join(f"{m} x{k}" if len(counts) > 1 else m for m, k in counts.items())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+", type=Path, help="directories holding the phases' JSON (searched recursively)")
    ap.add_argument("--out", type=Path, help="the page to write (default: side_by_side.md in the first directory)")
    a = ap.parse_args(argv)
    got = collect(a.dirs)
    if not got["ttft"] and not got["load"] and not got["peers_load"]:
        raise SystemExit(f"no ttft.json, load.json or peer-load-*.json under {', '.join(map(str, a.dirs))}")
    out = a.out or a.dirs[0] / "side_by_side.md"
    out.write_text(page(got))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
