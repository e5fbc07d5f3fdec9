"""report: each phase's JSON as a Markdown page (``<phase>.md`` beside it)."""

from __future__ import annotations

from kvfetcher.fetch.executor import STAGES


def link_label(gbit: float) -> str:
    """A cell's link as set: its Gbit/s, or ``unpaced`` (0: the link server at full speed)."""
    return f"{gbit:g} Gbit/s" if gbit > 0 else "unpaced"


def _f(x, nd: int = 3) -> str:
    return "" if x is None else f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def _head(res: dict) -> str:
    settings = ", ".join(f"`{k}={v}`" for k, v in (res.get("settings") or {}).items())
    return (f"Device: {res.get('device')}; vLLM {res.get('vllm')}; {res.get('date')}"
            f"{' — a CPU smoke run of the benchmark (--tiny), not a result' if res.get('tiny') else ''}."
            f"{' Settings from the environment: ' + settings + '.' if settings else ''}"
            f"{_load(res)}\n\n")


def _load(res: dict) -> str:
    """The machine's load average when the phase started (other work there skews every figure)."""
    if res.get("load_avg_at_start") is None:
        return ""
    return f" Load average at the phase's start: {res['load_avg_at_start']} ({res.get('cpus')} CPUs)."


def _tp(res: dict) -> str:
    """What the report says of tensor parallelism (a result before ``tp`` was recorded ran one rank)."""
    tp = res.get("tp", 1)
    if tp == 1:
        return "tensor parallelism 1 (one rank, one sidecar)"
    return (f"tensor parallelism {tp}: one sidecar per rank{' (each pinned to its GPU)' if res.get('sidecars_pinned') else ''}, each "
            f"loading its rank's shard ({tp} ranks' bytes a chunk over the one "
            "link); seconds of the breakdown are the slowest rank's, `loaded` vLLM's (what every rank holds), `ranks loaded` each "
            "rank's sidecar's")


def ttft(res: dict) -> str:
    c = res.get("link_self_check") or {}
    ranks = res.get("tp", 1) > 1
    out = ["# vllm_ttft: time to first token, broken down\n", _head(res),
           f"Model {res['model']} ({res['kv_dtype']}), {_tp(res)}. Chunks of {res['chunk_tokens']} tokens, bytes a chunk"
           f"{' (one rank' + chr(39) + 's)' if ranks else ''}: {res['object_bytes_per_chunk']}. "
           f"Link self-check on this machine: at most {c.get('delivered_gbit')} Gbit/s delivered ({c.get('procs')} server processes, "
           f"{c.get('parallel')} parallel ranged GETs). `delivered` is what the link server sent during the cell over the sidecar's download "
           "time (time with a read in flight): the link a cell really had, next to its label. Seconds: `lookup` the sidecar's time "
           "answering the scheduler's lookup, `wait` the sidecar's load request outside its fetch, `download` / `decode` time with a read / a decode or "
           "restore in flight (they overlap), `restore` the fetch's wall time, `prefill` the rest of the TTFT (the remainder's prefill and "
           "the engine's own work). `call` is the scheduler's lookup call for the prompt timed from a client right after the cell "
           "(its whole cost, listing or not; not part of the TTFT shown). `in flight` is the load's chunks in each step of their restore "
           "on average (admitted by the fetch's window / header read / parts read and checked / decoded / waiting for a write thread / "
           "written): the step at its concurrency (the window, the reads in flight, the decode threads, the write threads) is what bounds the load. With repeats, TTFT is the median of the `samples` and "
           "the breakdown is the median sample's; a cell's methods take turns, one request each per round, in orders where each follows every other alike (a balanced Latin square). "
           f"`CPU` is how many of the machine's cores{' (' + str(res['cpus']) + ')' if res.get('cpus') else ''} were busy on average during the request (every process on it: the "
           "engine, the sidecars, the link server).\n\n",
           f"| link (label) | delivered Gbit/s | context | method | TTFT s | samples | loaded |{' ranks loaded |' if ranks else ''} lookup | "
           "wait | download | decode | restore | prefill | call | in flight " + "/".join(s[0] for s in STAGES) + " | CPU |\n",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if ranks else "") + "\n"]
    for r in res["rows"]:
        if "skipped" in r:
            out.append(f"| {link_label(r['link_gbit'])} | | {r['context']} | {r['method']} | skipped: {r['skipped']} | | | | | | | | | | | |"
                       f"{' |' if ranks else ''}\n")
            continue
        samples = " ".join(_f(x) for x in r.get("ttft_samples_s", [r["ttft_s"]]))
        each = f" {' '.join(map(str, r.get('ranks_loaded_tokens', [])))} |" if ranks else ""
        out.append(f"| {link_label(r['link_gbit'])} | {_f(r.get('delivered_gbit'), 2)} | {r['context']} | {r['method']} | {_f(r['ttft_s'])} | "
                   f"{samples} | {r['loaded_tokens']} |{each} {_f(r['lookup_s'])} | {_f(r['wait_s'])} | {_f(r['download_s'])} | "
                   f"{_f(r['decode_s'])} | {_f(r['restore_s'])} | {_f(r['prefill_s'])} | {_f(r.get('lookup_call_s'))} | "
                   f"{in_flight((r.get('sidecar') or {}).get('stages') or {})} | {_f(r.get('cpu_busy_cores'), 1)} |\n")
    out += auto_verdicts(res["rows"])
    learnt = {(r["link_gbit"], r["context"]): v for r in res["rows"] if (v := (r.get("sidecar") or {}).get("load_overhead_s")) is not None}
    if learnt:
        out.append("\nA load's cost to the engine beyond the fetch and the prefill, as the scheduler had learnt it by each cell's last "
                   "method (every load option pays it): " + ", ".join(f"{link_label(g)} {n}: {1e3 * v:.0f} ms" for (g, n), v in learnt.items())
                   + ".\n")
    return "".join(out)


