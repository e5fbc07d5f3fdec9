"""prefill: the engine's prefill time, as a function of the tokens it has and the tokens it computes.

``seconds(cached, new) = c0 + c1 * new + c2 * new * (cached + new / 2)``: a fixed cost of the
request's prefill step, a cost per computed token (the matmuls) and attention, whose cost per new
token grows with the context it attends over (the ``cached`` tokens and, on average, half the new
ones). ``c0`` is paid whatever was loaded, since the engine always computes at least the prompt's
last token; so comparing two splits of one prefix ``T`` is exact under the model: recomputing
tokens ``n .. T`` costs ``c1 (T - n) + c2 (T² - n²) / 2`` beyond ``c0``.

:class:`PrefillFit` learns the coefficients from timed engine steps. A step that computes for
several requests at once is one observation, its terms summed over them (the fixed term once).
The fit is non-negative least squares over decayed sums; it has no model until it has seen a step
(the sidecar then takes a constant rate).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np


def _coef(text: str) -> float:
    return field(default=0.0, metadata={"doc": text, "min": 0})


@dataclass(frozen=True)
class PrefillModel:
    """Seconds to prefill `new` tokens after `cached` ones: `c0 + c1 * new + c2 * new * (cached + new / 2)`."""

    c0: float = _coef("seconds of the request's prefill step whatever it computes")
    c1: float = _coef("seconds per computed token")
    c2: float = _coef("seconds per computed token and token it attends over (attention)")

    def __post_init__(self):
        terms = (self.c0, self.c1, self.c2)
        if not all(math.isfinite(c) and c >= 0 for c in terms) or not any(terms):
            raise ValueError(f"a prefill model's coefficients are finite, non-negative and not all zero, not {terms}")

    @classmethod
    def linear(cls, tokens_per_s: float) -> PrefillModel:
        """A constant prefill rate."""
        return cls(c1=1.0 / tokens_per_s)

    def seconds(self, cached: int, new: int) -> float:
        return self.step(new, new * (cached + new / 2))

    def step(self, tokens: int, attention: float) -> float:
        """Seconds of an engine step computing ``tokens`` with the attention term ``attention`` (:func:`terms`)."""
        return self.c0 + self.c1 * tokens + self.c2 * attention


def terms(work: Iterable[tuple[int, int]]) -> tuple[int, float]:
    """The terms of one step that computes ``new`` tokens after ``cached`` for each ``(cached, new)``
    of ``work``: ``(sum of new, sum of new * (cached + new / 2))``."""
    tokens, attention = 0, 0.0
    for cached, new in work:
        tokens += new
        attention += new * (cached + new / 2)
    return tokens, attention


#: the subsets of terms a fit may have (0: fixed, 1: per token, 2: attention), the fewest first: the
#: per-token term is in every one (a fixed cost alone would make every fetch look useless)
_SUBSETS = ((1,), (0, 1), (1, 2), (0, 1, 2))
#: a term beside the per-token one is fitted only once its ratio to the tokens varies this much
#: across the steps (coefficient of variation): before, the two cannot be told apart
SPREAD = 0.25


class PrefillFit:
    """A :class:`PrefillModel` fitted to timed steps, each ``(tokens, attention, seconds)`` with the
    terms of :func:`terms`.

    Observations enter decayed sums (``decay``: the weight an observation loses per later one), so
    the latest few dozen steps dominate. :meth:`model` is the non-negative least-squares fit over
    them with the per-token term and those of the others that the steps tell apart from it
    (:data:`SPREAD`), of the fewest terms that explain them as well as more would: steps of one
    shape give a constant rate. None until a step was seen.
    """

    def __init__(self, decay: float = 0.02):
        self.keep = 1.0 - decay
        self._xx = np.zeros((3, 3))
        self._xy = np.zeros(3)
        self._yy = 0.0
        self._fitted: PrefillModel | None = None

    def observe(self, tokens: int, attention: float, seconds: float) -> None:
        if tokens <= 0 or not seconds > 0 or not math.isfinite(seconds):
            return
        x = np.array([1.0, tokens, attention])
        self._xx = self.keep * self._xx + np.outer(x, x)
        self._xy = self.keep * self._xy + x * seconds
        self._yy = self.keep * self._yy + seconds * seconds
        self._fitted = None

    def model(self) -> PrefillModel | None:
        if self._yy == 0.0:
            return None
        if self._fitted is None:
            self._fitted = self._solve()
        return self._fitted

    def _solve(self) -> PrefillModel:
        """Non-negative least squares on the normal equations, over the subsets of terms allowed:
        the best of those whose unconstrained solution is non-negative. Written here, not taken
        from scipy, because the observations live only as decayed sums."""
        scale = np.sqrt(np.diag(self._xx))  # columns differ by orders of magnitude
        xx, xy = self._xx / np.outer(scale, scale), self._xy / scale
        # xx[j, 1] is the cosine of term j and the tokens over the steps: 1 / sqrt(1 + CV² of their ratio)
        apart = {1} | {j for j in (0, 2) if xx[j, 1] <= 1 / math.sqrt(1 + SPREAD**2)}
        best, best_err = None, math.inf
        for s in _SUBSETS:
            if not apart.issuperset(s):
                continue
            idx = list(s)
            c = np.zeros(3)
            c[idx] = np.linalg.lstsq(xx[np.ix_(idx, idx)], xy[idx], rcond=None)[0]
            if (c < 0).any():
                continue
            err = self._yy - 2 * c @ xy + c @ xx @ c
            if err < best_err - 1e-9 * self._yy:  # a later, larger subset must explain more
                best, best_err = c / scale, err
        return PrefillModel(*map(float, best))


class WallScale:
    """How much longer an engine's prefills take by the wall clock than a :class:`PrefillModel`
    fitted to its GPU step times says: the engine's scheduling, input preparation, sampling and the
    steps of a chunked prefill, which a request's time to first token pays and the GPU's clock does
    not see. Learnt from whole prefills, ``actual / predicted`` as a ratio of decayed sums, bounded to
    0.5-4x; :meth:`apply` scales a model's every term by it (1 until a prefill was seen).
    :attr:`error` is how far the scaled model was off, ``|actual - scaled| / actual`` as a decayed mean
    of the prefills after the first (0 before): large while the fit is young or the engine's steps
    vary, a few percent once it has settled."""

    LOW, HIGH = 0.5, 4.0

    def __init__(self, decay: float = 0.1):
        self.keep = 1.0 - decay
        self._actual = self._predicted = 0.0
        self._err = self._n = 0.0

    def observe(self, predicted_s: float, actual_s: float) -> None:
        if predicted_s > 0 and actual_s > 0 and math.isfinite(actual_s):
            if self._predicted > 0:  # the first prefill sets the scale: it says nothing of the model's error
                self._err = self.keep * self._err + abs(actual_s - self.scale * predicted_s) / actual_s
                self._n = self.keep * self._n + 1.0
            self._actual = self.keep * self._actual + actual_s
            self._predicted = self.keep * self._predicted + predicted_s

    @property
    def error(self) -> float:
        return self._err / self._n if self._n else 0.0

    @property
    def scale(self) -> float:
        if self._predicted <= 0:
            return 1.0
        return min(self.HIGH, max(self.LOW, self._actual / self._predicted))

    def apply(self, model: PrefillModel | None) -> PrefillModel | None:
        s = self.scale
        return None if model is None else PrefillModel(model.c0 * s, model.c1 * s, model.c2 * s)


class LoadOverhead:
    """The seconds a load costs an engine beyond the fetch and the prefill after it: scheduling the
    request again once the load is done, a tail prefill slower over loaded KV than the model says.
    Learnt from loads, the time from the load's end to the end of the request's prefill less the
    prefill model's time for the engine's steps meanwhile (``actual - predicted``: the steps are
    shared with other requests), as a decayed mean, at least 0; ``prior_s`` until a load was timed.
    A plan adds :attr:`seconds` to every load option, so a load predicted to win by less than it
    costs is not taken."""

    def __init__(self, prior_s: float = 0.0, decay: float = 0.2):
        if not (math.isfinite(prior_s) and prior_s >= 0):
            raise ValueError(f"a load's prior overhead is non-negative seconds, not {prior_s!r}")
        self.keep = 1.0 - decay
        self.prior_s = prior_s
        self._sum = self._n = 0.0

    def observe(self, predicted_s: float, actual_s: float) -> None:
        if predicted_s > 0 and actual_s > 0 and math.isfinite(actual_s):
            self._sum = self.keep * self._sum + (actual_s - predicted_s)
            self._n = self.keep * self._n + 1.0

    @property
    def seconds(self) -> float:
        return self.prior_s if self._n == 0 else max(0.0, self._sum / self._n)
