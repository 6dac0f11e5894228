"""The communicator's configuration (mpilossy/call/config.py): every
setting validated once (argument, else environment, else default), the
shared ones agreed by every rank, and construction refused on every rank
when any rank's settings are bad or differ."""

import math
from dataclasses import fields

import numpy as np
import pytest

import mpilossy
from mpilossy import _core
from mpilossy.call.config import UNSET, VARIABLES, Config, agree, variable
from helpers import all_ranks_raise


def one_rank_passes(comm, bad, good):
    return bad if comm.rank == comm.size - 1 else good


# -- the record: one field per setting ------------------------------------------------
def test_every_argument_of_communicator_is_a_field():
    import inspect
    params = [p for p in inspect.signature(mpilossy.Communicator).parameters if p != "comm"]
    assert sorted(params) == sorted(Config.arguments())


def test_every_environment_variable_is_a_field():
    linked = {f.name for f in fields(Config) if f.metadata["env"]}
    assert linked == {v.name for v in VARIABLES}
    assert all(v.env == "MPILOSSY_" + v.name.upper() for v in VARIABLES)


def test_defaults_come_from_the_variables():
    config, env = Config.build({}, environ={})
    assert config.block_bytes == 256 * 1024 and config.tree_radix == 4
    assert config.timeout is None and config.loss == () and config.channel == "rma"
    assert config.ud_mtu == variable("ud_mtu").default
    assert env.source("block_bytes") == "default"


def test_argument_beats_environment_beats_default():
    environ = {"MPILOSSY_BLOCK_BYTES": "4096", "MPILOSSY_TIMEOUT": "0.25"}
    config, _ = Config.build({}, environ=environ)
    assert config.block_bytes == 4096 and config.timeout == 0.25
    config, _ = Config.build({"block_bytes": 8192, "timeout": None}, environ=environ)
    assert config.block_bytes == 8192 and config.timeout is None      # None is a choice
    config, _ = Config.build({"block_bytes": None, "timeout": UNSET}, environ=environ)
    assert config.block_bytes == 4096 and config.timeout == 0.25      # None: not given


def test_the_datagram_provider_falls_back_on_libfabrics_variable():
    assert Config.build({}, environ={"FI_PROVIDER": "udp"})[0].ud_provider == "udp"
    assert Config.build({}, environ={"FI_PROVIDER": "udp", "MPILOSSY_UD_PROVIDER": "native"}
                        )[0].ud_provider == "native"


def test_timeouts_are_normalised_once():
    assert Config.build({"timeout": math.inf}, environ={})[0].timeout is None
    assert Config.build({"timeout": 1}, environ={})[0].timeout == 1.0
    assert Config.build({"timeout": "auto"}, environ={})[0].core_timeout < -1


BAD_ARGUMENTS = {
    "channel": ("carrier-pigeon", ValueError), "timeout": ("1s", TypeError),
    "loss": ("bernoulli:1.5", ValueError), "algorithm": ("butterfly", ValueError),
    "block_bytes": (8, ValueError), "capacity": (-1, ValueError),
    "tree_radix": (_core.MAX_TREE_RADIX + 1, ValueError), "scaling": ("max", ValueError),
    "rotate": (1, TypeError), "compression": ("int2", ValueError),
    "compression_group": (63, ValueError), "redundancy": ((4, 4), ValueError),
    "redundancy_target": (0.0, ValueError),
    "delivered_target": (1.0, ValueError), "pipeline_bytes": (-1, ValueError),
    "elastic": ("yes", TypeError), "evict_after": (0, ValueError), "elastic_wait": (0, ValueError),
    "heartbeat_span": (0, ValueError), "spares": (-1, ValueError),
    "rendezvous": (3, TypeError),
}


def test_every_argument_has_a_bad_value_here():
    assert sorted(BAD_ARGUMENTS) == sorted(Config.arguments())


@pytest.mark.parametrize("name", sorted(BAD_ARGUMENTS))
def test_a_bad_argument_is_refused_naming_it(name):
    value, exc = BAD_ARGUMENTS[name]
    with pytest.raises(exc) as err:
        Config.build({name: value}, environ={})
    assert name in str(err.value) or name == "loss", err.value


