"""The settings table: parsing, the sidecar's and the client's settings from the environment the
operator injects, the generated docs, and an import that needs no torch."""

import re
import subprocess
import sys

import pytest

from kvfetcher import config
from kvfetcher.api.client import KVClient
from kvfetcher.config import Config
from kvfetcher.format.presets import PRESETS
from kvfetcher.store import from_env
from kvfetcher.store.local import LocalStore
from kvfetcher.store.s3 import S3Store

from kvtest import REPO, free_port

OPERATOR_ENV = {
    "KVFETCHER_S3_ENDPOINT": "https://minio.pool-a.svc:9000",
    "KVFETCHER_S3_BUCKET": "kv",
    "KVFETCHER_S3_ACCESS_KEY": "ak",
    "KVFETCHER_S3_SECRET_KEY": "sk",
    "KVFETCHER_S3_REGION": "eu-west-1",
    "KVFETCHER_AUTH_TOKEN": "tok",
    "KVFETCHER_TENANT": "salt",
    "KVFETCHER_POOL": "pool-a",
    "KVFETCHER_PRESET": "q8",
    "KVFETCHER_ALLOWED_PRESETS": "raw,q8",
    "KVFETCHER_CHUNK_TOKENS": "512",
}


def test_sidecar_config_from_the_operators_env():
    c = Config.from_env(OPERATOR_ENV)
    assert (c.chunk_tokens, c.presets, c.allowed_presets, c.tenant) == (512, ("q8",), ("raw", "q8"), "salt")
    assert Config.from_env({"KVFETCHER_POOL": "pool-a"}).tenant == "pool-a"  # no salt: the pool separates
    assert Config.from_env({"KVFETCHER_DECODE_PROCS": "3"}).decode_procs == 3
    assert Config.from_env({"KVFETCHER_TTFT_BUDGET_S": "1.5"}).ttft_budget_s == 1.5
    assert Config.from_env({}).ttft_budget_s is None
    assert Config.from_env({}).warm_up and not Config.from_env({"KVFETCHER_WARM_UP": "0"}).warm_up


@pytest.mark.parametrize("env", [{"KVFETCHER_CHUNK_TOKENS": "0"}, {"KVFETCHER_DECODE_PROCS": "-1"},
                                 {"KVFETCHER_TTFT_BUDGET_S": "0"}, {"KVFETCHER_PRESET": ","}, {"KVFETCHER_FETCH_WINDOW": "0"},
                                 {"KVFETCHER_FETCH_READS": "0"}, {"KVFETCHER_DECODE_THREADS": "0"}, {"KVFETCHER_WRITE_THREADS": "0"},
                                 {"KVFETCHER_READ_PROCS": "-1"}])
def test_bad_config_is_refused_at_start(env):
    with pytest.raises(ValueError):
        Config.from_env(env)


@pytest.mark.parametrize("env", [{"KVFETCHER_PRESET": "q3000"}, {"KVFETCHER_ALLOWED_PRESETS": "raw,nope"}])
def test_unknown_presets_are_refused_by_validation_against_the_known_ones(env):
    c = Config.from_env(env)  # the table knows no presets
    with pytest.raises(ValueError, match="unknown preset"):
        c.validate(PRESETS)


@pytest.mark.parametrize("name, text, expected", [
    ("KVFETCHER_CHUNK_TOKENS", "abc", "KVFETCHER_CHUNK_TOKENS: expected an integer, got 'abc'"),
    ("KVFETCHER_TTFT_BUDGET_S", "1,5", "KVFETCHER_TTFT_BUDGET_S: expected a number, got '1,5'"),
    ("KVFETCHER_WARM_UP", "maybe", "KVFETCHER_WARM_UP: expected a flag"),
])
def test_a_malformed_variable_is_named_with_what_was_expected(name, text, expected):
    with pytest.raises(ValueError) as e:
        Config.from_env({name: text})
    assert str(e.value).startswith(expected)


def test_unset_or_empty_takes_the_default():
    assert config.S3_BUCKET.read({}) == config.S3_BUCKET.read({"KVFETCHER_S3_BUCKET": ""}) == "kvfetcher"
    assert config.PRESET.read({"KVFETCHER_PRESET": "auto"}) == config.PRESET.read({}) == ("q8",)
    assert config.PRESET.read({"KVFETCHER_PRESET": " q8, raw ,"}) == ("q8", "raw")
    assert [config.WARM_UP.read({"KVFETCHER_WARM_UP": w}) for w in ("0", "off", "False", "1", "yes")] == [False] * 3 + [True] * 2


def test_config_fields_default_to_their_settings():
    assert Config() == Config.from_env({})
    assert Config().chunk_tokens == config.CHUNK_TOKENS.default


