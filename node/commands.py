"""What each `prime-node` command does, once its config is parsed. Every step logs what it does; every
failure is one `PrimeError` whose message says what to do next (the CLI prints it as one line)."""

from __future__ import annotations

import json
import logging
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from node.config import EngineSettings, NodeConfig
from node.errors import NodeError
from protocol.config import ShardcastWeights
from protocol.errors import ChainError, ConfigError, KeystoreError
from protocol.identity import Identity, load_identity, read_password
from protocol.model_spec import ModelSpec
from protocol.rollout import RunSpec, submission_domain

logger = logging.getLogger("prime-node")
PROTECTION_DB = "protection.sqlite"


# -- keys -------------------------------------------------------------------------------------------

def node_key(cfg: NodeConfig, *, create: bool = False) -> Identity:
    """The node key: a keystore (created when missing, for `join`), or a raw key from the environment."""
    k = cfg.key
    if k.key_env:
        return load_identity(key_env=k.key_env)
    if k.keystore is None:
        raise KeystoreError("no node key: give --keystore PATH (`prime-node join` creates it when missing)")
    if not k.keystore.exists():
        if not (create and k.create):
            raise KeystoreError(f"keystore not found: {k.keystore}")
        password = read_password(env=k.password_env, file=k.password_file, prompt="New node keystore password: ")
        identity = Identity.create()
        identity.save_keystore(k.keystore, password, scrypt_n=k.scrypt_n)
        logger.info("created a new node key %s in %s (back up the file and its password)", identity.address,
                    k.keystore)
        return identity
    identity = load_identity(keystore=k.keystore, password_env=k.password_env, password_file=k.password_file,
                             prompt="Node keystore password: ")
    logger.info("node key %s (%s)", identity.address, k.keystore)
    return identity


def operator_key(cfg: NodeConfig, node: Identity) -> Identity:
    """The key that stakes and claims: the operator keystore, or the node key itself."""
    o = cfg.operator
    if o is None or (o.keystore is None and o.key_env is None):
        return node
    return load_identity(keystore=o.keystore, key_env=o.key_env, password_env=o.password_env,
                         password_file=o.password_file, prompt="Operator keystore password: ")


# -- chain ------------------------------------------------------------------------------------------

@dataclass
class Chain:
    w3: Any
    chain_id: int
    pool: str
    start_block: int
    trainers: list[str] = field(default_factory=list)
    """Trainer addresses the deployment file names (empty without one)."""

    def client(self, identity: Identity) -> Any:
        from contracts.pool import PoolClient

        return PoolClient(self.w3, self.pool, identity)


def open_chain(cfg: NodeConfig) -> Chain:
    """Connect and check that the pool really is where the config says (chain id, contract code)."""
    from contracts.deployment import Deployment
    from contracts.transactor import connect
    from protocol.identity import checksum

    deployment = Deployment.load(cfg.chain.deployment) if cfg.chain.deployment else None
    pool = cfg.chain.pool or (deployment.pool if deployment else None)
    if pool is None:
        raise ConfigError("no pool: give --deployment deployment.json or --pool ADDRESS")
    pool = checksum(pool)
    rpc = cfg.chain.rpc_url
    w3 = connect(rpc)
    try:
        chain_id = int(w3.eth.chain_id)
        code = bytes(w3.eth.get_code(pool))  # type: ignore[arg-type]
    except Exception as exc:  # noqa: BLE001 - any transport failure is "cannot reach the chain"
        raise ChainError(f"cannot reach the chain at {rpc}: {type(exc).__name__}: {exc}") from exc
    if deployment is not None and chain_id != deployment.chain_id:
        raise ChainError(f"the chain at {rpc} has chain id {chain_id}, the deployment file says "
                         f"{deployment.chain_id}: wrong --rpc-url or --deployment")
    if not code:
        raise ChainError(f"no pool contract at {pool} on the chain at {rpc} (chain id {chain_id}): wrong "
                         f"--deployment/--pool, or the chain was reset since the deployment")
    return Chain(w3, chain_id, pool, deployment.start_block if deployment else 0,
                 list(deployment.trainers) if deployment else [])


