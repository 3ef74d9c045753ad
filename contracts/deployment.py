"""Deploying and configuring a pool, and the deployment JSON that every role reads."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from contracts.artifacts import load_artifact
from contracts.pool import PoolClient, TokenClient
from contracts.transactor import Transactor
from protocol.errors import ChainError
from protocol.identity import checksum

MAX_APPEAL_WINDOW = 100 * 365 * 24 * 3600
"""The longest `appeal_window` the pool's constructor takes (`ComputePool.MAX_APPEAL_WINDOW`): its appeal
deadlines are uint40 pool times."""

logger = logging.getLogger(__name__)

DEPLOYMENT_VERSION = 1


class PoolSettings(BaseModel):
    """Parameters a pool is deployed with (amounts in token base units, periods in seconds)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_stake: int = Field(default=10**18, gt=0)
    """Smallest stake a node may register with."""
    unbonding_period: int = Field(default=7 * 24 * 3600, ge=0)
    """Seconds between leaving (or ejection) and withdrawable stake; at least the invalidation window."""
    invalidation_window: int = Field(default=24 * 3600, ge=0)
    """Seconds after recording during which work can still be invalidated."""
    reward_lock_period: int = Field(default=24 * 3600, ge=0)
    """Seconds a reward stays locked (and removable); at least the invalidation window."""
    reward_per_unit: int = Field(default=10**15, ge=0)
    """Reward paid per accepted work unit."""
    slash_penalty: int = Field(default=10**18, ge=0)
    """Stake taken on a hard invalidation, capped at the node's stake: held in escrow for `appeal_window`,
    then paid to the treasury (or back to the node if its appeal wins)."""
    appeal_window: int = Field(default=3 * 24 * 3600, ge=0, le=MAX_APPEAL_WINDOW)
    """Seconds after a hard invalidation during which the node may appeal it (pool clock)."""


class Deployment(BaseModel):
    """What a deploy wrote: where the pool lives and from which block to read its events."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: int = DEPLOYMENT_VERSION
    """Format version of this file."""
    chain_id: int
    """EIP-155 chain id the contracts live on."""
    pool: str
    """ComputePool address."""
    token: str
    """Stake and reward ERC-20 address."""
    start_block: int
    """Block of the pool's deployment: event readers start here."""
    deployer: str
    """Address that deployed (and administers) the pool."""
    treasury: str
    """Where slashed stake goes."""
    validators: list[str] = []
    """Addresses granted VALIDATOR_ROLE at deploy time."""
    trainers: list[str] = []
    """Addresses granted TRAINER_ROLE at deploy time."""
    settings: PoolSettings
    """Parameters the pool was deployed with."""
    abis: dict[str, str] = {"pool": "ComputePool", "token": "PoolToken"}
    """Artifact names (contracts/artifacts/<name>.json) of the ABIs to use."""

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.model_dump_json(indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> Deployment:
        try:
            return cls.model_validate(json.loads(Path(path).read_text()))
        except (OSError, ValueError) as exc:
            raise ChainError(f"cannot read deployment {path}: {exc}") from exc


def deploy_pool(
    tx: Transactor,
    *,
    treasury: str,
    settings: PoolSettings | None = None,
    token: str | None = None,
    validators: list[str] = [],  # noqa: B006 - never mutated
    trainers: list[str] = [],  # noqa: B006 - never mutated
    mint: dict[str, int] | None = None,
    fund_rewards: int = 0,
    bootstrap_peers: list[str] = [],  # noqa: B006 - never mutated
) -> Deployment:
    """Deploy (a dev PoolToken unless `token` is given and) a ComputePool administered by `tx`'s key.

    Grants the roles, records the discovery bootstrap peers (`bootstrap_peers`), mints dev tokens (`mint`, PoolToken only) and funds the reward budget (with a dev
    token the deployer is minted what it lacks; with a real token it must hold the budget).
    """
    settings = settings or PoolSettings()
    w3 = tx.w3
    start_block = int(tx.rpc("block number", lambda: w3.eth.block_number)) + 1
    dev_token = token is None
    if token is None:
        art = load_artifact("PoolToken")
        token, _ = tx.deploy("deploy PoolToken", art.abi, art.bytecode, "Prime Compute", "PRIME", tx.address)
    token = checksum(token)
    art = load_artifact("ComputePool")
    pool_address, _ = tx.deploy(
        "deploy ComputePool", art.abi, art.bytecode, token, tx.address, checksum(treasury),
        settings.min_stake, settings.unbonding_period, settings.invalidation_window,
        settings.reward_lock_period, settings.reward_per_unit, settings.slash_penalty, settings.appeal_window,
    )
    pool = PoolClient(w3, pool_address, tx.identity, tx)
    for account in validators:
        pool.grant_role("validator", account)
    for account in trainers:
        pool.grant_role("trainer", account)
    token_client = TokenClient(w3, token, tx.identity, tx)
    for account, amount in (mint or {}).items():
        token_client.mint(account, amount)
    if fund_rewards:
        if dev_token and token_client.balance_of(tx.address) < fund_rewards:
            token_client.mint(tx.address, fund_rewards)  # a dev token: the budget is minted for the run
        pool.fund_rewards(fund_rewards)
    if bootstrap_peers:
        pool.set_bootstrap_peers(bootstrap_peers)
    deployment = Deployment(
        chain_id=tx.chain_id(), pool=checksum(pool_address), token=token, start_block=start_block,
        deployer=tx.address, treasury=checksum(treasury), validators=[checksum(v) for v in validators],
        trainers=[checksum(t) for t in trainers], settings=settings,
    )
    logger.info("pool %s (token %s) on chain %d from block %d", pool_address, token, deployment.chain_id, start_block)
    return deployment
