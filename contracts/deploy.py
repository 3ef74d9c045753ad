"""Deploy and configure a ComputePool; write the deployment JSON the roles read.

    python -m contracts.deploy --rpc http://127.0.0.1:8545 --dev-account 0 --out deployment.json \\
        --validator 0x... --trainer 0x... --treasury 0x... --fund-rewards 1000000000000000000000

    python -m contracts.deploy --devnet --out deployment.json   # start anvil, deploy, keep it running

The deployer key comes from --keystore (password from --password-env / --password-file / prompt) or,
on a dev chain only, --dev-account N (PUBLIC anvil keys).
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from typing import TYPE_CHECKING

from protocol.errors import PrimeError

if TYPE_CHECKING:
    from contracts.devchain import DevChain


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="prime-chain", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--rpc", help="JSON-RPC URL of the chain")
    where.add_argument("--devnet", action="store_true", help="start a local anvil, deploy, keep running")
    p.add_argument("--out", required=True, help="where to write the deployment JSON")
    key = p.add_mutually_exclusive_group()
    key.add_argument("--keystore", help="deployer keystore (Web3 secret storage JSON)")
    key.add_argument("--dev-account", type=int, help="PUBLIC anvil dev account index (dev chains only)")
    p.add_argument("--password-env", default="PRIME_KEYSTORE_PASSWORD", help="env var holding the password")
    p.add_argument("--password-file", help="file holding the keystore password")
    p.add_argument("--token", help="existing ERC-20 to stake/reward in (default: deploy a dev PoolToken)")
    p.add_argument("--treasury", help="where slashed stake goes (default: the deployer)")
    p.add_argument("--validator", action="append", default=[], help="grant VALIDATOR_ROLE (repeatable)")
    p.add_argument("--trainer", action="append", default=[], help="grant TRAINER_ROLE (repeatable)")
    p.add_argument("--mint", action="append", default=[], metavar="ADDR=AMOUNT",
                   help="mint dev tokens (dev PoolToken only; repeatable)")
    p.add_argument("--bootstrap-peer", action="append", default=[], metavar="MULTIADDR",
                   help="record a discovery bootstrap peer (.../p2p/<peer id>) in the pool (repeatable, at most 16)")
    p.add_argument("--fund-rewards", type=int, default=0, help="reward budget to fund (token base units)")
    p.add_argument("--settings", help="JSON object of PoolSettings fields (min_stake, unbonding_period, ...)")
    p.add_argument("--port", type=int, default=8545, help="anvil port with --devnet")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # web3 and eth-account take ~2 s to import: only after the arguments parsed, so --help is instant.
    from contracts.deployment import PoolSettings, deploy_pool
    from contracts.devchain import DevChain, dev_identity
    from contracts.transactor import Transactor, connect
    from protocol.identity import Identity, read_password

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    chain: DevChain | None = None
    stop = threading.Event()
    if args.devnet:
        # before anything starts: a SIGTERM at any moment (a test or a supervisor stopping it right after the
        # "dev chain at" line, before the handler would otherwise be in place) ends the run cleanly, anvil stopped
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        if args.devnet:
            chain = DevChain.start(port=args.port)
            rpc = chain.rpc_url
        else:
            rpc = args.rpc
        if args.keystore:
            password = read_password(env=args.password_env, file=args.password_file, prompt="keystore password: ")
            identity = Identity.load_keystore(args.keystore, password)
        elif args.dev_account is not None or args.devnet:
            identity = dev_identity(args.dev_account or 0)
        else:
            print("need --keystore or --dev-account", file=sys.stderr)
            return 2
        mint = {}
        for item in args.mint:
            addr, _, amount = item.partition("=")
            mint[addr] = int(amount)
        settings = PoolSettings.model_validate(json.loads(args.settings)) if args.settings else PoolSettings()
        tx = Transactor(connect(rpc), identity)
        deployment = deploy_pool(
            tx, treasury=args.treasury or identity.address, settings=settings, token=args.token,
            validators=args.validator, trainers=args.trainer, mint=mint, fund_rewards=args.fund_rewards,
            bootstrap_peers=args.bootstrap_peer,
        )
        deployment.save(args.out)
        print(f"pool {deployment.pool} token {deployment.token} chain {deployment.chain_id} -> {args.out}")
        if chain is not None:
            print(f"dev chain at {chain.rpc_url}; Ctrl-C to stop", flush=True)
            try:
                stop.wait()
            except KeyboardInterrupt:
                pass
        return 0
    except (PrimeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        if chain is not None:
            chain.stop()


if __name__ == "__main__":
    sys.exit(main())