# -- the run, from the validators -------------------------------------------------------------------

def run_rules(cfg: NodeConfig, chain: Chain, http: httpx.Client,
              is_validator: Callable[[str], bool] | None = None) -> tuple[RunSpec, ModelSpec, str]:
    """(run spec, model spec, envelope domain): from config, checked against each reachable `/v1/info` that is
    proved by the address it names (and, with `is_validator`, one holding the validator role on chain)."""
    run, model, _ = _rules(cfg, chain, http, is_validator)
    return run, model, submission_domain(chain.chain_id, chain.pool, run.run_id)


def _rules(cfg: NodeConfig, chain: Chain | None, http: httpx.Client,
           is_validator: Callable[[str], bool] | None = None) -> tuple[RunSpec, ModelSpec, dict[str, Any]]:
    """(run, model, the validators' check thresholds); the domain is compared when `chain` is given. A `/v1/info`
    not proved by a signature of the address it names over our fresh challenge (`protocol.info_proof`), or, with
    `is_validator`, named by an address without the validator role, is ignored: a look-alike URL cannot hand the
    node another run's rules."""
    from pydantic import TypeAdapter

    from protocol.info_proof import read_info

    run, model = cfg.run, cfg.model
    checks: dict[str, Any] = {}
    for url in cfg.validators:
        try:
            proven = read_info(http, url, domain=None, timeout_s=cfg.submit.probe_timeout_s)
            info = proven.info
            their_run = RunSpec.model_validate(info["run"])
            their_model: ModelSpec = TypeAdapter(ModelSpec).validate_python(info["model"])
        except Exception as exc:  # noqa: BLE001 - a down, garbled or unproved validator is not fatal here
            logger.warning("validator %s: /v1/info unavailable or not proved (%s)", url, exc)
            continue
        if is_validator is not None and not is_validator(proven.address):
            logger.warning("validator %s: /v1/info is %s's, which holds no validator role on chain: ignored", url,
                           proven.address)
            continue
        if run is not None and run != their_run:
            raise ConfigError(f"the configured run differs from validator {url}'s: {their_run!r}")
        if model is not None and model != their_model:
            raise ConfigError(f"the configured model differs from validator {url}'s: {their_model!r}")
        their_base = info.get("base_version")
        if (isinstance(cfg.weights, ShardcastWeights) and isinstance(their_base, int)
                and their_base != cfg.weights.base_version):
            # generating a version with other weights than the validator checks it with gets honest work slashed
            raise ConfigError(f"weights.base_version is {cfg.weights.base_version} here and {their_base} at validator "
                              f"{url}: versions up to it run on the base model, the others on weights pulled over the "
                              f"relays (-1: none is the base model, the run started from a checkpoint); set "
                              f"weights.base_version = {their_base}")
        run, model = their_run, their_model
        their_checks = info.get("checks")
        checks = their_checks if isinstance(their_checks, dict) else checks
        if chain is not None:
            domain = submission_domain(chain.chain_id, chain.pool, run.run_id)
            if info.get("domain") != domain:
                raise ConfigError(f"validator {url} serves domain {info.get('domain')!r}, this node computes "
                                  f"{domain!r}: another chain, pool or run")
    if run is None or model is None:
        raise NodeError(f"no validator answered /v1/info ({', '.join(cfg.validators)}) and the config gives no "
                        f"run and model: start a validator or set [run] and [model]")
    return run, model, checks


# -- commands ---------------------------------------------------------------------------------------

def join(cfg: NodeConfig) -> int:
    node = node_key(cfg, create=True)
    operator = operator_key(cfg, node)
    chain = open_chain(cfg)
    logger.info("pool %s on chain %d (%s); operator %s", chain.pool, chain.chain_id, cfg.chain.rpc_url,
                operator.address)
    ensure_registered(cfg, chain, node, operator)
    return work(cfg, node, chain)


