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


async def test_the_operators_calibration_job_publishes_to_s3_and_a_sidecar_then_finds_it(tiny_dir, s3_endpoint, s3, tmp_path,
                                                                                          monkeypatch, capsys):
    """The Job's own command line and environment (operator/calibration.py) run through the CLI, the
    model's volume being ``tiny_dir``'s parent, into an S3 bucket (moto) as the pool's store; a
    sidecar of a node without the calibration then fetches it and the model gets balanced."""
    from kvfetcher_operator import calibration as job_builder

    from kvtest import running

    pool = {"metadata": {"name": "p", "namespace": "ml", "uid": "u"}, "spec": {
        "storage": {"external": {"endpoint": s3_endpoint, "bucket": s3.bucket, "credentialsSecretRef": {"name": "c"}}},
        "model": {"name": "tiny-llama/float32", "calibration": {
            "source": {"persistentVolumeClaim": {"claimName": "models", "path": tiny_dir.name}}}}}}
    (container,) = job_builder.job(pool)["spec"]["template"]["spec"]["containers"]
    for e in container["env"]:  # the Secret's values as the kubelet would set them; the scratch volume here
        value = {"KVFETCHER_S3_ACCESS_KEY": "testing", "KVFETCHER_S3_SECRET_KEY": "testing"}.get(e["name"], e.get("value"))
        value = value if value is None or not value.startswith(job_builder.WORK_DIR) else value.replace(
            job_builder.WORK_DIR, str(tmp_path / "work"), 1)
        monkeypatch.setenv(e["name"], value) if value is not None else None
    args = [a.replace(job_builder.MODEL_DIR, str(tiny_dir.parent), 1) if a.startswith(job_builder.MODEL_DIR) else a
            for a in container["args"]]
    presets.for_model.cache_clear()
    texts = [str(calibrate.TEXTS_DIR / n) for n in ("prose.txt", "code.txt")]  # as above: a random model's budget search is long
    assert cli.main(args + ["--no-measure", "--texts", *texts]) == 0
    published = json.loads(capsys.readouterr().out.splitlines()[1])["published"]
    assert sorted(s3.list("_meta/calibration/tiny-llama--float32/")) == sorted(published)

    monkeypatch.setenv("KVFETCHER_CALIBRATION_DIR", str(tmp_path / "node"))  # a node that has none
    presets.for_model.cache_clear()
    assert presets.refusal("balanced", "tiny-llama/float32") is not None
    async with running(s3, decode_procs=0, device="cpu", warm_up=False) as sc:
        sc.calibrations.look("tiny-llama/float32")
        await sc.calibrations.finding
    assert presets.refusal("balanced", "tiny-llama/float32") is None
    presets.for_model.cache_clear()


def _calibrated_and_retuned(tiny_dir, tmp_path, monkeypatch, capsys, *retune_args: str) -> tuple[str, str]:
    """Paths of a first calibration of the tiny model and of its retune (``--retune`` plus ``retune_args``)."""
    monkeypatch.setenv("KVFETCHER_CALIBRATION_DIR", str(tmp_path / "local"))
    args = ["calibrate", "--model", str(tiny_dir), "--no-measure", "--texts", str(calibrate.TEXTS_DIR / "prose.txt")]
    assert cli.main(args) == 0
    first = json.loads(capsys.readouterr().out.splitlines()[0])["calibration"]
    assert cli.main([*args, "--retune", first, *retune_args]) == 0
    return first, json.loads(capsys.readouterr().out.splitlines()[0])["calibration"]


def test_retune_keeps_the_basis_and_allocation_and_tunes_the_budget(tiny_dir, tmp_path, monkeypatch, capsys):
    first, retuned = _calibrated_and_retuned(tiny_dir, tmp_path, monkeypatch, capsys)
    again, before = calibration.read(retuned), calibration.read(first)
    assert again.basis == before.basis and again.rope_thetas == before.rope_thetas and again.name != before.name
    doc = json.loads((tmp_path / "local" / f"{again.name}.json").read_text())
    for kind in ("basis", "trellis"):
        a = doc["sensitivity"][kind]["allocation"]
        assert "rate_slopes" not in a and a["budget"]["multiplier"] > 0  # the allocation kept, its level tuned
    presets.for_model.cache_clear()


def test_retune_of_compact_alone_keeps_balanced_and_holds_compact_to_its_gate(tiny_dir, tmp_path, monkeypatch, capsys):
    from kvfetcher.eval import accuracy

    first, again = _calibrated_and_retuned(tiny_dir, tmp_path, monkeypatch, capsys, "--presets", "compact")
    before, after = json.loads(Path(first).read_text()), json.loads(Path(again).read_text())
    assert after["sensitivity"]["trellis"] == before["sensitivity"]["trellis"]  # balanced untouched
    budget = after["sensitivity"]["basis"]["allocation"]["budget"]
    gate = accuracy.GATES["compact"]
    assert budget["target"]["kl"] == gate["kl"] and isinstance(budget["gate_bound"], bool)
    if budget["gate_bound"]:  # the size gave way: the steps kept are within the gate on the windows
        assert budget["kl"] <= gate["kl"] and budget["tf_top1"] >= gate["tf_top1"]
    presets.for_model.cache_clear()
