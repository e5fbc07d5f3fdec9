import hashlib
import json
import shutil

import pytest
import torch

from kvfetcher.format import calibration, container, presets
from kvfetcher.config import Config

SHIPPED_FP = "smollm2-135m-instruct-q4_1/float32"


def test_every_preset_is_consistent():
    for name, p in presets.PRESETS.items():
        assert p.name == name
        assert p.lossless == (p.layout.mode in ("exact", "native"))
        assert (p.codec.format == "raw") == (name == "raw")


def test_a_pre_rope_preset_needs_the_models_theta():
    assert presets.get("lean").pre_rope
    with pytest.raises(ValueError, match="KVFETCHER_ROPE_THETA"):
        Config.from_env({"KVFETCHER_PRESET": "q8,lean"}).validate(presets.PRESETS)
    c = Config.from_env({"KVFETCHER_PRESET": "q8,lean", "KVFETCHER_ROPE_THETA": "500000"})
    c.validate(presets.PRESETS)
    assert c.rope_theta == 500000.0 and c.presets == ("q8", "lean")


def test_unknown_preset_is_refused():
    with pytest.raises(ValueError):
        presets.get("turbo")


def test_balanced_and_compact_are_sensitivity_profiles_with_compact_coarser():
    b, c = presets.get("balanced"), presets.get("compact")
    assert b.pre_rope and c.pre_rope and not b.lossless and not c.lossless
    assert b.layout.trellis and c.layout.trellis  # trellis-coded quantisation (layout v6)
    assert b.layout.sparse_tokens == 4 and c.layout.sparse_tokens == 0  # layout v7's sparse corrections
    cal = calibration.default()
    assert len(b.layout.sigma_steps) == len(c.layout.sigma_steps) == len(cal.table("basis")) == len(cal.table("trellis"))
    pairs = [(x, y) for kb, kc in zip(b.layout.sigma_steps, c.layout.sigma_steps) for x, y in zip(kb, kc)]
    # compact keeps the 0.7-sigma table; balanced's (re-measured at its point) is coarser for the values
    # of layers 3-10, which that table over-weighted: compact is coarser everywhere else
    assert sum(y > x for x, y in pairs) >= len(pairs) - 8
    # the more sensitive a layer, the finer its step
    for p, table in ((b, cal.table("trellis")), (c, cal.table("basis"))):
        sens = [w for kv in table for w in kv]
        steps = [s for kv in p.layout.sigma_steps for s in kv]
        most, least = sens.index(max(sens)), sens.index(min(sens))
        assert steps[most] < steps[least]


def test_sigma_steps_respect_their_bounds():
    steps = [s for kv in presets.sigma_steps(0.01, lo=0.1, hi=0.5, table=calibration.default().table("channel")) for s in kv]
    assert min(steps) >= 0.1 and max(steps) <= 0.5