def in_flight(stages: dict[str, float]) -> str:
    """A load's chunks in flight per step of the restore, one number per stage of :data:`STAGES` joined
    by ``/`` (blank: no load; ``-``: a step its chunks skip, such as raw's decode)."""
    return "/".join(f"{stages[s]:.1f}" if s in stages else "-" for s in STAGES) if stages else ""


def auto_verdicts(rows: list[dict]) -> list[str]:
    """Markdown lines: per cell, ``auto`` against the best of recompute and every forced preset
    (medians), whether it is within 2% or 10 ms of it (the criterion `auto` is held to), and in how
    many rounds ``auto`` was as fast as that method's request of the same round (the methods take
    turns, so a round pairs them): a miss in one round of three is a near-tie, in every round a loss.
    Where the rows say what ``auto``'s requests did (``chose_samples``), also its decision apart from
    its luck: the forced median of what it chose most against the best's, held to the same criterion."""
    cells: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        if "ttft_s" in r:
            cells.setdefault((r["link_gbit"], r["context"]), {})[r["method"]] = r
    out = ["\n`auto` against the best other method per cell (medians; passes within 2% or 10 ms; `rounds`: those in which "
           "auto's request was as fast as the best method's of the same round; `chose`: what auto's requests did; `decision`: "
           "the forced median of what it chose most against the best's, by the same criterion, so that a right choice whose "
           "samples fell slow is told from a wrong one):\n\n",
           "| link (label) | context | best | its TTFT s | auto s | auto vs best | rounds | passes | chose | decision |\n"
           "|---|---|---|---|---|---|---|---|---|---|\n"]
    for (gbit, n), c in cells.items():
        if "auto" not in c or len(c) < 2:
            continue
        t = {m: r["ttft_s"] for m, r in c.items()}
        best = min((m for m in t if m != "auto"), key=t.get)
        a, b = c["auto"].get("ttft_samples_s") or [], c[best].get("ttft_samples_s") or []
        rounds = f"{sum(x <= y for x, y in zip(a, b))} of {len(a)}" if a and len(a) == len(b) else ""
        chose, decision = _decision(c["auto"].get("chose_samples") or [], t, best)
        passes = "yes" if _within(t["auto"], t[best]) else "no"
        out.append(f"| {link_label(gbit)} | {n} | {best} | {_f(t[best])} | {_f(t['auto'])} | {_gap(t['auto'], t[best])} | {rounds} | "
                   f"{passes} | {chose} | {decision} |\n")
    return out


