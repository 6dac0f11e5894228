"""The wires of one cluster: its names, its namespaces (one per node, one
for the switch), the bridge and the veths, each port's rate and queue (tbf),
the offloads, the nftables table that counts and drops, and the counters
of what crossed them.

A node is a network namespace `CID-nN` with one interface, eth0, at
10.77.0.N/24 and IPv6 off; the switch is the namespace `CID-sw` holding the
bridge br0 (no STP, no forwarding delay) and one veth port pN per node.
Nothing is created in the root namespace.  In loopback mode there is one
node whose ranks reach each other through its loopback, where the rate and
the drops then apply."""

from __future__ import annotations

import json
import subprocess
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .host import _netns_names, sh
from .leftovers import STATE_ROOT, new_cid

TABLE = "mpilossy_cluster"
PACKETS = "meta protocol ip ip protocol { tcp, udp }"      # what drop rules drop
SUBNET = "10.77.0"


class Network:
    """The names and the wires of a cluster (Cluster's settings: see there).
    _build() makes the namespaces and wires them; close() removes them."""

    def __init__(self, nodes: int, rate: Optional[str], queue: str, node_rate: Optional[str],
                 node_queue: str, burst: str, mtu: int, offloads: str, loopback: bool) -> None:
        if nodes < 1 or nodes > 200:
            raise ValueError(f"nodes={nodes}: 1 to 200")
        if offloads not in ("nic", "off", "on"):
            raise ValueError(f"offloads={offloads!r}: 'nic', 'off' or 'on'")
        if loopback and nodes != 1:
            raise ValueError("loopback: one node")
        if not 576 <= mtu <= 65535:
            raise ValueError(f"mtu={mtu}: 576 to 65535")
        self.cid = new_cid()
        self.nodes = nodes
        self.rate = rate or None
        self.queue = queue
        self.node_rate = self.rate if node_rate == "" else (node_rate or None)
        self.node_queue = node_queue
        self.burst = burst or f"{max(4 * (mtu + 14), 16384)}b"
        self.mtu = mtu
        self.offloads = offloads
        self.loopback = loopback
        self.state = STATE_ROOT / self.cid
        self.control = self.state / "control"
        self.meet = self.state / "meet"         # where bench ranks line up (MPILOSSY_BENCH_MEET)
        self.switch_ns = f"{self.cid}-sw"
        self.node_ns = [f"{self.cid}-n{i + 1}" for i in range(nodes)]
        self.names = [f"node{i + 1}" for i in range(nodes)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(nodes)]
        self.wrapper = self.state / "launch"

    # -- building ------------------------------------------------------------
    def _build_network(self) -> None:
        sw = self.switch_ns
        for name in [sw] + self.node_ns:
            sh(["ip", "netns", "add", name])
        for name in [sw] + self.node_ns:
            # No IPv6 (router solicitations and the like on the wire), no
            # bridged traffic through iptables (br_netfilter) in the switch.
            self._sysctl(name, {"net/ipv6/conf/all/disable_ipv6": "1",
                                "net/ipv6/conf/default/disable_ipv6": "1",
                                "net/bridge/bridge-nf-call-iptables": "0",
                                "net/bridge/bridge-nf-call-ip6tables": "0"})
            sh(["ip", "-n", name, "link", "set", "lo", "up"])
        sh(["ip", "-n", sw, "link", "add", "br0", "mtu", str(self.mtu), "type", "bridge",
            "stp_state", "0", "forward_delay", "0", "mcast_snooping", "0"])
        sh(["ip", "-n", sw, "link", "set", "br0", "up"])
        for i, ns in enumerate(self.node_ns):
            port = f"p{i + 1}"
            sh(["ip", "-n", sw, "link", "add", port, "mtu", str(self.mtu), "type", "veth",
                "peer", "name", "eth0", "mtu", str(self.mtu), "netns", ns])
            sh(["ip", "-n", sw, "link", "set", port, "master", "br0", "up"])
            sh(["ip", "-n", ns, "addr", "add", f"{self.addresses[i]}/24", "dev", "eth0"])
            sh(["ip", "-n", ns, "link", "set", "eth0", "up"])
            self._offloads(ns, "eth0", node=True)
            self._offloads(sw, port, node=False)
            if self.rate:
                self._tbf(sw, port, self.rate, self.queue)
            if self.node_rate:
                self._tbf(ns, "eth0", self.node_rate, self.node_queue)
        if self.loopback:
            ns = self.node_ns[0]
            sh(["ip", "-n", ns, "link", "set", "lo", "mtu", str(self.mtu)])
            sh(["ip", "netns", "exec", ns, "ethtool", "-K", "lo", "tso", "off", "gso", "off",
                "tx-udp-segmentation", "off", "gro", "off"])
            if self.rate:
                self._tbf(ns, "lo", self.rate, self.queue)
        family, hook = self._hook()
        sh(self.in_filter_ns(["nft", "-f", "-"]), input=(
            f"add table {family} {TABLE}\n"
            f"add counter {family} {TABLE} seen\n"
            f"add counter {family} {TABLE} dropped\n"
            f"add chain {family} {TABLE} count {{ {hook} priority -1 ; policy accept ; }}\n"
            f"add chain {family} {TABLE} drops {{ {hook} priority 0 ; policy accept ; }}\n"
            f"add chain {family} {TABLE} bursts {{ {hook} priority 1 ; policy accept ; }}\n"
            f'add rule {family} {TABLE} count {PACKETS} counter name "seen"\n'))

    def _sysctl(self, ns: str, values: Dict[str, str]) -> None:
        script = "".join(f"[ -e /proc/sys/{k} ] && echo {v} > /proc/sys/{k}\n"
                         for k, v in values.items())
        subprocess.run(["ip", "netns", "exec", ns, "sh", "-c", script + "true"],
                       capture_output=True)

    def _offloads(self, ns: str, dev: str, node: bool) -> None:
        if self.offloads == "on":
            return
        if self.offloads == "off" or not node:
            # switch ports: never merge frames back into super-packets
            opts = ["tso", "off", "gso", "off", "tx-udp-segmentation", "off", "gro", "off"]
        else:
            # a NIC: the stack segments after the qdisc (GSO), GRO merges on receipt
            opts = ["tso", "off", "tx-udp-segmentation", "off", "gso", "on", "gro", "on"]
        sh(["ip", "netns", "exec", ns, "ethtool", "-K", dev, *opts])

    def _tbf(self, ns: str, dev: str, rate: str, limit: str) -> None:
        sh(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
            "burst", self.burst, "limit", limit])

    def _namespaces(self) -> List[str]:
        """Those of this cluster's namespaces that exist (close() removes them)."""
        present = set(_netns_names())
        return [n for n in self.node_ns + [self.switch_ns] if n in present]

    # -- where the drops are ---------------------------------------------------
    def _hook(self) -> Tuple[str, str]:
        if self.loopback:
            return "netdev", 'type filter hook ingress device "lo"'
        return "bridge", "type filter hook forward"

    def chain(self, name: str) -> str:
        return f"{self._hook()[0]} {TABLE} {name}"

    def in_filter_ns(self, cmd: Sequence[str]) -> List[str]:
        """`cmd` in the namespace whose nftables drop: the switch (node 1 in
        loopback mode)."""
        ns = self.node_ns[0] if self.loopback else self.switch_ns
        return ["ip", "netns", "exec", ns, *cmd]

    # -- counters ----------------------------------------------------------------
    def counters(self) -> Dict[str, Any]:
        """What the wire saw: per switch port and per node NIC the tbf's
        packets, bytes, drops, overlimits; the nftables drops; per node the
        kernel's TCP and UDP counters (/proc/net/snmp, netstat)."""
        out: Dict[str, Any] = {"ports": {}, "nics": {}, "nodes": {}}
        for i, ns in enumerate(self.node_ns):
            port = f"p{i + 1}"
            out["ports"][port] = self._qdisc(self.switch_ns, port)
            out["nics"][self.names[i]] = self._qdisc(ns, "lo" if self.loopback else "eth0")
            out["nodes"][self.names[i]] = self._snmp(ns)
        out["switch_drops"] = self._nft_drops()
        total: Dict[str, int] = {}
        for node in out["nodes"].values():
            for k, v in node.items():
                total[k] = total.get(k, 0) + v
        out["kernel"] = total
        out["port_drops"] = sum(p.get("drops", 0) for p in out["ports"].values())
        return out

    def _qdisc(self, ns: str, dev: str) -> Dict[str, int]:
        proc = subprocess.run(["tc", "-n", ns, "-s", "-j", "qdisc", "show", "dev", dev],
                              capture_output=True, text=True)
        try:
            rows = json.loads(proc.stdout or "[]")
        except ValueError:
            return {}
        for row in rows:
            if row.get("kind") == "tbf":
                return {k: int(row.get(k, 0)) for k in ("packets", "bytes", "drops",
                                                        "overlimits", "backlog")}
        return {}

    def _snmp(self, ns: str) -> Dict[str, int]:
        proc = subprocess.run(["ip", "netns", "exec", ns, "cat", "/proc/net/snmp"],
                              capture_output=True, text=True)
        # (/proc/net/netstat: how TCP recovered its losses, by retransmission
        # timeout or by a tail loss probe; the scale model's TCP takes them)
        extra = subprocess.run(["ip", "netns", "exec", ns, "cat", "/proc/net/netstat"],
                               capture_output=True, text=True)
        lines = proc.stdout.splitlines() + extra.stdout.splitlines()
        stats: Dict[str, int] = {}
        wanted = {("Udp", "OutDatagrams"), ("Udp", "InDatagrams"), ("Udp", "RcvbufErrors"),
                  ("Tcp", "RetransSegs"), ("Tcp", "OutSegs"), ("TcpExt", "TCPTimeouts"),
                  ("TcpExt", "TCPLossProbes"), ("TcpExt", "TCPLossProbeRecovery"),
                  ("TcpExt", "TCPLostRetransmit")}
        for head, values in zip(lines[::2], lines[1::2]):
            proto, names = head.split(":", 1)
            for name, value in zip(names.split(), values.split(":", 1)[1].split()):
                if (proto, name) in wanted:
                    stats[f"{proto}.{name}"] = int(value)
        return stats

    def _nft_drops(self) -> Dict[str, int]:
        family = self._hook()[0]
        proc = subprocess.run(self.in_filter_ns(["nft", "-j", "list", "table", family, TABLE]),
                              capture_output=True, text=True)
        counts = {"seen": 0, "dropped": 0}
        try:
            items = json.loads(proc.stdout or "{}").get("nftables", [])
        except ValueError:
            items = []
        for item in items:
            counter = item.get("counter")
            if counter and counter.get("name") in counts:
                counts[counter["name"]] = int(counter.get("packets", 0))
        return counts
