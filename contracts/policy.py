"""The policy versions a pool has published, with their manifest hashes, from `PolicyPublished` events.

The contract stores only the newest (version, hash); a node or validator working inside the async
window needs the hash of each version it may use, so it reads the events once from the deployment
block and then only the new blocks (`refresh`), reading the last few again each time (`REORG_DEPTH`): a
version sent again after a rollback lands in a block the reader may have passed already.
"""

from __future__ import annotations

import argparse
import sys
import threading

from contracts.events import reread_from
from contracts.pool import PoolClient


class PolicyHistory:
    """{version: manifest hash} of one pool, refreshed incrementally."""

    def __init__(self, pool: PoolClient, start_block: int = 0) -> None:
        self.pool = pool
        self._start_block = start_block
        self._next_block = start_block
        self._hashes: dict[int, bytes] = {}
        self._lock = threading.Lock()

    def refresh(self) -> list[int]:
        """Read the blocks since the last refresh; returns the versions newly seen. `ChainError` if unreachable."""
        latest = int(self.pool.tx.rpc("block number", lambda: self.pool.w3.eth.block_number))
        with self._lock:
            start = reread_from(self._next_block, latest, self._start_block)
        if latest < start:
            return []
        found = {int(ev.args["version"]): bytes(ev.args["manifestHash"])
                 for ev in self.pool.events(start, latest, names={"PolicyPublished"})}
        with self._lock:
            fresh = {v: h for v, h in found.items() if self._hashes.get(v) != h}
            self._hashes.update(fresh)
            self._next_block = latest + 1
        return sorted(fresh)

    def current(self) -> int | None:
        """The newest version published (as of the last refresh), None before the first."""
        with self._lock:
            return max(self._hashes) if self._hashes else None

    def manifest_hash(self, version: int) -> bytes | None:
        with self._lock:
            return self._hashes.get(version)


def main(argv: list[str] | None = None) -> int:
    """`python -m contracts.policy`: record a policy version on chain as the trainer (`publishPolicy`)."""
    p = argparse.ArgumentParser(prog="python -m contracts.policy",
                                description="Record policy VERSION with its manifest hash on chain (TRAINER_ROLE "
                                            "key); `prime-relay publish` prints the manifest hash.")
    p.add_argument("--deployment", required=True, help="deployment.json written by prime-chain")
    p.add_argument("--rpc-url", default="http://127.0.0.1:8545")
    p.add_argument("--version", type=int, required=True)
    p.add_argument("--manifest-hash", required=True, help="0x + 64 hex digits")
    key = p.add_mutually_exclusive_group(required=True)
    key.add_argument("--keystore", help="the trainer's keystore (password: --password-env)")
    key.add_argument("--key-env", help="dev chains only: environment variable holding a raw key")
    key.add_argument("--dev-account", type=int, help="PUBLIC anvil dev account index (dev chains only)")
    p.add_argument("--password-env", default="PRIME_KEYSTORE_PASSWORD")
    args = p.parse_args(argv)
    from contracts.deployment import Deployment
    from contracts.devchain import dev_identity
    from contracts.transactor import connect
    from protocol.errors import PrimeError
    from protocol.identity import load_identity

    try:
        identity = dev_identity(args.dev_account) if args.dev_account is not None else load_identity(
            keystore=args.keystore, key_env=args.key_env, password_env=args.password_env)
        deployment = Deployment.load(args.deployment)
        pool = PoolClient(connect(args.rpc_url), deployment.pool, identity)
        pool.publish_policy(args.version, args.manifest_hash)
    except PrimeError as exc:
        print(f"contracts.policy: {exc}", file=sys.stderr)
        return 2
    print(f"policy v{args.version} recorded on chain ({args.manifest_hash}) by {identity.address}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
