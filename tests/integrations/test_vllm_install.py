"""The connector installs as documented: `pip install '<checkout>[vllm]'` into a vLLM image brings
everything its import chain needs (zstandard among them, which a `--no-deps` install would
miss). Building a fresh venv with vLLM is too slow for CI; instead the connector is imported
in a subprocess where only the standard library and the distributions `kvfetcher[vllm]` requires
(transitively, as installed here) may be imported, vLLM itself stood in for by empty modules."""

from __future__ import annotations

import importlib.metadata as md
import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from vllm_stub import run_without_vllm

REPO = Path(__file__).resolve().parents[2]
CONNECTOR = "kvfetcher.integrations.vllm"

def _name(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def required_distributions(extra: str) -> set[str]:
    """The distributions `kvfetcher[extra]` brings, transitively, as installed here (vLLM's own
    requirements are not: it is not installed here, and stood in for)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    todo = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"][extra]]
    seen: set[str] = set()
    while todo:
        req = todo.pop()
        name = _name(req.name)
        if name in seen or (req.marker and not req.marker.evaluate({"extra": ""})):
            continue
        seen.add(name)
        try:
            more = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        todo += [Requirement(r) for r in more]
    return seen


def import_names(distributions: set[str]) -> set[str]:
    return {top for top, dists in md.packages_distributions().items() if any(_name(d) in distributions for d in dists)}


def test_the_connector_imports_with_only_what_its_extra_requires():
    allowed = import_names(required_distributions("vllm"))
    run = run_without_vllm(f"import {CONNECTOR}", allowed)
    assert run.returncode == 0, run.stderr[-3000:]


def test_the_gate_refuses_what_the_extra_does_not_require():
    """The check itself bites: without zstandard among the allowed, the connector does not import."""
    allowed = import_names(required_distributions("vllm")) - {"zstandard"}
    run = run_without_vllm(f"import {CONNECTOR}", allowed)
    assert run.returncode != 0 and "zstandard" in run.stderr


def test_the_documented_image_recipe_installs_the_extra():
    """Every recipe the docs give installs `[vllm]`, with its dependencies."""
    for path in (REPO / "docs" / "operations.md", REPO / "examples" / "model-deployment.yaml"):
        recipes = [line for line in path.read_text().splitlines() if "pip install" in line and "kvfetcher" in line
                   or "COPY . /src" in line]
        assert recipes, path
        for line in recipes:
            assert "[vllm]" in line and "--no-deps" not in line, (path, line)
