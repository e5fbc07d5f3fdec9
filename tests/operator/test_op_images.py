"""The images install pinned, hash-checked dependencies that satisfy pyproject.toml, and the
operator image gets the kopf these tests run (the floor in pyproject.toml is that version)."""
from __future__ import annotations

import re
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
IMAGES = {"operator": PROJECT["optional-dependencies"]["operator"],
          "sidecar": PROJECT["dependencies"] + PROJECT["optional-dependencies"]["gpu"]}


def locked(image: str) -> dict[str, tuple[Version, int]]:
    """Name -> (pinned version, number of hashes) of requirements/<image>.txt."""
    text = (REPO / "requirements" / f"{image}.txt").read_text()
    out = {}
    for block in re.split(r"\n(?=[A-Za-z0-9])", text):
        head = re.match(r"([A-Za-z0-9._-]+)==([^\s\\;]+)", block)
        if head:
            out[canonicalize_name(head[1])] = (Version(head[2]), len(re.findall(r"--hash=sha256:[0-9a-f]{64}", block)))
    return out


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_image_installs_only_hash_checked_pins(image: str) -> None:
    dockerfile = (REPO / f"Dockerfile.{image}").read_text()
    installs = [line for line in dockerfile.replace("\\\n", " ").splitlines() if "pip install" in line]
    commands = [c.strip() for line in installs for c in line.split("&&") if "pip install" in c]
    assert any(f"--require-hashes -r requirements/{image}.txt" in c for c in commands), commands
    for c in commands:  # anything else installs the project itself, from the pinned packages only
        assert "--require-hashes" in c or c.endswith("--no-deps --no-build-isolation ."), c
    pins = locked(image)
    assert pins and all(hashes for _, hashes in pins.values()), "a pin without its hash"
    for spec in IMAGES[image] + ["setuptools>=77"]:
        req = Requirement(spec)
        name = canonicalize_name(req.name)
        assert name in pins and pins[name][0] in req.specifier, f"{image}: {spec} not satisfied by the lock"
    assert "!requirements/*.txt" in (REPO / ".dockerignore").read_text()  # the lock reaches the build


def test_the_kopf_floor_is_the_kopf_under_test() -> None:
    """kopf 1.37's JSON patch removes an absent annotation (the API server then rejects the pod)."""
    (spec,) = [Requirement(r) for r in IMAGES["operator"] if Requirement(r).name == "kopf"]
    floor = Version(str(spec.specifier).removeprefix(">="))
    assert floor == Version(version("kopf")) == locked("operator")["kopf"][0]
