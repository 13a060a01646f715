"""Two emulated sites of several hosts each, like cloud VMs in two regions (needs root).

Each host is a network namespace. Inside a site the hosts share a fast local network: a veth
from each host to a bridge in the site's switch namespace, with no cap and no delay. Each host
has its own WAN path: a wanem emulator from the host's ``wan0`` to a TUN device in the *other*
site's switch, which forwards onto that site's bridge. So a host's egress towards the other
site is capped on its own (rate, one-way delay, loss, queue), as clouds cap each VM, and the
bandwidth between the sites is the sum over the senders::

    a0 ─lan0─┐                 ┌─ wan-a0 ◄══ a0's WAN path (cap, delay, loss) ══ a0 wan0
    a1 ─lan0─┴─ br0  site a    site b  br0 ─┬─lan0─ b0
                switch (asw)   switch (bsw) └─lan0─ b1
    (and b0, b1 each send over their own WAN path into asw's wan-b0, wan-b1)

Routing is asymmetric on purpose: a0 -> b1 leaves over a0's path and enters through bsw, b1's
answer leaves over b1's path and enters through asw. Half the RTT is spent each way.
"""
from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from .netns import (
    DEFAULT_PREFIX, DEFAULT_WINDOW_KB, DEV, Link, Topology, WanemError, _sh, check_cc, check_link, route_to, wan_link,
)

SITES = ("a", "b")
SUBNETS = {"a": "198.18.1", "b": "198.18.2"}  # RFC 2544 benchmarking range, only inside our namespaces
SWITCH_HOST = 254
LAN = "lan0"
MAX_HOSTS = 200
_NO_RP_FILTER = {"net.ipv4.conf.all.rp_filter": "0", "net.ipv4.conf.default.rp_filter": "0"}


@dataclass(frozen=True)
class Host:
    """One emulated machine: site ``a`` or ``b``, its index there, its namespace and address."""

    site: str
    index: int
    ns: str
    addr: str
    egress: Link

    @property
    def name(self) -> str:
        return f"{self.site}{self.index}"


