"""Names from a KVCachePool spec cannot reach another namespace.

A Secret or claim name such as ``../../victim/secrets/prod-db`` used to be joined into the API path
unchecked: the operator read the victim's Secret and sent it to the pool's endpoint as an access key.
Now the CRD and the operator refuse every name that is not an object name (ConfigValid=False says
why), and the REST client builds paths so that no name can change them."""
from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import kopf
import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))
from crd_check import validate  # noqa: E402

from kvfetcher_operator import conditions, handlers, kube  # noqa: E402
from kvfetcher_operator import spec as specs  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
ESCAPES = ["../../victim/secrets/prod-db", "..", "a/b", "prod-db/..", "Creds", "creds?x=1", "creds#", "a%2Fb",
           "creds\n", " creds", "x" * 254, "-creds", "creds.", "a..b", ""]
EXTERNAL = {"storage": {"external": {"endpoint": "https://s3.example.com", "bucket": "kv-cache",
                                     "credentialsSecretRef": {"name": "creds"},
                                     "tls": {"caSecretRef": {"name": "ca"}}}},
            "tenancy": {"saltFrom": "Secret", "secretRef": {"name": "salt"}},
            "model": {"name": "org/m", "calibration": {"source": {"persistentVolumeClaim": {"claimName": "weights",
                                                                                             "path": "m"}}}}}
# each place a spec names an object or a Secret key, as (path, field)
NAMES = [("storage.external.credentialsSecretRef", "name"), ("storage.external.tls.caSecretRef", "name"),
         ("tenancy.secretRef", "name"), ("model.calibration.source.persistentVolumeClaim", "claimName")]
KEYS = [("storage.external.credentialsSecretRef", "accessKeyKey"), ("storage.external.credentialsSecretRef", "secretKeyKey"),
        ("storage.external.tls.caSecretRef", "key"), ("tenancy.secretRef", "key")]


@pytest.fixture(scope="module")
def pool_schema() -> dict[str, Any]:
    crd = yaml.safe_load((REPO / "crds" / "kvcachepools.kvfetcher.io.yaml").read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def with_value(path: str, field: str, value: Any) -> dict[str, Any]:
    spec = copy.deepcopy(EXTERNAL)
    node = spec
    for part in path.split("."):
        node = node[part]
    node[field] = value
    return spec


def pool(spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "kvfetcher.io/v1alpha1", "kind": "KVCachePool",
            "metadata": {"name": "p", "namespace": "attacker"}, "spec": spec}


def test_the_valid_spec_is_valid(pool_schema):
    assert validate(pool_schema, pool(EXTERNAL)) == [] and specs.problems(EXTERNAL) == []


@pytest.mark.parametrize("path,field", NAMES)
def test_a_name_that_is_not_an_object_name_is_refused_by_the_crd_and_the_operator(path, field, pool_schema):
    for bad in ESCAPES:
        spec = with_value(path, field, bad)
        # (the API server's RE2 `$` refuses a trailing newline; the test's Python `re` does not)
        assert validate(pool_schema, pool(spec)) or bad.endswith("\n"), f"the CRD accepted {path}.{field}={bad!r}"
        assert any(f"{path}.{field}" in p or (not bad and "required" in p) for p in specs.problems(spec)), (bad, specs.problems(spec))
    for good in ("creds", "prod-db.v2", "1st"):
        assert specs.problems(with_value(path, field, good)) == [] == validate(pool_schema, pool(with_value(path, field, good)))


@pytest.mark.parametrize("path,field", KEYS)
def test_a_secret_key_that_is_not_one_is_refused(path, field, pool_schema):
    """A key becomes a file name (the CA under its mount), so neither `..` nor `/`."""
    for bad in ("..", ".", "../ca", "a/b", "", "ca crt"):
        spec = with_value(path, field, bad)
        assert validate(pool_schema, pool(spec)) and any(f"{path}.{field}" in p for p in specs.problems(spec)), bad
    assert specs.problems(with_value(path, field, "ca.crt")) == []


def test_the_crd_in_the_chart_is_the_same():
    assert (REPO / "charts" / "kvfetcher" / "crds" / "kvcachepools.kvfetcher.io.yaml").read_bytes() == \
        (REPO / "crds" / "kvcachepools.kvfetcher.io.yaml").read_bytes()


def test_no_name_changes_an_api_path():
    for bad in ESCAPES:
        with pytest.raises(ValueError, match="not a Kubernetes object name"):
            kube.Kube.path("v1", "secrets", "attacker", bad)
        with pytest.raises(ValueError):
            kube.Kube.path("v1", "secrets", bad or "..", "creds")  # (no namespace: cluster scope)
    assert kube.Kube.path("v1", "secrets", "attacker", "prod-db.v2") == "/api/v1/namespaces/attacker/secrets/prod-db.v2"


def test_the_reconciler_reports_a_bad_name_and_reads_no_secret(monkeypatch):
    """ConfigValid=False says which field, and no API call is made for the pool."""
    calls = []

    class Spy:
        def __getattr__(self, name):
            calls.append(name)
            raise AssertionError(f"the operator called the API ({name}) for an invalid pool")

    monkeypatch.setattr(handlers, "_announce", lambda *a: None)
    spec = with_value("storage.external.credentialsSecretRef", "name", "../../victim/secrets/prod-db")
    body = kopf.Body({"apiVersion": "kvfetcher.io/v1alpha1", "kind": "KVCachePool",
                      "metadata": {"name": "p", "namespace": "attacker", "uid": "u", "generation": 2},
                      "spec": spec, "status": {}})
    patch = kopf.Patch()
    handlers.reconcile(body, patch, kopf.Memo(kube=Spy()), {}, retry_until_ready=True)
    valid = conditions.find(patch["status"]["conditions"], conditions.CONFIG_VALID)
    assert valid["status"] == "False" and "credentialsSecretRef.name" in valid["message"] and not calls
