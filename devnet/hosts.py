"""Separate hosts on one machine: a Linux network namespace per role, each with its own address on a bridge.

    prime-devnet up --hosts netns [--subnet 10.77.0.0/24]     (as root; needs iproute2's `ip`)

The plan (`plan_hosts`, pure, no root needed) names everything after a tag derived from the state directory,
so two devnets in two state directories never touch each other's links, and nothing outside the plan is ever
touched:

- a bridge `pnb<tag>` in the root namespace holding the subnet's first address (the *gateway*): the devnet
  process itself (summary, audit, dashboard, the deploy job) stays in the root namespace and reaches every
  host through it;
- per role (chain, origin, relay-i, validator-i, trainer, node-i) a namespace `prime-<tag>-<role>` with
  `lo` up and `eth0`, one end of a veth pair whose other end (`pnv<tag><i>`) is a port of the bridge, and the
  next address of the subnet.

The plan is written to `<state_dir>/hosts.json` *before* anything is created, so `prime-devnet down` from
another terminal, or the next `up` after a crash, removes exactly what this plan names (`teardown`).
Removing a namespace removes its end of the veth pair and with it the pair; the bridge goes last.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from devnet.tomlfile import write_atomic

log = logging.getLogger(__name__)

RECORD = "hosts.json"
DEFAULT_SUBNET = "10.77.0.0/24"
"""Private (RFC 1918), unlikely to collide with docker (172.17/16), libvirt (192.168.122/24) or a home LAN."""
IFNAMSIZ = 15
"""Longest Linux interface name."""


class HostsError(RuntimeError):
    """Separate hosts cannot be made here (not root, no `ip`, the subnet in use) or an `ip` command failed."""


@dataclass(frozen=True)
class Host:
    name: str
    """The role's process name (`validator-0`)."""
    netns: str
    """Its network namespace."""
    address: str
    """Its own address on the bridge (no prefix length)."""
    veth: str
    """The root-namespace end of its veth pair (a port of the bridge); `eth0` inside the namespace."""


@dataclass(frozen=True)
class HostPlan:
    tag: str
    subnet: str
    bridge: str
    gateway: str
    """The root namespace's address on the bridge (the devnet process reaches the hosts from it)."""
    hosts: tuple[Host, ...]

    @property
    def prefixlen(self) -> int:
        return ipaddress.ip_network(self.subnet).prefixlen

    def host(self, name: str) -> Host:
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(name)

    def exec_prefix(self, name: str) -> list[str]:
        """Prepended to a role's command so it runs inside its namespace (`ip netns exec` execs: same pid)."""
        return ["ip", "netns", "exec", self.host(name).netns]

    def save(self, state_dir: Path) -> Path:
        return write_atomic(Path(state_dir) / RECORD, json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, state_dir: Path) -> HostPlan | None:
        try:
            data = json.loads((Path(state_dir) / RECORD).read_text())
        except OSError:
            return None
        return cls(**{**data, "hosts": tuple(Host(**h) for h in data["hosts"])})


def state_tag(state_dir: Path) -> str:
    """6 hex digits naming this state directory's namespaces and links."""
    return hashlib.sha256(str(Path(state_dir).resolve()).encode()).hexdigest()[:6]


def plan_hosts(names: Sequence[str], *, tag: str, subnet: str = DEFAULT_SUBNET) -> HostPlan:
    """Addresses in order from the subnet: the gateway first, then one per name (ValueError when it is too small,
    not private, or a name repeats)."""
    net = ipaddress.ip_network(subnet, strict=True)
    if not isinstance(net, ipaddress.IPv4Network) or not net.is_private:
        raise ValueError(f"subnet {subnet}: must be a private IPv4 network (RFC 1918), e.g. {DEFAULT_SUBNET}")
    if len(set(names)) != len(names):
        raise ValueError(f"host names repeat: {list(names)}")
    addrs = list(net.hosts())
    if len(addrs) < len(names) + 1:
        raise ValueError(f"subnet {subnet} has {len(addrs)} addresses; {len(names) + 1} are needed")
    if not tag.isalnum() or len(f"pnv{tag}{len(names) - 1}") > IFNAMSIZ:
        raise ValueError(f"tag {tag!r}: must be short and alphanumeric")
    hosts = tuple(Host(name=n, netns=f"prime-{tag}-{n}", address=str(addrs[i + 1]), veth=f"pnv{tag}{i}")
                  for i, n in enumerate(names))
    return HostPlan(tag=tag, subnet=str(net), bridge=f"pnb{tag}", gateway=str(addrs[0]), hosts=hosts)


# -- the kernel side (root only) ------------------------------------------------------------------------------


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise HostsError(f"`ip {' '.join(args)}` failed: {proc.stderr.strip() or proc.returncode}")
    return proc


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if not Path("/proc/self/ns/net").exists():
        return "no Linux network namespaces on this system (--hosts netns needs Linux)"
    if os.geteuid() != 0:
        return "--hosts netns must run as root (it creates network namespaces, a bridge and veth pairs)"
    if shutil.which("ip") is None:
        return "--hosts netns needs iproute2's `ip` on PATH (apt-get install iproute2)"
    return None