class WanSites(Topology):
    """Sites ``a`` and ``b`` of ``hosts`` namespaces each (or a pair of counts), every host with
    its own capped WAN path to the other site.

    rate_mbit, rtt_ms, loss, queue_kb, queue_pkts: each host's egress towards the other site
    (as :class:`~bench.wanem.netns.WanPath`; the queue defaults to 20 ms at the rate);
    ``egress``: explicit per-host Links by host name (``{"a1": Link(20, 500)}``); window_kb
    and cc: as for WanPath, in every host.
    """

    def __init__(self, hosts: int | tuple[int, int] = 2, rtt_ms: float = 40.0, rate_mbit: float = 250.0,
                 loss: float = 0.0, queue_kb: float | None = None, queue_pkts: int | None = None, *,
                 egress: dict[str, Link] | None = None, window_kb: float | None = DEFAULT_WINDOW_KB,
                 cc: str | None = None, seed: int = 1, offload: bool = True, prefix: str = DEFAULT_PREFIX):
        super().__init__(prefix)
        counts = (hosts, hosts) if isinstance(hosts, int) else tuple(hosts)
        if len(counts) != 2 or not all(isinstance(k, int) and 1 <= k <= MAX_HOSTS for k in counts):
            raise ValueError(f"hosts must be 1..{MAX_HOSTS} per site (an int or a pair), got {hosts!r}")
        default = wan_link(rtt_ms, rate_mbit, loss, queue_kb, queue_pkts)
        egress = dict(egress or {})
        self.sites: dict[str, list[Host]] = {}
        for site, count in zip(SITES, counts):
            self.sites[site] = [Host(site, i, f"{self.name}-{site}{i}", f"{SUBNETS[site]}.{i + 1}",
                                     egress.pop(f"{site}{i}", default)) for i in range(count)]
        if egress:
            raise ValueError(f"egress names unknown hosts {sorted(egress)}; hosts are {[h.name for h in self.hosts]}")
        for host in self.hosts:
            check_link(host.egress)
        check_cc(cc)
        self.rtt_ms, self.window_kb, self.cc, self.seed, self.offload = rtt_ms, window_kb, cc, seed, offload
        self.final_stats: dict[str, dict | None] = {}

    @property
    def hosts(self) -> list[Host]:
        """Every host, site a's first."""
        return [host for site in SITES for host in self.sites[site]]

    def host(self, name: str) -> Host:
        """The host called ``name`` (``"a0"``, ``"b1"``...)."""
        for host in self.hosts:
            if host.name == name:
                return host
        raise KeyError(f"no host {name!r}; hosts are {[h.name for h in self.hosts]}")

    def switch(self, site: str) -> str:
        """The namespace of ``site``'s switch (bridge and the other site's WAN ends)."""
        return f"{self.name}-{site}sw"

    # -- building ---------------------------------------------------------------------------

    def _build(self, binary: Path) -> None:
        for site in SITES:
            self._add_namespace(f"{site}sw")
            self._set_sysctls(self.switch(site), None, {**_NO_RP_FILTER, "net.ipv4.ip_forward": "1"})
            _sh(["ip", "-n", self.switch(site), "-batch", "-"], input="\n".join([
                "link set lo up", "link add br0 type bridge", f"addr add {SUBNETS[site]}.{SWITCH_HOST}/24 dev br0",
                "link set br0 up"]) + "\n")
        for host in self.hosts:
            self._add_namespace(host.name)
            self._set_sysctls(host.ns, self.window_kb, _NO_RP_FILTER)
        for i, host in enumerate(self.hosts):
            remote = self._other(host.site)
            # Egress (a->b of this emulator) carries the host's traffic; the way back is unused
            # (answers come over the other host's own path) and left unlimited.
            self._start_emulator(binary, host.ns, self.switch(remote), host.egress, Link(host.egress.delay_ms),
                                 seed=self.seed + i, offload=self.offload, dev_b=self._wan_end(host))
            self._wire(host, remote)

    def _wire(self, host: Host, remote: str) -> None:
        switch, port, wan_end = self.switch(host.site), f"lan-{host.name}", self._wan_end(host)
        _sh(["ip", "-n", switch, "-batch", "-"], input="\n".join([
            f"link add {port} type veth peer name {LAN} netns {host.ns}",
            f"link set {port} master br0 up"]) + "\n")
        _sh(["ip", "-n", self.switch(remote), "-batch", "-"], input="\n".join([
            f"link set {wan_end} mtu 1500 txqueuelen 1000 up",
            f"route replace {host.addr}/32 dev {wan_end}"]) + "\n")
        _sh(["ip", "-n", host.ns, "-batch", "-"], input="\n".join([
            "link set lo up", f"link set {LAN} up", f"addr add {host.addr}/24 dev {LAN}",
            f"link set {DEV} mtu 1500 txqueuelen 1000 up",
            route_to(f"{SUBNETS[remote]}.0/24", DEV, host.addr, self.cc)]) + "\n")
        _sh(["ip", "netns", "exec", host.ns, "sysctl", "-q", "-w", f"net.ipv4.conf.{LAN}.rp_filter=0",
             f"net.ipv4.conf.{DEV}.rp_filter=0"])

    @staticmethod
    def _other(site: str) -> str:
        return SITES[1 - SITES.index(site)]

    @staticmethod
    def _wan_end(host: Host) -> str:
        return f"wan-{host.name}"

    def _final_stats(self, stats: list[dict | None]) -> None:
        self.final_stats = {host.name: s and _by_direction(s) for host, s in zip(self.hosts, stats)}

    # -- running things inside ----------------------------------------------------------------

    def cmd(self, host: Host | str, argv: list[str]) -> list[str]:
        """``argv`` wrapped to run on ``host`` (a Host or its name)."""
        return self.cmd_in(self._resolve(host).ns, argv)

    def run(self, host: Host | str, argv: list[str], **kw) -> subprocess.CompletedProcess:
        """subprocess.run on ``host``."""
        return subprocess.run(self.cmd(host, argv), **kw)

    def popen(self, host: Host | str, argv: list[str], **kw) -> subprocess.Popen:
        """subprocess.Popen on ``host``; terminated by down() if still running."""
        return self.popen_in(self._resolve(host).ns, argv, **kw)

    def _resolve(self, host: Host | str) -> Host:
        return self.host(host) if isinstance(host, str) else host

    def stats(self) -> dict[str, dict]:
        """Each host's WAN emulator counters by host name: ``"egress"`` (what it sent towards the
        other site) and ``"ingress"`` (the unused way back)."""
        if not self._emulators:
            raise WanemError("sites are not up")
        return {host.name: _by_direction(e.stats()) for host, e in zip(self.hosts, self._emulators)}

    def cpu_seconds(self) -> float:
        """CPU time all the hosts' emulators have used so far."""
        return sum(e.cpu_seconds() for e in self._emulators)


def _by_direction(stats: dict) -> dict:
    return {"egress": stats["ab"], "ingress": stats["ba"]}