def preflight(cfg: NodeConfig) -> int:
    """Print the pre-flight report; exit status 0 when honest work from here would pass, 1 when not."""
    report = _preflight(cfg, None)
    for line in report.lines():
        print(line)
    return 0 if report.ok else 1


def _preflight(cfg: NodeConfig, chain: Chain | None) -> Any:
    from node.engines import build_engine
    from node.preflight import run_preflight

    with httpx.Client(timeout=cfg.submit.timeout_s) as http:
        run, model, checks = _rules(cfg, chain, http)
    settings = engine_settings(cfg, model, run)
    logger.info("pre-flight: generating %d assignment(s) of %s with the %s engine (%s, %s), then checking them as "
                "a validator would", cfg.preflight.batches, run.env, settings.type, settings.device, settings.dtype)
    engine = build_engine(settings, model)
    return run_preflight(engine, model, run, checks, batches=cfg.preflight.batches, dtype=cfg.preflight.dtype)


def engine_settings(cfg: NodeConfig, model: ModelSpec, run: RunSpec) -> EngineSettings:
    """The engine `cfg` names, or where it names none, the one `node.engine_choice` picks for this machine (on a
    CPU with vLLM installed: the faster of the two, measured once and cached)."""
    from node.engine_choice import choose_engine

    return choose_engine(cfg.engine, model, run).settings


def ensure_registered(cfg: NodeConfig, chain: Chain, node: Identity, operator: Identity) -> None:
    from contracts.pool import NodeStatus

    pool = chain.client(operator)
    info = pool.get_node(node.address)
    if info.status is NodeStatus.ACTIVE:
        logger.info("node %s is already registered (stake %d, operator %s): skipping registration",
                    node.address, info.stake, info.operator)
        return
    if info.status is not NodeStatus.NONE:
        raise NodeError(f"node {node.address} is {info.status.name.lower()} on chain (unbonding ends at pool time "
                        f"{info.unbonding_end}): it cannot work again; `prime-node withdraw` once unbonded, "
                        f"then join with a new key")
    params = pool.params()
    stake = cfg.stake or params.min_stake
    if stake < params.min_stake:
        raise ConfigError(f"stake {stake} is below the pool's minimum {params.min_stake}")
    tokens = pool.token.balance_of(operator.address)
    gas = int(chain.w3.eth.get_balance(operator.address))
    missing = []
    if tokens < stake:
        missing.append(f"{stake - tokens} more stake token units (token {params.token}; it holds {tokens}, "
                       f"the stake is {stake})")
    if gas == 0:
        missing.append("ETH for gas (it holds none)")
    if missing:
        raise NodeError(f"operator {operator.address} cannot stake: send it " + " and ".join(missing))
    if not cfg.preflight.skip:
        report = _preflight(cfg, chain)
        for line in report.lines():
            logger.info("%s", line)
        if not report.ok and not cfg.preflight.force:
            raise NodeError("not staking: pre-flight says honest work from this machine would be rejected and "
                            "slashed (see the table above; try --engine.dtype float32 or another --engine.device); "
                            "--force stakes anyway")
    if pool.token.allowance(operator.address, chain.pool) < stake:
        logger.info("approving the pool to take %d token units from %s", stake, operator.address)
        pool.token.approve(chain.pool, stake)
    logger.info("registering node %s with stake %d (signed by the node key, sent by %s)", node.address, stake,
                operator.address)
    receipt = pool.register(node, stake, approve=False)
    logger.info("registered in block %s; node active: %s", getattr(receipt, "block_number", "?"),
                pool.is_active(node.address))


