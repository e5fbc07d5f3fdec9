"""Fixtures for the control-plane tests: real servers on loopback, nothing patched in.

- `s3`: the session's moto S3 server (tests/conftest.py: real HTTP, the S3 API the MinIO SDK uses), its endpoint.
- `kmock` (from the kmock plugin): a Kubernetes API emulator over real HTTP.
- `operator`: the kopf operator with this repo's handlers, run cluster-wide against kmock
  through a kubeconfig, its webhook on HTTPS with a certificate made here, its /metrics on
  a free port.
"""
from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

os.environ.setdefault("KVFETCHER_RESYNC_SECONDS", "2")  # read when the handlers are imported

import aiohttp
import kmock as kmocklib
import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from op_helpers import Api, declare_resources, run_operator

REPO = Path(__file__).resolve().parents[2]
CRD_PATH = REPO / "crds" / "kvcachepools.kvfetcher.io.yaml"


@pytest.fixture(scope="session")
def crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_PATH.read_text())


@pytest.fixture(scope="session")
def pool_schema(crd: dict[str, Any]) -> dict[str, Any]:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


@pytest.fixture(scope="session")
def s3(s3_endpoint: str) -> str:
    return s3_endpoint


@pytest.fixture(scope="session")
def tls(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A CA and a server certificate for 127.0.0.1/localhost, as a cluster's cert-manager would issue."""
    out = tmp_path_factory.mktemp("tls")
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvfetcher-test-ca")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvfetcher-webhook")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([
                x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    paths = {"ca": out / "ca.crt", "cert": out / "tls.crt", "key": out / "tls.key"}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths["key"].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
    return paths


@pytest.fixture()
async def api(kmock: kmocklib.KubernetesEmulator) -> AsyncIterator[Api]:
    declare_resources(kmock)
    async with aiohttp.ClientSession(base_url=str(kmock.url)) as session:
        yield Api(session, kmock)


@pytest.fixture()
async def operator(api: Api, request: pytest.FixtureRequest) -> AsyncIterator[dict[str, Any]]:
    async with run_operator(request) as running:
        yield running
