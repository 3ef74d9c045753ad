"""Discovery over libp2p gossipsub: how long one announcement takes to reach all of N hosts, and how many
announcements per second one host takes in, with our signed envelopes and checks against bare gossipsub.

    python -m bench.discovery [--quick] [--json PATH] [--sizes 4,8,16] [--rounds 40]
    python -m bench.discovery --smoke --json out.json   # N = 3, 2 rounds, a 0.5 s rate window (seconds)

Every host is a real py-libp2p host on 127.0.0.1 (all in this process, each in its own trio thread, like the
tests). The mesh is sparse, not all-to-all: host i dials host i-1 and host i//2 (a line with shortcuts, so the
farthest host is a few hops away and gossipsub has to forward).

- reach: host 0 announces (ours: `Discovery.announce_relay`, a signed envelope, every receiving host checks it
  before it forwards it: domain, age, signature, nonce, rate buckets, board); the time until the newest
  announcement sits on every other host's board. p50 and p99 over `--rounds` announcements per N.
- rate: 4 senders connected straight to one receiver publish pre-signed announcements as fast as they can;
  the receiver's admitted messages per second over `--seconds`.
- anchor: the same two measurements over bare gossipsub hosts (`discovery.host.GossipHost` with no validator),
  with payloads of the same size: what the transport alone does on this machine. The ratios are ours / bare.

The rate buckets are raised for the bench (a real host admits at most `forwarder_rate` = 100/s per forwarding
peer and `signer_rate` = 1/s per signer by default, policy rather than capacity); everything else is default.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from bench import harness

DOMAIN = "prime/31337/0x5FbDB2315678afecb367f032d93F642f64180aa3/bench"
LOOPBACK = "/ip4/127.0.0.1/tcp/0"
SETTLE_S = 2.5  # after wiring: gossipsub grafts its mesh on the 1 s heartbeat
IDLE_S = 3.0  # the receiver's count has stopped moving for this long: the rate window is over
RAISED = {"forwarder_rate": 1e6, "forwarder_burst": 1e6, "origin_rate": 1e6, "origin_burst": 1e6,
          "signer_rate": 1e6, "signer_burst": 1e6, "gossip_rate": 1e6}


def _wait(pred: Callable[[], object], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.01)


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def _mesh(n: int) -> list[list[int]]:
    """Whom host i dials: i-1 and i//2 (sparse; every host reachable, a few hops at most)."""
    return [sorted({i - 1, i // 2} - {i}) if i else [] for i in range(n)]


class Ours:
    """N Discovery hosts on the relays topic (anyone may announce a relay, so no chain is needed)."""

    def __init__(self, n: int, root: Path, *, senders: int = 1) -> None:
        from discovery.admission import Trust, anyone
        from discovery.config import DiscoveryConfig
        from discovery.messages import Topic
        from discovery.service import Discovery
        from protocol.identity import Identity

        self.topic = Topic.RELAYS
        self.hosts: list[Any] = []
        for i in range(n):
            config = DiscoveryConfig(enabled=True, listen=[LOOPBACK], target_peers=0, reannounce_s=3600.0, **RAISED)
            disc = Discovery(config, identity=Identity.create() if i < senders else None, domain=DOMAIN,
                             trust=Trust(trainer=Identity.create().address, relay_signer=anyone), state_dir=root / f"h{i}",
                             topics=[Topic.RELAYS], name=f"bench{i}")
            disc.start()
            self.hosts.append(disc)

    def wire(self, links: list[list[int]]) -> None:
        for i, targets in enumerate(links):
            for j in targets:
                self.hosts[i].connect(self.hosts[j].addrs[0])
        # gossipsub grafts its mesh on the heartbeat (1 s): wait until every link carries the topic
        _wait(lambda: all(len(h.peers()) >= len(links[i]) for i, h in enumerate(self.hosts)), "connections")
        time.sleep(SETTLE_S)

    def reach(self, k: int) -> float:
        """Announce version k from host 0; seconds until every other host's board holds it."""
        t0 = time.perf_counter()
        self.hosts[0].announce_relay("http://127.0.0.1:8601", versions=[k])
        others = self.hosts[1:]
        while not all(any(k in a.body.versions for a in h.board.relays()) for h in others):
            time.sleep(0.0005)
        return time.perf_counter() - t0

    def stop(self) -> None:
        for h in self.hosts:
            h.stop()


class Bare:
    """N bare gossipsub hosts (no validator), payloads of the same size as ours."""

    def __init__(self, n: int, size: int) -> None:
        from libp2p.crypto.ed25519 import create_new_key_pair

        from discovery.host import GossipHost
        from discovery.messages import Topic, topic_name

        self.topic = topic_name(DOMAIN, Topic.RELAYS)
        self.size = size
        self.latest = [-1] * n
        self.count = [0] * n
        self.hosts: list[Any] = []
        for i in range(n):
            # counted in a validator that admits everything (where ours checks), not in the subscription,
            # whose 32-message channel drops a burst's overflow
            host = GossipHost(create_new_key_pair(), listen=[LOOPBACK], topics=[self.topic],
                              validator=self._sink(i), name=f"bare{i}")
            host.start()
            self.hosts.append(host)

    def _sink(self, i: int) -> Callable[[str, str, bytes, str], Awaitable[bool]]:
        async def admit_all(_topic: str, _origin: str, data: bytes, _forwarder: str) -> bool:
            self.count[i] += 1
            self.latest[i] = max(self.latest[i], int.from_bytes(data[:8], "big"))
            return True
        return admit_all

    def payload(self, k: int) -> bytes:
        return k.to_bytes(8, "big") + os.urandom(self.size - 8)

    def wire(self, links: list[list[int]]) -> None:
        for i, targets in enumerate(links):
            for j in targets:
                self.hosts[i].connect(self.hosts[j].addrs[0])
        _wait(lambda: all(len(h.topic_peers(self.topic)) >= len(links[i]) for i, h in enumerate(self.hosts)),
              "topic peers")
        time.sleep(SETTLE_S)

    def reach(self, k: int) -> float:
        t0 = time.perf_counter()
        self.hosts[0].publish(self.topic, self.payload(k))
        while not all(x >= k for x in self.latest[1:]):
            time.sleep(0.0005)
        return time.perf_counter() - t0

    def stop(self) -> None:
        for h in self.hosts:
            h.stop()


def _envelope_size(root: Path) -> int:
    from discovery.messages import RelayAnnounced
    from protocol.envelope import seal
    from protocol.identity import Identity
    from protocol.nonce import random_nonce

    body = RelayAnnounced(peer_id="12D3KooW" + "x" * 44, addrs=("/ip4/127.0.0.1/tcp/40000",),
                          http_url="http://127.0.0.1:8601", versions=(1,))
    return len(seal(Identity.create(), body, domain=DOMAIN, nonce=random_nonce()).to_bytes())


def measure_reach(n: int, rounds: int, root: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"hosts": n, "links": sum(len(x) for x in _mesh(n)), "rounds": rounds}
    size = _envelope_size(root)
    for name, make in (("ours", lambda: Ours(n, root / f"reach{n}")), ("bare", lambda: Bare(n, size))):
        net = make()
        try:
            net.wire(_mesh(n))
            net.reach(0)  # warm-up (first message on fresh streams)
            times = [net.reach(k) for k in range(1, rounds + 1)]
        finally:
            net.stop()
        out[name] = {"p50_s": _pct(times, 0.5), "p99_s": _pct(times, 0.99), "mean_s": statistics.fmean(times)}
    out["p50_ratio"] = out["ours"]["p50_s"] / out["bare"]["p50_s"]
    out["p99_ratio"] = out["ours"]["p99_s"] / out["bare"]["p99_s"]
    out["envelope_bytes"] = size
    return out


def measure_rate(seconds: float, root: Path, senders: int = 4) -> dict[str, Any]:
    """Senders 1..S connected straight to host 0; each publishes pre-signed announcements in a loop."""
    from discovery.messages import RelayAnnounced, topic_name
    from protocol.envelope import seal
    from protocol.nonce import random_nonce

    links = [[] if i == 0 else [0] for i in range(senders + 1)]
    out: dict[str, Any] = {"senders": senders, "seconds": seconds}

    # ours: host 0 listens; hosts 1..S hold identities and publish envelopes signed in advance
    ours = Ours(senders + 1, root / "rate", senders=senders + 1)
    try:
        ours.wire(links)
        topic = topic_name(DOMAIN, ours.topic)
        batches: list[list[bytes]] = []
        per_sender = int(seconds * 2500) + 100  # more than a sender can publish in the window
        for s in ours.hosts[1:]:
            addrs = tuple(a.removesuffix(f"/p2p/{s.peer_id}") for a in s.addrs)
            batches.append([seal(s.identity, RelayAnnounced(peer_id=s.peer_id, addrs=addrs,
                                                            http_url="http://127.0.0.1:8601", versions=(k,)),
                                 domain=DOMAIN, nonce=random_nonce()).to_bytes() for k in range(1, per_sender + 1)])

        def admitted() -> int:
            st = ours.hosts[0].stats()
            return sum(v for k, v in st.items() if k.startswith("accepted."))

        ours_sent = _blast([lambda d, h=h: h.host.publish(topic, d) for h in ours.hosts[1:]], batches, seconds)
        base = 0
        got, dt = _count_window(admitted, base, seconds)
        out["ours"] = {"sent": ours_sent, "received": got, "msgs_per_s": got / dt,
                       "dropped": {k: v for k, v in ours.hosts[0].stats().items() if k.startswith("dropped.")}}
    finally:
        ours.stop()

    bare = Bare(senders + 1, _envelope_size(root))
    try:
        bare.wire(links)
        batches = [[bare.payload(k) for k in range(1, int(seconds * 2500) + 100)] for _ in range(senders)]
        bare_sent = _blast([lambda d, h=h: h.publish(bare.topic, d) for h in bare.hosts[1:]], batches, seconds)
        got, dt = _count_window(lambda: bare.count[0], 0, seconds)
        out["bare"] = {"sent": bare_sent, "received": got, "msgs_per_s": got / dt}
    finally:
        bare.stop()
    out["ratio"] = out["ours"]["msgs_per_s"] / out["bare"]["msgs_per_s"]
    return out


_BLAST: dict[str, Any] = {}


def _blast(publishers: list[Callable[[bytes], None]], batches: list[list[bytes]], seconds: float) -> list[int]:
    """Start one thread per sender publishing its batch until `seconds` pass; returns at once (counts later)."""
    stop_at = time.monotonic() + seconds
    sent = [0] * len(publishers)

    def run(i: int) -> None:
        for data in batches[i]:
            if time.monotonic() >= stop_at:
                break
            publishers[i](data)
            sent[i] += 1

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(publishers))]
    _BLAST["threads"] = threads
    _BLAST["t0"] = time.monotonic()
    for t in threads:
        t.start()
    return sent


def _count_window(count: Callable[[], int], base: int, seconds: float) -> tuple[int, float]:
    """Wait for the senders, then until the receiver's count stops moving; (received, seconds to the last one)."""
    for t in _BLAST["threads"]:
        t.join()
    last, last_change = count(), time.monotonic()
    while time.monotonic() - last_change < IDLE_S:
        time.sleep(0.05)
        now = count()
        if now != last:
            last, last_change = now, time.monotonic()
    return last - base, max(1e-9, last_change - _BLAST["t0"])


def main() -> int:
    ap = harness.parser(__doc__, smoke="N = 3, 2 rounds, a 0.5 s rate window: checks the bench in seconds, "
                        "measures nothing", quick="fewer rounds and a shorter rate window")
    ap.add_argument("--sizes", default=None, help="host counts N for the reach measurement (default 4,8,16; smoke 3)")
    ap.add_argument("--rounds", type=int, default=None, help="announcements per N (default 60; quick 20)")
    ap.add_argument("--seconds", type=float, default=None, help="rate window (default 10; quick 4)")
    args = ap.parse_args()
    import logging

    logging.basicConfig(level=logging.WARNING)
    rounds = args.rounds or (2 if args.smoke else 20 if args.quick else 60)
    seconds = args.seconds or (0.5 if args.smoke else 4.0 if args.quick else 10.0)
    sizes = [int(x) for x in (args.sizes or ("3" if args.smoke else "4,8,16")).split(",")]
    load0 = os.getloadavg()[0]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-discovery-") as tmp:
        root = Path(tmp)
        reach = {str(n): measure_reach(n, rounds, root) for n in sizes}
        rate = measure_rate(seconds, root)
    result = {
        "bench": "discovery", "quick": args.quick, "smoke": args.smoke,
        "machine": {**harness.machine(), "load_avg_start": load0, "load_avg_end": os.getloadavg()[0]},
        "mesh": "host i dials i-1 and i//2 (sparse)", "rate_limits": "raised for the bench (see docstring)",
        "reach": reach, "rate": rate, "wall_s": time.perf_counter() - started,
    }
    print(f"discovery on 127.0.0.1, {os.cpu_count()} cores, load {load0:.1f}; {rounds} announcements per N, "
          f"envelope {next(iter(reach.values()))['envelope_bytes']} bytes")
    print(f"{'N':>3} {'links':>5} | {'ours p50':>9} {'p99':>8} | {'bare p50':>9} {'p99':>8} | {'p50 x':>6} {'p99 x':>6}")
    for n, r in reach.items():
        print(f"{n:>3} {r['links']:>5} | {r['ours']['p50_s'] * 1e3:7.1f}ms {r['ours']['p99_s'] * 1e3:6.1f}ms | "
              f"{r['bare']['p50_s'] * 1e3:7.1f}ms {r['bare']['p99_s'] * 1e3:6.1f}ms | "
              f"{r['p50_ratio']:6.2f} {r['p99_ratio']:6.2f}")
    print(f"one host taking in from {rate['senders']} senders for {seconds:.0f} s: ours "
          f"{rate['ours']['msgs_per_s']:.0f} msg/s (checked and admitted), bare {rate['bare']['msgs_per_s']:.0f} msg/s; "
          f"ratio {rate['ratio']:.2f}; dropped {rate['ours']['dropped'] or 0}")
    harness.write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