def _within(t: float, best: float) -> bool:
    """The criterion `auto` is held to: at most 2% or 10 ms behind ``best``."""
    return t - best <= max(0.02 * best, 0.010)


def _gap(t: float, best: float) -> str:
    return f"{(t - best) / best:+.1%}"


def _decision(choices: list[str], t: dict[str, float], best: str) -> tuple[str, str]:
    """(what ``auto``'s requests did, counted; the forced median of its most frequent choice against
    ``best``'s: 'right' or 'wrong' with the gap; '' where it is not known)."""
    if not choices:
        return "", ""
    counts = {m: choices.count(m) for m in dict.fromkeys(choices)}
    chose = ", ".join(f"{m} x{k}" if len(choices) > 1 else m for m, k in counts.items())
    most = max(counts, key=counts.get)
    if most not in t:
        return chose, ""
    return chose, f"{'right' if _within(t[most], t[best]) else 'wrong'} ({_gap(t[most], t[best])})"


def identity(res: dict, phase: str) -> str:
    out = ["# vllm_ttft: identity (" + phase + ")\n", _head(res),
           f"{res['model']}, prompts of {res['prompt_tokens']} tokens, split at {res['split']} (the stored prefix).\n\n"]
    if phase == "identity-store":
        out.append("| prompt for | vLLM's own hit cached | sidecar loaded | same tokens as a recompute |\n|---|---|---|---|\n")
        for p, r in res["per_preset"].items():
            out.append(f"| {p} | {r['vllm_hit_cached']} | {r['vllm_hit_sidecar_loaded']} | {r['vllm_hit_equals_recompute']} |\n")
        return "".join(out)
    out.append("| forced preset | cached | sidecar loaded (its chunks; the one straddling vLLM's own hit writes its tail) | "
               "= vLLM's own hit at the split | = recompute | vLLM's own hit = recompute | passed |\n|---|---|---|---|---|---|---|\n")
    for p, r in res["per_preset"].items():
        out.append(f"| {p} | {r['cached']} | {r['sidecar_loaded_tokens']} | {r['equals_vllm_hit']} | "
                   f"{r['equals_recompute']} | {r['vllm_hit_equals_recompute']} | {r['passed']} |\n")
    out.append("\nPass criterion: the forced `raw` load gives the tokens of vLLM's own prefix-cache hit at the same split; the "
               "coded preset's comparisons and the recompute comparisons are reported, not required.\n")
    return "".join(out)


