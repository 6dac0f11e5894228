"""Every ``MPILOSSY_*`` environment variable, parsed in one place.

`from_environment()` reads them into a frozen `Settings`: a bad value raises
a ValueError that names the variable and what it accepts, and each setting
remembers where it came from ("environment" or "default") for
``python -m mpilossy info`` and for the warning below.

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


def _timeout(text: str) -> Union[None, str, float]:
    text = text.strip().lower()
    if text in ("none", "inf"):
        return None
    if text == "auto":
        return "auto"
    value = float(text)
    if not math.isfinite(value) or value <= 0:
        raise ValueError
    return value


def _loss_spec(text: str) -> str:
    parse_loss(text)            # raises with the model's own message
    return text


def _int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise ValueError
        return value
    return parse


def _seconds(allow_negative: bool = False) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = float(text)
        if not math.isfinite(value) or (value < 0 and not allow_negative):
            raise ValueError
        return value
    return parse


def _switch(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError


def _log_level(text: str) -> str:
    value = text.strip().lower()
    if value not in ("warning", "info", "debug"):
        raise ValueError
    return value


def _text(text: str) -> str:
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
    """One environment variable: its setting's name, default, parser, what it
    accepts and what it does."""

    env: str
    name: str
    default: Any
    parse: Callable[[str], Any]
    accepts: str
    meaning: str


VARIABLES: Tuple[Variable, ...] = (
    Variable("MPILOSSY_TIMEOUT", "timeout", None, _timeout, "seconds > 0, 'auto' or 'none'",
             "deadline of every call of a Communicator built without timeout="),
    Variable("MPILOSSY_LOSS", "loss", None, _loss_spec,
             "a loss model, e.g. 'bernoulli:0.1' (docs/deadlines.md)",
             "injected loss of a Communicator built without loss="),
    Variable("MPILOSSY_BLOCK_BYTES", "block_bytes", 256 * 1024, _int_at_least(64),
             "an integer >= 64", "bytes per block (the unit of loss)"),
    Variable("MPILOSSY_TREE_RADIX", "tree_radix", 4, _int_at_least(2),
             "an integer in 2..64", "children per node of the k-nomial tree"),
    Variable("MPILOSSY_TREE_MAX_BYTES", "tree_max_bytes", None, _int_at_least(0),
             "an integer >= 0", "largest message for which algorithm='auto' picks the tree"),
    Variable("MPILOSSY_RMA_SHM", "rma_shm", True, _switch, "0 or 1",
             "read peers on the same node through shared memory"),
    Variable("MPILOSSY_UD_PROVIDER", "ud_provider", "", _text,
             "'native' or a libfabric provider name",
             "transport of channel='ud': mpilossy's own UDP sockets (native) or a libfabric "
             "provider (default: $FI_PROVIDER, else libfabric's first match)"),
    Variable("MPILOSSY_UD_DOMAIN", "ud_domain", "", _text, "a libfabric domain name",
             "domain (interface) of channel='ud'"),
    Variable("MPILOSSY_UD_MTU", "ud_mtu", 8192, _int_at_least(64), "an integer >= 64",
             "largest datagram payload of channel='ud'"),
    Variable("MPILOSSY_UD_RECV_BUFFERS", "ud_recv_buffers", 512, _int_at_least(16),
             "an integer >= 16", "receives kept posted by channel='ud'"),
    Variable("MPILOSSY_UD_RATE", "ud_rate", 0.0, parse_rate,
             "a rate: '1gbit', '800mbit', '10g', bits per second, or 'none'",
             "the rate of a node's port: channel='ud' paces each rank's datagrams to its share "
             "of it (docs/ud.md)"),
    Variable("MPILOSSY_UD_OFFLOAD", "ud_offload", True, _switch, "0 or 1",
             "segmentation (UDP_SEGMENT) and receive offload (UDP_GRO) of the native "
             "datagram transport, where the kernel has them"),
    Variable("MPILOSSY_UD_SOCKET_BYTES", "ud_socket_bytes", 32 << 20, _int_at_least(0),
             "an integer >= 0", "kernel receive buffer of the udp provider"),
    Variable("MPILOSSY_AUTO_FLOOR", "auto_floor", 1e-3, _seconds(), "seconds > 0",
             "smallest deadline timeout='auto' learns"),
    Variable("MPILOSSY_AUTO_CAP", "auto_cap", 1.0, _seconds(), "seconds > 0",
             "largest deadline timeout='auto' learns (and its first)"),
    Variable("MPILOSSY_EARLY_CLOSE", "early_close", 100e-6, _seconds(allow_negative=True),
             "seconds, < 0 turns it off", "grace after a producer's end mark (docs/deadlines.md)"),
    Variable("MPILOSSY_SPIN", "spin", 0, _int_at_least(0), "an integer >= 0",
             "idle polling passes before a call yields the core"),
    Variable("MPILOSSY_MAX_BEHIND", "max_behind", 1000, _int_at_least(1), "an integer >= 1",
             "calls in a row behind every peer before LaggingError"),
    Variable("MPILOSSY_TRACE", "trace", None, _text, "a directory",
             "write one line per call and rank into this directory"),
    Variable("MPILOSSY_LOG", "log", None, _log_level, "warning, info or debug",
             "log through the 'mpilossy' logger on stderr"),
)

_BY_NAME = {v.name: v for v in VARIABLES}


def variable(name: str) -> Variable:
    """The variable of the setting `name` (e.g. "block_bytes")."""
    return _BY_NAME[name]


@dataclass(frozen=True)
class Settings:
    """Parsed settings; `source(name)` says where each came from."""

    values: Mapping[str, Any]
    sources: Mapping[str, str] = field(default_factory=dict)

    def __getattr__(self, name: str) -> Any:
        try:
            return self.values[name]
        except KeyError:
            raise AttributeError(name) from None

    def source(self, name: str) -> str:
        return self.sources[name]

    def rows(self) -> Tuple[Tuple[str, Any, str], ...]:
        """(variable, value, source) of every setting, for reports."""
        return tuple((v.env, self.values[v.name], self.sources[v.name]) for v in VARIABLES)


def from_environment(environ: Optional[Mapping[str, str]] = None) -> Settings:
    """Parse every MPILOSSY_* variable; a bad one raises a ValueError that
    names it and says what it accepts.  Empty counts as unset."""
    environ = os.environ if environ is None else environ
    values: Dict[str, Any] = {}
    sources: Dict[str, str] = {}
    for v in VARIABLES:
        text = environ.get(v.env, "")
        if not text.strip():
            values[v.name], sources[v.name] = v.default, "default"
            continue
        try:
            values[v.name] = v.parse(text)
        except ValueError as exc:
            detail = f" ({exc})" if str(exc) else ""
            raise ValueError(f"{v.env}={text!r} is not valid: expected {v.accepts}{detail}") \
                from None
        sources[v.name] = "environment"
    return Settings(values, sources)


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
            var = _BY_NAME[name].env
            warnings.warn(f"mpilossy: {var}={os.environ.get(var, '')!r} is in effect "
                          f"({_BY_NAME[name].meaning}); pass {name}= to Communicator to choose "
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
