"""The sdist patch that lets LMCache build without setuptools_scm on the GPU machine."""

import tomllib

import pytest

from benchmarks.vllm_ttft.lmcache_version import pinned

PYPROJECT = """[build-system]
requires = ["setuptools>=77.0.3,<81", "setuptools_scm>=8"]

[project]
name = "lmcache"
dynamic = ["dependencies", "optional-dependencies", "version"]

[tool.setuptools_scm]
version_file = "lmcache/_version.py"
"""


def test_the_version_is_pinned_and_setuptools_scm_left_out():
    d = tomllib.loads(pinned(PYPROJECT, "0.5.6"))
    assert d["project"]["version"] == "0.5.6"
    assert d["project"]["dynamic"] == ["dependencies", "optional-dependencies"]
    assert "setuptools_scm" not in d.get("tool", {})


def test_a_pyproject_without_a_dynamic_version_is_refused():
    with pytest.raises(ValueError):
        pinned(PYPROJECT.replace(', "version"', ""), "0.5.6")
