"""`prime-relay`: run an origin or relay, publish a checkpoint, pull a version, list versions.

Parses arguments before importing aiohttp, eth-account or pydantic, so `--help` answers at once.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Coroutine
from typing import Any

log = logging.getLogger("shardcast.cli")

DEFAULT_ORIGIN_PORT = 8600
DEFAULT_RELAY_PORT = 8601


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prime-relay", description="SHARDCAST: signed, verified, pipelined checkpoint broadcast over HTTP relays."
    )
    parser.add_argument("--log-level", default=os.environ.get("PRIME_LOG_LEVEL", "INFO"), help="logging level")
    sub = parser.add_subparsers(dest="command", required=True)

    def serving(p: argparse.ArgumentParser, port: int) -> None:
        p.add_argument("--store", required=True, help="directory holding the versions this server serves")
        p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 to expose)")
        p.add_argument("--port", type=int, default=port, help=f"TCP port (default {port})")
        p.add_argument("--retention", type=int, default=3, help="versions kept (older ones are deleted)")
        p.add_argument("--max-conns-per-peer", type=int, default=128,
                       help="open connections one peer address (IPv6: its /64) may hold; more get 503 (default 128)")
        p.add_argument("--head-timeout", type=float, default=20.0,
                       help="seconds a connection may take to send a complete request head, counted from its "
                            "opening or its previous response; idle connections close after it too (default 20)")
        p.add_argument("--min-send-kib", type=float, default=16.0,
                       help="KiB/s a shard response must average once the grace has passed, or the connection "
                            "is cut (default 16)")
        p.add_argument("--send-grace", type=float, default=20.0,
                       help="seconds before --min-send-kib applies to a response (default 20)")

    def bans(p: argparse.ArgumentParser, who: str) -> None:
        p.add_argument("--ban-hours", type=float, default=24.0,
                       help=f"how long {who} that served bad bytes or a bad manifest stays banned (remembered "
                            "in bans.json; 0: only for this run)")
        p.add_argument("--forget-bans", action="store_true", help="clear the remembered bans first")

    def keyed(p: argparse.ArgumentParser) -> None:
        key = p.add_mutually_exclusive_group(required=True)
        key.add_argument("--keystore", help="trainer keystore (password: $PRIME_KEYSTORE_PASSWORD, --password-file or prompt)")
        key.add_argument("--key-env", metavar="VAR", help="DEV ONLY: name of an env var holding the raw private key")
        p.add_argument("--password-file", help="file holding the keystore password")

    origin = sub.add_parser("origin", help="serve a store that `publish` writes into")
    serving(origin, DEFAULT_ORIGIN_PORT)
    origin.add_argument("--run-id", required=True, help="training run id")

    publish = sub.add_parser("publish", help="shard, hash and sign PATH (file or directory) as a new version")
    publish.add_argument("path", help="checkpoint file or directory")
    publish.add_argument("--store", required=True, help="the origin's store directory")
    publish.add_argument("--run-id", required=True, help="training run id")
    publish.add_argument("--version", type=int, help="version number (default: newest + 1)")
    publish.add_argument("--shard-mib", type=int, default=32, help="shard size in MiB (default 32)")
    publish.add_argument("--retention", type=int, default=3, help="versions kept in the store")
    keyed(publish)

    relay = sub.add_parser("relay", help="follow upstreams and re-serve verified shards")
    serving(relay, DEFAULT_RELAY_PORT)
    relay.add_argument("--upstream", nargs="+", action="extend", required=True, metavar="URL", help="origin or relay URLs")
    relay.add_argument("--trainer", required=True, help="trainer address that must have signed every manifest")
    relay.add_argument("--run-id", help="training run id (default: the first manifest's)")
    relay.add_argument("--concurrency", type=int, default=4, help="shards fetched from upstream at once")
    bans(relay, "an upstream")
    def discovery(p: argparse.ArgumentParser, what: str) -> None:
        disc = p.add_argument_group("discovery", f"announce this {what} and the versions it holds over libp2p "
                                    "gossipsub, and serve the announcements it believes at GET /v1/announcements "
                                    "(off unless --discovery or --discovery-bootstrap is given)")
        disc.add_argument("--discovery", action="store_true", help="turn discovery on (also implied by a bootstrap peer)")
        disc.add_argument("--discovery-bootstrap", nargs="+", action="extend", default=[], metavar="MULTIADDR",
                          help="peers to join through, .../p2p/<peer id> (a validator's /v1/info lists its own)")
        disc.add_argument("--discovery-listen", nargs="+", action="extend", default=[], metavar="MULTIADDR",
                          help="libp2p listen addresses (default /ip4/127.0.0.1/tcp/0)")
        disc.add_argument("--discovery-domain", metavar="DOMAIN",
                          help="the run's envelope domain, prime/<chain id>/<pool>/<run id> (a validator's /v1/info "
                               "shows it); required with discovery")
        disc.add_argument("--public-url", help=f"URL readers reach this {what} at (default: the bound http://host:port)")
        disc.add_argument("--announce-key-env", metavar="VAR",
                          help="env var holding the raw key that signs the announcements (it holds no stake); "
                               "default: a fresh key per run")
        disc.add_argument("--relay-signer", nargs="+", action="extend", default=[], metavar="ADDRESS",
                          help="addresses whose relay announcements are believed besides the trainer's (staked node "
                               "or validator keys of the run; nodes check stake on chain themselves)")

    discovery(relay, "relay")
    origin.add_argument("--trainer", help="with discovery: the trainer address whose policy announcements are believed")
    discovery(origin, "origin")

    pull = sub.add_parser("pull", help="download, verify and install a version")
    pull.add_argument("--from", dest="sources", nargs="+", action="extend", required=True, metavar="URL", help="relay URLs")
    pull.add_argument("--trainer", required=True, help="trainer address that must have signed the manifest")
    pull.add_argument("--out", required=True, help="directory receiving v<N>/ and the `current` symlink")
    pull.add_argument("--version", default="latest", type=_version, help="N or 'latest' (default)")
    pull.add_argument("--run-id", help="training run id (default: that of the installed version, if any)")
    pull.add_argument("--concurrency", type=int, default=8, help="shards fetched at once")
    pull.add_argument("--wait", type=float, default=0.0, help="seconds to wait for the version to appear")
    pull.add_argument("--keep", type=int, default=2, help="installed versions kept")
    pull.add_argument("--fsync", action="store_true", help="fsync files before the swap")
    pull.add_argument("--no-progress", action="store_true", help="no progress bar even on a terminal")
    bans(pull, "a relay")
    pull.add_argument("--json", action="store_true", help="print the result as JSON (with --follow: one line per install)")
    pull.add_argument("--follow", action="store_true",
                      help="keep running: install every newer version as soon as a source advertises it "
                           "(stop with SIGINT/SIGTERM)")
    pull.add_argument("--poll", type=float, default=60.0, help="with --follow: long-poll window in seconds")

    ls = sub.add_parser("ls", help="list the versions a server holds")
    ls.add_argument("url")
    return parser


def _version(text: str) -> str:
    if text != "latest" and not (text.isascii() and text.isdigit()):
        raise argparse.ArgumentTypeError(f"expected a version number or 'latest', not {text!r}")
    return text


def _limits(args: argparse.Namespace) -> Any:
    from shardcast.server import ServeLimits

    return ServeLimits(max_conns_per_peer=args.max_conns_per_peer, head_timeout_s=args.head_timeout,
                       min_send_rate=args.min_send_kib * 1024, send_grace_s=args.send_grace)


def _identity(args: argparse.Namespace) -> Any:
    from protocol.identity import load_identity

    return load_identity(keystore=args.keystore, key_env=args.key_env, password_file=args.password_file)


async def _serve(server: Any, beside: Callable[[], Coroutine[Any, Any, None]] | None = None) -> None:
    import asyncio
    import signal

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await server.start()
    print(f"{type(server).__name__.lower()} listening on {server.url}", flush=True)
    task = None if beside is None else asyncio.create_task(beside())
    try:
        await stop.wait()
    finally:
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await server.stop()


def _relay_announcer(args: argparse.Namespace, relay: Any) -> Callable[[], Coroutine[Any, Any, None]]:
    """Discovery beside a relay (or the origin): announce (URL, complete versions) whenever the store changes.

    Composed here, in the entry point, so that the shardcast library itself imports only `protocol`.
    The relay takes part in the policy and relays topics only: without a chain it cannot judge
    validators, and a peer refusing a whole topic would be a dead end in that topic's mesh.
    """
    if not args.discovery_domain:
        raise SystemExit("prime-relay: --discovery-domain is required with discovery")
    import asyncio
    from pathlib import Path

    from discovery.admission import Trust, allow
    from discovery.config import DiscoveryConfig
    from discovery.messages import MAX_VERSIONS, Topic
    from discovery.service import Discovery
    from protocol.errors import PrimeError
    from protocol.identity import Identity, load_identity

    identity = load_identity(key_env=args.announce_key_env) if args.announce_key_env else Identity.create()
    config = DiscoveryConfig(enabled=True, bootstrap=args.discovery_bootstrap,
                             listen=args.discovery_listen or ["/ip4/127.0.0.1/tcp/0"])
    # who may announce a relay: the trainer (its origin), the addresses the operator lists (a relay has no chain
    # to check stake on; a node reader asks the chain instead), and this server itself (its own announcements)
    signers = [identity.address, *(getattr(args, "relay_signer", None) or [])]
    trust = Trust(trainer=args.trainer, relay_signer=allow(signers))
    disc = Discovery(config, identity=identity, domain=args.discovery_domain, trust=trust,
                     state_dir=Path(args.store), topics=[Topic.POLICY, Topic.RELAYS], name="relay-discovery")
    relay.server.documents["/v1/announcements"] = disc.board.to_json  # the HTTP fallback for peers without libp2p

    async def announce() -> None:
        await asyncio.to_thread(disc.start)
        log.info("discovery: libp2p peer %s on %s, announcing as %s", disc.peer_id, disc.addrs, identity.address)
        url = args.public_url or relay.url
        if not args.public_url and args.host in ("0.0.0.0", "::"):
            log.warning("discovery: announcing %s; give --public-url for an address others can reach", url)
        learner = asyncio.create_task(learn()) if hasattr(relay, "add_upstream") else None
        held: list[int] | None = None
        try:
            while True:
                complete = [v for v in relay.store.versions() if relay.store.get(v).complete][-MAX_VERSIONS:]
                if complete != held:
                    try:
                        await asyncio.to_thread(disc.announce_relay, url, complete)
                        held = complete
                    except PrimeError as exc:
                        log.warning("discovery: announcement refused: %s", exc)
                        await asyncio.sleep(5.0)
                    continue  # the store may have changed while we announced: look again before waiting
                await relay.store.wait_change(60.0)  # no await between the look and this wait: no lost wake-up
        finally:
            if learner is not None:
                learner.cancel()
            await asyncio.to_thread(disc.stop)

    async def learn() -> None:
        """A relay follows the other relays and origins announced for the run as extra upstreams (capped by
        `Relay.add_upstream`; what they serve is verified like anything else)."""
        sub = disc.subscribe([Topic.RELAYS, Topic.POLICY])
        try:
            while True:
                ann = await sub.aget()
                if ann is None or ann.body.peer_id == disc.peer_id:
                    continue
                urls = getattr(ann.body, "urls", None) or [getattr(ann.body, "http_url", "")]
                for url in urls:
                    if url and url.rstrip("/") != (args.public_url or relay.url).rstrip("/"):
                        relay.add_upstream(str(url), signer=ann.signer)
        finally:
            sub.close()

    return announce


async def _follow(client: Any, poll_s: float, as_json: bool) -> None:
    import asyncio
    import signal

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    async def installs() -> None:
        async for result in client.follow(poll_s=poll_s):
            if as_json:
                print(json.dumps(result.as_dict()), flush=True)
            else:
                print(f"v{result.version} installed at {result.path} ({result.fetched_shards} shards fetched, "
                      f"{result.reused_shards} reused, {result.seconds:.2f} s)", flush=True)

    task = asyncio.create_task(installs())
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    for pending in (task, stopper):
        pending.cancel()
    await asyncio.gather(task, stopper, return_exceptions=True)
    if task.done() and not task.cancelled() and task.exception() is not None:
        raise task.exception()  # type: ignore[misc]


def _freeze_heap() -> None:
    """Move everything imported so far out of the garbage collector's sight.

    The imports (aiohttp, pydantic, eth-account) leave a large heap that every full collection walks
    again; during a transfer those walks were about a tenth of a client's CPU (perf, bench/shardcast.py).
    """
    import gc

    gc.collect()
    gc.freeze()


def _run(args: argparse.Namespace) -> int:
    import asyncio

    if args.command == "origin":
        from shardcast.origin import Origin

        origin = Origin(args.store, run_id=args.run_id, host=args.host, port=args.port, retention=args.retention,
                        limits=_limits(args))
        if (args.discovery or args.discovery_bootstrap) and not args.trainer:
            raise SystemExit("prime-relay: origin --trainer is required with discovery")
        beside = _relay_announcer(args, origin) if args.discovery or args.discovery_bootstrap else None
        _freeze_heap()
        asyncio.run(_serve(origin, beside))
        return 0
    if args.command == "publish":
        from pathlib import Path

        from shardcast.publisher import publish_blocking
        from shardcast.store import Store

        signed = publish_blocking(Path(args.path), Path(args.store), identity=_identity(args), run_id=args.run_id,
                                  version=args.version, shard_size=args.shard_mib << 20)
        Store(Path(args.store), retention=args.retention).scan()  # applies retention
        m = signed.manifest
        print(json.dumps({"version": m.version, "shards": len(m.shards), "bytes": m.total_bytes, "signer": signed.signer,
                          "manifest_hash": "0x" + m.content_hash().hex()}))  # what the trainer records on chain
        return 0
    if args.command == "relay":
        from shardcast.relay import Relay

        relay = Relay(args.upstream, trainer=args.trainer, store_root=args.store, run_id=args.run_id, host=args.host,
                      port=args.port, retention=args.retention, concurrency=args.concurrency,
                      ban_s=args.ban_hours * 3600, limits=_limits(args))
        if args.forget_bans:
            relay.forget_bans()
        beside = _relay_announcer(args, relay) if args.discovery or args.discovery_bootstrap else None
        _freeze_heap()
        asyncio.run(_serve(relay, beside))
        return 0
    if args.command == "pull":
        from shardcast.client import Client

        version = None if args.version == "latest" else int(args.version)
        client = Client(args.sources, trainer=args.trainer, out_dir=args.out, run_id=args.run_id,
                        concurrency=args.concurrency, keep=args.keep, fsync=args.fsync, wait_s=args.wait,
                        ban_s=args.ban_hours * 3600,
                        progress=False if args.no_progress else None)
        if args.forget_bans:
            client.forget_bans()
        _freeze_heap()
        if args.follow:
            if version is not None:
                raise SystemExit("prime-relay: --follow always installs the newest version; drop --version")
            asyncio.run(_follow(client, args.poll, args.json))
            return 0
        result = asyncio.run(client.pull(version))
        if args.json:
            print(json.dumps(result.as_dict()))
        else:
            print(f"v{result.version} installed at {result.path} ({result.fetched_shards} shards fetched, "
                  f"{result.reused_shards} reused, {result.seconds:.2f} s)")
        return 0
    if args.command == "ls":
        from shardcast.transfer import fetch_index, new_session

        async def ls() -> Any:
            async with new_session() as session:
                return await fetch_index(session, args.url)

        index = asyncio.run(ls())
        print(f"run {index.run_id}  latest {index.latest}")
        for v in index.versions:
            print(f"  v{v.version:<8} {'complete' if v.complete else 'arriving':9} {v.shards:6} shards {v.bytes:>14} bytes")
        return 0
    raise AssertionError(args.command)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from protocol.errors import PrimeError

    try:
        return _run(args)
    except PrimeError as exc:
        print(f"prime-relay: {exc.__class__.__name__}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
