"""calibrations: a sidecar's look for its models' calibrations in the store, when due.

A model's calibration (format/calibration.py) may be published into the store after the sidecar
started (the operator's calibration Job). :meth:`CalibrationLookup.look` is called at a buffer's
registration and at every plan; it looks once per model and process once found, else again every
``recheck_s`` (one listing), in the background. Until one is found, the presets that need it are
neither stored nor chosen for that model.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from concurrent.futures import Executor

from kvfetcher.errors import Reason
from kvfetcher.format import calibration
from kvfetcher.format.presets import for_model
from kvfetcher.metrics import Metrics
from kvfetcher.store import Store, StoreError

log = logging.getLogger("kvfetcher.calibrations")

#: how long a model whose calibration the store lacked waits for the next look (one listing of it)
RECHECK_S = 60.0


class CalibrationLookup:
    def __init__(self, store: Store, pool: Executor, metrics: Metrics, recheck_s: float = RECHECK_S):
        self.store, self.pool, self.metrics, self.recheck_s = store, pool, metrics, recheck_s
        self._looked: dict[str, float] = {}  # model -> when its calibration was last looked for; inf: found
        self.finding: asyncio.Future | None = None  # the latest look

    def look(self, model: str) -> None:
        """Run :meth:`find` in ``pool`` when it is due. Blocking only without an event loop."""
        last = self._looked.get(model)
        if last is not None and time.monotonic() - last < self.recheck_s:
            return
        self._looked[model] = time.monotonic()  # one look at a time
        try:
            self.finding = asyncio.get_running_loop().run_in_executor(self.pool, self.find, model)
        except RuntimeError:  # no event loop (a direct caller)
            self.find(model)

    def find(self, model: str) -> None:
        """Make the calibration of ``model`` local (the store's ``_meta/calibration/``) when no local
        place has one. Store errors are counted and logged; the next registration or plan looks again."""
        if calibration.calibration_for(model) is not None:
            self._looked[model] = math.inf
            return
        try:
            if calibration.fetch(self.store, model) is not None:
                for_model.cache_clear()
                self._looked[model] = math.inf
        except (StoreError, ValueError, OSError) as e:
            self._looked.pop(model, None)
            self.metrics.errors.labels(getattr(e, "reason", Reason.INTERNAL)).inc()
            log.warning("calibration of %s not fetched from the store: %s", model, e)
