"""Shared fixtures: the real model, loaded once per test session."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # kvtest helpers


@pytest.fixture(scope="session")
def lm():
    from kvfetcher.eval import model

    return model.load()


def pytest_sessionfinish(session, exitstatus):
    """Collect garbage before pytest prints its summary, so that any late finaliser message
    (e.g. an aiohttp "Unclosed client session" from a library) lands above the closing line
    that CI reads, not after it."""
    import gc

    gc.collect()
