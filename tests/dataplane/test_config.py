"""The environment the operator injects maps onto the sidecar's and the client's settings."""

import pytest

from kvfetcher.api.client import KVClient
from kvfetcher.config import Config
from kvfetcher.store import from_env
from kvfetcher.store.local import LocalStore
from kvfetcher.store.s3 import S3Store

from dptest import closed_port

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


@pytest.mark.parametrize("env", [{"KVFETCHER_PRESET": "q3000"}, {"KVFETCHER_ALLOWED_PRESETS": "raw,nope"}, {"KVFETCHER_CHUNK_TOKENS": "0"},
                                 {"KVFETCHER_DECODE_PROCS": "-1"}, {"KVFETCHER_TTFT_BUDGET_S": "0"}])
def test_bad_config_is_refused_at_start(env):
    with pytest.raises(ValueError):
        Config.from_env(env)


def test_store_from_env(tmp_path):
    s = from_env(OPERATOR_ENV)
    assert isinstance(s, S3Store) and s.endpoint == "https://minio.pool-a.svc:9000/kv"
    assert from_env(dict(OPERATOR_ENV, KVFETCHER_S3_INSECURE="true")).client is not None
    local = from_env({"KVFETCHER_STORE_DIR": str(tmp_path / "d")})
    assert isinstance(local, LocalStore) and (tmp_path / "d").is_dir()


def test_client_from_env():
    c = KVClient.from_env({"KVFETCHER_SOCKET": "/run/kvfetcher/kvfetcher.sock"})
    assert c.token == ""
    c = KVClient.from_env({"KVFETCHER_URL": f"http://127.0.0.1:{closed_port()}", "KVFETCHER_AUTH_TOKEN": "t"})
    assert c.token == "t"
    with pytest.raises(OSError):  # nothing listens there: a clear connection error
        c.lookup("b", [1])