def work(cfg: NodeConfig, node: Identity, chain: Chain, *, stop: threading.Event | None = None) -> int:
    """Run the work loop until stopped, `max_batches`, or a hard rejection.

    The first SIGTERM/SIGINT lets the batch in flight finish and be submitted; a second one drops it
    at once (nothing is signed before it is recorded, so a dropped batch is either unsigned or
    resent unchanged by the next start: never signed twice)."""
    from contracts.policy import PolicyHistory
    from node.engines import build_engine
    from node.monitor import Monitor
    from node.protection import SlashingProtection
    from node.weights import PolicyWeights
    from node.worker import ValidatorDirectory, Worker
    from protocol.deadline import deadline_client

    # A validator that trickles its status line and headers is given up at the deadline too (protocol/deadline.py).
    with deadline_client(cfg.submit.timeout_s) as http:
        run, model, domain = run_rules(cfg, chain, http, validator_role(chain.client(node)))
        history = PolicyHistory(chain.client(node), chain.start_block)
        gossip = None
        if cfg.discovery.active:  # libp2p is imported only when discovery is on
            from node.gossip import NodeGossip

            gossip = NodeGossip(cfg, pool=chain.client(node), history=history, domain=domain,
                                trainer=NodeGossip.trainer_of(cfg, chain.trainers))
            gossip.start()
        settings = engine_settings(cfg, model, run)
        weights = PolicyWeights(cfg.weights, model, run, history, lambda spec: build_engine(settings, spec),
                                cfg.state_dir / "weights", poll_s=cfg.chain.poll_s,
                                learned_relays=gossip.relay_urls if gossip is not None else None,
                                on_install=gossip.note_install if gossip is not None else None)
        pool = chain.client(node)
        with SlashingProtection(cfg.state_dir / PROTECTION_DB) as protection:
            worker = Worker(cfg, node, run, domain, weights, protection, ValidatorDirectory(
                list(cfg.validators), http, validator_role(pool),
                learned=gossip.validator_urls if gossip is not None else None, timeout_s=cfg.submit.probe_timeout_s,
                domain=domain),
                is_active=lambda: bool(pool.is_active(node.address)))
            monitor = None
            if cfg.monitor.port is not None:
                monitor = Monitor(lambda: worker.tally, lambda: len(worker.pending()), host=cfg.monitor.host,
                                  records=lambda: protection.counts(run.run_id, node.address), node=node.address,
                                  port=cfg.monitor.port)
                monitor.start()
            previous = _install_signals(worker)
            if stop is not None:
                def relay_stop() -> None:
                    stop.wait()
                    worker.stop()

                threading.Thread(target=relay_stop, daemon=True).start()
            weights.start()
            logger.info("working on run %s (%s, %d tasks x %d samples per batch) as %s; weights: %s", run.run_id,
                        run.env, run.tasks_per_batch, run.samples_per_task, node.address,
                        f"relays {', '.join(weights.relays()) or '(none)'}" if weights.follower else "the base model")
            try:
                tally = worker.run_loop()
            except BaseException as exc:
                worker.tally.state, worker.tally.detail = "failed", str(exc)
                raise
            finally:
                weights.stop()
                if gossip is not None:
                    gossip.stop()
                if monitor is not None:
                    monitor.stop()
                for sig, handler in previous.items():
                    signal.signal(sig, handler)
    logger.info("stopped: %d batches, %d tokens, %d accepted, rejected %s", tally.batches, tally.tokens,
                tally.accepted, dict(tally.rejected) or "none")
    return 0


def validator_role(pool: Any, ttl_s: float = 30.0) -> Any:
    """`address -> holds the validator role on chain`, cached for `ttl_s` (a revoked role stops counting
    within it). What the node's validator directory believes instead of a URL's own word."""
    import time

    seen: dict[str, tuple[float, bool]] = {}

    def check(address: str) -> bool:
        now = time.monotonic()
        hit = seen.get(address)
        if hit is None or now - hit[0] > ttl_s:
            hit = (now, bool(pool.has_role("validator", address)))
            if len(seen) > 4096:
                seen.clear()
            seen[address] = hit
        return hit[1]

    return check


