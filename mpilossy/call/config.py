"""The communicator's settings: one immutable record, each field validated
once, and the agreement that the shared ones match on every rank.

Each field of `Config` is one setting.  Its value is the Communicator
argument of the same name where one was given, else its environment
variable (``mpilossy/control/settings.py`` parses every ``MPILOSSY_*``
variable), else its default; the field's check turns that into the value
or raises TypeError/ValueError naming the setting.  Fields marked
``agreed`` must be equal on every rank (a rank on another channel or block
size would wait forever in a collective the others never enter): `agree`
compares them all in one allgather.  Adding a setting is one field here
(and its variable in settings.py if the environment may set it).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Dict, Mapping, Optional, Tuple, Union

from mpi4py import MPI

from ..loss import parse as parse_loss, to_spec as loss_spec
from .._core import MAX_TREE_RADIX, fec_check
from ..control import settings as _settings
from ..errors import MismatchError

__all__ = ["Config", "UNSET", "agree", "CHANNELS", "COMPRESSIONS", "SCALINGS"]

CHANNELS = ("rma", "ud", "auto")
SCALINGS = ("unbiased", "zero-fill")
COMPRESSIONS = {"int8": 8, "int4": 4}      # bits per value on the wire
ALGORITHM_CHOICES = ("ring", "tree", "direct", "auto")
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


def _one_of(choices: Tuple[str, ...]) -> Callable[[str, Any], Any]:
    def check(name: str, value: Any) -> Any:
        if value not in choices:
            raise ValueError(f"{name} must be one of {choices}, got {value!r}")
        return value
    return check


def check_algorithm(name: str, value: Any) -> str:
    if value not in ALGORITHM_CHOICES:
        raise ValueError(f"{name} must be 'ring', 'tree', 'direct' or 'auto', got {value!r}")
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
    return check


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, not {type(value).__name__}")
    return value


def _parsed(name: str, value: Any) -> Any:
    """Environment-only settings: settings.py has parsed and checked them."""
    return value


def setting(default: Any = None, *, check: Callable[[str, Any], Any] = _parsed,
            env: Optional[str] = None, agreed: bool = False, argument: bool = True,
            none_is_unset: bool = False, label: Optional[str] = None) -> Any:
    """A field of Config.  `env`: the name of its variable in settings.py
    (whose default it takes); `argument`: Communicator takes it as a keyword;
    `none_is_unset`: an argument of None means "not given"; `label`: its
    name in a mismatch message (default: the argument, or the variable)."""
    return field(default=default, metadata={
        "check": check, "env": env, "agreed": agreed, "argument": argument,
        "none_is_unset": none_is_unset, "label": label})


@dataclass(frozen=True)
class Config:
    """Every setting of one Communicator, validated (see the module docs)."""

    # Communicator(...) arguments
    channel: str = setting("rma", check=_one_of(CHANNELS), agreed=True)
    timeout: Timeout = setting(env="timeout", check=check_timeout)
    loss: Tuple[Any, ...] = setting(env="loss", check=_loss_models)
    algorithm: str = setting("auto", check=check_algorithm)
    block_bytes: int = setting(env="block_bytes", none_is_unset=True, agreed=True,
                               check=_int_in(64, words="an int >= 64"))
    capacity: int = setting(DEFAULT_CAPACITY, agreed=True, check=_int_in(0, words="an int >= 0"))
    tree_radix: int = setting(env="tree_radix", none_is_unset=True, agreed=True,
                              check=_int_in(2, MAX_TREE_RADIX,
                                            words=f"an int in 2..{MAX_TREE_RADIX}"))
    scaling: str = setting("unbiased", check=_one_of(SCALINGS), agreed=True)
    rotate: bool = setting(True, check=_bool, agreed=True)
    compression: Optional[str] = setting(None, check=check_compression, agreed=True)
    compression_group: int = setting(64, agreed=True, check=_int_in(
        2, 65536, even=True, words="an even int in 2..65536"))
    redundancy: Redundancy = setting(None, check=check_redundancy, agreed=True)
    redundancy_target: float = setting(0.025, check=check_fraction, agreed=True)
    # from the environment only
    rma_shm: bool = setting(env="rma_shm", argument=False, agreed=True)
    ud_provider: str = setting(env="ud_provider", argument=False, agreed=True,
                               label="datagram provider")
    ud_domain: str = setting(env="ud_domain", argument=False)       # per node
    ud_mtu: int = setting(env="ud_mtu", argument=False, agreed=True)
    ud_recv_buffers: int = setting(env="ud_recv_buffers", argument=False)
    ud_socket_bytes: int = setting(env="ud_socket_bytes", argument=False)
    ud_rate: float = setting(env="ud_rate", argument=False)        # bits/s, per node
    ud_offload: bool = setting(env="ud_offload", argument=False)
    tree_max_bytes: Optional[int] = setting(env="tree_max_bytes", argument=False)
    auto_floor: float = setting(env="auto_floor", argument=False)
    auto_cap: float = setting(env="auto_cap", argument=False)
    early_close: float = setting(env="early_close", argument=False)
    spin: int = setting(env="spin", argument=False)
    max_behind: int = setting(env="max_behind", argument=False)
    trace: Optional[str] = setting(env="trace", argument=False)
    log: Optional[str] = setting(env="log", argument=False)

    @classmethod
    def build(cls, arguments: Mapping[str, Any],
              environ: Optional[Mapping[str, str]] = None) -> Tuple["Config", "_settings.Settings"]:
        """The config of these Communicator arguments (UNSET where not given)
        and the parsed environment.  Raises TypeError/ValueError."""
        env = _settings.from_environment(environ)
        values: Dict[str, Any] = {}
        for f in fields(cls):
            meta = f.metadata
            given = arguments.get(f.name, UNSET)
            if given is None and meta["none_is_unset"]:
                given = UNSET
            if given is not UNSET:
                value = given
            elif meta["env"] is not None:
                value = getattr(env, meta["env"])
            else:
                value = f.default
            values[f.name] = meta["check"](f.name, value)
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
    return _settings.variable(meta["env"]).env


def agree(comm: MPI.Intracomm, arguments: Mapping[str, Any]) -> Tuple[Config, "_settings.Settings"]:
    """Collective: build the config on every rank and compare what must
    match.  A bad argument on any rank, or a difference between ranks,
    raises on every rank: the culprit its own error, the others a
    ValueError naming the ranks, or a MismatchError naming the settings."""
    error: Optional[BaseException] = None
    config: Optional[Config] = None
    env: Optional[_settings.Settings] = None
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
