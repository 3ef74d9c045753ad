"""Several libp2p discovery hosts on 127.0.0.1 in one test process (and one in a subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from libp2p.crypto.ed25519 import create_new_key_pair

from discovery.admission import Trust, allow, anyone
from discovery.config import DiscoveryConfig
from discovery.host import GossipHost
from discovery.messages import Topic, topic_name
from discovery.service import Discovery
from protocol.identity import Identity

DOMAIN = "prime/31337/0x5FbDB2315678afecb367f032d93F642f64180aa3/run-a"
TOPICS = [topic_name(DOMAIN, t) for t in Topic]
ROOT = Path(__file__).resolve().parents[3]
LOOPBACK = "/ip4/127.0.0.1/tcp/0"


def wait_until(pred: Callable[[], object], what: str, timeout: float = 20.0) -> None:
    """Poll `pred` until true; AssertionError naming `what` after `timeout` s (a bound, not a measurement)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


@dataclass
class Net:
    """Identities of a run and the discovery hosts started for one test (all stopped at teardown)."""

    root: Path
    trainer: Identity = field(default_factory=Identity.create)
    validators: list[Identity] = field(default_factory=lambda: [Identity.create() for _ in range(3)])
    hosts: list[Discovery] = field(default_factory=list)
    raw: list[GossipHost] = field(default_factory=list)

    @property
    def trust(self) -> Trust:
        # relay_signer=anyone: these tests are about the gossip transport (who may announce a relay is
        # tests/unit/discovery/test_admission.py)
        return Trust(
            trainer=self.trainer.address,
            is_validator=allow(v.address for v in self.validators),
            relay_signer=anyone,
        )

    def start(
        self,
        identity: Identity | None = None,
        bootstrap: list[str] | None = None,
        *,
        start: bool = True,
        listen_only: bool = False,
        topics: list[Topic] | None = None,
        **cfg: Any,
    ) -> Discovery:
        """A (started) Discovery; `target_peers=0` by default so the topology is only what the test wires."""
        cfg.setdefault("target_peers", 0)
        cfg.setdefault("reannounce_s", 1.0)
        config = DiscoveryConfig(enabled=True, listen=[LOOPBACK], bootstrap=bootstrap or [], **cfg)
        state = self.root / f"host{len(self.hosts)}"
        disc = Discovery(
            config,
            identity=None if listen_only else identity or Identity.create(),
            domain=DOMAIN,
            trust=self.trust,
            state_dir=state,
            name=f"disc{len(self.hosts)}",
            topics=topics,
        )
        self.hosts.append(disc)
        if start:
            disc.start()
        return disc

    def start_raw(self, on_message: Callable[[str, str, bytes], None] | None = None) -> GossipHost:
        """A bare gossipsub peer with no validator: plays the hostile publisher or the observer."""
        host = GossipHost(
            create_new_key_pair(),
            listen=[LOOPBACK],
            topics=TOPICS,
            on_message=on_message,
            name=f"raw{len(self.raw)}",
        )
        self.raw.append(host)
        host.start()
        return host

    def stop_all(self) -> None:
        for disc in self.hosts:
            disc.stop()
        for host in self.raw:
            host.stop()


def wait_linked(a: Discovery | GossipHost, b: Discovery | GossipHost, topics: list[str] = TOPICS) -> None:
    """Wait until `a` knows `b` is subscribed to `topics` (safe to publish to it)."""
    host = a.host if isinstance(a, Discovery) else a
    peer = b.peer_id
    wait_until(
        lambda: all(peer in host.topic_peers(t) for t in topics), f"{peer} subscribed at {host.peer_id}"
    )


def policy_version(disc: Discovery) -> int | None:
    current = disc.board.current_policy()
    return None if current is None else current.body.policy_version  # type: ignore[union-attr]


def spawn_peer(
    state_dir: Path, trainer: str, bootstrap: list[str]
) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    """A discovery host in another process (it announces a relay); returns it and what it printed."""
    args = [
        sys.executable,
        str(Path(__file__).with_name("discovery_peer_process.py")),
        DOMAIN,
        trainer,
        str(state_dir),
        json.dumps(bootstrap),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        raise AssertionError(f"peer process exited with {proc.wait(10)} before it started")
    return proc, json.loads(line)
