"""Typed Python client of ComputePool (and of its ERC-20 token): one method per contract function.

    pool = PoolClient(connect(url), deployment.pool, operator_identity)
    pool.register(node_identity, stake)                 # approve + signed registration
    receipt = pool.record_work(node, work_key, units)   # as a validator

Reverts raise `ChainError` with `.reason` = the contract's custom error name (e.g. "DuplicateWorkKey").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from eth_utils.crypto import keccak
from web3 import Web3
from web3.exceptions import Web3Exception

from contracts.artifacts import load_artifact
from contracts.events import ChainEvent, EventCursor, read_events
from contracts.transactor import Receipt, Transactor
from protocol.errors import ChainError, PrimeError
from protocol.identity import Identity, checksum

logger = logging.getLogger(__name__)

DEFAULT_ADMIN_ROLE = b"\x00" * 32
VALIDATOR_ROLE = keccak(text="VALIDATOR_ROLE")
TRAINER_ROLE = keccak(text="TRAINER_ROLE")
ROLES = {"admin": DEFAULT_ADMIN_ROLE, "validator": VALIDATOR_ROLE, "trainer": TRAINER_ROLE}
EIP712_NAME = "PrimeComputePool"
EIP712_VERSION = "1"
REGISTRATION_TTL_S = 3600


class NodeStatus(IntEnum):
    NONE = 0
    ACTIVE = 1
    LEAVING = 2
    EJECTED = 3


class WorkStatus(IntEnum):
    """What the pool holds for a work key (the contract's `WorkStatus`)."""

    NONE = 0  # unknown: never recorded nor invalidated
    ACCEPTED = 1  # recorded, reward reserved, not yet claimed
    CLAIMED = 2  # recorded and paid
    SOFT_INVALIDATED = 3  # removed (or consumed before recording) without a slash
    HARD_INVALIDATED = 4  # removed (or consumed before recording) with a slash


class EscrowStatus(IntEnum):
    """What became of the stake one hard invalidation took (the contract's `EscrowStatus`)."""

    NONE = 0  # no hard invalidation under this key
    HELD = 1  # in escrow; the node may appeal until `appeal_deadline`
    APPEALED = 2  # appeal filed; a validator other than the slasher resolves it
    UPHELD = 3  # the appeal lost: paid to the treasury
    OVERTURNED = 4  # the appeal won: back in the node's stake, the work accepted again
    RELEASED = 5  # not appealed in time: paid to the treasury
    LAPSED = 6  # appealed, but not resolved by `resolve_deadline`: the slash stands (paid to the treasury)


@dataclass(frozen=True)
class EscrowInfo:
    """The slash of one hard invalidation (`getEscrow`). Deadlines are on the pool clock."""

    work_key: bytes
    slasher: str
    status: EscrowStatus
    appeal_deadline: int
    amount: int
    resolve_deadline: int = 0
    """Once appealed: unresolved at this pool time, the appeal may be let lapse (`lapse_appeal`); 0 before."""


@dataclass(frozen=True)
class NodeInfo:
    """A node's record in the pool."""

    address: str
    operator: str
    status: NodeStatus
    unbonding_end: int
    stake: int
    nonce: int
    accepted_units: int


@dataclass(frozen=True)
class WorkInfo:
    """What the pool holds for one work key (a submission).

    `status` says recorded (ACCEPTED, CLAIMED), invalidated (HARD_INVALIDATED, SOFT_INVALIDATED) or unknown
    (NONE). A key invalidated before it was ever recorded has `units == reward == 0` and `recorded_at` =
    when it was invalidated; `recorded_at` is on the pool clock (`PoolClient.pool_time`).
    """

    work_key: bytes
    node: str
    status: WorkStatus
    recorded_at: int
    units: int
    reward: int

    @property
    def known(self) -> bool:
        """The key is used for good: recordWork refuses it, recordWorkBatch skips it."""
        return self.status is not WorkStatus.NONE

    @property
    def was_recorded(self) -> bool:
        """It was recorded as accepted work at some point (recorded work always has units > 0)."""
        return self.units > 0

    @property
    def invalidated(self) -> bool:
        return self.status in (WorkStatus.HARD_INVALIDATED, WorkStatus.SOFT_INVALIDATED)


_APPEALED = (EscrowStatus.APPEALED, EscrowStatus.UPHELD, EscrowStatus.OVERTURNED)
"""Escrow statuses only an appeal leads to."""
_RESOLVED = (EscrowStatus.UPHELD, EscrowStatus.OVERTURNED)


@dataclass(frozen=True)
class PoolParams:
    """The pool's configuration as it stands on chain."""

    token: str
    treasury: str
    min_stake: int
    unbonding_period: int
    invalidation_window: int
    reward_lock_period: int
    reward_per_unit: int
    slash_penalty: int
    appeal_window: int


def registration_typed_data(
    *, chain_id: int, pool: str, node: str, operator: str, nonce: int, deadline: int
) -> dict[str, Any]:
    """The EIP-712 message a node key signs to be registered under `operator` in `pool`."""
    return {
        "types": {
            "EIP712Domain": [
                {"name": "name", "type": "string"},
                {"name": "version", "type": "string"},
                {"name": "chainId", "type": "uint256"},
                {"name": "verifyingContract", "type": "address"},
            ],
            "Registration": [
                {"name": "node", "type": "address"},
                {"name": "operator", "type": "address"},
                {"name": "nonce", "type": "uint256"},
                {"name": "deadline", "type": "uint256"},
            ],
        },
        "primaryType": "Registration",
        "domain": {"name": EIP712_NAME, "version": EIP712_VERSION, "chainId": chain_id, "verifyingContract": pool},
        "message": {"node": node, "operator": operator, "nonce": nonce, "deadline": deadline},
    }


def _key32(value: bytes | str) -> bytes:
    try:
        raw = bytes.fromhex(value.removeprefix("0x")) if isinstance(value, str) else bytes(value)
    except (ValueError, TypeError) as exc:
        raise ChainError(f"a work key / hash must be 32 bytes or their hex: {value!r}", reason="bad_argument") from exc
    if len(raw) != 32:
        raise ChainError(f"a work key / hash must be 32 bytes, got {len(raw)}", reason="bad_argument")
    return raw


def _address(value: str) -> str:
    """The checksum form of an address argument; ChainError (not SignatureError) when it is none."""
    try:
        return checksum(value)
    except PrimeError as exc:
        raise ChainError(str(exc), reason="bad_argument") from exc


class ContractClient:
    """Shared plumbing: a contract bound to an address, sending from one identity."""

    artifact = ""

    def __init__(self, w3: Web3, address: str, identity: Identity, transactor: Transactor | None = None) -> None:
        self.w3 = w3
        self.address = _address(address)
        self.identity = identity
        self.tx = transactor or Transactor(w3, identity)
        self.abi = load_artifact(self.artifact).abi
        self.contract = w3.eth.contract(address=self.address, abi=self.abi)  # type: ignore[call-overload]

    def _f(self, name: str, *args: Any) -> Any:
        """The bound contract function `name(*args)`; arguments that do not fit its ABI raise ChainError."""
        try:
            return getattr(self.contract.functions, name)(*args)
        except Web3Exception as exc:
            raise ChainError(f"{name}: arguments do not fit the ABI: {exc}", reason="bad_argument") from exc

    def _send(self, what: str, fn: Any, gas: int | None = None, done: Callable[[], bool] | None = None) -> Receipt:
        """Send `fn`; `done()` reads whether its action is on chain already (a resent copy that reverts then
        counts as success: see `Transactor.send`)."""
        return self.tx.send(what, {"to": self.address, "data": fn._encode_transaction_data(), "value": 0}, gas,
                            done=done)

    def _call(self, what: str, fn: Any) -> Any:
        return self.tx.call(what, fn.call)


class TokenClient(ContractClient):
    """The pool's ERC-20 (PoolToken on a dev chain; any ERC-20 in production)."""

    artifact = "PoolToken"

    def balance_of(self, account: str) -> int:
        return int(self._call("balanceOf", self._f("balanceOf", _address(account))))

    def allowance(self, owner: str, spender: str) -> int:
        fn = self._f("allowance", _address(owner), _address(spender))
        return int(self._call("allowance", fn))

    def total_supply(self) -> int:
        return int(self._call("totalSupply", self._f("totalSupply")))

    def approve(self, spender: str, amount: int) -> Receipt:
        return self._send("approve", self._f("approve", _address(spender), amount))

    def transfer(self, to: str, amount: int) -> Receipt:
        return self._send("transfer", self._f("transfer", _address(to), amount))

    def mint(self, to: str, amount: int) -> Receipt:
        """PoolToken only (owner mints on a dev chain)."""
        return self._send("mint", self._f("mint", _address(to), amount))


class PoolClient(ContractClient):
    """One identity's view of one ComputePool: typed calls, transactions and event reading."""

    artifact = "ComputePool"

    def __init__(self, w3: Web3, address: str, identity: Identity, transactor: Transactor | None = None) -> None:
        super().__init__(w3, address, identity, transactor)
        self._token: TokenClient | None = None

    @property
    def token(self) -> TokenClient:
        """The pool's token, sending from the same identity (and nonce sequence)."""
        if self._token is None:
            self._token = TokenClient(self.w3, self.params().token, self.identity, self.tx)
        return self._token

    # -- nodes ----------------------------------------------------------------------------

    def registration_signature(self, node: Identity, operator: str, deadline: int, nonce: int | None = None) -> bytes:
        """The node key's EIP-712 signature allowing `operator` to register it in this pool."""
        if nonce is None:
            nonce = self.get_node(node.address).nonce
        message = registration_typed_data(
            chain_id=self.tx.chain_id(), pool=self.address, node=node.address,
            operator=_address(operator), nonce=nonce, deadline=deadline,
        )
        return node.sign_typed_data(message)

    def register_signed(self, node: str, amount: int, deadline: int, signature: bytes) -> Receipt:
        """register(node, amount, deadline, signature): the raw contract call (token allowance must exist)."""
        fn = self._f("register", _address(node), amount, deadline, signature)
        return self._send("register", fn, done=lambda: self.get_node(node).operator.lower()
                          == self.identity.address.lower())

    def register(self, node: Identity, amount: int, *, deadline: int | None = None, approve: bool = True) -> Receipt:
        """Register `node` under this client's identity with `amount` stake (approving the pool if needed)."""
        if deadline is None:
            deadline = int(time.time()) + REGISTRATION_TTL_S
        signature = self.registration_signature(node, self.identity.address, deadline)
        if approve and self.token.allowance(self.identity.address, self.address) < amount:
            self.token.approve(self.address, amount)
        return self.register_signed(node.address, amount, deadline, signature)

    def add_stake(self, node: str, amount: int, *, approve: bool = True) -> Receipt:
        if approve and self.token.allowance(self.identity.address, self.address) < amount:
            self.token.approve(self.address, amount)
        return self._send("addStake", self._f("addStake", _address(node), amount))

    def leave_pool(self, node: str) -> Receipt:
        return self._send("leavePool", self._f("leavePool", _address(node)))

    def withdraw(self, node: str) -> Receipt:
        return self._send("withdraw", self._f("withdraw", _address(node)))

    # -- work -----------------------------------------------------------------------------

    def record_work(self, node: str, work_key: bytes | str, units: int) -> Receipt:
        """recordWork: strict, a key already known reverts with reason "DuplicateWorkKey"."""
        fn = self._f("recordWork", _address(node), _key32(work_key), units)
        return self._send("recordWork", fn, done=lambda: self.get_work(work_key).was_recorded)

    def record_work_batch(self, items: list[tuple[str, bytes | str, int]]) -> Receipt:
        """recordWorkBatch: [(node, work_key, units), ...] in one transaction. Idempotent: keys already known
        (recorded or invalidated, earlier or in this batch) are skipped with a `WorkSkipped` event, so a batch
        whose outcome is unknown can be sent again. Any other failure reverts the whole batch."""
        nodes = [_address(node) for node, _, _ in items]
        keys = [_key32(key) for _, key, _ in items]
        units = [u for _, _, u in items]
        return self._send("recordWorkBatch", self._f("recordWorkBatch", nodes, keys, units),
                          done=lambda: all(self.get_work(k).known for k in keys))

    def invalidate_hard(self, node: str, work_key: bytes | str, reason_code: int, evidence_hash: bytes | str) -> Receipt:
        """invalidateHard: slash `node` for `work_key`, recorded (inside its window) or never recorded (the key
        is then consumed). `evidence_hash` must be non-zero. Reverts: "WorkOfOtherNode", "WorkNotAccepted"
        (already claimed or invalidated), "InvalidationWindowClosed", "ZeroEvidenceHash", "ZeroAddress"."""
        fn = self._f("invalidateHard", _address(node), _key32(work_key), reason_code, _key32(evidence_hash))
        return self._send("invalidateHard", fn,
                          done=lambda: self.get_work(work_key).status is WorkStatus.HARD_INVALIDATED)

    def invalidate_hard_batch(self, items: list[tuple[str, bytes | str, int, bytes | str]]) -> Receipt:
        """invalidateHardBatch: [(node, work_key, reason_code, evidence_hash), ...] in one transaction, each slashed
        as by `invalidate_hard`. Idempotent: keys already hard-invalidated are skipped with a `WorkSkipped` event.
        Any other failure reverts the whole batch."""
        nodes = [_address(node) for node, _, _, _ in items]
        keys = [_key32(key) for _, key, _, _ in items]
        codes = [code for _, _, code, _ in items]
        evidence = [_key32(e) for _, _, _, e in items]
        return self._send("invalidateHardBatch", self._f("invalidateHardBatch", nodes, keys, codes, evidence),
                          done=lambda: all(self.get_work(k).status is WorkStatus.HARD_INVALIDATED for k in keys))

    def invalidate_soft(self, node: str, work_key: bytes | str, reason_code: int) -> Receipt:
        """invalidateSoft: remove `node`'s recorded work, or consume a key never recorded; no slash."""
        fn = self._f("invalidateSoft", _address(node), _key32(work_key), reason_code)
        return self._send("invalidateSoft", fn, done=lambda: self.get_work(work_key).invalidated)

    def invalidate_soft_batch(self, items: list[tuple[str, bytes | str, int]]) -> Receipt:
        """invalidateSoftBatch: [(node, work_key, reason_code), ...] in one transaction, no slash. Idempotent: keys
        already invalidated (earlier or in this batch) are skipped with a `WorkSkipped` event, so a batch whose
        outcome is unknown can be sent again. Any other failure reverts the whole batch (the reasons of
        `invalidate_soft`)."""
        nodes = [_address(node) for node, _, _ in items]
        keys = [_key32(key) for _, key, _ in items]
        codes = [code for _, _, code in items]
        return self._send("invalidateSoftBatch", self._f("invalidateSoftBatch", nodes, keys, codes),
                          done=lambda: all(self.get_work(k).invalidated for k in keys))

    # -- appeals --------------------------------------------------------------------------

    def appeal(self, work_key: bytes | str) -> Receipt:
        """appeal: the node's operator (or the node key) contests the hard invalidation of `work_key` before its
        appeal deadline. Reverts: "NotSlashed", "NotOperator", "WrongEscrowStatus" (filed or settled already),
        "AppealWindowClosed"."""
        return self._send("appeal", self._f("appeal", _key32(work_key)),
                          done=lambda: self.get_escrow(work_key).status in _APPEALED)

    def resolve_appeal(self, work_key: bytes | str, upheld: bool, units: int, evidence_hash: bytes | str) -> Receipt:
        """resolveAppeal (a validator other than the slasher): `upheld` pays the escrow to the treasury; otherwise
        the stake returns to the node and the work is accepted again (`units` for a key never recorded).
        Reverts: "WrongEscrowStatus" (no appeal pending), "ResolverIsSlasher", "ZeroEvidenceHash", "ZeroUnits",
        "InsufficientRewardBudget"."""
        fn = self._f("resolveAppeal", _key32(work_key), bool(upheld), units, _key32(evidence_hash))
        return self._send("resolveAppeal", fn, done=lambda: self.get_escrow(work_key).status in _RESOLVED)

    def release_escrow(self, work_key: bytes | str) -> Receipt:
        """releaseEscrow (anyone): an escrow not appealed by its deadline goes to the treasury. Reverts:
        "WrongEscrowStatus", "AppealWindowOpen"."""
        return self._send("releaseEscrow", self._f("releaseEscrow", _key32(work_key)),
                          done=lambda: self.get_escrow(work_key).status is EscrowStatus.RELEASED)

    def lapse_appeal(self, work_key: bytes | str) -> Receipt:
        """lapseAppeal (anyone): an appeal no validator resolved by its resolve deadline lapses; the slash stands
        and the escrow goes to the treasury. Reverts: "WrongEscrowStatus", "AppealStillOpen"."""
        return self._send("lapseAppeal", self._f("lapseAppeal", _key32(work_key)))

    def claim_rewards(self, node: str, work_keys: list[bytes | str]) -> Receipt:
        keys = [_key32(k) for k in work_keys]
        return self._send("claimRewards", self._f("claimRewards", _address(node), keys),
                          done=lambda: all(self.get_work(k).status is WorkStatus.CLAIMED for k in keys))

    # -- trainer and budget ---------------------------------------------------------------

    def publish_policy(self, version: int, manifest_hash: bytes | str) -> Receipt:
        digest = _key32(manifest_hash)

        def done() -> bool:
            current, current_hash = self.policy()
            return current > version or (current == version and current_hash == digest)

        return self._send("publishPolicy", self._f("publishPolicy", version, digest), done=done)

    def fund_rewards(self, amount: int, *, approve: bool = True) -> Receipt:
        if approve and self.token.allowance(self.identity.address, self.address) < amount:
            self.token.approve(self.address, amount)
        return self._send("fundRewards", self._f("fundRewards", amount))

    def defund_rewards(self, to: str, amount: int) -> Receipt:
        return self._send("defundRewards", self._f("defundRewards", _address(to), amount))

    # -- admin ----------------------------------------------------------------------------

    def grant_role(self, role: str, account: str) -> Receipt:
        return self._send("grantRole", self._f("grantRole", ROLES[role], _address(account)))

    def revoke_role(self, role: str, account: str) -> Receipt:
        return self._send("revokeRole", self._f("revokeRole", ROLES[role], _address(account)))

    def renounce_role(self, role: str) -> Receipt:
        fn = self._f("renounceRole", ROLES[role], self.identity.address)
        return self._send("renounceRole", fn)

    def set_treasury(self, treasury: str) -> Receipt:
        return self._send("setTreasury", self._f("setTreasury", _address(treasury)))

    def set_min_stake(self, amount: int) -> Receipt:
        return self._send("setMinStake", self._f("setMinStake", amount))

    def set_reward_per_unit(self, amount: int) -> Receipt:
        return self._send("setRewardPerUnit", self._f("setRewardPerUnit", amount))

    def set_slash_penalty(self, amount: int) -> Receipt:
        return self._send("setSlashPenalty", self._f("setSlashPenalty", amount))

    def set_bootstrap_peers(self, peers: list[str]) -> Receipt:
        """Replace the run's discovery bootstrap list (admin; at most 16 entries of at most 256 bytes)."""
        return self._send("setBootstrapPeers", self._f("setBootstrapPeers", list(peers)))

    def pause(self) -> Receipt:
        return self._send("pause", self._f("pause"))

    def unpause(self) -> Receipt:
        return self._send("unpause", self._f("unpause"))

    # -- views ----------------------------------------------------------------------------

    def get_node(self, node: str) -> NodeInfo:
        r = self._call("getNode", self._f("getNode", _address(node)))
        return NodeInfo(_address(node), _address(r[0]), NodeStatus(r[1]), int(r[2]), int(r[3]), int(r[4]), int(r[5]))

    def get_work(self, work_key: bytes | str) -> WorkInfo:
        """What the pool holds for `work_key`: recorded, claimed, invalidated (hard/soft) or unknown."""
        key = _key32(work_key)
        r = self._call("getWork", self._f("getWork", key))
        return WorkInfo(key, _address(r[0]), WorkStatus(r[1]), int(r[2]), int(r[3]), int(r[4]))

    def get_escrow(self, work_key: bytes | str) -> EscrowInfo:
        """The escrow of `work_key`'s slash (status NONE when the key was never hard-invalidated)."""
        key = _key32(work_key)
        r = self._call("getEscrow", self._f("getEscrow", key))
        return EscrowInfo(key, _address(r[0]), EscrowStatus(r[1]), int(r[2]), int(r[4]), int(r[3]))

    def total_escrow(self) -> int:
        return int(self._call("totalEscrow", self._f("totalEscrow")))

    def is_active(self, node: str) -> bool:
        return bool(self._call("isActive", self._f("isActive", _address(node))))

    def validator_count(self) -> int:
        """How many accounts hold the validator role (with one, it re-checks appeals of its own verdicts)."""
        return int(self._call("validatorCount", self._f("validatorCount")))

    def has_role(self, role: str, account: str) -> bool:
        return bool(self._call("hasRole", self._f("hasRole", ROLES[role], _address(account))))

    def paused(self) -> bool:
        return bool(self._call("paused", self._f("paused")))

    def params(self) -> PoolParams:
        return PoolParams(
            token=_address(self._call("token", self._f("token"))),
            treasury=_address(self._call("treasury", self._f("treasury"))),
            min_stake=int(self._call("minStake", self._f("minStake"))),
            unbonding_period=int(self._call("unbondingPeriod", self._f("unbondingPeriod"))),
            invalidation_window=int(self._call("invalidationWindow", self._f("invalidationWindow"))),
            reward_lock_period=int(self._call("rewardLockPeriod", self._f("rewardLockPeriod"))),
            reward_per_unit=int(self._call("rewardPerUnit", self._f("rewardPerUnit"))),
            slash_penalty=int(self._call("slashPenalty", self._f("slashPenalty"))),
            appeal_window=int(self._call("appealWindow", self._f("appealWindow"))),
        )

    def reward_budget(self) -> int:
        return int(self._call("rewardBudget", self._f("rewardBudget")))

    def rewards_reserved(self) -> int:
        return int(self._call("rewardsReserved", self._f("rewardsReserved")))

    def total_stake(self) -> int:
        return int(self._call("totalStake", self._f("totalStake")))

    def policy(self) -> tuple[int, bytes]:
        """(latest published policy version, its manifest hash)."""
        version = int(self._call("policyVersion", self._f("policyVersion")))
        manifest = bytes(self._call("policyManifestHash", self._f("policyManifestHash")))
        return version, manifest

    def bootstrap_peers(self) -> list[str]:
        """The discovery bootstrap multiaddrs the admin recorded: untrusted hints (check each before dialing)."""
        return [str(p) for p in self._call("bootstrapPeers", self._f("bootstrapPeers"))]

    def domain_separator(self) -> bytes:
        return bytes(self._call("domainSeparator", self._f("domainSeparator")))

    def pool_time(self) -> int:
        """The pool clock: block time less every second spent paused (it stands still while paused).
        Every period (window, lock, unbonding) and `recorded_at`/`unbonding_end` are on this clock."""
        return int(self._call("poolTime", self._f("poolTime")))

    # -- events ---------------------------------------------------------------------------

    def events(
        self, from_block: int, to_block: int | None = None, names: set[str] | None = None, chunk: int = 5000
    ) -> list[ChainEvent]:
        """The pool's events from `from_block` onward (to `to_block`, default the latest), oldest first."""
        return read_events(self.tx, self.address, self.abi, from_block, to_block, names=names, chunk=chunk)

    def cursor(self, start_block: int, names: set[str] | None = None) -> EventCursor:
        """An incremental reader of the pool's events from `start_block` on (`contracts.events.EventCursor`)."""
        return EventCursor(lambda: int(self.tx.rpc("block number", lambda: self.w3.eth.block_number)),
                           lambda first, last: self.events(first, last, names=names), start_block)
