"""The plan of `prime-devnet up --hosts netns` (no root needed): one namespace and address per role on a private
subnet, names the kernel accepts and that no two state directories share, a record that `down` can read back, and
a clear refusal where namespaces cannot be made."""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
from pathlib import Path

import pytest

from devnet.config import load_config
from devnet.hosts import IFNAMSIZ, RECORD, HostPlan, plan_hosts, state_tag, teardown
from devnet.network import NETNS_PORTS, Network

REPO = Path(__file__).resolve().parents[3]
NAMES = ["chain", "origin", "relay-0", "relay-1", "validator-0", "validator-1", "trainer", "node-0", "node-1",
         "node-2"]


def test_every_role_gets_its_own_address_and_names_the_kernel_accepts(tmp_path: Path) -> None:
    plan = plan_hosts(NAMES, tag=state_tag(tmp_path), subnet="10.77.0.0/24")
    assert plan.gateway == "10.77.0.1"
    assert [h.address for h in plan.hosts] == [f"10.77.0.{i}" for i in range(2, 2 + len(NAMES))]
    assert [h.name for h in plan.hosts] == NAMES
    addresses = [plan.gateway] + [h.address for h in plan.hosts]
    assert len(set(addresses)) == len(addresses)
    assert all(ipaddress.ip_address(a) in ipaddress.ip_network(plan.subnet) for a in addresses)
    links = [plan.bridge] + [h.veth for h in plan.hosts]
    assert len(set(links)) == len(links) and all(len(n) <= IFNAMSIZ for n in links)
    assert len({h.netns for h in plan.hosts}) == len(NAMES)
    assert all(plan.tag in n for n in links + [h.netns for h in plan.hosts])  # ours, and only ours, by name
    assert plan.exec_prefix("validator-1") == ["ip", "netns", "exec", plan.host("validator-1").netns]


def test_two_state_directories_never_share_a_name(tmp_path: Path) -> None:
    a = plan_hosts(NAMES, tag=state_tag(tmp_path / "a"))
    b = plan_hosts(NAMES, tag=state_tag(tmp_path / "b"))
    assert state_tag(tmp_path / "a") == state_tag(tmp_path / "a" / ".." / "a")
    assert a.bridge != b.bridge
    assert not {h.netns for h in a.hosts} & {h.netns for h in b.hosts}
    assert not {h.veth for h in a.hosts} & {h.veth for h in b.hosts}


def test_the_largest_devnet_fits_and_bad_subnets_are_refused() -> None:
    biggest = ["chain", "origin"] + [f"relay-{i}" for i in range(8)] + [f"validator-{i}" for i in range(8)] + [
        "trainer"] + [f"node-{i}" for i in range(20)]
    plan = plan_hosts(biggest, tag="abc123", subnet="192.168.77.0/26")
    assert all(len(h.veth) <= IFNAMSIZ for h in plan.hosts)
    with pytest.raises(ValueError, match="addresses"):
        plan_hosts(NAMES, tag="abc123", subnet="10.77.0.0/29")  # 6 usable, 11 needed
    with pytest.raises(ValueError, match="private"):
        plan_hosts(NAMES, tag="abc123", subnet="8.8.8.0/24")  # never someone else's addresses
    with pytest.raises(ValueError):
        plan_hosts(NAMES, tag="abc123", subnet="10.77.0.1/24")  # host bits set: a typo, not a network
    with pytest.raises(ValueError, match="repeat"):
        plan_hosts(["node-0", "node-0"], tag="abc123")


def test_the_cleanup_record_reads_back(tmp_path: Path) -> None:
    plan = plan_hosts(NAMES, tag=state_tag(tmp_path), subnet="10.88.0.0/24")
    plan.save(tmp_path)
    assert (tmp_path / RECORD).exists()
    assert HostPlan.load(tmp_path) == plan
    assert HostPlan.load(tmp_path / "elsewhere") is None
    assert teardown(tmp_path / "elsewhere") == []  # no record: nothing is touched


def test_netns_mode_binds_and_advertises_each_hosts_address(tmp_path: Path) -> None:
    cfg = load_config(["--hosts", "netns", "--subnet", "10.78.0.0/24", "--state-dir", str(tmp_path / "s"),
                       "--nodes", "3", "--validators", "2", "--relays", "2"])
    net = Network(cfg)  # plans only; namespaces are made by up()
    assert net.hosts is not None and net.gateway == "10.78.0.1"
    assert {h.name for h in net.hosts.hosts} == set(NAMES)
    assert net.address("validator-1") == net.hosts.host("validator-1").address != "127.0.0.1"
    assert net.url("node-2", net.port("node")) == f"http://{net.hosts.host('node-2').address}:{NETNS_PORTS['node']}"
    assert net.command("relay-0", ["x"]) == ["ip", "netns", "exec", net.hosts.host("relay-0").netns, "x"]
    local = Network(load_config(["--state-dir", str(tmp_path / "l")]))
    assert local.hosts is None and local.gateway is None
    assert local.address("node-0") == "127.0.0.1" and local.command("node-0", ["x"]) == ["x"]


def test_up_without_ip_says_why_and_makes_nothing(tmp_path: Path) -> None:
    state = tmp_path / "s"
    proc = subprocess.run([sys.executable, "-m", "devnet.cli", "up", "--hosts", "netns", "--state-dir", str(state)],
                          cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PATH": str(tmp_path), "PYTHONPATH": str(REPO)})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "--hosts netns" in proc.stderr and ("`ip`" in proc.stderr or "root" in proc.stderr), proc.stderr
    assert not (state / RECORD).exists()
    assert not [p for p in (state / "logs").glob("*.log")]  # no role was started
