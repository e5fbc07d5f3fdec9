"""Calibration artefacts: content names, the fingerprint check, publishing to a pool's store and a
sidecar finding its model's there; presets that need a calibration are never stored or chosen for
a model without one."""

import json
from pathlib import Path

import pytest
import torch

from kvfetcher import keys
from kvfetcher.chunk import decode_chunk, encode_chunk
from kvfetcher.codec import basis
from kvfetcher.format import calibration, container, presets
from kvfetcher.store.local import LocalStore
from kvfetcher.fetch.plan import FetchOptions

from kvtest import running

GEO = (3, 1, 64)  # layers, KV heads, head_dim
THETAS = (1e4, 1e4, 1e6)


def made(tag: str, directory: Path, seed: int = 0) -> tuple[Path, Path]:
    """A calibration of a 3-layer model (random orthogonal basis) written as ``calibrate`` does."""
    L, H, D = GEO
    g = torch.Generator().manual_seed(seed)
    enc = torch.linalg.qr(torch.randn(L, 2, H, D, D, generator=g))[0]
    b = basis.build(tag, enc, torch.randn(L, 2, H, D, generator=g))
    bpath = basis.save(b, directory)
    tables = {k: {"layers": [[1e-4 * (i + 1), 2e-4] for i in range(L)]} for k in ("basis", "trellis")}
    doc = calibration.artefact(tag, tables, b.name, GEO, THETAS, (512, 512, 0), made_by="test")
    return calibration.write(doc, directory), bpath


def kv_of(seed=1, tokens=32):
    L, H, D = GEO
    return torch.randn(L, 2, H, tokens, D, generator=torch.Generator().manual_seed(seed)).half()


def test_an_artefact_is_named_by_its_content_and_a_changed_one_is_refused(local):
    path, _ = made("tiny-lm", local)
    cal = calibration.read(path)
    assert path.stem == cal.name == f"tiny-lm-{calibration.digest(json.loads(path.read_text()))}"
    assert (cal.model, cal.geometry, cal.rope_thetas, cal.windows) == ("tiny-lm", GEO, THETAS, (512, 512, 0))
    doc = json.loads(path.read_text())
    doc["sensitivity"]["trellis"]["layers"][0] = [1.0, 1.0]
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="does not match its content"):
        calibration.read(path)


def test_a_calibration_for_another_model_is_refused(local):
    cal = calibration.read(made("tiny-lm", local)[0])
    calibration.check(cal, "tiny-lm/fp16")
    with pytest.raises(ValueError, match="is for model 'tiny-lm', not 'other-lm/fp16'"):
        calibration.check(cal, "other-lm/fp16")
    assert calibration.calibration_for("other-lm/fp16") is None
    with pytest.raises(ValueError, match="not named for model"):  # another model's basis
        calibration.artefact("other-lm", {"basis": {"layers": [[1, 1]] * 3}}, cal.basis, GEO, THETAS, None)
    with pytest.raises(ValueError, match="2 layers, the geometry 3"):
        calibration.artefact("tiny-lm", {"basis": {"layers": [[1, 1]] * 2}}, None, GEO, THETAS, None)


def test_a_calibrated_model_codes_with_its_basis_and_per_layer_bases(local):
    made("tiny-lm", local)
    p = presets.get("balanced", "tiny-lm/fp16")
    assert p.layout.basis.startswith("tiny-lm-") and p.layout.rope_theta == THETAS and p.layout.sparse_tokens == 4
    kv = kv_of()
    obj = encode_chunk(kv, "balanced", "tiny-lm/fp16", start=32)  # no rope_theta: the calibration's
    h = container.parse_header(obj)
    assert h.layout.rope_theta == THETAS and h.layout.basis == p.layout.basis
    assert (decode_chunk(obj, "tiny-lm/fp16").float() - kv.float()).abs().mean() < 0.2


def test_publish_then_a_sidecar_node_fetches_it_by_fingerprint(local, store, tmp_path):
    path, bpath = made("tiny-lm", tmp_path / "made")
    names = calibration.publish(store, path, bpath)
    assert names == [f"_meta/calibration/tiny-lm/{path.name}", f"_meta/calibration/tiny-lm/{bpath.name}"]
    assert calibration.fetch(store, "other-lm/fp16") is None
    assert presets.refusal("balanced", "tiny-lm/fp16") is not None  # not local yet
    cal = calibration.fetch(store, "tiny-lm/fp16")
    assert cal.name == path.stem and (local / path.name).exists() and (local / bpath.name).exists()
    presets.for_model.cache_clear()
    assert presets.refusal("balanced", "tiny-lm/fp16") is None and calibration.calibration_for("tiny-lm-chat/fp16") == cal


