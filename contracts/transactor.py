"""Sending transactions: local signing, nonces, gas, fees, receipts, revert reasons, transient retries, and
transactions that a real chain loses: dropped from the pool, stuck, or rolled back with their block.

Every failure leaves as `ChainError`, classified once here (`chain_error`); a contract revert carries its
reason (custom error name, require string or panic code) in `ChainError.reason`. Only connection-level RPC
failures are retried; a revert or a rejected transaction is never retried. A transaction that was sent is
watched until it lands: dropped, it is sent again (same nonce while that is free, so two copies can never
both land); stuck, it is replaced with higher fees; rolled back, it is sent again (`Transactor.reconcile`),
whatever the depth of the rollback: every transaction is written to a journal (`contracts.journal`, durable in
the role's state) before it is sent and kept after it lands. A nonce gap (the chain's nonce below one of ours
that waits in the pool, with nothing of ours to fill it) is filled. The original web3/requests exception stays
attached as `__cause__`.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import requests
from eth_utils.conversions import to_bytes
from hexbytes import HexBytes
from web3 import Web3
from web3.exceptions import (
    ContractLogicError,
    ProviderConnectionError,
    TimeExhausted,
    TransactionNotFound,
    Web3Exception,
    Web3RPCError,
)
from web3.providers.rpc import HTTPProvider

from contracts.artifacts import decode_revert
from contracts.journal import Journal
from protocol.errors import ChainError
from protocol.identity import Identity

logger = logging.getLogger(__name__)

T = TypeVar("T")

GAS_MARGIN = 1.2  # estimates can be a little low when state shifts between estimate and inclusion
GAS_BUMP = 1.25  # a replacement offers this much more (nodes want at least +10% to replace a pending tx)
JOURNAL_LIMIT = 1024  # landed transactions watched for a rollback, whatever its depth (the oldest leave first)
FILLER_GAS = 21_000  # a plain transfer: what fills a nonce gap

# What web3.py and its transport raise for a failed or malformed RPC exchange (web3 also raises plain
# ValueError from eth_utils/hexbytes on odd responses). Anything else is a bug here and stays uncaught.
RPC_FAILURES: tuple[type[Exception], ...] = (Web3Exception, requests.RequestException, ValueError)
# A node without eth_feeHistory, or an answer without base fees.
FEE_HISTORY_FAILURES: tuple[type[Exception], ...] = (*RPC_FAILURES, KeyError, IndexError)
# Encoding arguments for the ABI: eth_utils raises TypeError for a wrong argument count.
ENCODING_FAILURES: tuple[type[Exception], ...] = (*RPC_FAILURES, TypeError)


def connect(rpc_url: str, timeout: float = 30.0) -> Web3:
    """A Web3 for `rpc_url` with web3's own retry middleware off (Transactor decides what to retry)."""
    provider = HTTPProvider(rpc_url, request_kwargs={"timeout": timeout}, exception_retry_configuration=None)
    return Web3(provider)


def is_transient(exc: BaseException) -> bool:
    """True for failures of the transport (connection refused/reset, timeout, 429/502/503/504)."""
    if isinstance(exc, requests.ConnectionError | requests.Timeout | ProviderConnectionError):
        return True
    if isinstance(exc, requests.HTTPError) and exc.response is not None:
        return exc.response.status_code in {429, 502, 503, 504}
    return False


def revert_error(exc: ContractLogicError | Web3RPCError, action: str) -> ChainError:
    """A ChainError with the decoded revert reason of a failed call or estimate."""
    data: Any = getattr(exc, "data", None)
    if isinstance(data, dict):
        data = data.get("data")
    if isinstance(data, str) and data.startswith("0x"):
        reason, detail = decode_revert(to_bytes(hexstr=data))
        return ChainError(f"{action} reverted: {detail}", reason=reason)
    return ChainError(f"{action} failed: {exc}", reason=None)


