"""What a real chain does to transactions, done to anvil: manual mining, dropping, rolling back.

Helpers for the tests of resending (`Transactor`): a send runs in a `Background` thread while the test drops
its transaction from anvil's pool or mines a block; waits end on what the chain or the transactor shows.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Generic, TypeVar

from contracts.devchain import DevChain
from contracts.pool import PoolClient
from contracts.transactor import Transactor, connect
from protocol.identity import Identity

T = TypeVar("T")


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


class Background(Generic[T]):
    """`fn()` in a thread; `result()` joins and returns its value or raises its exception."""

    def __init__(self, fn: Callable[[], T]) -> None:
        self._value: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], T]) -> None:
        try:
            self._value = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test in result()
            self._error = exc

    def result(self, timeout: float = 60.0) -> T:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the send did not finish"
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[no-any-return]


def pending(chain: DevChain, sender: str) -> list[dict[str, Any]]:
    """`sender`'s transactions in anvil's pool."""
    content = chain.rpc("txpool_content")
    by_sender = {a.lower(): txs for a, txs in (content.get("pending") or {}).items()}
    return list((by_sender.get(sender.lower()) or {}).values())


@contextmanager
def manual_mining(chain: DevChain) -> Iterator[None]:
    """Blocks only when the test mines one (`evm_mine`): transactions wait in the pool."""
    chain.rpc("evm_setAutomine", [False])
    try:
        yield
    finally:
        chain.rpc("evm_setAutomine", [True])


def watchful(chain: DevChain, address: str, identity: Identity, **settings: Any) -> PoolClient:
    """A PoolClient whose transactor probes its pending transaction often (tests need no long waits)."""
    options: dict[str, Any] = {"probe_s": 0.1, "receipt_timeout": 60.0} | settings
    w3 = connect(chain.rpc_url)
    return PoolClient(w3, address, identity, transactor=Transactor(w3, identity, **options))


def nonce(chain: DevChain, address: str) -> int:
    return int(chain.web3().eth.get_transaction_count(address, "latest"))  # type: ignore[arg-type]


def recorded(pool: PoolClient, key: bytes | str) -> int:
    """How many WorkRecorded events for `key` the canonical chain holds."""
    raw = bytes.fromhex(key[2:]) if isinstance(key, str) else key
    head = int(pool.w3.eth.block_number)
    return sum(1 for ev in pool.events(0, head, names={"WorkRecorded"}) if bytes(ev.args["workKey"]) == raw)