def test_the_table_imports_no_torch():
    """The operator's image has no torch: the table, and the operator's modules using it, import without it."""
    code = ("import sys, kvfetcher.config, kvfetcher_operator.injection, kvfetcher_operator.config; "
            "print(sorted({'torch', 'numpy', 'av'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_configuration_docs_are_the_tables_rendering():
    committed = REPO / "docs" / "configuration.md"
    assert committed.read_text() == config.render(), "regenerate: python -m kvfetcher.config > docs/configuration.md"
    assert all(f"`{s.name}`" in committed.read_text() for table in config.TABLES.values() for s in table)


def test_every_setting_is_declared_once():
    settings = [s for s in vars(config).values() if isinstance(s, config.Setting)]
    assert len({s.name for s in settings}) == len(settings)
    assert {s.name for table in config.TABLES.values() for s in table} == {s.name for s in settings}


def test_store_from_env(tmp_path):
    s = from_env(OPERATOR_ENV)
    assert isinstance(s, S3Store) and s.endpoint == "https://minio.pool-a.svc:9000/kv"
    assert from_env(dict(OPERATOR_ENV, KVFETCHER_S3_INSECURE="true")).client is not None
    local = from_env({"KVFETCHER_STORE_DIR": str(tmp_path / "d")})
    assert isinstance(local, LocalStore) and (tmp_path / "d").is_dir()


def test_client_from_env():
    c = KVClient.from_env({"KVFETCHER_SOCKET": "/run/kvfetcher/kvfetcher.sock"})
    assert c.token == ""
    c = KVClient.from_env({"KVFETCHER_URL": f"http://127.0.0.1:{free_port()}", "KVFETCHER_AUTH_TOKEN": "t"})
    assert c.token == "t"
    with pytest.raises(OSError):  # nothing listens there: a clear connection error
        c.hit_tokens("b", [1])


def test_every_variable_the_code_and_chart_name_is_declared():
    """No KVFETCHER_* variable is read, injected or set outside the table (a typo, or one nothing reads)."""
    files = [p for d in ("sidecar", "operator", "charts") for p in (REPO / d).rglob("*") if p.suffix in (".py", ".yaml", ".tpl")]
    named = {m for p in files + sorted(REPO.glob("Dockerfile.*")) for m in re.findall(r"KVFETCHER_[A-Z0-9_]*[A-Z0-9]\b", p.read_text())}
    declared = {s.name for table in config.TABLES.values() for s in table}
    assert named and named <= declared, sorted(named - declared)


def test_only_the_table_names_a_variable_in_code():
    """Modules read settings through the table: none but config.py spells a variable as a string."""
    table = REPO / "sidecar" / "kvfetcher" / "config.py"
    spelled = [p.name for d in ("sidecar", "operator") for p in (REPO / d).rglob("*.py")
               if p != table and re.search(r"[\"']KVFETCHER_", p.read_text())]
    assert spelled == []


@pytest.mark.parametrize("cfg", [Config(presets=("nope",)), Config(presets=("lean",), rope_theta=None)])
def test_a_sidecar_refuses_presets_it_cannot_store(tmp_path, cfg):
    from kvfetcher.service import Sidecar

    with pytest.raises(ValueError):
        Sidecar(LocalStore(str(tmp_path)), cfg)


def test_the_preset_names_the_operator_checks_are_the_data_planes_presets():
    """The operator checks a pool's presets against config.PRESET_NAMES (it cannot import the codecs):
    they are the data plane's presets, and PRE_ROPE_PRESETS those that need the model's RoPE base."""
    assert set(PRESETS) <= set(config.PRESET_NAMES)
    assert {n for n, p in PRESETS.items() if p.pre_rope} == set(config.PRE_ROPE_PRESETS) & set(PRESETS)
    assert set(config.PRE_ROPE_PRESETS) <= set(config.PRESET_NAMES)
    # Until the GPU-entropy back end lands, only its presets may be named ahead of the data plane.
    assert set(config.PRESET_NAMES) - set(PRESETS) <= {f"{layout}-{fmt}" for layout in ("q8", "balanced", "compact")
                                                       for fmt in ("ans", "zstd")}


def test_the_memory_limit_is_read_from_cgroup_v2_or_v1_and_none_when_unlimited(tmp_path):
    from kvfetcher.config import memory_limit

    v2, v1 = tmp_path / "memory.max", tmp_path / "memory.limit_in_bytes"
    assert memory_limit((str(v2), str(v1))) is None  # neither file
    v1.write_text("8589934592\n")
    assert memory_limit((str(v2), str(v1))) == 8 << 30
    v2.write_text("max\n")  # v2 unlimited wins over what v1 says
    assert memory_limit((str(v2), str(v1))) is None
    v2.write_text("4294967296\n")
    assert memory_limit((str(v2), str(v1))) == 4 << 30
    v1.write_text("9223372036854771712\n")  # v1's "no limit"
    assert memory_limit((str(v1),)) is None
