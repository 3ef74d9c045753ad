"""Sending transactions: local signing, nonces, gas, fees, receipts, revert reasons, transient retries.

Every failure leaves as `ChainError`, classified once here (`chain_error`); a contract revert carries its
reason (custom error name, require string or panic code) in `ChainError.reason`. Only connection-level RPC
failures are retried; a revert or a rejected transaction is never retried. The original web3/requests
exception stays attached as `__cause__`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
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
    ) -> None:
        self.w3 = w3
        self.identity = identity
        self.retries = retries
        self.retry_backoff = retry_backoff
        self.receipt_timeout = receipt_timeout
        self.priority_fee_wei = priority_fee_wei
        self._lock = threading.Lock()
        self._next_nonce: int | None = None
        self._chain_id: int | None = None

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
        """Forget the cached nonce (after a chain reset or a transaction sent elsewhere from this key)."""
        with self._lock:
            self._next_nonce = None

    def call(self, what: str, fn: Callable[[], T]) -> T:
        """A read-only contract call; reverts become ChainError with the reason."""
        return self.rpc(what, fn)

    # -- sending --------------------------------------------------------------------------

    def send(self, what: str, tx: dict[str, Any], gas: int | None = None) -> Receipt:
        """Fill in nonce, gas and fees, sign locally, send, wait for and check the receipt."""
        with self._lock:
            tx = dict(tx)
            tx["from"] = self.address
            tx["chainId"] = self.chain_id()
            pending = int(self.rpc("nonce", lambda: self.w3.eth.get_transaction_count(self.identity.account.address, "pending")))
            nonce = pending if self._next_nonce is None else max(pending, self._next_nonce)
            tx["nonce"] = nonce
            if gas is None:
                try:
                    estimate = int(self._retrying(what, lambda: self.w3.eth.estimate_gas(tx)))  # type: ignore[arg-type]
                except RPC_FAILURES as exc:
                    raise chain_error(exc, what) from exc
                gas = int(estimate * GAS_MARGIN)
            tx["gas"] = gas
            self._fill_fees(tx)
            signed = self.identity.account.sign_transaction(tx)
            tx_hash = HexBytes(signed.hash)
            self._send_raw(what, bytes(signed.raw_transaction), tx_hash)
            self._next_nonce = nonce + 1
        return self._await_receipt(what, tx, tx_hash)

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

    def _await_receipt(self, what: str, tx: dict[str, Any], tx_hash: HexBytes) -> Receipt:
        try:
            receipt = self._retrying(
                f"{what}: receipt",
                lambda: self.w3.eth.wait_for_transaction_receipt(
                    tx_hash, timeout=self.receipt_timeout, poll_latency=0.05
                ),
            )
        except TimeExhausted as exc:
            raise ChainError(
                f"{what}: no receipt for {tx_hash.to_0x_hex()} after {self.receipt_timeout}s", reason="timeout"
            ) from exc
        except RPC_FAILURES as exc:
            raise chain_error(exc, f"{what}: receipt of {tx_hash.to_0x_hex()}") from exc
        if receipt["status"] != 1:
            raise self._failure(what, tx, receipt)
        return Receipt(
            tx_hash=tx_hash.to_0x_hex(),
            block_number=int(receipt["blockNumber"]),
            gas_used=int(receipt["gasUsed"]),
            logs=list(receipt["logs"]),
        )

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
