"""Fixtures the fetch tests share."""

import pytest

from kvfetcher.fetch.workers import DecodeWorkers


@pytest.fixture(scope="module")
def workers():
    """Two started decode worker processes, for one test module."""
    w = DecodeWorkers(2)
    w.start()
    yield w
    w.close()