def chain_error(exc: Exception, action: str) -> ChainError:
    """Classify a failure of an RPC exchange once, as a ChainError (`reason` = the revert reason, or a
    short word for the kind of failure)."""
    if isinstance(exc, ChainError):
        return exc
    if isinstance(exc, ContractLogicError | Web3RPCError):
        return revert_error(exc, action)
    if isinstance(exc, TimeExhausted):
        return ChainError(f"{action}: timed out: {exc}", reason="timeout")
    if isinstance(exc, requests.HTTPError) and exc.response is not None:
        return ChainError(f"{action}: HTTP {exc.response.status_code} from the RPC: {exc}", reason="http")
    if is_transient(exc):
        return ChainError(f"{action}: RPC unreachable: {exc}", reason="unreachable")
    return ChainError(f"{action} failed: {type(exc).__name__}: {exc}")


@dataclass(frozen=True)
class Receipt:
    """A mined, successful transaction."""

    tx_hash: str
    block_number: int
    gas_used: int
    logs: list[Any]
    replayed: bool = False
    """True when a resent transaction reverted because the chain already shows its action (`done()`): the
    action happened once, by an earlier copy or another sender; this receipt is of the reverted resend."""


@dataclass(eq=False)
class _Sent:
    """One action on its way on chain: the transaction as last signed and every hash it was sent under."""

    what: str
    tx: dict[str, Any]
    done: Callable[[], bool] | None
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    raw: bytes = b""
    hashes: list[HexBytes] = field(default_factory=list)
    sent_at: float = 0.0
    resends: int = 0
    block_number: int | None = None
    block_hash: bytes | None = None
    mined: HexBytes | None = None
    reverted: bool = False
    relanding: bool = False
    """Rolled back and not landed again yet: checked every round, whatever the blocks of the others."""

    @property
    def nonce(self) -> int:
        return int(self.tx["nonce"])

    def record(self) -> dict[str, Any]:
        """What the journal keeps of it (`contracts.journal`)."""
        return {"what": self.what, "tx": self.tx, "raw": "0x" + self.raw.hex(),
                "hashes": [h.to_0x_hex() for h in self.hashes], "block_number": self.block_number,
                "block_hash": None if self.block_hash is None else "0x" + self.block_hash.hex(),
                "mined": None if self.mined is None else self.mined.to_0x_hex()}

    @classmethod
    def from_record(cls, entry_id: str, record: dict[str, Any]) -> _Sent:
        """A journalled transaction of an earlier process (its `done()` did not survive it)."""
        block_hash = record.get("block_hash")
        mined = record.get("mined")
        return cls(what=str(record["what"]), tx=dict(record["tx"]), done=None, id=entry_id,
                   raw=bytes.fromhex(str(record["raw"])[2:]), hashes=[HexBytes(h) for h in record["hashes"]],
                   block_number=record.get("block_number"),
                   block_hash=None if block_hash is None else bytes.fromhex(block_hash[2:]),
                   mined=None if mined is None else HexBytes(mined))


