"""`kvfetcher calibrate` on a small random model (SmolLM2's tokenizer, 2 layers): it writes a
content-named artefact stamped with the model, publishes it, and the model then gets balanced."""

import json
from pathlib import Path

import pytest

from kvfetcher import cli
from kvfetcher.eval import calibrate
from kvfetcher.format import calibration, presets
from kvfetcher.store.local import LocalStore


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, lm):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=lm.config.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, rope_theta=5e4, max_position_embeddings=1024)
    d = tmp_path_factory.mktemp("models") / "tiny-llama"
    LlamaForCausalLM(cfg).save_pretrained(d)
    lm.tokenizer.save_pretrained(d)
    return d


def test_calibrate_writes_publishes_and_unlocks_balanced(tiny_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVFETCHER_CALIBRATION_DIR", str(tmp_path / "local"))
    presets.for_model.cache_clear()
    fp = "tiny-llama/float32"
    assert presets.refusal("balanced", fp) is not None
    store_dir = tmp_path / "store"
    texts = [str(calibrate.TEXTS_DIR / n) for n in ("prose.txt", "code.txt")]  # two texts: a random model's budget search is long
    assert cli.main(["calibrate", "--model", str(tiny_dir), "--no-measure", "--out", str(tmp_path / "out"),
                     "--publish", str(store_dir), "--texts", *texts]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    cal = calibration.read(lines[0]["calibration"])
    assert (cal.model, cal.geometry, cal.rope_thetas, cal.windows) == ("tiny-llama", (2, 2, 16), (5e4, 5e4), (0, 0))
    assert set(cal.tables) == {"basis", "trellis"} and all(len(t) == 2 and min(min(t)) > 0 for t in cal.tables.values())
    doc = json.loads(Path(lines[0]["calibration"]).read_text())
    for kind in ("basis", "trellis"):  # steps allocated by rate and KL, the budget tuned: what was measured is recorded
        a = doc["sensitivity"][kind]["allocation"]
        assert len(a["kl_per_step2"]) == len(a["rate_slopes"]) == 2 and a["budget"]["multiplier"] > 0
    assert sorted(LocalStore(store_dir).list("_meta/calibration/tiny-llama/")) == sorted(lines[1]["published"])
    presets.for_model.cache_clear()
    p = presets.get("balanced", fp)
    assert p.layout.basis == cal.basis and p.layout.rope_theta == 5e4
    presets.for_model.cache_clear()


def test_retune_keeps_the_basis_and_allocation_and_tunes_the_budget(tiny_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVFETCHER_CALIBRATION_DIR", str(tmp_path / "local"))
    texts = [str(calibrate.TEXTS_DIR / "prose.txt")]
    assert cli.main(["calibrate", "--model", str(tiny_dir), "--no-measure", "--texts", *texts]) == 0
    first = json.loads(capsys.readouterr().out.splitlines()[0])["calibration"]
    assert cli.main(["calibrate", "--model", str(tiny_dir), "--no-measure", "--texts", *texts, "--retune", first]) == 0
    again = calibration.read(json.loads(capsys.readouterr().out.splitlines()[0])["calibration"])
    before = calibration.read(first)
    assert again.basis == before.basis and again.rope_thetas == before.rope_thetas and again.name != before.name
    doc = json.loads((tmp_path / "local" / f"{again.name}.json").read_text())
    for kind in ("basis", "trellis"):
        a = doc["sensitivity"][kind]["allocation"]
        assert "rate_slopes" not in a and a["budget"]["multiplier"] > 0  # the allocation kept, its level tuned
    presets.for_model.cache_clear()
