"""Sending transactions: local signing, nonces, gas, fees, receipts, revert reasons, transient retries, and
transactions that a real chain loses: dropped from the pool, stuck, or rolled back with their block.

Every failure leaves as `ChainError`, classified once here (`chain_error`); a contract revert carries its
reason (custom error name, require string or panic code) in `ChainError.reason`. Only connection-level RPC
failures are retried; a revert or a rejected transaction is never retried. A transaction that was sent is
watched until it lands: dropped, it is sent again (same nonce while that is free, so two copies can never
both land); stuck, it is replaced with higher fees; rolled back, it is sent again (`Transactor.reconcile`). The original web3/requests
exception stays attached as `__cause__`.
"""

from __future__ import annotations

import logging
import threading
import time
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
from protocol.errors import ChainError
from protocol.identity import Identity

logger = logging.getLogger(__name__)

T = TypeVar("T")

GAS_MARGIN = 1.2  # estimates can be a little low when state shifts between estimate and inclusion
GAS_BUMP = 1.25  # a replacement offers this much more (nodes want at least +10% to replace a pending tx)
JOURNAL_LIMIT = 256  # landed transactions watched for a rollback at most (the oldest leave first)

# What web3.py and its transport raise for a failed or malformed RPC exchange (web3 also raises plain
# ValueError from eth_utils/hexbytes on odd responses). Anything else is a bug here and stays uncaught.
RPC_FAILURES: tuple[type[Exception], ...] = (Web3Exception, requests.RequestException, ValueError)
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
    raw: bytes = b""
    hashes: list[HexBytes] = field(default_factory=list)
    sent_at: float = 0.0
    resends: int = 0
    block_number: int | None = None
    block_hash: bytes | None = None
    mined: HexBytes | None = None


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
        confirmations: int = 12,
    ) -> None:
        """`receipt_timeout`: how long one send may wait for its receipt, resends included. `resend_after_s`: a
        transaction pending this long is replaced with higher fees. `probe_s`: how often a waiting send asks
        whether its transaction is still in the pool. `confirmations`: blocks after which a landed transaction
        is final (0: never watched for a rollback)."""
        self.w3 = w3
        self.identity = identity
        self.retries = retries
        self.retry_backoff = retry_backoff
        self.receipt_timeout = receipt_timeout
        self.priority_fee_wei = priority_fee_wei
        self._lock = threading.Lock()
        self._next_nonce: int | None = None
        self._chain_id: int | None = None
        self.resend_after_s = resend_after_s
        self.probe_s = probe_s
        self.confirmations = confirmations
        self.resent = 0
        """Transactions sent again so far (dropped, stuck or rolled back)."""
        self._journal: list[_Sent] = []
        self._journal_lock = threading.Lock()
        self._reconciling = threading.Lock()

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
        """Forget the cached nonce (after a chain reset or a transaction sent elsewhere from this key) and, after a
        reset, the journal of landed transactions (a new chain is not a rollback to repair)."""
        with self._lock:
            self._next_nonce = None
        with self._journal_lock:
            self._journal.clear()

    def call(self, what: str, fn: Callable[[], T]) -> T:
        """A read-only contract call; reverts become ChainError with the reason."""
        return self.rpc(what, fn)

    # -- sending --------------------------------------------------------------------------

    def _allocate_nonce(self) -> int:
        """The next nonce of this key (caller holds `_lock`): the node's pending count, or our own count when
        it is ahead (transactions we sent that the node has not shown yet)."""
        pending = int(self.rpc("nonce", lambda: self.w3.eth.get_transaction_count(self.identity.account.address, "pending")))
        nonce = pending if self._next_nonce is None else max(pending, self._next_nonce)
        self._next_nonce = nonce + 1
        return nonce

    def send(self, what: str, tx: dict[str, Any], gas: int | None = None, *,
             done: Callable[[], bool] | None = None) -> Receipt:
        """Fill in nonce, gas and fees, sign locally, send, wait for and check the receipt.

        While it waits it watches the transaction: dropped from the pool (no receipt, not pending) it is sent
        again under the same nonce, or a fresh one when that nonce was used by another transaction (then ours
        can never land, so the action cannot happen twice); pending longer than `resend_after_s` it is replaced
        under the same nonce with fees raised by `GAS_BUMP`. `done()` reads whether the action is on chain
        already: a resend that reverts counts as success when it says so (the contract's own keys make a
        replay revert harmlessly). Gives up after `receipt_timeout` with a ChainError (reason "timeout").
        A landed transaction is kept in the journal until `confirmations` blocks bury it; `reconcile()` (run
        before every send) sends again one whose block left the canonical chain (a reorg or a revert).
        """
        self.reconcile()
        with self._lock:
            tx = dict(tx)
            tx["from"] = self.address
            tx["chainId"] = self.chain_id()
            tx["nonce"] = self._allocate_nonce()
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
                self._sign_and_send(sent)
            except BaseException:
                self._next_nonce = None  # the nonce was not used: ask the node again next time
                raise
        return self._settle(sent)

    def _sign_and_send(self, sent: _Sent) -> None:
        signed = self.identity.account.sign_transaction(sent.tx)
        tx_hash = HexBytes(signed.hash)
        sent.raw = bytes(signed.raw_transaction)
        self._send_raw(sent.what, sent.raw, tx_hash)
        if tx_hash not in sent.hashes:
            sent.hashes.append(tx_hash)
        sent.sent_at = time.monotonic()

    def _settle(self, sent: _Sent) -> Receipt:
        """Wait for `sent` to land, resending it when it is dropped or stuck; the checked Receipt."""
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
                elif now - sent.sent_at >= self.resend_after_s:
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

    def _revive(self, sent: _Sent, why: str) -> None:
        """`sent` is gone (dropped, or its block rolled back): send it again, under its nonce while that is
        still free (so it and the lost copy can never both land), else under a fresh one."""
        sent.resends += 1
        self.resent += 1
        nonce = int(sent.tx["nonce"])
        if self._chain_nonce() <= nonce:
            logger.warning("%s: tx %s %s: sending it again (nonce %d, resend %d)", sent.what,
                           sent.hashes[-1].to_0x_hex(), why, nonce, sent.resends)
            try:
                self._send_raw(sent.what, sent.raw, sent.hashes[-1])
                sent.sent_at = time.monotonic()
                return
            except ChainError as exc:
                if exc.reason != "rejected" or self._chain_nonce() <= nonce:
                    raise
        with self._lock:
            sent.tx["nonce"] = self._allocate_nonce()
        logger.warning("%s: tx %s %s and its nonce %d is used: sending it again with nonce %d (resend %d)",
                       sent.what, sent.hashes[-1].to_0x_hex(), why, nonce, sent.tx["nonce"], sent.resends)
        self._sign_and_send(sent)

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
        """Check a mined receipt; journal it until it is final."""
        if receipt["status"] != 1:
            failure = self._failure(sent.what, sent.tx, receipt)
            if sent.resends and sent.done is not None and self._done(sent):
                logger.info("%s: the resent tx reverted (%s) and the chain already shows the action: done",
                            sent.what, failure)
                return Receipt(tx_hash=receipt["transactionHash"].to_0x_hex(), block_number=int(receipt["blockNumber"]),
                               gas_used=int(receipt["gasUsed"]), logs=[], replayed=True)
            raise failure
        sent.block_number = int(receipt["blockNumber"])
        sent.block_hash = bytes(receipt["blockHash"])
        sent.mined = HexBytes(receipt["transactionHash"])
        if self.confirmations > 0:
            with self._journal_lock:
                self._journal.append(sent)
                del self._journal[: max(0, len(self._journal) - JOURNAL_LIMIT)]
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
        """Check the journal of landed transactions not yet `confirmations` blocks deep: one whose block left
        the canonical chain (a reorg, a revert) is sent again (see `_revive`) and awaited. Returns how many
        were sent again. Final ones leave the journal."""
        if not self._reconciling.acquire(blocking=False):
            return 0  # another thread of ours is at it (two would send the same lost transaction twice)
        try:
            return self._reconcile()
        finally:
            self._reconciling.release()

    def _reconcile(self) -> int:
        with self._journal_lock:
            journal = list(self._journal)
        if not journal:
            return 0
        head = int(self.rpc("block number", lambda: self.w3.eth.block_number))
        lost: list[_Sent] = []
        # A chain reorganises a suffix: once a journalled block is canonical, every lower one is too.
        for sent in sorted(journal, key=lambda s: s.block_number or 0, reverse=True):
            if self._canonical(sent, head):
                break
            lost.append(sent)
        final = [s for s in journal if s not in lost and head - (s.block_number or 0) + 1 >= self.confirmations]
        with self._journal_lock:
            self._journal = [s for s in self._journal if s not in final and s not in lost]
        resent = 0
        for sent in sorted(lost, key=lambda s: int(s.tx["nonce"])):
            logger.warning("%s: tx %s was mined in block %s, which is no longer on the chain: sending it again",
                           sent.what, sent.mined.to_0x_hex() if sent.mined else "?", sent.block_number)
            resent += 1
            try:
                receipt = self._receipt_of(sent)  # re-mined by the chain itself (a reorg puts it back in the pool)
                if receipt is not None:
                    self._landed(sent, receipt)
                else:
                    if not self._in_pool(sent):
                        self._revive(sent, "rolled back")
                    self._settle(sent)
            except ChainError as exc:
                if sent.done is not None and self._done(sent):
                    logger.info("%s: the chain already shows the action (%s): done", sent.what, exc)
                    continue
                logger.error("%s: the rolled-back transaction could not be landed again: %s", sent.what, exc)
        return resent

    def _canonical(self, sent: _Sent, head: int) -> bool:
        if sent.block_number is None or sent.block_number > head:
            return False
        block = self.rpc("block", lambda: self.w3.eth.get_block(sent.block_number))  # type: ignore[arg-type]
        return bytes(block["hash"]) == sent.block_hash

    def _fill_fees(self, tx: dict[str, Any]) -> None:
        block = self.rpc("latest block", lambda: self.w3.eth.get_block("latest"))
        base_fee = int(block.get("baseFeePerGas", 0) or 0)
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
                self._next_nonce = None
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