class Transactor:
    """Signs and sends transactions from one key; thread-safe (one nonce sequence per key)."""

    def __init__(
        self,
        w3: Web3,
        identity: Identity,
        *,
        retries: int = 3,
        retry_backoff: float = 0.5,
        receipt_timeout: float = 120.0,
        priority_fee_wei: int | None = None,
        resend_after_s: float = 30.0,
        probe_s: float = 1.0,
        keep: int = JOURNAL_LIMIT,
        journal: Journal | None = None,
    ) -> None:
        """`receipt_timeout`: how long one send may wait for its receipt, resends included. `resend_after_s`: a
        transaction pending this long is replaced with higher fees. `probe_s`: how often a waiting send asks
        whether its transaction is still in the pool (and whether a nonce gap below it holds it up). `keep`:
        landed transactions watched for a rollback, whatever its depth (0: none). `journal`: where sent
        transactions are kept (`contracts.journal.FileJournal` in the role's state survives a restart; default:
        memory); transactions an earlier process left there are taken up by `reconcile()`."""
        self.w3 = w3
        self.identity = identity
        self.retries = retries
        self.retry_backoff = retry_backoff
        self.receipt_timeout = receipt_timeout
        self.priority_fee_wei = priority_fee_wei
        self._lock = threading.Lock()
        self._chain_id: int | None = None
        self.resend_after_s = resend_after_s
        self.probe_s = probe_s
        self.keep = keep
        self.resent = 0
        """Transactions sent again so far (dropped, stuck or rolled back)."""
        self.filled = 0
        """Nonce gaps filled so far (nonces below ours that nothing of ours held; see `_fill_gap`)."""
        self.store = journal if journal is not None else Journal()
        self._journal: list[_Sent] = []
        """Landed transactions watched for a rollback (the newest `keep`)."""
        self._orphans: list[_Sent] = []
        """Sent, never seen landed, and nobody waits for them (an earlier process's, or a send that timed out)."""
        self._flying: dict[int, _Sent] = {}
        """Nonce -> our transaction a send (or a resend) is waiting for now."""
        self._reserved: set[int] = set()
        """Nonces handed out whose transaction is not signed yet."""
        self._journal_lock = threading.Lock()
        self._reconciling = threading.Lock()
        for entry_id, record in sorted(self.store.load().items(), key=lambda kv: int(kv[1]["tx"]["nonce"])):
            sent = _Sent.from_record(entry_id, record)
            (self._journal if sent.block_number is not None else self._orphans).append(sent)
        if self._journal or self._orphans:
            logger.info("transaction journal: %d landed transactions to watch, %d sent by an earlier process not "
                        "seen landed", len(self._journal), len(self._orphans))

    @property
    def address(self) -> str:
        return self.identity.address

    # -- transport ------------------------------------------------------------------------

    def rpc(self, what: str, fn: Callable[[], T]) -> T:
        """Run one RPC call, retrying transient transport failures with backoff; any failure is ChainError."""
        try:
            return self._retrying(what, fn)
        except RPC_FAILURES as exc:
            raise chain_error(exc, what) from exc

    def _retrying(self, what: str, fn: Callable[[], T]) -> T:
        """`fn()` with transient failures retried; other failures are raised as they came (for callers that
        look at them before classifying)."""
        for attempt in range(self.retries + 1):
            try:
                return fn()
            except Exception as exc:
                if not is_transient(exc):
                    raise
                if attempt == self.retries:
                    raise ChainError(
                        f"{what}: RPC unreachable after {attempt + 1} tries: {exc}", reason="unreachable"
                    ) from exc
                delay = self.retry_backoff * (2**attempt)
                logger.warning("%s: transient RPC error (%s), retry in %.1fs", what, exc, delay)
                time.sleep(delay)
        raise AssertionError("unreachable")

    def chain_id(self) -> int:
        if self._chain_id is None:
            self._chain_id = int(self.rpc("chain_id", lambda: self.w3.eth.chain_id))
        return self._chain_id

    def resync_nonce(self) -> None:
        """After a chain reset (a new chain, not a rollback to repair): forget the journal. Nonces need no
        resync: each comes from the chain's pending count, above only what a send of ours is waiting for."""
        with self._journal_lock:
            dropped = [s.id for s in self._journal + self._orphans]
            self._journal.clear()
            self._orphans.clear()
        self.store.drop(dropped)

    def call(self, what: str, fn: Callable[[], T]) -> T:
        """A read-only contract call; reverts become ChainError with the reason."""
        return self.rpc(what, fn)

    # -- the journal ----------------------------------------------------------------------

    def _save(self, sent: _Sent) -> None:
        self.store.save(sent.id, sent.record())

    def _forget(self, sents: list[_Sent]) -> None:
        self.store.drop([s.id for s in sents])

    def _fly(self, sent: _Sent) -> None:
        with self._lock:
            self._flying[sent.nonce] = sent

    def _land(self, sent: _Sent) -> None:
        with self._lock:
            if self._flying.get(sent.nonce) is sent:
                del self._flying[sent.nonce]

    def _held(self) -> set[int]:
        """Nonces a send of ours is using now (caller holds `_lock`)."""
        return set(self._flying) | self._reserved

    # -- sending --------------------------------------------------------------------------

    def _allocate_nonce(self) -> int:
        """The next nonce of this key (caller holds `_lock`): the node's pending count, or above every nonce a
        send of ours is using (sent, maybe not shown by the node yet). Nothing else is remembered: after a
        rollback deeper than anything watched, the next nonce is the chain's again, not one above a gap."""
        pending = int(self.rpc("nonce", lambda: self.w3.eth.get_transaction_count(self.identity.account.address, "pending")))
        held = self._held()
        nonce = max(pending, max(held) + 1) if held else pending
        self._reserved.add(nonce)
        return nonce

    def send(self, what: str, tx: dict[str, Any], gas: int | None = None, *,
             done: Callable[[], bool] | None = None) -> Receipt:
        """Fill in nonce, gas and fees, sign locally, send, wait for and check the receipt.

        While it waits it watches the transaction: dropped from the pool (no receipt, not pending) it is sent
        again under the same nonce, or a fresh one when that nonce was used by another transaction (then ours
        can never land, so the action cannot happen twice); pending longer than `resend_after_s` it is replaced
        under the same nonce with fees raised by `GAS_BUMP`, or, when a nonce gap below it is what holds it up,
        the gap is filled.
        `done()` reads whether the action is on chain already: a resent copy that reverts counts as success when
        it says so (the contract's own keys make a replay revert harmlessly). Gives up after `receipt_timeout`
        with a ChainError (reason "timeout"); the transaction stays in the journal for `reconcile()`.
        A landed transaction stays in the journal (the newest `keep`); `reconcile()` (run before every send)
        sends again one whose block left the canonical chain (a reorg or a revert of any depth).
        """
        self.reconcile()
        with self._lock:
            tx = dict(tx)
            tx["from"] = self.address
            tx["chainId"] = self.chain_id()
            tx["nonce"] = nonce = self._allocate_nonce()
        try:
            if gas is None:
                try:
                    estimate = int(self._retrying(what, lambda: self.w3.eth.estimate_gas(tx)))  # type: ignore[arg-type]
                except RPC_FAILURES as exc:
                    raise chain_error(exc, what) from exc
                gas = int(estimate * GAS_MARGIN)
            tx["gas"] = gas
            self._fill_fees(tx)
            sent = _Sent(what, tx, done)
            self._fly(sent)
            try:
                self._sign_and_send(sent)
            except BaseException as exc:
                self._land(sent)
                if isinstance(exc, ChainError) and exc.reason != "rejected":
                    self._orphan(sent)  # the outcome is unknown (the node may hold it): reconcile() finds out
                else:
                    self._forget([sent])
                raise
        finally:
            with self._lock:
                self._reserved.discard(nonce)
        try:
            return self._settle(sent)
        except ChainError:
            self._orphan(sent)
            raise

    def _orphan(self, sent: _Sent) -> None:
        """Nobody waits for `sent` any more (its send gave up): `reconcile()` learns whether it landed after all."""
        if sent.reverted:
            return
        with self._journal_lock:
            if sent not in self._orphans and sent not in self._journal:
                self._orphans.append(sent)

    def _sign_and_send(self, sent: _Sent) -> None:
        """Sign `sent` as it stands and send it; journalled before it leaves (a kill between the two leaves a
        record of a transaction that may be out)."""
        signed = self.identity.account.sign_transaction(sent.tx)
        tx_hash = HexBytes(signed.hash)
        sent.raw = bytes(signed.raw_transaction)
        if tx_hash not in sent.hashes:
            sent.hashes.append(tx_hash)
        self._save(sent)
        self._send_raw(sent.what, sent.raw, tx_hash)
        sent.sent_at = time.monotonic()

    def _settle(self, sent: _Sent) -> Receipt:
        """Wait for `sent` to land, resending it when it is dropped or stuck and filling a nonce gap below it;
        the checked Receipt."""
        self._fly(sent)
        try:
            return self._wait(sent)
        finally:
            self._land(sent)

    def _wait(self, sent: _Sent) -> Receipt:
        deadline = time.monotonic() + self.receipt_timeout
        poll = 0.05
        last_probe = time.monotonic()
        while True:
            receipt = self._receipt_of(sent)
            if receipt is not None:
                return self._landed(sent, receipt)
            now = time.monotonic()
            if now >= deadline:
                raise ChainError(
                    f"{sent.what}: no receipt for {sent.hashes[-1].to_0x_hex()} after {self.receipt_timeout}s "
                    f"({sent.resends} resends)", reason="timeout")
            if now - last_probe >= self.probe_s:
                last_probe = now
                if not self._in_pool(sent):
                    if self._receipt_of(sent) is None:  # mined between the two lookups otherwise
                        self._revive(sent, "dropped from the pool")
                        deadline = max(deadline, time.monotonic() + min(self.receipt_timeout, 10 * self.probe_s))
                elif now - sent.sent_at >= self.resend_after_s:  # stuck: held up by a gap, or priced too low
                    if self._fill_gap(sent):
                        deadline = max(deadline, time.monotonic() + min(self.receipt_timeout, 10 * self.probe_s))
                        sent.sent_at = time.monotonic()
                    else:
                        self._replace(sent)
            time.sleep(poll)
            poll = min(poll * 1.5, self.probe_s)

    def _receipt_of(self, sent: _Sent) -> Any:
        """The receipt of whichever of `sent`'s hashes was mined, None when none was."""
        for tx_hash in reversed(sent.hashes):
            try:
                receipt = self._retrying("receipt", lambda h=tx_hash: self.w3.eth.get_transaction_receipt(h))  # type: ignore[misc]
            except TransactionNotFound:
                continue
            except RPC_FAILURES as exc:
                raise chain_error(exc, f"{sent.what}: receipt of {tx_hash.to_0x_hex()}") from exc
            if receipt is not None and receipt.get("blockNumber") is not None:
                return receipt
        return None

    def _in_pool(self, sent: _Sent) -> bool:
        return any(self._transaction_exists(h) for h in sent.hashes)

    def _chain_nonce(self) -> int:
        """How many of this key's transactions the chain has mined (the next nonce it will accept)."""
        return int(self.rpc("nonce", lambda: self.w3.eth.get_transaction_count(self.identity.account.address, "latest")))

    def _fill_gap(self, sent: _Sent) -> bool:
        """`sent` waits in the pool above the chain's nonce: every nonce in between that no send of ours is using
        (a transaction of ours lost with a rollback deeper than the journal, or sent by another process of this
        key and lost) holds it up for good. Fill each with a plain transfer to ourselves, so ours land under
        their own nonces (never twice). True when it filled one."""
        chain = self._chain_nonce()
        if chain >= sent.nonce:
            return False
        self.reconcile()  # nonces of ours a rollback removed are sent again, not filled (unless that runs now)
        chain = self._chain_nonce()
        with self._journal_lock:
            known = {s.nonce for s in self._journal + self._orphans}
        with self._lock:
            holes = [n for n in range(chain, sent.nonce) if n not in self._held() and n not in known]
            self._reserved.update(holes)
        if not holes:
            return False
        logger.warning("%s: tx %s (nonce %d) waits behind a nonce gap (the chain is at %d; nothing of ours holds "
                       "%s): filling it", sent.what, sent.hashes[-1].to_0x_hex(), sent.nonce, chain, holes)
        fillers = []
        try:
            for n in holes:
                filler = _Sent("nonce gap filler", {"from": self.address, "to": self.address, "value": 0,
                                                    "chainId": self.chain_id(), "nonce": n, "gas": FILLER_GAS}, None)
                self._fill_fees(filler.tx)
                self._fly(filler)
                try:
                    self._sign_and_send(filler)
                except ChainError as exc:  # the pool holds a transaction at that nonce (another process's): no gap
                    self._land(filler)
                    self._forget([filler])
                    logger.warning("nonce %d not filled: %s", n, exc)
                    break
                fillers.append(filler)
                self.filled += 1
        finally:
            with self._lock:
                self._reserved.difference_update(holes)
        for filler in fillers:
            try:
                self._settle(filler)
            except ChainError as exc:  # the next probe looks again
                self._orphan(filler)
                logger.warning("nonce gap filler %d: %s", filler.nonce, exc)
        return bool(fillers)

    def _revive(self, sent: _Sent, why: str) -> None:
        """`sent` is gone (dropped, or its block rolled back): send it again, under its nonce while that is
        still free (so it and the lost copy can never both land), else under a fresh one."""
        sent.resends += 1
        self.resent += 1
        nonce = sent.nonce
        if self._chain_nonce() <= nonce:
            logger.warning("%s: tx %s %s: sending it again (nonce %d, resend %d)", sent.what,
                           sent.hashes[-1].to_0x_hex(), why, nonce, sent.resends)
            try:
                if int(sent.tx["maxFeePerGas"]) < self._next_base_fee():  # it could not land now: raise its fees
                    self._refee(sent)
                    self._sign_and_send(sent)
                else:
                    self._send_raw(sent.what, sent.raw, sent.hashes[-1])
                    sent.sent_at = time.monotonic()
                return
            except ChainError as exc:
                if exc.reason != "rejected" or self._chain_nonce() <= nonce:
                    raise
        self._land(sent)
        with self._lock:
            sent.tx["nonce"] = fresh = self._allocate_nonce()
            self._flying[fresh] = sent
            self._reserved.discard(fresh)
        logger.warning("%s: tx %s %s and its nonce %d is used: sending it again with nonce %d (resend %d)",
                       sent.what, sent.hashes[-1].to_0x_hex(), why, nonce, fresh, sent.resends)
        self._refee(sent)
        self._sign_and_send(sent)

    def _refee(self, sent: _Sent) -> None:
        """Fees of `sent` at least what a fresh transaction would offer now."""
        fresh: dict[str, Any] = {}
        self._fill_fees(fresh)
        sent.tx["maxPriorityFeePerGas"] = max(int(sent.tx["maxPriorityFeePerGas"]), int(fresh["maxPriorityFeePerGas"]))
        sent.tx["maxFeePerGas"] = max(int(sent.tx["maxFeePerGas"]), int(fresh["maxFeePerGas"]))

    def _replace(self, sent: _Sent) -> None:
        """`sent` has been pending `resend_after_s`: replace it (same nonce) with fees raised by GAS_BUMP, and at
        least what a fresh transaction would offer now."""
        sent.resends += 1
        self.resent += 1
        old_tip, old_max = int(sent.tx["maxPriorityFeePerGas"]), int(sent.tx["maxFeePerGas"])
        fresh: dict[str, Any] = {}
        self._fill_fees(fresh)
        tip = max(int(old_tip * GAS_BUMP) + 1, int(fresh["maxPriorityFeePerGas"]))
        sent.tx["maxPriorityFeePerGas"] = tip
        sent.tx["maxFeePerGas"] = max(int(old_max * GAS_BUMP) + 1, int(fresh["maxFeePerGas"]), tip)
        logger.warning("%s: tx %s pending for %.0fs: replacing it (nonce %d, max fee %d -> %d wei, resend %d)",
                       sent.what, sent.hashes[-1].to_0x_hex(), time.monotonic() - sent.sent_at, sent.tx["nonce"],
                       old_max, sent.tx["maxFeePerGas"], sent.resends)
        try:
            self._sign_and_send(sent)
        except ChainError as exc:
            # underpriced for the node, or the old one was mined meanwhile: the next probe decides
            logger.warning("%s: replacement not accepted (%s); still waiting", sent.what, exc)
            sent.sent_at = time.monotonic()

    def _landed(self, sent: _Sent, receipt: Any) -> Receipt:
        """Check a mined receipt; journal it, watched for a rollback while it is among the newest `keep`."""
        if receipt["status"] != 1:
            sent.reverted = True
            self._forget([sent])  # it used its nonce; sending it again is the caller's decision
            failure = self._failure(sent.what, sent.tx, receipt)
            if sent.resends and sent.done is not None and self._done(sent):
                logger.info("%s: the resent tx reverted (%s) and the chain already shows the action: done",
                            sent.what, failure)
                return Receipt(tx_hash=receipt["transactionHash"].to_0x_hex(), block_number=int(receipt["blockNumber"]),
                               gas_used=int(receipt["gasUsed"]), logs=[], replayed=True)
            raise failure
        sent.relanding = False
        sent.block_number = int(receipt["blockNumber"])
        sent.block_hash = bytes(receipt["blockHash"])
        sent.mined = HexBytes(receipt["transactionHash"])
        if self.keep > 0:
            self._save(sent)
            with self._journal_lock:
                if sent not in self._journal:
                    self._journal.append(sent)
                self._journal.sort(key=lambda s: s.nonce)
                old = self._journal[: max(0, len(self._journal) - self.keep)]
                del self._journal[: len(old)]
            self._forget(old)
        else:
            self._forget([sent])
        return Receipt(
            tx_hash=sent.mined.to_0x_hex(),
            block_number=sent.block_number,
            gas_used=int(receipt["gasUsed"]),
            logs=list(receipt["logs"]),
        )

    def _done(self, sent: _Sent) -> bool:
        assert sent.done is not None
        try:
            return bool(sent.done())
        except ChainError as exc:
            logger.warning("%s: could not read whether the action is on chain: %s", sent.what, exc)
            return False

    def reconcile(self) -> int:
        """Check the journal: a landed transaction whose block left the canonical chain (a reorg, a revert, of
        any depth) is sent again (see `_revive`), in nonce order, and awaited; one nobody waits for any more
        (an earlier process's, or a send that timed out) is journalled as landed when it did land, and
        forgotten when it is gone (its nonce is the chain's to give again). Returns how many were sent again."""
        if not self._reconciling.acquire(blocking=False):
            return 0  # another thread of ours is at it (two would send the same lost transaction twice)
        try:
            self._adopt_orphans()
            return self._reconcile()
        finally:
            self._reconciling.release()

    def _adopt_orphans(self) -> None:
        with self._journal_lock:
            orphans = list(self._orphans)
        for sent in orphans:
            receipt = self._receipt_of(sent)
            if receipt is None and self._in_pool(sent):
                continue  # still on its way: looked at again next time
            with self._journal_lock:
                self._orphans.remove(sent)
            if receipt is None:
                logger.warning("%s: tx %s (nonce %d) of an earlier send is gone; its nonce is free again",
                               sent.what, sent.hashes[-1].to_0x_hex(), sent.nonce)
                self._forget([sent])
                continue
            try:
                self._landed(sent, receipt)
            except ChainError as exc:
                logger.warning("%s: tx %s of an earlier send reverted: %s", sent.what, sent.hashes[-1].to_0x_hex(), exc)

    def _reconcile(self) -> int:
        with self._journal_lock:
            journal = list(self._journal)
        if not journal:
            return 0
        head = int(self.rpc("block number", lambda: self.w3.eth.block_number))
        lost = [s for s in journal if s.relanding]
        # A chain reorganises a suffix: once a journalled block is canonical, every lower one is too.
        for sent in sorted([s for s in journal if not s.relanding], key=lambda s: s.block_number or 0, reverse=True):
            if self._canonical(sent, head):
                break
            lost.append(sent)
        if not lost:
            return 0
        with self._journal_lock:
            self._journal = [s for s in self._journal if s not in lost]
        with self._lock:  # their nonces are ours to send again: no other send of ours may take them meanwhile
            self._flying.update({s.nonce: s for s in lost})
        lost.sort(key=lambda s: s.nonce)
        logger.warning("%d of our landed transactions (nonces %d..%d, blocks %s..%s) are no longer on the chain "
                       "(a rollback): sending them again", len(lost), lost[0].nonce, lost[-1].nonce,
                       min(s.block_number or 0 for s in lost), max(s.block_number or 0 for s in lost))
        waiting: list[_Sent] = []
        for sent in lost:  # all out first, in nonce order, then awaited: one block can take them all
            try:
                receipt = self._receipt_of(sent)  # re-mined by the chain itself (a reorg puts it back in the pool)
                if receipt is not None:
                    self._land(sent)
                    self._landed(sent, receipt)
                    continue
                # its journal record keeps the lost block until it lands again (a restart retries it)
                if not self._in_pool(sent):
                    self._revive(sent, "rolled back")
                waiting.append(sent)
            except ChainError as exc:
                self._land(sent)
                self._given_up(sent, exc)
        for sent in waiting:
            try:
                self._settle(sent)
            except ChainError as exc:
                self._given_up(sent, exc)
        return len(lost)

    def _given_up(self, sent: _Sent, exc: ChainError) -> None:
        """A rolled-back transaction did not land again: the next round tries again after a failure of the RPC
        or a timeout; after a revert or a refusal it is given up (logged)."""
        if sent.done is not None and self._done(sent):
            logger.info("%s: the chain already shows the action (%s): done", sent.what, exc)
            self._forget([sent])
            return
        if exc.reason in {"timeout", "unreachable", "http"}:
            logger.warning("%s: the rolled-back transaction has not landed again yet (%s); trying again next round",
                           sent.what, exc)
            sent.relanding = True
            with self._journal_lock:
                if sent in self._orphans:
                    self._orphans.remove(sent)
                if sent not in self._journal:
                    self._journal.append(sent)
            return
        logger.error("%s: the rolled-back transaction could not be landed again: %s", sent.what, exc)
        self._forget([sent])

    def _canonical(self, sent: _Sent, head: int) -> bool:
        if sent.block_number is None or sent.block_number > head:
            return False
        block = self.rpc("block", lambda: self.w3.eth.get_block(sent.block_number))  # type: ignore[arg-type]
        return bytes(block["hash"]) == sent.block_hash

    def _next_base_fee(self) -> int:
        """The base fee of the next block (the one a transaction sent now can enter): the last entry of
        `eth_feeHistory`. The latest block's is not it: under anvil's automine, a transaction priced from a
        block whose successor costs more is never mined, so no block follows and nothing else lands either."""
        try:
            history = self._retrying("fee history", lambda: self.w3.eth.fee_history(1, "latest"))
            return int(history["baseFeePerGas"][-1])
        except FEE_HISTORY_FAILURES as exc:  # a node without eth_feeHistory: the latest block's
            logger.debug("fee history unavailable (%s): pricing from the latest block", exc)
        block = self.rpc("latest block", lambda: self.w3.eth.get_block("latest"))
        return int(block.get("baseFeePerGas", 0) or 0)

    def _fill_fees(self, tx: dict[str, Any]) -> None:
        base_fee = self._next_base_fee()
        if self.priority_fee_wei is not None:
            tip = self.priority_fee_wei
        else:
            tip = int(self.rpc("priority fee", lambda: self.w3.eth.max_priority_fee))
        tx["maxPriorityFeePerGas"] = tip
        tx["maxFeePerGas"] = 2 * base_fee + tip  # survives a few full blocks of base-fee growth

    def _send_raw(self, what: str, raw: bytes, tx_hash: HexBytes) -> None:
        try:
            self._retrying(f"{what}: send", lambda: self.w3.eth.send_raw_transaction(raw))
        except (ContractLogicError, Web3RPCError) as exc:
            message = str(exc).lower()
            # A retried send after a lost response: the node already has our (identical) transaction.
            if "already known" in message or "already imported" in message:
                return
            if "nonce too low" in message:
                if self._transaction_exists(tx_hash):
                    return
            raise ChainError(f"{what}: transaction rejected: {exc}", reason="rejected") from exc
        except RPC_FAILURES as exc:  # the outcome is unknown (the node may hold it): not "rejected"
            raise chain_error(exc, f"{what}: send") from exc

    def _transaction_exists(self, tx_hash: HexBytes) -> bool:
        try:
            self.rpc("transaction lookup", lambda: self.w3.eth.get_transaction(tx_hash))
            return True
        except ChainError as exc:
            if isinstance(exc.__cause__, TransactionNotFound):
                return False
            raise

    def _failure(self, what: str, tx: dict[str, Any], receipt: Any) -> ChainError:
        """Replay a mined-but-reverted transaction as a call at its block to learn the reason."""
        call = {k: tx[k] for k in ("from", "to", "data", "value") if k in tx}
        try:
            self.w3.eth.call(call, block_identifier=receipt["blockNumber"] - 1)  # type: ignore[arg-type]
        except (ContractLogicError, Web3RPCError) as exc:
            err = revert_error(exc, what)
            err.args = (f"{err.args[0]} (tx {receipt['transactionHash'].to_0x_hex()})",)
            return err
        except RPC_FAILURES as exc:  # the replay is a courtesy: without it the failure is still reported
            logger.debug("%s: could not replay the reverted transaction: %s", what, exc)
        if receipt["gasUsed"] >= tx["gas"]:
            return ChainError(f"{what}: out of gas ({tx['gas']})", reason="out_of_gas")
        return ChainError(f"{what}: reverted (tx {receipt['transactionHash'].to_0x_hex()})", reason="revert")

    def deploy(self, what: str, abi: list[dict[str, Any]], bytecode: str, *args: Any) -> tuple[str, Receipt]:
        """Deploy a contract; returns (address, receipt)."""
        try:
            data = self.w3.eth.contract(abi=abi, bytecode=bytecode).constructor(*args).data_in_transaction
        except ENCODING_FAILURES as exc:
            raise ChainError(f"{what}: constructor arguments do not fit the ABI: {exc}", reason="bad_argument") from exc
        receipt = self.send(what, {"data": data, "value": 0})
        raw = self.rpc("deploy receipt", lambda: self.w3.eth.get_transaction_receipt(HexBytes(receipt.tx_hash)))
        return str(raw["contractAddress"]), receipt
