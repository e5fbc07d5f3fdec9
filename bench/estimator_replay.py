import json, sys
from kvfetcher import choice
r = json.load(open(sys.argv[1]))
FMT = {"raw": "raw", "balanced": "hevc", "q8": "hevc"}
STORED = {"raw": 21475152468, "balanced": 6456103200}
KV = 21474836480
def run(skip_first: bool, label: str):
    e = choice.Estimator(gpu=True)
    seen, group = set(), []
    for ev in r["estimator_journal"]:
        if ev[0] == "observe_lookup":
            continue
        if ev[0] != "fetch":
            group.append(ev); continue
        _, ctx, preset, ep, secs, decided = ev
        if ctx == 65536 and preset is None:  # the auto decision, made before this fetch's observations
            rt = e.rates(ep, 1.0)
            pred = {p: choice.fetch_seconds(STORED[p], KV, choice.decode_rate(p, FMT[p], rt), rt, rt.fit.get(p, 1.0), FMT[p]) for p in STORED}
            print(f"{label:28s} {ep}: predicted raw {pred['raw']:.2f} s, balanced {pred['balanced']:.2f} s -> {min(pred, key=pred.get)}")
        fmt = next((g[4] for g in group if g[0] == "observe_read"), None)
        first = fmt not in seen
        seen.add(fmt)
        for g in group:
            if g[0] == "observe_latency" or not (skip_first and first):
                getattr(e, g[0])(*g[1:])
        group = []
run(False, "decayed sums (as run)")
run(True, "+ first fetch per format off")
