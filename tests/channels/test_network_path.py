"""The network path: with MPIR_CVAR_NOLOCAL=1 MPICH shares no memory between
ranks, as between nodes, and mpilossy must read its peers with MPI_Rget and
drive MPI progress itself.  These tests start their own mpiexec, so they run
in the single-rank session only."""

import pytest

from helpers import is_singleton, run_mpi_script

pytestmark = pytest.mark.skipif(not is_singleton(), reason="starts its own mpiexec: runs at size 1")

# "tcp" puts real TCP under MPI, pinned to the loopback interface (UCX's tcp
# transport would pick the host's own Ethernet address instead).
TRANSPORTS = {
    "ucx": {"MPIR_CVAR_NOLOCAL": "1"},
    "tcp": {"MPIR_CVAR_NOLOCAL": "1", "MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp",
            "FI_TCP_IFACE": "lo"},
}


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
@pytest.mark.parametrize("mode", ["lossless", "lossy"])
@pytest.mark.parametrize("ranks", [3, 4])
def test_network_path(transport, mode, ranks):
    proc = run_mpi_script("network_path.py", ranks, mode, timeout=240, **TRANSPORTS[transport])
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert proc.stdout.count(f"{mode} ok") == ranks, proc.stdout


def test_forced_rget_path_in_process(monkeypatch):
    """MPILOSSY_RMA_SHM=0 forces MPI_Rget even where memory is shared."""
    proc = run_mpi_script("network_path.py", 2, "lossless", timeout=120, MPILOSSY_RMA_SHM="0")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
