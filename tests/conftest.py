"""Shared fixtures: the real model, loaded once per test session."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # kvtest helpers


@pytest.fixture(scope="session")
def lm():
    from kvfetcher import model

    return model.load()
