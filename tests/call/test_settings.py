"""Settings from the environment: one parser for every MPILOSSY_* variable,
errors that name the variable, a warning when loss or a deadline come from
the environment, logging on request, and `python -m mpilossy info`."""

import os
import re
import sys
import warnings

import pytest
from mpi4py import MPI

import mpilossy
from mpilossy.call import config, environment
from helpers import clean_subprocess_env, is_singleton, mpiexec, run_bounded

BAD = {"MPILOSSY_TIMEOUT": "-1", "MPILOSSY_LOSS": "bernouli:0.1", "MPILOSSY_BLOCK_BYTES": "64k",
       "MPILOSSY_TREE_RADIX": "1", "MPILOSSY_TREE_MAX_BYTES": "-5", "MPILOSSY_RMA_SHM": "maybe",
       "MPILOSSY_UD_MTU": "12", "MPILOSSY_UD_RECV_BUFFERS": "many",
       "MPILOSSY_UD_SOCKET_BYTES": "1.5", "MPILOSSY_AUTO_FLOOR": "-0.1",
       "MPILOSSY_AUTO_CAP": "inf", "MPILOSSY_EARLY_CLOSE": "soon", "MPILOSSY_SPIN": "-1",
       "MPILOSSY_MAX_BEHIND": "0", "MPILOSSY_LOG": "loud", "MPILOSSY_UD_RATE": "fast",
       "MPILOSSY_UD_OFFLOAD": "maybe", "MPILOSSY_DELIVERED_TARGET": "1.5",
       "MPILOSSY_PIPELINE_BYTES": "32M"}


def test_every_variable_is_known_and_checked():
    free_text = {"MPILOSSY_UD_DOMAIN", "MPILOSSY_UD_PROVIDER", "MPILOSSY_TRACE"}   # any text
    assert {v.env for v in config.VARIABLES} == set(BAD) | free_text


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_bad_value_names_its_variable(name):
    with pytest.raises(ValueError) as err:
        config.from_environment({name: BAD[name]})
    message = str(err.value)
    assert message.startswith(f"{name}={BAD[name]!r}") and "expected" in message, message


def test_defaults_sources_and_parsing():
    env = config.from_environment({})
    assert env.timeout is None and env.loss is None and env.block_bytes == 256 * 1024
    assert all(source == "default" for _, _, source in env.rows())
    env = config.from_environment({"MPILOSSY_TIMEOUT": "auto", "MPILOSSY_RMA_SHM": "0",
                                     "MPILOSSY_BLOCK_BYTES": " ", "MPILOSSY_LOG": "DEBUG"})
    assert env.timeout == "auto" and env.rma_shm is False and env.log == "debug"
    assert env.source("timeout") == "environment" and env.source("block_bytes") == "default"
    assert config.from_environment({"MPILOSSY_TIMEOUT": "0.25"}).timeout == 0.25
    assert config.from_environment({"MPILOSSY_TIMEOUT": "none"}).timeout is None


@pytest.mark.mpi
def test_loss_from_the_environment_is_announced_once_on_rank_0(comm, monkeypatch):
    monkeypatch.setenv("MPILOSSY_LOSS", "bernoulli:0.1")
    monkeypatch.setattr(environment, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            mpilossy.Communicator(comm).free()
        mpilossy.Communicator(comm, loss=None).free()       # chosen explicitly: no warning
    ours = [w for w in caught if "MPILOSSY_LOSS" in str(w.message)]
    expected = 1 if MPI.COMM_WORLD.Get_rank() == 0 else 0
    assert len(ours) == expected and all(w.category is RuntimeWarning for w in ours), ours


def test_logging_on_request(tmp_path):
    if not is_singleton():
        pytest.skip("starts its own interpreter: runs at size 1")
    code = ("import mpilossy\nfrom mpi4py import MPI\n"
            "mpilossy.Communicator(MPI.COMM_WORLD, timeout=0.5).free()\n")
    quiet = run_bounded([sys.executable, "-c", code], 60, clean_subprocess_env(), cwd=tmp_path)
    loud = run_bounded([sys.executable, "-c", code], 60,
                       clean_subprocess_env(MPILOSSY_LOG="info"), cwd=tmp_path)
    assert quiet.returncode == 0 and "mpilossy" not in quiet.stderr, quiet.stderr
    assert loud.returncode == 0, loud.stderr
    assert "[mpilossy rank 0] INFO communicator of 1 ranks: channel=rma timeout=0.5" in loud.stderr


def test_info_at_two_ranks(tmp_path):
    if not is_singleton():
        pytest.skip("starts its own mpiexec: runs at size 1")
    proc = run_bounded([mpiexec(), "-n", "2", sys.executable, "-m", "mpilossy", "info"], 120,
                       clean_subprocess_env(MPILOSSY_TIMEOUT="0.05"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert out.startswith(f"mpilossy {mpilossy.__version__} (")
    settings = re.sub(r"(MPILOSSY_\w+) +=", r"\1 =", out)     # (padded to the longest name)
    for needle in ("compiled core: /", "MPI: ", "MPI library file: /", "2 rank(s)", "channel rma: built",
                   "channel ud: ", "MPILOSSY_TIMEOUT = 0.05 [environment]",
                   "MPILOSSY_LOSS = None [default]", "ranks:\n  0: ", "\n  1: "):
        assert needle in settings, (needle, out)