def _install_signals(worker: Any) -> dict[int, Any]:
    """First SIGTERM/SIGINT: finish the batch in flight; a second one: drop it (KeyboardInterrupt)."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def handler(signum: int, _frame: Any) -> None:
        if worker.stopping:
            logger.warning("second %s: dropping the batch in flight (nothing unsigned is lost)",
                           signal.Signals(signum).name)
            raise KeyboardInterrupt
        logger.info("%s: finishing the batch in flight, then stopping (again to drop it)", signal.Signals(signum).name)
        worker.stop()

    previous: dict[int, Any] = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        previous[sig] = signal.getsignal(sig)
        signal.signal(sig, handler)
    return previous


def rewards(chain: Chain, pool: Any, node: str) -> tuple[list[bytes], int, int]:
    """(claimable work keys, claimable amount, locked amount) of `node`, from WorkRecorded events."""
    from contracts.pool import WorkStatus

    lock = pool.params().reward_lock_period
    now = pool.pool_time()
    keys, claimable, locked = [], 0, 0
    for ev in pool.events(chain.start_block, names={"WorkRecorded"}):
        if ev.args.get("node") != node:
            continue
        work = pool.get_work(bytes(ev.args["workKey"]))
        if work.status is not WorkStatus.ACCEPTED:
            continue
        if work.recorded_at + lock <= now:
            keys.append(work.work_key)
            claimable += work.reward
        else:
            locked += work.reward
    return keys, claimable, locked


def status(cfg: NodeConfig) -> int:
    node = node_key(cfg)
    chain = open_chain(cfg)
    pool = chain.client(node)
    info = pool.get_node(node.address)
    version, manifest = pool.policy()
    keys, claimable, locked = rewards(chain, pool, node.address)
    report: dict[str, Any] = {
        "node": node.address, "operator": info.operator, "state": info.status.name.lower(), "stake": info.stake,
        "unbonding_end": info.unbonding_end, "accepted_units": info.accepted_units,
        "policy_version": version, "manifest_hash": "0x" + manifest.hex(),
        "rewards": {"claimable": claimable, "claimable_work": len(keys), "locked": locked}, "validators": {},
        "weights": cfg.weights.model_dump(mode="json"),
    }
    with httpx.Client(timeout=cfg.submit.timeout_s) as http:
        for url in cfg.validators:
            try:
                r = http.get(f"{url.rstrip('/')}/v1/nodes/{node.address}")
                r.raise_for_status()
                report["validators"][url] = r.json()
            except (httpx.HTTPError, ValueError) as exc:
                report["validators"][url] = {"error": str(exc)}
    print(json.dumps(report, indent=2))
    return 0


def claim(cfg: NodeConfig) -> int:
    node = node_key(cfg)
    chain = open_chain(cfg)
    pool = chain.client(operator_key(cfg, node))
    keys, amount, locked = rewards(chain, pool, node.address)
    if not keys:
        logger.info("nothing to claim yet (%d still locked)", locked)
        return 0
    logger.info("claiming %d for %d accepted work items", amount, len(keys))
    pool.claim_rewards(node.address, list(keys))
    logger.info("claimed %d (still locked: %d)", amount, locked)
    return 0


def leave(cfg: NodeConfig) -> int:
    node = node_key(cfg)
    chain = open_chain(cfg)
    pool = chain.client(operator_key(cfg, node))
    pool.leave_pool(node.address)
    info = pool.get_node(node.address)
    logger.info("node %s is leaving; stake %d withdrawable at pool time %d (`prime-node withdraw`)", node.address,
                info.stake, info.unbonding_end)
    return 0


def withdraw(cfg: NodeConfig) -> int:
    node = node_key(cfg)
    chain = open_chain(cfg)
    pool = chain.client(operator_key(cfg, node))
    stake = pool.get_node(node.address).stake
    pool.withdraw(node.address)
    logger.info("withdrew %d to operator %s", stake, pool.identity.address)
    return 0


def protection(cfg: NodeConfig, action: str, path: str) -> int:
    from node.protection import SlashingProtection, load_document

    with SlashingProtection(cfg.state_dir / PROTECTION_DB) as db:
        if action == "export":
            Path(path).write_text(json.dumps(db.export(), indent=2) + "\n")
            logger.info("exported the slashing-protection record to %s", path)
        else:
            added = db.import_(load_document(path))
            logger.info("imported %d new record(s) from %s", added, path)
    return 0
