"""The communicator's settings: one immutable record, each field validated
once, and the agreement that the shared ones match on every rank.

Each field of `Config` is one setting, declared on one line: its default,
its check, and where the environment may set it, its ``MPILOSSY_*``
variable (how its text converts, what it means).  Its value is the
Communicator argument of the same name where one was given, else its
environment variable, else its default; the field's check turns that into
the value or raises TypeError/ValueError naming the setting (or the
variable).  Fields marked ``agreed`` must be equal on every rank (a rank on
another channel or block size would wait forever in a collective the
others never enter): `agree` compares them all in one allgather.  Adding a
setting is one field here; Communicator's signature takes its defaults
from `DEFAULTS`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Dict, Mapping, Optional, Tuple, Union

from mpi4py import MPI

from ..loss import parse as parse_loss, to_spec as loss_spec
from .._core import MAX_TREE_RADIX, fec_check
from ..errors import MismatchError
from . import environment
from .environment import Settings, Variable, as_text, parse_rate, to_loss, to_lower, \
    to_switch, to_timeout

__all__ = ["Config", "UNSET", "DEFAULTS", "VARIABLES", "agree", "from_environment", "variable",
           "CHANNELS", "COMPRESSIONS", "SCALINGS"]

CHANNELS = ("rma", "ud", "auto")
SCALINGS = ("unbiased", "zero-fill")
COMPRESSIONS = {"int8": 8, "int4": 4}      # bits per value on the wire
ALGORITHM_CHOICES = ("ring", "tree", "direct", "hierarchical", "auto")
DEFAULT_CAPACITY = 4 * 1024 * 1024

Timeout = Union[None, str, float]


class _Unset:
    def __repr__(self) -> str:
        return "<from environment>"


UNSET: Any = _Unset()
"""An argument not given: the environment or the default decides."""


# -- checks: value in, field value out (or TypeError/ValueError) ------------------
def check_timeout(name: str, value: Any) -> Timeout:
    """None (no deadline), "auto", or seconds > 0 (inf: no deadline)."""
    if value is None or (isinstance(value, str) and value == "auto"):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, 'auto' or None, not {value!r}")
    if math.isinf(value) and value > 0:
        return None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive number of seconds or None, got {value!r}")
    return float(value)


def _loss_models(name: str, value: Any) -> Tuple[Any, ...]:
    if value is None:
        models: list = []
    elif isinstance(value, str):
        models = parse_loss(value)
    elif isinstance(value, (list, tuple)):
        models = list(value)
    else:
        models = [value]
    loss_spec(models)                # raises for what is not a model, or two of a kind
    return tuple(models)


def _one_of(choices: Tuple[Optional[str], ...]) -> Callable[[str, Any], Any]:
    def check(name: str, value: Any) -> Any:
        if value not in choices:
            raise ValueError(f"{name} must be one of {choices}, got {value!r}")
        return value
    return check


def check_algorithm(name: str, value: Any) -> str:
    if value not in ALGORITHM_CHOICES:
        raise ValueError(f"{name} must be 'ring', 'tree', 'direct', 'hierarchical' or 'auto', "
                         f"got {value!r}")
    return value


def check_compression(name: str, value: Any) -> Optional[str]:
    if value is not None and value not in COMPRESSIONS:
        raise ValueError(f"{name} must be None, 'int8' or 'int4', got {value!r}")
    return value


Redundancy = Union[None, str, Tuple[int, int]]


def check_redundancy(name: str, value: Any) -> Redundancy:
    """None, "auto", or (k, m): m parity blocks with every k data blocks of a
    stream (docs/redundancy.md); the code must be one this build has."""
    if value is None or (isinstance(value, str) and value == "auto"):
        return value
    if (not isinstance(value, (tuple, list)) or len(value) != 2
            or any(isinstance(v, bool) or not isinstance(v, int) for v in value)):
        raise TypeError(f"{name} must be None, 'auto' or a pair of ints (k, m), got {value!r}")
    k, m = value
    why = fec_check(k, m)
    if why is not None:
        raise ValueError(f"{name}=({k}, {m}): {why}")
    return (k, m)


def check_fraction(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
        raise ValueError(f"{name} must be a number strictly between 0 and 1, got {value!r}")
    return float(value)


def _int_in(low: int, high: Optional[int] = None, even: bool = False,
            words: str = "") -> Callable[[str, Any], int]:
    def check(name: str, value: Any) -> int:
        if (isinstance(value, bool) or not isinstance(value, int) or value < low
                or (high is not None and value > high) or (even and value % 2)):
            raise ValueError(f"{name} must be {words}, got {value!r}")
        return value
    check.accepts = words   # type: ignore[attr-defined]
    return check


def _seconds(negative: bool = False) -> Callable[[str, Any], float]:
    words = "seconds, < 0 turns it off" if negative else "seconds > 0"

    def check(name: str, value: Any) -> float:
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or not math.isfinite(value) or (value <= 0 and not negative)):
            raise ValueError(f"{name} must be {words}, got {value!r}")
        return float(value)
    check.accepts = words   # type: ignore[attr-defined]
    return check


def _optional(check: Callable[[str, Any], Any]) -> Callable[[str, Any], Any]:
    def optional(name: str, value: Any) -> Any:
        return None if value is None else check(name, value)
    optional.accepts = check.accepts    # type: ignore[attr-defined]
    return optional


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, not {type(value).__name__}")
    return value


def _text(name: str, value: Any) -> Optional[str]:
    if value is not None and not isinstance(value, str):
        raise TypeError(f"{name} must be text, not {type(value).__name__}")
    return value


def _directory(name: str, value: Any) -> Optional[str]:
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise TypeError(f"{name} must be a directory's path (str or os.PathLike), "
                        f"not {value!r}")
    return os.fspath(value)     # type: ignore[return-value]


_directory.accepts = "a directory's path"                           # type: ignore[attr-defined]


def _rate(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a rate in bits per second >= 0, got {value!r}")
    return float(value)


_bool.accepts = "0 or 1"                                            # type: ignore[attr-defined]
_text.accepts = "any text"                                          # type: ignore[attr-defined]
_rate.accepts = "a rate: '1gbit', '800mbit', '10g', bits per second, or 'none'"   # type: ignore
check_timeout.accepts = "seconds > 0, 'auto' or 'none'"            # type: ignore[attr-defined]
LOG_LEVELS = (None, "warning", "info", "debug")


def setting(default: Any = None, *, check: Callable[[str, Any], Any],
            env: Optional[str] = None, convert: Callable[[str], Any] = as_text,
            accepts: Optional[str] = None, meaning: str = "", agreed: bool = False,
            argument: bool = True, none_is_unset: bool = False,
            label: Optional[str] = None) -> Any:
    """A field of Config: its `default` and `check` (value -> value, or
    TypeError/ValueError naming the setting).  `env`: its MPILOSSY_*
    variable, whose text `convert` turns into a value for the check
    (`accepts`: what the text may be, default the check's own words;
    `meaning`: what it does); `argument`: Communicator takes it as a
    keyword; `none_is_unset`: an argument of None means "not given";
    `label`: its name in a mismatch message (default: the argument, or the
    variable)."""
    return field(default=default, metadata={
        "check": check, "env": env, "convert": convert,
        "accepts": accepts or getattr(check, "accepts", ""), "meaning": meaning,
        "agreed": agreed, "argument": argument, "none_is_unset": none_is_unset,
        "label": label})


@dataclass(frozen=True)
class Config:
    """Every setting of one Communicator, validated (see the module docs)."""

    # Communicator(...) arguments
    channel: str = setting("rma", check=_one_of(CHANNELS), agreed=True)
    timeout: Timeout = setting(
        None, check=check_timeout, env="MPILOSSY_TIMEOUT", convert=to_timeout,
        meaning="deadline of every call of a Communicator built without timeout=")
    loss: Tuple[Any, ...] = setting(
        None, check=_loss_models, env="MPILOSSY_LOSS", convert=to_loss,
        accepts="a loss model, e.g. 'bernoulli:0.1' (docs/deadlines.md)",
        meaning="injected loss of a Communicator built without loss=")
    algorithm: str = setting("auto", check=check_algorithm)
    block_bytes: int = setting(
        256 * 1024, check=_int_in(64, words="an int >= 64"), env="MPILOSSY_BLOCK_BYTES",
        convert=int, none_is_unset=True, agreed=True, meaning="bytes per block (the unit of loss)")
    capacity: int = setting(DEFAULT_CAPACITY, agreed=True, check=_int_in(0, words="an int >= 0"))
    tree_radix: int = setting(
        4, check=_int_in(2, MAX_TREE_RADIX, words=f"an int in 2..{MAX_TREE_RADIX}"),
        env="MPILOSSY_TREE_RADIX", convert=int, none_is_unset=True, agreed=True,
        meaning="children per node of the k-nomial tree")
    scaling: str = setting("unbiased", check=_one_of(SCALINGS), agreed=True)
    rotate: bool = setting(True, check=_bool, agreed=True)
    compression: Optional[str] = setting(None, check=check_compression, agreed=True)
    compression_group: int = setting(64, agreed=True, check=_int_in(
        2, 65536, even=True, words="an even int in 2..65536"))
    redundancy: Redundancy = setting(None, check=check_redundancy, agreed=True)
    redundancy_target: float = setting(0.025, check=check_fraction, agreed=True)
    delivered_target: float = setting(
        0.99, check=check_fraction, env="MPILOSSY_DELIVERED_TARGET", convert=float, agreed=True,
        meaning="timeout='auto' lengthens its deadline while the deadline cuts more than "
                "1 - this share of the blocks (docs/deadlines.md)")
    pipeline_bytes: int = setting(
        8 << 20, check=_int_in(0, words="an int >= 0"), env="MPILOSSY_PIPELINE_BYTES",
        convert=int, none_is_unset=True, agreed=True,
        meaning="a GPU all-reduce of at least four times this many bytes is staged in segments of "
                "about this size, each copied while the one before travels; 0: in one piece "
                "(docs/gpu.md)")
    elastic: bool = setting(False, check=_bool, agreed=True)
    evict_after: int = setting(20, check=_int_in(1, words="an int >= 1 (calls)"), agreed=True)
    elastic_wait: float = setting(10.0, check=_seconds(), agreed=True)
    heartbeat_span: int = setting(2, check=_int_in(1, words="an int >= 1 (ranks on each side)"),
                                  agreed=True)
    spares: int = setting(0, check=_int_in(0, words="an int >= 0 (ranks)"), agreed=True)
    rendezvous: Optional[str] = setting(None, check=_directory, agreed=True)
    # from the environment only
    rma_shm: bool = setting(
        True, check=_bool, env="MPILOSSY_RMA_SHM", convert=to_switch, argument=False,
        agreed=True, meaning="read peers on the same node through shared memory")
    ud_provider: str = setting(
        "", check=_text, env="MPILOSSY_UD_PROVIDER", argument=False, agreed=True,
        label="datagram provider", accepts="'native' or a libfabric provider name",
        meaning="transport of channel='ud': mpilossy's own UDP sockets (native) or a "
                "libfabric provider (default: $FI_PROVIDER, else libfabric's first match)")
    ud_domain: str = setting(           # per node
        "", check=_text, env="MPILOSSY_UD_DOMAIN", argument=False,
        accepts="a libfabric domain name", meaning="domain (interface) of channel='ud'")
    ud_mtu: int = setting(
        8192, check=_int_in(64, words="an int >= 64"), env="MPILOSSY_UD_MTU", convert=int,
        argument=False, agreed=True, meaning="largest datagram payload of channel='ud'")
    ud_recv_buffers: int = setting(
        512, check=_int_in(16, words="an int >= 16"), env="MPILOSSY_UD_RECV_BUFFERS",
        convert=int, argument=False, meaning="receives kept posted by channel='ud'")
    ud_socket_bytes: int = setting(
        32 << 20, check=_int_in(0, words="an int >= 0"), env="MPILOSSY_UD_SOCKET_BYTES",
        convert=int, argument=False, meaning="kernel receive buffer of the udp provider")
    ud_rate: float = setting(           # bits/s, per node
        0.0, check=_rate, env="MPILOSSY_UD_RATE", convert=parse_rate, argument=False,
        meaning="the rate of a node's port: channel='ud' paces each rank's datagrams to its "
                "share of it (docs/ud.md)")
    ud_offload: bool = setting(
        True, check=_bool, env="MPILOSSY_UD_OFFLOAD", convert=to_switch, argument=False,
        meaning="segmentation (UDP_SEGMENT) and receive offload (UDP_GRO) of the native "
                "datagram transport, where the kernel has them")
    tree_max_bytes: Optional[int] = setting(
        None, check=_optional(_int_in(0, words="an int >= 0")), env="MPILOSSY_TREE_MAX_BYTES",
        convert=int, argument=False,
        meaning="largest message for which algorithm='auto' picks the tree")
    auto_floor: float = setting(
        1e-3, check=_seconds(), env="MPILOSSY_AUTO_FLOOR", convert=float, argument=False,
        meaning="smallest deadline timeout='auto' learns")
    auto_cap: float = setting(
        1.0, check=_seconds(), env="MPILOSSY_AUTO_CAP", convert=float, argument=False,
        meaning="largest deadline timeout='auto' learns (and its first)")
    early_close: float = setting(
        100e-6, check=_seconds(negative=True), env="MPILOSSY_EARLY_CLOSE", convert=float,
        argument=False, meaning="grace after a producer's end mark (docs/deadlines.md)")
    spin: int = setting(
        0, check=_int_in(0, words="an int >= 0"), env="MPILOSSY_SPIN", convert=int,
        argument=False, meaning="idle polling passes before a call yields the core")
    max_behind: int = setting(
        1000, check=_int_in(1, words="an int >= 1"), env="MPILOSSY_MAX_BEHIND", convert=int,
        argument=False, meaning="calls in a row behind every peer before LaggingError")
    trace: Optional[str] = setting(
        None, check=_text, env="MPILOSSY_TRACE", argument=False, accepts="a directory",
        meaning="write one line per call and rank into this directory")
    log: Optional[str] = setting(
        None, check=_one_of(LOG_LEVELS), env="MPILOSSY_LOG", convert=to_lower, argument=False,
        accepts="warning, info or debug", meaning="log through the 'mpilossy' logger on stderr")

    @classmethod
    def build(cls, arguments: Mapping[str, Any],
              environ: Optional[Mapping[str, str]] = None) -> Tuple["Config", Settings]:
        """The config of these Communicator arguments (UNSET where not given)
        and the parsed environment.  Raises TypeError/ValueError."""
        env = from_environment(environ)
        values: Dict[str, Any] = {}
        for f in fields(cls):
            meta = f.metadata
            given = arguments.get(f.name, UNSET)
            if given is None and meta["none_is_unset"]:
                given = UNSET
            if given is not UNSET:
                values[f.name] = meta["check"](f.name, given)
            elif meta["env"] is not None:
                values[f.name] = meta["check"](f.name, getattr(env, f.name))
            else:
                values[f.name] = f.default
        if not values["ud_provider"]:
            # libfabric's own variable names the provider where ours does not
            values["ud_provider"] = (os.environ if environ is None else environ).get(
                "FI_PROVIDER", "")
        return cls(**values), env

    @classmethod
    def arguments(cls) -> Tuple[str, ...]:
        """The settings Communicator takes as keywords."""
        return tuple(f.name for f in fields(cls) if f.metadata["argument"])

    def agreed(self) -> Tuple[Tuple[str, Any], ...]:
        """(label, value) of every setting that must match across ranks."""
        return tuple((_label(f), getattr(self, f.name)) for f in fields(self)
                     if f.metadata["agreed"])

    @property
    def core_timeout(self) -> float:
        """The deadline as the core takes it: seconds, -1 for none, AUTO."""
        return core_timeout(self.timeout)


AUTO = -2.0     # core_timeout's answer for timeout="auto"


def core_timeout(timeout: Timeout) -> float:
    if timeout is None:
        return -1.0
    if timeout == "auto":
        return AUTO
    return float(timeout)


def _label(f: Any) -> str:
    meta = f.metadata
    if meta["label"]:
        return meta["label"]
    if meta["argument"]:
        return f.name
    return meta["env"]


VARIABLES: Tuple[Variable, ...] = tuple(
    Variable(f.metadata["env"], f.name, f.default, f.metadata["convert"], f.metadata["check"],
             f.metadata["accepts"], f.metadata["meaning"])
    for f in fields(Config) if f.metadata["env"])
"""Every MPILOSSY_* variable, from the settings that declare one."""

_BY_NAME = {v.name: v for v in VARIABLES}


def variable(name: str) -> Variable:
    """The variable of the setting `name` (e.g. "block_bytes")."""
    return _BY_NAME[name]


def from_environment(environ: Optional[Mapping[str, str]] = None) -> Settings:
    """Every MPILOSSY_* variable, parsed and checked (a bad one raises a
    ValueError that names it and says what it accepts)."""
    return environment.read(VARIABLES, environ)


class _Defaults:
    """Config's defaults by name (Communicator's signature takes them)."""

    def __getattr__(self, name: str) -> Any:
        return next(f.default for f in fields(Config) if f.name == name)


DEFAULTS = _Defaults()


def agree(comm: MPI.Intracomm, arguments: Mapping[str, Any]) -> Tuple[Config, Settings]:
    """Collective: build the config on every rank and compare what must
    match.  A bad argument on any rank, or a difference between ranks,
    raises on every rank: the culprit its own error, the others a
    ValueError naming the ranks, or a MismatchError naming the settings."""
    error: Optional[BaseException] = None
    config: Optional[Config] = None
    env: Optional[Settings] = None
    try:
        config, env = Config.build(arguments)
    except (TypeError, ValueError) as exc:
        error = exc
    shared = config.agreed() if config is not None else ()
    everyone = comm.allgather((error is not None, shared))
    failed = [r for r, (bad, _) in enumerate(everyone) if bad]
    if failed:
        if error is not None:
            raise error
        raise ValueError(f"Communicator arguments rejected on rank(s) {failed}")
    differ = [k for k in range(len(shared)) if len({c[k][1] for _, c in everyone}) > 1]
    if differ:
        raise MismatchError("ranks disagree on " + "; ".join(
            f"{shared[k][0]} (" + ", ".join(
                f"rank {r}: {c[k][1]!r}" for r, (_, c) in enumerate(everyone)) + ")"
            for k in differ))
    assert config is not None and env is not None
    return config, env
