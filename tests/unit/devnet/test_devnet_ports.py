"""`free_port`: the ports it hands out are claimed for every process on the machine, so two suites (or a
suite and a devnet) running at once never draw the same one in the time between drawing it and binding it."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from devnet import network


@pytest.fixture
def three_ports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A window of three ports (all bindable as far as the draw knows), claims kept under `tmp_path`."""
    monkeypatch.setattr(network, "_ephemeral_low", lambda: 40003)
    monkeypatch.setattr(network, "PORT_WINDOW", 3)
    monkeypatch.setattr(network, "_bindable", lambda port: True)
    monkeypatch.setattr(network, "_claims_dir", lambda: tmp_path / "claims")
    return [40000, 40001, 40002]


def _claimed_by_another(tmp_path: Path, port: int, age_s: float = 0.0) -> None:
    path = tmp_path / "claims" / str(port)
    path.parent.mkdir(exist_ok=True)
    path.touch()
    if age_s:
        os.utime(path, (time.time() - age_s, time.time() - age_s))


def test_a_port_another_process_claimed_is_not_handed_out(tmp_path: Path, three_ports: list[int]) -> None:
    _claimed_by_another(tmp_path, three_ports[0])
    _claimed_by_another(tmp_path, three_ports[2])
    assert network.free_port() == three_ports[1]
    # all three claimed now (the last by this call): the next comes from the kernel, outside the window
    assert network.free_port() not in three_ports


def test_a_stale_claim_is_taken_over(tmp_path: Path, three_ports: list[int]) -> None:
    for port in three_ports[:2]:
        _claimed_by_another(tmp_path, port)
    _claimed_by_another(tmp_path, three_ports[2], age_s=network.PORT_CLAIM_S + 5)
    assert network.free_port() == three_ports[2]
    assert time.time() - (tmp_path / "claims" / str(three_ports[2])).stat().st_mtime < network.PORT_CLAIM_S


def test_without_a_writable_claims_directory_the_bind_test_alone_decides(
        tmp_path: Path, three_ports: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "file").write_text("")
    monkeypatch.setattr(network, "_claims_dir", lambda: tmp_path / "file" / "claims")  # under a file: mkdir fails
    assert network.free_port() in three_ports
