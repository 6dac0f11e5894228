"""mpilossy.torch.init_process_group / destroy_process_group in one
process, one after the other.  (Its own module: the other modules keep a
process group up for all their tests.)"""

import os

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")

import torch.distributed as dist  # noqa: E402

import mpilossy.torch as mt  # noqa: E402


@pytest.mark.mpi
def test_a_second_process_group_does_not_reuse_the_first_ones_port(comm, monkeypatch):
    """init_process_group exports MASTER_ADDR/MASTER_PORT; destroy takes
    them back, so that the next init asks the kernel for a port again
    instead of reading its predecessor's as the user's (which was still
    held now and then: EADDRINUSE)."""
    if dist.is_initialized():
        pytest.skip("a process group of another test is still up")
    monkeypatch.delenv("MASTER_PORT", raising=False)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    mt.init_process_group()
    first = os.environ.get("MASTER_PORT")
    mt.destroy_process_group()
    assert first is not None and "MASTER_PORT" not in os.environ
    mt.init_process_group()
    try:
        assert "MASTER_PORT" in os.environ
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == comm.size
    finally:
        mt.destroy_process_group()
