"""Injected loss and delay, for experiments and tests.

Every model is seeded and decided from counters (seed, call number, link,
block), so a run is reproducible however the ranks are scheduled.  Losses
are decided by the receiving rank: a lost block is a record that never
arrives, so the receiver waits for it until the deadline, exactly as it
would for a packet lost on the wire.

A program runs under loss without changes through the environment::

    MPILOSSY_LOSS="bernoulli:0.1"                      # p
    MPILOSSY_LOSS="bernoulli:p=0.1,seed=3"
    MPILOSSY_LOSS="gilbert-elliott:p_good_to_bad=0.01,p_bad_to_good=0.25,loss_bad=1"
    MPILOSSY_LOSS="straggler:rank=1,delay=0.02,prob=0.05"
    MPILOSSY_LOSS="bernoulli:0.05+straggler:rank=0,delay=0.01,prob=0.1"
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Dict, Iterable, Union

__all__ = ["Bernoulli", "GilbertElliott", "Straggler", "LossModel", "parse"]


def _probability(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, not {type(value).__name__}")
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must lie in [0, 1], got {value!r}")
    return float(value)


def _seed(value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"seed must be an int, not {type(value).__name__}")
    return value & 0xFFFFFFFFFFFFFFFF


@dataclass(frozen=True)
class Bernoulli:
    """Each block is lost independently with probability `p`."""

    p: float
    seed: int = 0

    def __post_init__(self) -> None:
        _probability("p", self.p)
        _seed(self.seed)

    def _spec(self) -> Dict[str, Any]:
        return {"bernoulli": (float(self.p), _seed(self.seed))}


@dataclass(frozen=True)
class GilbertElliott:
    """Bursty loss (microbursts): each link is a two-state Markov chain that
    moves good->bad with `p_good_to_bad` and bad->good with `p_bad_to_good`
    per block, losing blocks with `loss_good` / `loss_bad` in each state.
    The mean burst lasts 1/p_bad_to_good blocks."""

    p_good_to_bad: float
    p_bad_to_good: float
    loss_bad: float = 1.0
    loss_good: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        for f in fields(self)[:4]:
            _probability(f.name, getattr(self, f.name))
        _seed(self.seed)

    @property
    def mean_loss(self) -> float:
        """Long-run fraction of blocks lost."""
        total = self.p_good_to_bad + self.p_bad_to_good
        bad = self.p_good_to_bad / total if total else 0.0
        return bad * self.loss_bad + (1.0 - bad) * self.loss_good

    def _spec(self) -> Dict[str, Any]:
        return {"gilbert": (float(self.p_good_to_bad), float(self.p_bad_to_good),
                            float(self.loss_good), float(self.loss_bad), _seed(self.seed))}


@dataclass(frozen=True)
class Straggler:
    """Rank `rank` sleeps `delay` seconds before a call, with probability `prob`."""

    rank: int
    delay: float
    prob: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int):
            raise TypeError(f"rank must be an int, not {type(self.rank).__name__}")
        if not isinstance(self.delay, (int, float)) or not math.isfinite(self.delay) or self.delay < 0:
            raise ValueError(f"delay must be a finite number of seconds >= 0, got {self.delay!r}")
        _probability("prob", self.prob)
        _seed(self.seed)

    def _spec(self) -> Dict[str, Any]:
        return {"straggler": (int(self.rank), float(self.delay), float(self.prob), _seed(self.seed))}


LossModel = Union[Bernoulli, GilbertElliott, Straggler]
_MODELS = {"bernoulli": Bernoulli, "gilbert-elliott": GilbertElliott, "ge": GilbertElliott,
           "straggler": Straggler}


def to_spec(models: Iterable[LossModel]) -> Dict[str, Any]:
    """The compiled core's description of a set of models (one of each kind)."""
    spec: Dict[str, Any] = {}
    for model in models:
        if not hasattr(model, "_spec"):
            raise TypeError(f"not a loss model: {model!r}")
        part = model._spec()
        if part.keys() & spec.keys():
            raise ValueError(f"more than one {type(model).__name__} model given")
        spec.update(part)
    return spec


def parse(text: str) -> list[LossModel]:
    """Models from MPILOSSY_LOSS syntax: 'kind:args[+kind:args...]', args
    positional ('bernoulli:0.1') or named ('straggler:rank=1,delay=0.02')."""
    models: list[LossModel] = []
    for part in filter(None, (p.strip() for p in text.split("+"))):
        kind, _, args = part.partition(":")
        cls = _MODELS.get(kind.strip().lower())
        if cls is None:
            raise ValueError(f"unknown loss model {kind!r} in {text!r}; "
                             f"known: {', '.join(sorted(_MODELS))}")
        names = [f.name for f in fields(cls)]
        positional, named = [], {}
        for item in filter(None, (a.strip() for a in args.split(","))):
            key, eq, value = item.partition("=")
            if eq:
                if key.strip() not in names:
                    raise ValueError(f"{kind}: unknown parameter {key.strip()!r}; known: {names}")
                named[key.strip()] = _number(value)
            else:
                positional.append(_number(item))
        models.append(cls(*positional, **named))
    return models


def _number(text: str) -> Union[int, float]:
    text = text.strip()
    try:
        return int(text)
    except ValueError:
        return float(text)
