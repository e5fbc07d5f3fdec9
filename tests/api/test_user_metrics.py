"""The metrics users ask for first: the hit rate (hit over looked-up tokens) and the build."""

import re

from kvfetcher.api.client import KVClient

from kvtest import sidecar, synthetic_kv


def test_hit_rate_and_build_info(s3, shm):
    buf = shm((2, 2, 2, 256, 32))
    tokens = list(range(500, 756))
    with sidecar(s3, chunk_tokens=64, presets=("raw",)) as sc:
        c = KVClient(socket_path=sc.socket)
        bid = c.register(buf.handle, "m")
        buf.tensor.copy_(synthetic_kv(layers=2, heads=2, tokens=256, head_dim=32))
        c.store(bid, tokens[:128])
        c.flush()
        assert c.hit_tokens(bid, tokens) == 128 and c.hit_tokens(bid, tokens[:200]) == 128
        text = c.metrics()
    value = lambda name: float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))  # noqa: E731
    assert value("kvfetcher_lookup_tokens_total") == 456 and value("kvfetcher_hit_tokens_total") == 256
    assert re.search(r'^kvfetcher_build_info\{python="[0-9.]+",version="[^"]+"\} 1\.0$', text, re.M)


def test_the_last_fetchs_steps_replace_the_ones_before():
    from prometheus_client import generate_latest

    from kvfetcher.fetch.executor import STAGES
    from kvfetcher.metrics import Metrics

    m = Metrics()
    m.stages({"admitted": {"in_flight": 1.0, "median_ms": 2.0}, "decoded": {"in_flight": 1.5, "median_ms": 3.0}}, STAGES)
    m.stages({"admitted": {"in_flight": 2.0, "median_ms": 4.0}}, STAGES)  # a raw load: no decode step
    text = generate_latest(m.registry).decode()
    assert 'kvfetcher_fetch_stage_chunks_in_flight{stage="admitted"} 2.0' in text
    assert 'kvfetcher_fetch_stage_median_seconds{stage="admitted"} 0.004' in text
    assert 'stage="decoded"' not in text  # not an earlier fetch's decode shown as this one's