def test_a_basis_that_does_not_match_its_name_is_not_installed(local, tmp_path):
    store = LocalStore(tmp_path / "store")
    path, bpath = made("tiny-lm", tmp_path / "made")
    other = made("tiny-lm", tmp_path / "other", seed=9)[1]
    calibration.publish(store, path, None)
    store.put(f"_meta/calibration/tiny-lm/{bpath.name}", other.read_bytes())  # the wrong tensor under the name
    assert calibration.fetch(store, "tiny-lm/fp16") is None  # refused (logged), so not installed
    assert not list(local.glob("*.pt")) and not list(local.glob("*.json"))


# --- the sidecar -----------------------------------------------------------------------------


def _tokens(n=64):
    return list(range(1000, 1000 + n))


async def test_a_model_without_calibration_never_stores_or_plans_balanced(local, tmp_path, shm):
    store = LocalStore(tmp_path / "store")
    kv = kv_of(tokens=64)
    buf = shm((GEO[0], 2, GEO[1], 64, GEO[2]))
    buf.tensor.copy_(kv)
    async with running(store, chunk_tokens=32, presets=("q8", "balanced"), decode_procs=0, device="cpu", warm_up=False) as sc:
        bid = sc.register(buf.handle, "uncalibrated-lm/fp16")
        await sc.calibrations.finding
        assert sc.writer.presets_for("uncalibrated-lm/fp16") == ("q8",)
        await sc.store(bid, _tokens())
        await sc.flush()
        stored = sorted(keys.preset_of(n) for n in store.list("kv/"))
        assert stored == ["q8", "q8"]
        again = await sc.store(bid, _tokens())  # stored in every preset it may store: nothing to queue
        assert again["skipped_chunks"] == 2
        # a balanced object under its name (e.g. written before) is never chosen
        ck = keys.chunk_keys(sc.buffers[bid].ns, _tokens(), 32)
        for k in ck:
            store.delete(keys.object_name(k, "q8"))
            store.put(keys.object_name(k, "balanced"), b"x" * 10)
        sc.index.forget(ck)  # as a sidecar that did not write them sees the store: it lists them
        plan = await sc.lookup(bid, _tokens(), options=FetchOptions(recompute_tokens_per_s=1e-9, refresh=True))
        assert plan.hit_tokens == 64 and plan.preset == "recompute"  # listed, never chosen


async def test_a_sidecar_finds_its_models_calibration_in_the_store_and_stores_balanced(local, tmp_path, shm):
    store = LocalStore(tmp_path / "store")
    calibration.publish(store, *made("tiny-lm", tmp_path / "made"))
    kv = kv_of(tokens=64)
    buf = shm((GEO[0], 2, GEO[1], 64, GEO[2]))
    buf.tensor.copy_(kv)
    async with running(store, chunk_tokens=32, presets=("balanced",), decode_procs=0, device="cpu", warm_up=False) as sc:
        bid = sc.register(buf.handle, "tiny-lm/fp16")
        await sc.calibrations.finding
        await sc.store(bid, _tokens())
        await sc.flush()
        assert sorted(keys.preset_of(n) for n in store.list("kv/")) == ["balanced", "balanced"]
        buf.tensor.zero_()
        r = await sc.fetch(bid, _tokens(), options=FetchOptions(recompute_tokens_per_s=1e-9))
        assert (r.error, r.loaded_tokens, r.decision.preset) == (None, 64, "balanced"), r
        assert (buf.tensor.float() - kv.float()).abs().mean() < 0.2


