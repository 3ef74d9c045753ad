"""`prime-relay relay` with discovery on: it announces its URL and the versions it holds completely,
and stops cleanly on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from discovery_harness import DOMAIN, LOOPBACK, ROOT, wait_until
from netfixtures import free_port

from discovery.admission import Trust
from discovery.config import DiscoveryConfig
from discovery.service import Discovery
from protocol.identity import Identity
from shardcast.publisher import publish_blocking

pytestmark = pytest.mark.timeout(120)


def _start(*args: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-m", "shardcast.cli", "--log-level", "WARNING", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        raise AssertionError(f"{args[0]} did not start: {line!r} {proc.communicate(timeout=10)[1][-2000:]}")
    return proc


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_relay_announces_its_url_and_complete_versions(tmp_path: Path,
                                                      processes: list[subprocess.Popen[str]]) -> None:
    trainer = Identity.create()
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "model.bin").write_bytes(os.urandom(200_000))
    publish_blocking(ckpt, tmp_path / "origin", identity=trainer, run_id="run-a", shard_size=64 << 10)
    origin_port, relay_port = free_port(), free_port()
    processes.append(_start("origin", "--store", str(tmp_path / "origin"), "--run-id", "run-a",
                            "--port", str(origin_port)))

    reader = Discovery(DiscoveryConfig(enabled=True, listen=[LOOPBACK], target_peers=0), identity=Identity.create(),
                       domain=DOMAIN, trust=Trust(trainer=trainer.address), state_dir=tmp_path / "reader")
    reader.start()
    try:
        relay = _start("relay", "--store", str(tmp_path / "relay"), "--upstream", f"http://127.0.0.1:{origin_port}",
                       "--trainer", trainer.address, "--run-id", "run-a", "--port", str(relay_port),
                       "--discovery-bootstrap", reader.addrs[0], "--discovery-domain", DOMAIN)
        processes.append(relay)
        wait_until(lambda: len(reader.board.relays(1)) == 1, "the relay's announcement of v1", timeout=60)
        [ann] = reader.board.relays(1)
        assert ann.body.http_url == f"http://127.0.0.1:{relay_port}"  # type: ignore[union-attr]
        assert ann.body.versions == (1,)  # type: ignore[union-attr]
        assert ann.body.peer_id in reader.peers()
        relay.send_signal(signal.SIGTERM)
        assert relay.wait(30) == 0
        # Its libp2p identity stays with its store.
        assert (tmp_path / "relay" / "libp2p.key").stat().st_mode & 0o777 == 0o600
    finally:
        reader.stop()


def test_relay_without_a_domain_refuses_discovery(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "shardcast.cli", "relay", "--store", str(tmp_path / "r"),
                           "--upstream", "http://127.0.0.1:9", "--trainer", Identity.create().address,
                           "--discovery"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode != 0 and "--discovery-domain" in proc.stderr
