"""A discovery host in its own process, for the test that kills one with SIGKILL.

argv: domain, trainer address, state dir, JSON list of bootstrap multiaddrs. Prints one JSON line
({"peer_id", "addrs", "relay"}) once it has announced itself as a relay, then runs until stdin closes.
"""

from __future__ import annotations

import json
import sys

from discovery.admission import Trust, anyone
from discovery.config import DiscoveryConfig
from discovery.service import Discovery
from protocol.identity import Identity


def main() -> None:
    domain, trainer, state_dir, bootstrap = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    relay = Identity.create()
    config = DiscoveryConfig(
        enabled=True, listen=["/ip4/127.0.0.1/tcp/0"], bootstrap=bootstrap, reannounce_s=1.0, target_peers=0
    )
    disc = Discovery(
        config,
        identity=relay,
        domain=domain,
        trust=Trust(trainer=trainer, relay_signer=anyone),
        state_dir=state_dir,
    )
    disc.start()
    disc.announce_relay("http://127.0.0.1:9999", [1])
    print(json.dumps({"peer_id": disc.peer_id, "addrs": disc.addrs, "relay": relay.address}), flush=True)
    sys.stdin.read()
    disc.stop()


if __name__ == "__main__":
    main()