def test_the_agreed_settings_are_marked_on_the_fields():
    config, _ = Config.build({}, environ={})
    labels = [label for label, _ in config.agreed()]
    assert labels == ["channel", "block_bytes", "capacity", "tree_radix", "scaling", "rotate",
                      "compression", "compression_group", "redundancy", "redundancy_target",
                      "delivered_target", "pipeline_bytes", "elastic", "evict_after",
                      "elastic_wait", "heartbeat_span", "spares", "rendezvous",
                      "MPILOSSY_RMA_SHM",
                      "datagram provider", "MPILOSSY_UD_MTU"]
    assert "timeout" not in labels and "MPILOSSY_UD_DOMAIN" not in labels   # may differ


def test_config_is_immutable():
    config, _ = Config.build({}, environ={})
    with pytest.raises(AttributeError):
        config.block_bytes = 64


@pytest.mark.mpi
def test_agreement_returns_the_same_config_everywhere(comm):
    config, _ = agree(comm, {"block_bytes": 4096})
    assert len({repr(c) for c in comm.allgather(config.agreed())}) == 1
    with mpilossy.Communicator(comm, block_bytes=4096) as lc:
        assert lc.config.block_bytes == 4096 and lc.config == config


# -- construction is refused on every rank --------------------------------------------
@pytest.mark.mpi
@pytest.mark.parametrize("bad", [0, -0.5, math.nan, -math.inf], ids=repr)
def test_bad_timeout_at_construction(comm, bad):
    timeout = one_rank_passes(comm, bad, 0.5)
    all_ranks_raise(comm, lambda: mpilossy.Communicator(comm, timeout=timeout), ValueError)


@pytest.mark.mpi
@pytest.mark.parametrize("kwargs", [{"algorithm": "butterfly"}, {"channel": "carrier-pigeon"},
                                    {"block_bytes": 8}, {"tree_radix": 1},
                                    {"loss": "bernoulli:1.5"}, {"scaling": "max"}], ids=str)
def test_bad_arguments_at_construction(comm, kwargs):
    args = one_rank_passes(comm, kwargs, {})
    all_ranks_raise(comm, lambda: mpilossy.Communicator(comm, **args), ValueError)


@pytest.mark.mpi(min_size=2)
def test_ranks_disagree_on_block_size(comm):
    block = one_rank_passes(comm, 4096, 8192)
    all_ranks_raise(comm, lambda: mpilossy.Communicator(comm, block_bytes=block),
                    mpilossy.MismatchError)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("setting", ["channel", "capacity", "block_bytes", "tree_radix"])
def test_different_settings_on_one_rank_raise_everywhere(comm, setting):
    """Before: channel='ud' on one rank and 'rma' on the others never returned."""
    if setting == "channel" and not (_core.HAVE_LIBFABRIC and _core.HAVE_DATAGRAM_AUTH):
        pytest.skip("channel='ud' not built")
    odd = comm.rank == 1
    kwargs = {"channel": dict(channel="ud" if odd else "rma"),
              "capacity": dict(capacity=(2 << 20) if odd else (4 << 20)),
              "block_bytes": dict(block_bytes=4096 if odd else 8192),
              "tree_radix": dict(tree_radix=2 if odd else 4)}[setting]
    message = all_ranks_raise(comm, lambda: mpilossy.Communicator(comm, timeout=0.5, **kwargs),
                              mpilossy.MismatchError)
    assert setting in message and "rank 1" in message, message


@pytest.mark.mpi
def test_bad_settings_are_refused_on_every_rank(comm, monkeypatch):
    culprit = comm.rank == comm.size - 1
    all_ranks_raise(comm, lambda: mpilossy.Communicator(
        comm, tree_radix=1000 if culprit else 4), ValueError)
    if culprit:
        monkeypatch.setenv("MPILOSSY_BLOCK_BYTES", "64k")
    message = all_ranks_raise(comm, lambda: mpilossy.Communicator(comm), ValueError)
    if culprit:
        assert "MPILOSSY_BLOCK_BYTES" in message, message


@pytest.mark.mpi(min_size=2)
def test_an_environment_setting_that_must_match_is_agreed(comm, monkeypatch):
    if comm.rank == 1:
        monkeypatch.setenv("MPILOSSY_RMA_SHM", "0")
    message = all_ranks_raise(comm, lambda: mpilossy.Communicator(comm),
                              mpilossy.MismatchError)
    assert "MPILOSSY_RMA_SHM" in message and "rank 1: False" in message, message
    x = np.ones(8)
    monkeypatch.undo()
    with mpilossy.Communicator(comm) as lc:         # the next construction is fine
        lc.allreduce(x)
