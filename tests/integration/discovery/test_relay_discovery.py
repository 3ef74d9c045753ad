"""`prime-relay relay` and `prime-relay origin` with discovery on: each announces its URL and the versions it
holds completely, serves the announcements it believes at `GET /v1/announcements` (the HTTP fallback: a reader
without libp2p learns the origin from the relay), and stops cleanly on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from discovery_harness import DOMAIN, LOOPBACK, ROOT, wait_until
from netfixtures import free_port

from discovery.admission import Admission, Trust, allow
from discovery.board import AnnouncementBoard
from discovery.config import DiscoveryConfig
from discovery.http import fetch_announcements
from discovery.service import Discovery
from protocol.identity import Identity
from shardcast.publisher import publish_blocking

pytestmark = pytest.mark.timeout(120)


def _start(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "shardcast.cli", "--log-level", "WARNING", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
    )
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


def test_relay_announces_its_url_and_complete_versions(
    tmp_path: Path, processes: list[subprocess.Popen[str]]
) -> None:
    trainer = Identity.create()
    staked = (
        Identity.create()
    )  # a key the run believes for relays (a staked node's, say): the relay announces with it
    keys = {"ORIGIN_KEY": trainer.account.key.hex(), "RELAY_KEY": staked.account.key.hex()}
    trust = Trust(trainer=trainer.address, relay_signer=allow([staked.address]))
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "model.bin").write_bytes(os.urandom(200_000))
    publish_blocking(ckpt, tmp_path / "origin", identity=trainer, run_id="run-a", shard_size=64 << 10)
    origin_port, relay_port = free_port(), free_port()
    reader = Discovery(
        DiscoveryConfig(enabled=True, listen=[LOOPBACK], target_peers=0),
        identity=Identity.create(),
        domain=DOMAIN,
        trust=trust,
        state_dir=tmp_path / "reader",
    )
    reader.start()
    try:
        processes.append(
            _start(
                "origin",
                "--store",
                str(tmp_path / "origin"),
                "--run-id",
                "run-a",
                "--port",
                str(origin_port),
                "--trainer",
                trainer.address,
                "--discovery-bootstrap",
                reader.addrs[0],
                "--discovery-domain",
                DOMAIN,
                "--announce-key-env",
                "ORIGIN_KEY",
                env=keys,
            )
        )
        relay = _start(
            "relay",
            "--store",
            str(tmp_path / "relay"),
            "--upstream",
            f"http://127.0.0.1:{origin_port}",
            "--trainer",
            trainer.address,
            "--run-id",
            "run-a",
            "--port",
            str(relay_port),
            "--discovery-bootstrap",
            reader.addrs[0],
            "--discovery-domain",
            DOMAIN,
            "--announce-key-env",
            "RELAY_KEY",
            env=keys,
        )
        processes.append(relay)
        mine = f"http://127.0.0.1:{relay_port}"

        def relay_announcements() -> list[Any]:
            return [a for a in reader.board.relays(1) if a.body.http_url == mine]  # type: ignore[union-attr]

        wait_until(relay_announcements, "the relay's announcement of v1", timeout=60)
        [ann] = relay_announcements()
        assert ann.body.versions == (1,)
        assert ann.body.peer_id in reader.peers()

        # HTTP fallback: a reader with no libp2p learns the origin and the relay from the relay's
        # /v1/announcements, every envelope checked as on gossip
        origin_url, relay_url = f"http://127.0.0.1:{origin_port}", f"http://127.0.0.1:{relay_port}"
        wait_until(
            lambda: {a.body.http_url for a in reader.board.relays(1)} == {origin_url, relay_url},  # type: ignore[union-attr]
            "the origin's announcement",
            timeout=60,
        )
        board = AnnouncementBoard()
        deadline = time.monotonic() + 30
        while {a.body.http_url for a in board.relays(1)} != {origin_url, relay_url}:  # type: ignore[union-attr]
            assert time.monotonic() < deadline, [a.body for a in board.relays(1)]
            fetch_announcements(relay_url, Admission(domain=DOMAIN, trust=trust), board)
            time.sleep(0.2)
        assert httpx.get(
            origin_url + "/v1/announcements", timeout=10
        ).json()  # the origin serves its own view

        # a relay whose only configured upstream is dead learns the origin and the relay from announcements and
        # installs v1 from them (verified as from any upstream)
        late_port = free_port()
        processes.append(
            _start(
                "relay",
                "--store",
                str(tmp_path / "late"),
                "--upstream",
                f"http://127.0.0.1:{free_port()}",
                "--trainer",
                trainer.address,
                "--run-id",
                "run-a",
                "--port",
                str(late_port),
                "--discovery-bootstrap",
                reader.addrs[0],
                "--discovery-domain",
                DOMAIN,
                "--relay-signer",
                staked.address,
            )
        )

        def late_has_v1() -> bool:
            index = httpx.get(f"http://127.0.0.1:{late_port}/versions", timeout=10).json()
            return any(v["version"] == 1 and v["complete"] for v in index["versions"])

        wait_until(late_has_v1, "v1 on the relay that learned its upstreams", timeout=60)

        relay.send_signal(signal.SIGTERM)
        assert relay.wait(30) == 0
        # Its libp2p identity stays with its store.
        assert (tmp_path / "relay" / "libp2p.key").stat().st_mode & 0o777 == 0o600
        assert (tmp_path / "origin" / "libp2p.key").stat().st_mode & 0o777 == 0o600
    finally:
        reader.stop()


def test_without_discovery_there_are_no_announcements(
    tmp_path: Path, processes: list[subprocess.Popen[str]]
) -> None:
    port = free_port()
    processes.append(
        _start("origin", "--store", str(tmp_path / "origin"), "--run-id", "run-a", "--port", str(port))
    )
    assert httpx.get(f"http://127.0.0.1:{port}/v1/announcements", timeout=10).status_code == 404


def test_origin_with_discovery_needs_the_trainer(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardcast.cli",
            "origin",
            "--store",
            str(tmp_path / "o"),
            "--run-id",
            "run-a",
            "--discovery",
            "--discovery-domain",
            DOMAIN,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode != 0 and "--trainer" in proc.stderr


def test_relay_without_a_domain_refuses_discovery(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardcast.cli",
            "relay",
            "--store",
            str(tmp_path / "r"),
            "--upstream",
            "http://127.0.0.1:9",
            "--trainer",
            Identity.create().address,
            "--discovery",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode != 0 and "--discovery-domain" in proc.stderr