async def test_a_store_right_after_registration_waits_for_the_calibration_being_fetched(local, tmp_path, shm, monkeypatch):
    """The look at registration runs in the background: a store issued before it is done still
    writes the presets the calibration allows (it waits for the look, not a 'not storing')."""
    import threading

    store = LocalStore(tmp_path / "store")
    calibration.publish(store, *made("tiny-lm", tmp_path / "made"))
    fetching, fetch = threading.Event(), calibration.fetch

    def slow_fetch(*a, **kw):
        fetching.wait(10)
        return fetch(*a, **kw)

    monkeypatch.setattr(calibration, "fetch", slow_fetch)
    buf = shm((GEO[0], 2, GEO[1], 64, GEO[2]))
    buf.tensor.copy_(kv_of(tokens=64))
    async with running(store, chunk_tokens=32, presets=("q8", "balanced"), decode_procs=0, device="cpu", warm_up=False) as sc:
        bid = sc.register(buf.handle, "tiny-lm/fp16")
        await sc.store(bid, _tokens())
        assert not sc.calibrations.finding.done()
        fetching.set()
        await sc.flush()
        assert sorted(keys.preset_of(n) for n in store.list("kv/")) == ["balanced", "balanced", "q8", "q8"]


async def test_a_calibration_published_after_the_sidecar_started_is_found_on_the_lookup_path(local, tmp_path, shm):
    """The operator's calibration Job publishes while the model already serves: a plan looks again
    once the recheck interval has passed (not before), and from then on the model stores and
    chooses balanced."""
    store = LocalStore(tmp_path / "store")
    buf = shm((GEO[0], 2, GEO[1], 64, GEO[2]))
    buf.tensor.copy_(kv_of(tokens=64))
    async with running(store, chunk_tokens=32, presets=("q8", "balanced"), decode_procs=0, device="cpu", warm_up=False) as sc:
        bid = sc.register(buf.handle, "tiny-lm/fp16")
        await sc.calibrations.finding
        assert sc.writer.presets_for("tiny-lm/fp16") == ("q8",)
        calibration.publish(store, *made("tiny-lm", tmp_path / "made"))
        looked = sc.calibrations.finding
        await sc.lookup(bid, _tokens())  # within the interval: no second look
        assert sc.calibrations.finding is looked and sc.writer.presets_for("tiny-lm/fp16") == ("q8",)
        sc.calibrations.recheck_s = 0.0
        await sc.lookup(bid, _tokens())
        await sc.calibrations.finding
        assert sc.writer.presets_for("tiny-lm/fp16") == ("q8", "balanced")
        await sc.store(bid, _tokens())
        await sc.flush()
        assert sorted(keys.preset_of(n) for n in store.list("kv/")) == ["balanced", "balanced", "q8", "q8"]
        plan = await sc.lookup(bid, _tokens(), options=FetchOptions(recompute_tokens_per_s=1e-9))
        assert plan.preset == "balanced"
        sc.calibrations.recheck_s = 3600.0
        looked = sc.calibrations.finding
        await sc.lookup(bid, _tokens())  # found: looked for again only after the interval (a longer tag may come)
        assert sc.calibrations.finding is looked


def test_presets_for_a_model_show_its_own_figures_and_its_refusals(local, capsys):
    from kvfetcher import cli

    assert cli.main(["presets", "--model", "uncalibrated-lm/fp16", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert "kvfetcher calibrate" in rows["balanced"]["refused"] and rows["q8"]["refused"] is None
    assert rows["q8"]["measured"] is None  # the shipped figures are another model's
    path, _ = made("tiny-lm", local)
    doc = json.loads(path.read_text())
    doc["measured"] = {"balanced": {"ratio_vs_fp16": 3.5, "kl": 0.001, "tf_top1": 0.98}}
    path.unlink()
    calibration.write(doc, local)
    presets.for_model.cache_clear()
    assert cli.main(["presets", "--model", "tiny-lm/fp16"]) == 0
    out = capsys.readouterr().out
    assert "calibration tiny-lm-" in out and "3.50x, KL 0.001" in out


def test_the_shipped_gemma_calibration_fits_gemma_3_270m():
    fp = "gemma-3-270m-q4_k_m/float32"
    cal = calibration.calibration_for(fp)
    assert cal.geometry == (18, 1, 256) and basis.load(cal.basis).shape == (18, 1, 256)
    assert cal.windows == ((512,) * 5 + (0,)) * 3 and set(cal.rope_thetas) == {1e4, 1e6}
    assert all(t == (1e6 if w == 0 else 1e4) for t, w in zip(cal.rope_thetas, cal.windows))
    p = presets.get("balanced", fp)
    assert p.layout.basis == cal.basis and p.layout.rope_theta == cal.rope_thetas and cal.measured["balanced"]["kl"] < 1e-3
