"""calibrations: a sidecar's look for its models' calibrations in the store, when due.

A model's calibration (format/calibration.py) may be published into the store after the sidecar
started (the operator's calibration Job). :meth:`CalibrationLookup.look` is called at a buffer's
registration and at every plan; it looks at most every ``recheck_s`` per model (one listing), in
the background, and takes the store's calibration when its tag is longer than the longest local
one's: which calibration a model gets does not depend on which model was looked up first. Until
one is found, the presets that need it are neither stored nor chosen for that model.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from concurrent.futures import Executor

from kvfetcher.codec.basis import tag_of
from kvfetcher.errors import Reason
from kvfetcher.format import calibration
from kvfetcher.format.presets import for_model
from kvfetcher.metrics import Metrics
from kvfetcher.store import Store, StoreError

log = logging.getLogger("kvfetcher.calibrations")

#: how long a model waits for its next look (one listing of the store's calibrations)
RECHECK_S = 60.0
#: how many models' looks are remembered (a client names its model; KVFETCHER_MODEL pins one)
MAX_MODELS = 256
#: the longest a store waits for its model's look in flight (:meth:`CalibrationLookup.settled`)
SETTLE_S = 10.0


class CalibrationLookup:
    """The looks of one sidecar, under its object key (``format.mac.key_from``; None: artefacts are
    taken untagged; ``accepted``: a rotation's previous keys, whose tags are taken too). At most ``max_models`` models are remembered (the oldest look is forgotten)."""

    def __init__(self, store: Store, pool: Executor, metrics: Metrics, recheck_s: float = RECHECK_S,
                 key: bytes | None = None, max_models: int = MAX_MODELS, accepted: tuple[bytes, ...] = ()):
        self.store, self.pool, self.metrics, self.recheck_s = store, pool, metrics, recheck_s
        self.key, self.accepted, self.max_models = key, accepted, max_models
        self._looked: dict[str, float] = {}  # model -> when its calibration was last looked for (insertion order)
        self.finding: asyncio.Future | None = None  # the latest look
        self._finding: dict[str, asyncio.Future] = {}  # model -> its look in flight

    def look(self, model: str) -> None:
        """Run :meth:`find` in ``pool`` when it is due (not within ``recheck_s`` of the last look,
        whatever it found). Blocking only without an event loop."""
        last = self._looked.pop(model, None)
        if last is not None and time.monotonic() - last < self.recheck_s:
            self._looked[model] = last
            return
        self._looked[model] = time.monotonic()  # one look at a time
        while len(self._looked) > self.max_models:
            del self._looked[next(iter(self._looked))]
        try:
            self.finding = asyncio.get_running_loop().run_in_executor(self.pool, self.find, model)
        except RuntimeError:  # no event loop (a direct caller)
            self.find(model)
            return
        self._finding = {m: f for m, f in self._finding.items() if not f.done()}
        self._finding[model] = self.finding

    async def settled(self, model: str, timeout_s: float = SETTLE_S) -> None:
        """Once the look for ``model``'s calibration in flight, if any, is done (at most
        ``timeout_s``): a store issued right after a buffer's registration then writes the presets
        that calibration allows. Never raises."""
        f = self._finding.get(model)
        if f is None or f.done():
            return
        try:
            await asyncio.wait_for(asyncio.shield(f), timeout_s)
        except TimeoutError:
            log.info("calibration look for %s still running after %.0f s: storing without it", model, timeout_s)

    def find(self, model: str) -> None:
        """Make the store's calibration of ``model`` local when its tag is longer than the longest
        local one's (none: any). Never raises: store errors and refused artefacts are counted and
        logged, and the next look is due ``recheck_s`` later."""
        try:
            local = calibration.calibration_for(model)
            if local is not None and local.model == tag_of(model):  # no longer tag can match
                self._looked[model] = math.inf
            elif calibration.fetch(self.store, model, self.key, longer_than=len(local.model) if local else 0,
                                     accepted=self.accepted) is not None:
                for_model.cache_clear()
        except Exception as e:  # a look in the background: nothing may escape it unlogged
            self.metrics.errors.labels(getattr(e, "reason", Reason.INTERNAL)).inc()
            log.warning("calibration of %s not fetched from the store: %s", model, e)
