import pytest

from kvfetcher import presets
from kvfetcher.service import Config


def test_every_preset_is_consistent():
    for name, p in presets.PRESETS.items():
        assert p.name == name
        assert p.lossless == (p.layout.mode == "exact")
        assert (p.codec.format == "raw") == (name == "raw")


def test_a_pre_rope_preset_needs_the_models_theta():
    assert presets.get("lean").pre_rope
    with pytest.raises(ValueError, match="KVFETCHER_ROPE_THETA"):
        Config.from_env({"KVFETCHER_PRESET": "q8,lean"})
    c = Config.from_env({"KVFETCHER_PRESET": "q8,lean", "KVFETCHER_ROPE_THETA": "500000"})
    assert c.rope_theta == 500000.0 and c.presets == ("q8", "lean")


def test_unknown_preset_is_refused():
    with pytest.raises(ValueError):
        presets.get("turbo")


def test_the_operator_offers_exactly_the_data_planes_presets():
    """A pool's preset names reach the sidecar as KVFETCHER_PRESET / KVFETCHER_ALLOWED_PRESETS."""
    from kvfetcher_operator import spec

    assert set(spec.PRESETS) == set(presets.PRESETS)
    for default in spec.DEFAULT_PRESETS:  # every default a pool may carry starts a sidecar
        Config.from_env({"KVFETCHER_PRESET": default, "KVFETCHER_ALLOWED_PRESETS": ",".join(spec.PRESETS)})
