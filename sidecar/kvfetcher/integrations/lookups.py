"""lookups: a serving engine's scheduler asks the sidecar without ever waiting on it for long.

:class:`Lookups` runs each request's lookup in its own thread pool. :meth:`Lookups.answer` is what
the scheduler calls, as often as it likes, from its own thread: it waits at most ``wait_s`` for the
answer, then says "not yet" (:data:`NOT_YET`: vLLM's connector answers ``None``, and the
scheduler asks again at its next step while the request waits); once ``timeout_s`` passed since the
first ask it gives up with the ``fallback`` answer (recompute). It keeps how long recent answers
took (:meth:`Lookups.typical_s`), so a caller can wait as long as an answer usually needs, and how
many asks it put off (``deferred``). Free of any engine's imports.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

NOT_YET = object()  # the answer is still on its way: ask again later
LEARNT = 32  # the recent answers whose times :meth:`Lookups.typical_s` reads


class Lookups:
    def __init__(self, wait_s: float, timeout_s: float, threads: int = 1):
        self.wait_s, self.timeout_s = wait_s, timeout_s
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="kvfetcher-lookup")
        self.asking: dict[Hashable, tuple[float, Future]] = {}  # in flight: when first asked, the answer to come
        self.took: deque[float] = deque(maxlen=LEARNT)  # seconds from the first ask to the answer, the latest last
        self.answered = 0  # lookups done (or failed)
        self.deferred = 0  # asks answered NOT_YET

    def answer(self, key: Hashable, ask: Callable[[], Any], fallback: Callable[[], Any], timeout_s: float | None = None,
               wait_s: float | None = None) -> Any:
        """``ask()``'s result for ``key`` (started in the pool at the first call) if it comes within
        ``wait_s``, else :data:`NOT_YET`, or, past ``timeout_s`` (or when ``ask`` raised), ``fallback()``;
        both default to the instance's. A key is forgotten once answered."""
        asked = self.asking.get(key)
        if asked is None:
            asked = self.asking[key] = (t0 := time.monotonic(), self.pool.submit(ask))
            asked[1].add_done_callback(lambda _, t0=t0: self._answered(time.monotonic() - t0))
        try:
            result = asked[1].result(timeout=self.wait_s if wait_s is None else wait_s)
        except FutureTimeout:
            if time.monotonic() - asked[0] < (self.timeout_s if timeout_s is None else timeout_s):
                self.deferred += 1
                return NOT_YET
            result = fallback()
        except Exception:  # noqa: BLE001 — a failed lookup is a recompute, never a failed request
            result = fallback()
        del self.asking[key]
        return result

    def _answered(self, seconds: float) -> None:
        self.took.append(seconds)
        self.answered += 1

    def typical_s(self) -> float:
        """The time most recent answers took from their first ask (the 90th percentile of the last
        :data:`LEARNT`); 0 before any."""
        took = sorted(self.took)
        return took[min(len(took) - 1, int(0.9 * len(took)))] if took else 0.0

    def forget(self, key: Hashable) -> None:
        """``key``'s request went away while its lookup was in flight."""
        self.asking.pop(key, None)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
