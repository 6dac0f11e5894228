"""The ``MPILOSSY_*`` environment and logging: how each variable's text
becomes a value (the converters below; each setting's bounds are checked
by its own check in call/config.py, where every variable is declared with
its setting), the record of where each value came from (`Settings`, for
``python -m mpilossy info`` and for the warning below), and the log.

Two variables change results, not only speed: ``MPILOSSY_LOSS`` injects
loss and ``MPILOSSY_TIMEOUT`` sets a deadline.  A communicator that takes
either from the environment (no argument given) says so once per process,
on rank 0, as a RuntimeWarning: an inherited variable must not inject loss
into a production run without a word.

Logging goes to the standard ``logging`` module, logger ``"mpilossy"``,
silent by default; ``MPILOSSY_LOG=info`` or ``debug`` prints it on stderr
with the rank in front.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Mapping, Optional, Tuple, Union

from ..loss import parse as parse_loss

log = logging.getLogger("mpilossy")
log.addHandler(logging.NullHandler())


# -- converters: a variable's text to a Python value (bounds: the setting's check)
def to_timeout(text: str) -> Union[None, str, float]:
    """'none' or 'inf': no deadline; 'auto'; else seconds."""
    text = text.strip().lower()
    if text in ("none", "inf"):
        return None
    if text == "auto":
        return "auto"
    return float(text)


def to_loss(text: str) -> str:
    """A loss model's text, kept as text (checked by parsing it)."""
    parse_loss(text)            # raises with the model's own message
    return text


def to_switch(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError


def to_lower(text: str) -> str:
    return text.strip().lower()


def as_text(text: str) -> str:
    return text


_RATE_UNITS = {"": 1, "bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
               "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_rate(text: str) -> float:
    """A rate in bits per second: '1gbit', '800mbit', '10g', '2.5e9'; 'none'
    or '0' is 0 (unpaced).  Raises ValueError."""
    value = text.strip().lower()
    if value in ("none", "0", ""):
        return 0.0
    number = value.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = value[len(number):]
    if unit not in _RATE_UNITS:
        raise ValueError(f"unknown unit {unit!r}")
    rate = float(number) * _RATE_UNITS[unit]
    if not math.isfinite(rate) or rate < 0:
        raise ValueError
    return rate


@dataclass(frozen=True)
class Variable:
    """One environment variable: its setting's name and default, how its
    text becomes a value (`convert`, then the setting's `check`), what it
    accepts and what it does.  call/config.py makes one from each setting
    that the environment may set."""

    env: str
    name: str
    default: Any
    convert: Callable[[str], Any]
    check: Callable[[str, Any], Any]
    accepts: str
    meaning: str

    def parse(self, text: str) -> Any:
        """The value of `text`; ValueError (or TypeError) where it is bad."""
        return self.check(self.name, self.convert(text))


@dataclass(frozen=True)
class Settings:
    """Parsed settings; `source(name)` says where each came from."""

    values: Mapping[str, Any]
    sources: Mapping[str, str] = field(default_factory=dict)
    variables: Tuple[Variable, ...] = ()

    def __getattr__(self, name: str) -> Any:
        try:
            return self.values[name]
        except KeyError:
            raise AttributeError(name) from None

    def source(self, name: str) -> str:
        return self.sources[name]

    def variable(self, name: str) -> Variable:
        return next(v for v in self.variables if v.name == name)

    def rows(self) -> Tuple[Tuple[str, Any, str], ...]:
        """(variable, value, source) of every setting, for reports."""
        return tuple((v.env, self.values[v.name], self.sources[v.name]) for v in self.variables)


def read(variables: Tuple[Variable, ...], environ: Optional[Mapping[str, str]] = None) -> Settings:
    """Parse `variables` from `environ` (default os.environ); a bad value
    raises a ValueError that names the variable and says what it accepts.
    Empty counts as unset."""
    environ = os.environ if environ is None else environ
    values: Dict[str, Any] = {}
    sources: Dict[str, str] = {}
    for v in variables:
        text = environ.get(v.env, "")
        if not text.strip():
            values[v.name], sources[v.name] = v.default, "default"
            continue
        try:
            values[v.name] = v.parse(text)
        except (TypeError, ValueError):
            raise ValueError(f"{v.env}={text!r} is not valid: expected {v.accepts}") from None
        sources[v.name] = "environment"
    return Settings(values, sources, variables)


_warned: set = set()


def warn_from_environment(settings: Settings, rank: int, names: Tuple[str, ...]) -> None:
    """Once per process and setting, on rank 0: say that a setting that
    changes results came from the environment."""
    for name in names:
        if settings.source(name) != "environment" or name in _warned:
            continue
        _warned.add(name)
        if rank == 0:
            import warnings
            var = settings.variable(name)
            warnings.warn(f"mpilossy: {var.env}={os.environ.get(var.env, '')!r} is in effect "
                          f"({var.meaning}); pass {name}= to Communicator to choose "
                          f"explicitly", RuntimeWarning, stacklevel=3)


def configure_logging(settings: Settings, rank: int) -> None:
    """MPILOSSY_LOG: log on stderr with the rank in front (once)."""
    if settings.log is None or getattr(configure_logging, "done", False):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"[mpilossy rank {rank}] %(levelname)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(settings.log.upper())
    configure_logging.done = True  # type: ignore[attr-defined]
