"""lookups: a serving engine's scheduler asks the sidecar without ever waiting on it for long.

:class:`Lookups` runs each request's lookup in its own thread pool. :meth:`Lookups.answer` is what
the scheduler calls, as often as it likes, from its own thread: it waits at most ``wait_s`` for the
answer, then says "not yet" (:data:`NOT_YET`: vLLM's connector answers ``None``, and the
scheduler asks again at its next step while the request waits); once ``timeout_s`` passed since the
first ask it gives up with the ``fallback`` answer (recompute). Free of any engine's imports.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

NOT_YET = object()  # the answer is still on its way: ask again later


class Lookups:
    def __init__(self, wait_s: float, timeout_s: float, threads: int = 1):
        self.wait_s, self.timeout_s = wait_s, timeout_s
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="kvfetcher-lookup")
        self.asking: dict[Hashable, tuple[float, Future]] = {}  # in flight: when first asked, the answer to come

    def answer(self, key: Hashable, ask: Callable[[], Any], fallback: Callable[[], Any], timeout_s: float | None = None,
               wait_s: float | None = None) -> Any:
        """``ask()``'s result for ``key`` (started in the pool at the first call) if it comes within
        ``wait_s``, else :data:`NOT_YET`, or, past ``timeout_s`` (or when ``ask`` raised), ``fallback()``;
        both default to the instance's. A key is forgotten once answered."""
        asked = self.asking.get(key)
        if asked is None:
            asked = self.asking[key] = (time.monotonic(), self.pool.submit(ask))
        try:
            result = asked[1].result(timeout=self.wait_s if wait_s is None else wait_s)
        except FutureTimeout:
            if time.monotonic() - asked[0] < (self.timeout_s if timeout_s is None else timeout_s):
                return NOT_YET
            result = fallback()
        except Exception:  # noqa: BLE001 — a failed lookup is a recompute, never a failed request
            result = fallback()
        del self.asking[key]
        return result

    def forget(self, key: Hashable) -> None:
        """``key``'s request went away while its lookup was in flight."""
        self.asking.pop(key, None)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
