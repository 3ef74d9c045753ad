"""The plan of `prime-devnet up --hosts netns` (no root needed): one namespace and address per role on a private
subnet, names the kernel accepts and that no two state directories share, a record that `down` can read back, and
a clear refusal where namespaces cannot be made."""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
import time
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
    assert net.listen("validator-0") == [f"/ip4/{net.hosts.host('validator-0').address}/tcp/4001"]
    local = Network(load_config(["--state-dir", str(tmp_path / "l")]))
    assert local.hosts is None and local.gateway is None
    assert local.address("node-0") == "127.0.0.1" and local.command("node-0", ["x"]) == ["x"]
    assert local.listen("validator-0") == []


def test_up_without_ip_says_why_and_makes_nothing(tmp_path: Path) -> None:
    state = tmp_path / "s"
    proc = subprocess.run([sys.executable, "-m", "devnet.cli", "up", "--hosts", "netns", "--state-dir", str(state)],
                          cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PATH": str(tmp_path), "PYTHONPATH": str(REPO)})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "--hosts netns" in proc.stderr and ("`ip`" in proc.stderr or "root" in proc.stderr), proc.stderr
    assert not (state / RECORD).exists()
    assert not [p for p in (state / "logs").glob("*.log")]  # no role was started


def _answers(address: str) -> bool:
    """Something at `address` answers (a refused connection is an answer; silence is not)."""
    import socket

    s = socket.socket()
    s.settimeout(1.0)
    try:
        s.connect((address, 9))  # nothing listens: a reachable host refuses at once
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    finally:
        s.close()
    return True


@pytest.mark.timeout(120)
def test_namespaces_are_made_cut_healed_and_removed(tmp_path: Path) -> None:
    """As root (skipped elsewhere): the plan becomes namespaces on a bridge, each reachable at its address from
    the root namespace; `cut` silences one host, `heal` brings it back; teardown leaves nothing."""
    from devnet.hosts import create, leftovers, link_up, set_link, unavailable

    why = unavailable()
    if why:
        pytest.skip(why)
    plan = plan_hosts(["a", "b"], tag=state_tag(tmp_path), subnet="10.81.7.0/29")
    try:
        create(plan, tmp_path)
        assert HostPlan.load(tmp_path) == plan
        assert leftovers(plan) == [h.netns for h in plan.hosts] + [h.veth for h in plan.hosts] + [plan.bridge]
        a, b = plan.hosts
        assert _answers(a.address) and _answers(b.address)
        set_link(plan, "a", up=False)
        assert not link_up(plan, "a") and not _answers(a.address) and _answers(b.address)
        set_link(plan, "a", up=True)
        deadline = time.monotonic() + 10
        while not _answers(a.address) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert link_up(plan, "a") and _answers(a.address)
        # a process in a namespace binds its host's address, and the root namespace reaches it there
        out = subprocess.run(plan.exec_prefix("b") + [sys.executable, "-c", (
            "import socket; s = socket.socket(); s.bind(('" + b.address + "', 0)); print(s.getsockname()[0])")],
            capture_output=True, text=True, timeout=30)
        assert out.stdout.strip() == b.address, out.stderr
    finally:
        # as after a crash: `prime-devnet down` from another terminal removes what the record names
        down = subprocess.run([sys.executable, "-m", "devnet.cli", "down", "--state-dir", str(tmp_path)], cwd=REPO,
                              capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
        left = leftovers(plan)
        teardown(tmp_path)  # whatever happened above, leave nothing behind
    assert down.returncode == 0 and "removed 3 namespaces/links" in down.stdout  # 2 namespaces (their veths go with them), the bridge, down.stdout + down.stderr
    assert left == []