def test_every_preset_lists_measured_figures(capsys):
    """What `kvfetcher presets --json` prints: parameters plus measured ratio and accuracy."""
    import json

    from kvfetcher import cli

    assert cli.main(["presets", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert set(rows) == set(presets.PRESETS)
    for name in ("balanced", "compact"):
        m = rows[name]["measured"]
        assert m is not None, f"{name} has no measured figures"
        assert {"ratio_vs_fp16", "kl", "tf_top1"} <= set(m)  # the calibration's figures for its own steps
        assert rows[name]["layout"]["sigma_steps"]


def test_balanced_and_compact_use_the_shipped_basis_of_the_shipped_model():
    from kvfetcher.codec import basis
    from kvfetcher.eval import model

    for name in ("balanced", "compact"):
        p = presets.get(name)
        assert p.layout.basis == calibration.calibration_for(SHIPPED_FP).basis and p.sink_exact_only
        b = basis.load(p.layout.basis)  # shipped, and its content matches its name
        assert b.shape == (len(calibration.default().table("basis")), 3, 64)
        assert model.GGUF_FILE.lower().startswith(p.layout.basis.rsplit("-", 1)[0])
        assert basis.fits(p.layout.basis, (30, 2, 3, 256, 64), SHIPPED_FP)


# --- calibration: per-model data ------------------------------------------------------------

#: Per preset, a digest of every header field a preset decides (layout, codec, segments), over
#: chunks at positions 0 and 16 of the shipped model and (for presets that need no calibration) of
#: another model, as the code before calibration became data wrote them: stored objects' bytes
#: must not change. Only a new shipped calibration changes the calibrated presets' (its steps, on
#: purpose; objects stored before still decode: their headers carry the steps they were coded with).
HEADER_DIGESTS = {
    "raw": "925b143014e6ba76", "exact": "1832593fa2f54ccc", "q8": "ebfe073824711109",
    "lean": "c51d807611c99bd6", "balanced": "69622cac7878d5f9", "compact": "513520e8d3b3fd04",
    "q8-zstd": "d4536c514b2c7482", "balanced-zstd": "00cf8207b2a4b502", "compact-zstd": "faa9f1eca1d1f79f",
    "transform-zstd": "121bf50dcd92ceed",
}  # (the -ans presets code only on a GPU; their headers differ from -zstd's in the format alone)


def _header_digest(name: str) -> str:
    from kvfetcher.chunk import encode_chunk

    h = hashlib.sha256()
    models = [(SHIPPED_FP, (30, 2, 3, 16, 64)), ("another-model/bf16", (4, 2, 2, 16, 64))]
    for fp, shape in models[:1] if presets.PRESETS[name].needs_calibration else models:
        kv = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(torch.float16)
        for start in (0, 16):
            j = container.parse_header(encode_chunk(kv, name, fp, start=start, rope_theta=1e5)).to_json()
            fields = {k: j[k] for k in ("fingerprint", "shape", "preset", "layout", "codec", "frame_shape", "start")}
            fields["segments"] = [s["frames"] for s in j["segments"]]
            fields["side"] = j["side"] is not None
            h.update(json.dumps(fields, sort_keys=True).encode())
    return h.hexdigest()[:16]


@pytest.mark.parametrize("name", sorted(HEADER_DIGESTS))
def test_every_preset_codes_chunks_as_before(name):
    assert set(HEADER_DIGESTS) == {p for p in presets.PRESETS if not p.endswith("-ans")}
    assert _header_digest(name) == HEADER_DIGESTS[name]


def test_a_fingerprint_finds_its_models_calibration_by_tag():
    cal = calibration.calibration_for(SHIPPED_FP)
    assert cal == calibration.default() and cal.model == "smollm2-135m" and cal.basis.startswith("smollm2-135m-")
    assert calibration.calibration_for("llama-3-8b/bf16") is None
    assert presets.get("balanced", SHIPPED_FP) == presets.get("balanced")


def test_a_model_without_calibration_gets_no_preset_that_needs_one():
    from kvfetcher.chunk import encode_chunk

    other = "llama-3-8b/bf16"
    needs = [n for n, p in presets.PRESETS.items() if p.needs_calibration]
    assert {"balanced", "compact"} <= set(needs)
    assert set(presets.usable(presets.PRESETS, other)) == set(presets.PRESETS) - set(needs) >= {"q8", "exact", "raw"}
    kv = torch.zeros(4, 2, 2, 16, 64, dtype=torch.float16)
    for name in needs:
        assert "kvfetcher calibrate" in presets.refusal(name, other)
        with pytest.raises(ValueError, match="needs a calibration"):
            encode_chunk(kv, name, other, rope_theta=1e4)
    assert presets.get("q8", other) == presets.get("q8") and presets.refusal("q8", other) is None


def test_a_calibrated_preset_refuses_a_chunk_its_basis_does_not_fit():
    from kvfetcher.chunk import encode_chunk

    with pytest.raises(ValueError, match="not made for model"):  # the shipped model's basis, another geometry
        encode_chunk(torch.zeros(4, 2, 2, 16, 64, dtype=torch.float16), "balanced", SHIPPED_FP, rope_theta=1e4)


@pytest.fixture
def models_dir(tmp_path, monkeypatch):
    """The shipped calibrations in a directory the test may add to."""
    for f in calibration.MODELS_DIR.glob("*.json"):
        shutil.copy(f, tmp_path)
    monkeypatch.setattr(calibration, "MODELS_DIR", tmp_path)
    monkeypatch.setenv("KVFETCHER_CALIBRATION_DIR", str(tmp_path / "local"))
    presets.for_model.cache_clear()
    yield tmp_path
    presets.for_model.cache_clear()


def _write(directory, tag: str, layers: int = 6, **extra) -> None:
    tables = {kind: {"layers": [[1e-4 * (i + 1), 1e-4] for i in range(layers)]} for kind in ("channel", "basis", "trellis")}
    (directory / f"{tag}.json").write_text(json.dumps(dict(extra, sensitivity=tables)))


def test_a_calibrated_model_gets_its_own_steps_and_the_longest_tag_wins(models_dir):
    _write(models_dir, "tiny-lm", layers=6)
    _write(models_dir, "tiny-lm-chat", layers=4)
    p = presets.get("balanced", "tiny-lm-base/fp16")
    assert len(p.layout.sigma_steps) == 6 and p.layout.basis is None and p.layout.sparse_tokens == 0
    assert [k for k, _ in p.layout.sigma_steps] == sorted((k for k, _ in p.layout.sigma_steps), reverse=True)
    assert len(presets.get("compact", "tiny-lm-chat/fp16").layout.sigma_steps) == 4
    assert presets.get("balanced") == presets.PRESETS["balanced"]  # the default model's stay


def test_a_calibration_must_be_well_formed(models_dir):
    _write(models_dir, "tiny-lm", basis="smollm2-135m-4c54e39f9986")
    with pytest.raises(ValueError, match="not named for model"):
        calibration.read(models_dir / "tiny-lm.json")
    assert calibration.calibration_for("tiny-lm/fp16") is None  # skipped (logged): it breaks no lookup
    _write(models_dir, "tiny-lm", default=True)
    with pytest.raises(ValueError, match="exactly one"):
        calibration.default()


def test_stored_objects_decode_whatever_the_calibration_says_now(models_dir):
    """The header carries the steps a chunk was coded with: decoding never reads calibration."""
    from kvfetcher.chunk import decode_chunk, encode_chunk

    _write(models_dir, "tiny-lm", layers=2)
    kv = torch.randn(2, 2, 2, 16, 64, generator=torch.Generator().manual_seed(5)).to(torch.float16)
    obj = encode_chunk(kv, "compact", "tiny-lm/fp16", start=16, rope_theta=1e4)
    before = decode_chunk(obj, "tiny-lm/fp16")
    _write(models_dir, "tiny-lm", layers=3)
    presets.for_model.cache_clear()
    assert presets.get("compact", "tiny-lm/fp16").layout.sigma_steps != container.parse_header(obj).layout.sigma_steps
    assert torch.equal(decode_chunk(obj, "tiny-lm/fp16"), before)
    (models_dir / "tiny-lm.json").unlink()
    presets.for_model.cache_clear()
    assert presets.refusal("compact", "tiny-lm/fp16") is not None
    assert torch.equal(decode_chunk(obj, "tiny-lm/fp16"), before)