def namespaces() -> set[str]:
    out = _ip("netns", "list", check=False).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def link_exists(name: str) -> bool:
    return _ip("link", "show", "dev", name, check=False).returncode == 0


def subnet_in_use(subnet: str) -> str | None:
    """The interface of the root namespace already holding an address or route inside `subnet`, if any."""
    net = ipaddress.ip_network(subnet)
    for line in _ip("-o", "-4", "addr", "show").stdout.splitlines():
        parts = line.split()
        if "inet" in parts:
            iface = ipaddress.ip_interface(parts[parts.index("inet") + 1])
            if iface.network.overlaps(net):
                return parts[1]
    for line in _ip("-4", "route", "show").stdout.splitlines():
        dest = line.split()[0]
        if dest != "default" and ipaddress.ip_network(dest, strict=False).overlaps(net):
            return f"route {line.strip()}"
    return None


def create(plan: HostPlan, state_dir: Path) -> None:
    """Make the bridge and every host of `plan` (recorded first: a failure half-way is cleaned by `teardown`)."""
    why = unavailable()
    if why:
        raise HostsError(why)
    teardown(state_dir)  # a crashed run's leftovers with the same names
    used = subnet_in_use(plan.subnet)
    if used:
        raise HostsError(f"subnet {plan.subnet} is already in use here ({used}); give another with --subnet")
    plan.save(state_dir)
    try:
        _ip("link", "add", plan.bridge, "type", "bridge")
        _ip("addr", "add", f"{plan.gateway}/{plan.prefixlen}", "dev", plan.bridge)
        _ip("link", "set", plan.bridge, "up")
        for h in plan.hosts:
            _ip("netns", "add", h.netns)
            _ip("-n", h.netns, "link", "set", "lo", "up")
            _ip("link", "add", h.veth, "type", "veth", "peer", "name", "eth0", "netns", h.netns)
            _ip("link", "set", h.veth, "master", plan.bridge, "up")
            _ip("-n", h.netns, "addr", "add", f"{h.address}/{plan.prefixlen}", "dev", "eth0")
            _ip("-n", h.netns, "link", "set", "eth0", "up")
            _ip("-n", h.netns, "route", "add", "default", "via", plan.gateway)
    except HostsError:
        teardown(state_dir)
        raise
    log.info("hosts: %d namespaces on bridge %s (%s, gateway %s)", len(plan.hosts), plan.bridge, plan.subnet,
             plan.gateway)


def set_link(plan: HostPlan, name: str, up: bool) -> None:
    """Cut role `name`'s host off the network (`eth0` down inside its namespace) or bring it back: a partition.
    Its processes keep running and its own loopback keeps working; every peer sees it as unreachable."""
    host = plan.host(name)
    if host.netns not in namespaces():
        raise HostsError(f"{name}: no namespace {host.netns} (is the devnet running?)")
    _ip("-n", host.netns, "link", "set", "eth0", "up" if up else "down")
    if up:  # the default route goes with the link: put it back
        _ip("-n", host.netns, "route", "replace", "default", "via", plan.gateway)


def link_up(plan: HostPlan, name: str) -> bool:
    out = _ip("-n", plan.host(name).netns, "-o", "link", "show", "dev", "eth0").stdout
    return "state UP" in out or ",UP" in out.split(">")[0]


def leftovers(plan: HostPlan) -> list[str]:
    """Namespaces and links of `plan` that still exist."""
    live = namespaces()
    left = [h.netns for h in plan.hosts if h.netns in live]
    left += [name for name in [h.veth for h in plan.hosts] + [plan.bridge] if link_exists(name)]
    return left


def teardown(state_dir: Path) -> list[str]:
    """Remove every namespace and link the record in `state_dir` names (those that still exist); the names of
    what was removed. Run after the roles' processes stopped (a namespace lives on while a process is in it)."""
    plan = HostPlan.load(state_dir)
    if plan is None or shutil.which("ip") is None:
        return []
    removed = []
    live = namespaces()
    for h in plan.hosts:
        if h.netns in live:
            _ip("netns", "delete", h.netns, check=False)
            removed.append(h.netns)
    if link_exists(plan.bridge):
        _ip("link", "delete", plan.bridge, check=False)
        removed.append(plan.bridge)
    # the kernel removes a veth pair with its namespace, but not at once: wait, then delete what still is there
    deadline = time.monotonic() + 5.0
    while (left := leftovers(plan)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for name in left:
        _ip("link", "delete", name, check=False) if name.startswith("pn") else _ip("netns", "delete", name,
                                                                                    check=False)
    left = leftovers(plan)
    if left:
        raise HostsError(f"could not remove {left}")
    if removed:
        log.info("hosts: removed %s", removed)
    return removed