def load(res: dict) -> str:
    w = res["workload"]
    out = ["# vllm_ttft: under load\n", _head(res),
           f"{w['requests']} requests at {w['rate']}/s, {int(w['shared'] * 100)}% one of {w['prefixes']} stored {w['prefix']}-token prefixes "
           f"plus {w['suffix']} fresh tokens, {w['output']} output tokens each, link {w['link']} Gbit/s. The passes, in the table's order: "
           "`recompute` passes the connector by (no lookup, load or save); `kvfetcher-nosave` looks up and loads as deployed but saves "
           "nothing (each request's `kv_transfer_params` say `\"store\": false`); `forced-<preset>`, where run, loads that preset "
           "whatever the cost model says and saves nothing; `kvfetcher` saves as deployed (the sidecar writes "
           f"`{res.get('writes')}`{'; the link server counts uploads without keeping them' if res.get('discard_puts') else ''}). "
           f"Both kvfetcher passes are `auto` among the presets stored: {', '.join(res.get('stored_presets') or ['(not recorded)'])}. "
           "`uploaded objects` counts every upload the link server took, the sidecar's small access records too.\n\n",
           "| method | TTFT p50 s | TTFT p99 s | shared p50 s | shared p99 s | output tokens/s | tokens loaded | lookups | lookup s "
           "(sum) | lookup p50 / p99 ≤ s (buckets) | stored chunks | uploaded objects | dropped chunks | delivered Gbit/s |\n"
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"]
    for m in load_passes(res):
        r = res[m]
        if r.get("skipped"):
            out.append(f"| {m} | {r['skipped']} |\n")
            continue
        s = r.get("sidecar", {})
        out.append(f"| {m} | {_f(r['ttft_p50_s'])} | {_f(r['ttft_p99_s'])} | {_f(r['shared_ttft_p50_s'])} | {_f(r['shared_ttft_p99_s'])} | "
                   f"{_f(r['output_tokens_per_s'], 1)} | {r['loaded_tokens']} | {s.get('lookups')} | {_f(s.get('lookup_s'))} | "
                   f"{_f(s.get('lookup_p50_le_s'), 4)} / {_f(s.get('lookup_p99_le_s'), 4)} | "
                   f"{s.get('stored_chunks')} | {s.get('link_objects_put')} | {s.get('dropped_chunks')} | {_f(r.get('delivered_gbit'), 2)} |\n")
    out.append(_paired(res))
    lc = res.get("lookup_cost")
    if lc:
        out.append(f"\nThe lookup's own cost: the connector scheduler's call (`{lc.get('call')}`, as `get_num_new_matched_tokens` makes "
                   f"it) timed from a client against the running sidecar, {lc['reps']} repetitions each (fewer where a prompt's time ran out; ms):\n\n"
                   "| prompt tokens | stored | calls | p50 ms | p99 ms | max ms | sidecar's answer ms (mean) | store listings |\n|---|---|---|---|---|---|---|---|\n")
        for r in lc["rows"]:
            out.append(f"| {r['tokens']} | {r['stored_tokens']} | {r['reps']} | {_f(r['p50_ms'], 2)} | {_f(r['p99_ms'], 2)} | {_f(r['max_ms'], 2)} | "
                       f"{_f(r.get('sidecar_answer_ms_mean'), 2)} | {r.get('store_listings')} |\n")
    return "".join(out)


def load_passes(res: dict) -> list[str]:
    """The ``load`` phase's passes in ``res``, in their order: ``recompute`` first (those of
    :data:`~benchmarks.vllm_ttft.under_load.PASSES` and any forced one: the JSON keeps the order they ran in)."""
    from benchmarks.vllm_ttft.under_load import FORCED, PASSES

    return [m for m in res if m in PASSES or m.startswith(FORCED)]


PARTS = (("ttft_s", "TTFT"), ("queued_s", "queued (arrival in the scheduler to first scheduled)"),
         ("scheduled_s", "scheduled to first token"))


def _paired(res: dict) -> str:
    """Each kvfetcher pass against recompute request by request (the passes share arrivals): the
    median, p90 and max of the differences of the TTFT and, where vLLM kept them, of its two parts.
    A p90 near one decode step with a small median says a few requests waited a step; a median
    shift says every request paid; the parts say whether it was waiting to be scheduled (a lookup
    that put the request off a step) or the steps that computed it."""
    lines = []
    for m in (m for m in load_passes(res) if m != "recompute"):
        for key, name in PARTS:
            base, got = (res.get("recompute") or {}).get(key), (res.get(m) or {}).get(key)
            if base and got and len(got) == len(base):
                d = sorted((g - b) * 1000 for g, b in zip(got, base))
                lines.append(f"`{m}` − `recompute`, request by request, {name}: median {d[len(d) // 2]:+.1f} ms, "
                             f"p90 {d[min(len(d) - 1, int(0.9 * len(d)))]:+.1f} ms, max {d[-1]:+.1f} ms.")
    return "\n" + "\n".join(lines) + "\n" if lines else ""


def peer(res: dict) -> str:
    out = [f"# vllm_ttft: peer `{res['method']}`\n", _head(res)]
    if res.get("unavailable"):
        return "".join(out + [f"Not run: {res['unavailable']}.\n"])
    over = any(r.get("over_link") for r in res["rows"])
    via = f" ({res['link']})" if res.get("link") else ""
    out.append(f"Model {res.get('model')} ({res.get('kv_dtype')}), the `ttft` phase's prompts. A cell stores the prompt with one request, clears "
               "vLLM's GPU prefix cache and times the same prompt again (its load). "
               + (f"Loads go over the paced link{via} at the link shown (`sent`: its bytes during the request; `delivered ≥`: those "
                  "bytes over the request's TTFT, a lower bound on the rate the link delivered, as it was idle for part of it). " if over else
                  "Loads read host memory, not the link: the local upper bound, the same at every link label. ")
               + "`stored B/token`: bytes stored per prompt token.\n\n"
               "| link (label) | delivered ≥ Gbit/s | context | TTFT s | loaded | stored B/token | sent MB | store request s |\n"
               "|---|---|---|---|---|---|---|---|\n")
    for r in res["rows"]:
        if "skipped" in r:
            out.append(f"| {link_label(r['link_gbit'])} | | {r['context']} | skipped: {r['skipped']} | | | | |\n")
            continue
        out.append(f"| {link_label(r['link_gbit'])} | {_f(r.get('delivered_gbit'), 2)} | {r['context']} | {_f(r['ttft_s'])} | {r['loaded_tokens']} | "
                   f"{_f(r['stored_bytes_per_token'], 0)} | {_f(r['link_bytes_sent'] / 1e6, 1)} | {_f(r['store_request_s'])} |\n")
    return "".join(out)


def interference(res: dict) -> str:
    """The ``interference`` phase: per path, the decoding streams' TPOT during the request's window
    against the baseline's, its TTFT, and where it stands against the +5% target and ShadowServe."""
    w, target, shadow = res["workload"], res.get("target_p50_x", 1.05), res.get("shadowserve_x", 2.2)
    out = ["# vllm_ttft: interference — decoding beside a load\n", _head(res),
           f"Model {res['model']} ({res['kv_dtype']}). {w['streams']} requests decode ({w['stream_prompt']}-token prompts, no cached KV "
           f"read) in one engine with the kvfetcher connector (vLLM's prefix cache off; {res.get('max_num_batched_tokens')} tokens a step at "
           f"most); once each has {w['warm']} tokens, one request of a stored {w['prefix']}-token prefix plus {w['suffix']} fresh tokens "
           f"arrives in each path in turn, over a {w['link']:g} Gbit/s link: `recompute` (the engine prefills it), each stored preset "
           "forced, `auto` (the cost model), and a `baseline` with no request (a "
           f"{w['base_window_s']:g} s window). The window is the request's arrival to its first token; the streams' inter-token "
           "times (TPOT) overlapping it give p50 / p99 / mean / max; `loaded` and `sidecar chose` are per sample. Medians over "
           f"{res.get('repeats')} rounds (one sample of each path per round); `x` is the median over the baseline's. "
           f"Target: p50 at most {target:.2f}x the baseline's; ShadowServe reports GPU decompression slowing decoding "
           f"by up to {shadow:g}x.\n\n",
           "| path | TTFT s | loaded | sidecar chose | TPOT p50 ms | p50 x | TPOT p99 ms | p99 x | mean ms | mean x | max gap ms | samples | "
           f"p50 within +{(target - 1):.0%} |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"]
    for p, r in res["paths"].items():
        ok = {None: "", True: "yes", False: "no"}[r.get("p50_within_target")] if p != "baseline" else "(reference)"
        loaded = " ".join(str(x) for x in r.get("loaded_tokens", []) if x is not None)
        chose = " ".join("+".join(c) or "-" for c in r.get("chose", []) if c is not None)
        out.append(f"| {p} | {_f(r.get('ttft_s'))} | {loaded} | {chose} | {_f(r.get('tpot_p50_ms'), 2)} | {_x(r.get('tpot_p50_x'))} | "
                   f"{_f(r.get('tpot_p99_ms'), 2)} | {_x(r.get('tpot_p99_x'))} | {_f(r.get('tpot_mean_ms'), 2)} | {_x(r.get('tpot_mean_x'))} | "
                   f"{_f(r.get('tpot_max_ms'), 1)} | {r.get('samples')} | {ok} |\n")
    short = [p for p, r in res["paths"].items() if p not in ("baseline", "recompute", "auto")
             and any(x is not None and x < res["workload"]["prefix"] for x in r.get("loaded_tokens", []))]
    if short:
        out.append(f"\nForced loads that loaded less than the stored prefix in some sample (partly a recompute): {', '.join(short)}.\n")
    if res.get("stopped_early"):
        out.append("\nThe phase's time ran short: the rounds stopped early (see `samples`).\n")
    if any(s.get("streams_ended_in_window") for s in res.get("samples", [])):
        out.append("\nSome stream reached its output limit inside a window: that sample's figures cover less than its window.\n")
    return "".join(out)


def _x(r) -> str:
    return "" if r is None else f"{r:.2f}x"


def _gb(n: float | None) -> float | None:
    return None if n is None else n / 1e9


def peer_load(res: dict) -> str:
    """A peer under the ``load`` phase's workload (``peers_load``): one pass, as deployed."""
    out = [f"# vllm_ttft: peer `{res['method']}` under load\n", _head(res)]
    if res.get("unavailable"):
        return "".join(out + [f"Not run: {res['unavailable']}\n"])
    w = res["workload"]
    out += [f"Model {res['model']} ({res['kv_dtype']}), the `load` phase's stream: {w['requests']} requests at {w['rate']}/s, "
            f"{int(w['shared'] * 100)}% one of {w['prefixes']} {w['prefix']}-token prefixes (each stored once beforehand through this "
            f"engine, unpaced) plus {w['suffix']} fresh tokens, {w['output']} output tokens each, vLLM's prefix cache off; link "
            f"{w['link']} Gbit/s ({res.get('link')}). The peer looks up, loads and saves as deployed. `delivered ≥`: the link's bytes "
            "during the stream over its length (a lower bound). Its recompute reference is the `load` phase's `recompute` pass.\n\n",
            "| method | TTFT p50 s | TTFT p99 s | shared p50 s | shared p99 s | output tokens/s | tokens loaded | stored B/token | "
            "sent GB | delivered ≥ Gbit/s |\n|---|---|---|---|---|---|---|---|---|---|\n"]
    if res.get("skipped"):
        return "".join(out + [f"| {res['method']} | {res['skipped']} |\n"])
    out.append(f"| {res['method']} | {_f(res['ttft_p50_s'])} | {_f(res['ttft_p99_s'])} | {_f(res['shared_ttft_p50_s'])} | "
               f"{_f(res['shared_ttft_p99_s'])} | {_f(res['output_tokens_per_s'], 1)} | {res['loaded_tokens']} | "
               f"{_f(res.get('stored_bytes_per_token'), 0)} | {_f(_gb(res.get('link_bytes_sent')), 2)} | {_f(res.get('delivered_gbit'), 2)} |\n")
    return "".join(out)


def markdown(phase: str, res: dict) -> str:
    if phase.startswith("peer-load-"):
        return peer_load(res)
    if phase.startswith("peer-"):
        return peer(res)
    if phase == "interference":
        return interference(res)
    if phase == "ttft":
        return ttft(res)
    if phase == "load":
        return load(res)
    return identity(res, phase)
