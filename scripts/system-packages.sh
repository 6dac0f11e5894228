#!/usr/bin/env bash
# Debian packages that some tests use beyond what pip installs:
#   slurm-wlm, munge  tests/cluster/test_slurm.py runs jobs/ on a single-node Slurm
#   libpmix-dev       srun --mpi=pmix (Slurm's plugin loads libpmix.so) for
#                     the Open MPI build in tests/cluster/test_site_mpi.py
#   libfabric-dev     headers for the datagram channel (channel="ud"); without
#                     them the build leaves it out and tests/channels/test_ud.py skips
#   libssl-dev        OpenSSL libcrypto headers: the datagrams' keyed MAC
#                     (without them channel="ud" and its decoder tests skip)
#   libisal-dev       Intel ISA-L: erasure codes with m >= 2 parity blocks
#                     (without it m = 1 only, and those kernel tests skip)
#   nftables, iproute2  real kernel drops in tests/channels/test_ud.py (network namespace);
#                     mpilossy.cluster, the emulated cluster (namespaces,
#                     bridge, tbf, drops on the switch: tests/cluster/test_cluster.py,
#                     tests/cluster/test_multinode.py; unshare and mount from util-linux)
#   ethtool           mpilossy.cluster: segmentation and receive offloads per
#                     node, so that drops hit wire-sized packets
#   ShellCheck        lints the shell scripts and jobs/ templates (tests/cluster/test_scripts.py)
#   python3-simgrid   SimGrid's Python bindings for the scale model (mpilossy.sim,
#                     tests/sim/test_engine.py); built for the system's CPython 3.11,
#                     loaded by path from a 3.11 venv (mpilossy/sim/_simgrid.py)
# Never fails: where the packages cannot be installed, those tests skip and
# say why.
set -uo pipefail
PACKAGES=(slurm-wlm munge libpmix-dev libfabric-dev libssl-dev libisal-dev nftables iproute2 ethtool shellcheck python3-simgrid)
missing=()
for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
    echo "system-packages: ${PACKAGES[*]} already installed"
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "system-packages: cannot install ${missing[*]} (needs root and apt-get); the tests that need them will skip"
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
timeout 300 apt-get update -q >/dev/null || echo "system-packages: apt-get update failed; trying the install anyway"
if timeout 300 apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null; then
    echo "system-packages: installed ${missing[*]}"
else
    echo "system-packages: could not install ${missing[*]}; the tests that need them will skip"
fi
exit 0
