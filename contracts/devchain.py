"""A local dev chain: anvil (npm `@foundry-rs/anvil-linux-amd64`) on a free 127.0.0.1 port.

    with DevChain.start() as chain:
        w3 = chain.web3()
        admin = chain.account(0)          # Identity of a PUBLIC dev key

The dev accounts come from anvil's well-known test mnemonic. THOSE KEYS ARE PUBLIC: every Foundry and
Hardhat user has them. They exist only on a local dev chain; never send real funds to them.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import tempfile
import time
from functools import cache
from pathlib import Path
from types import TracebackType
from typing import Any

from eth_account import Account
from web3 import Web3
from web3.providers.rpc import HTTPProvider

from contracts.transactor import RPC_FAILURES, chain_error
from protocol.errors import ChainError
from protocol.identity import Identity

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent
ANVIL_BIN = REPO_ROOT / "node_modules" / "@foundry-rs" / "anvil-linux-amd64" / "bin" / "anvil"

# PUBLIC DEV MNEMONIC (anvil/hardhat default). Anyone can derive these keys; local dev chains only.
DEV_MNEMONIC = "test test test test test test test test test test test junk"
DEV_CHAIN_ID = 31337
DEV_ACCOUNTS = 10

_LISTENING = re.compile(r"Listening on (\d+\.\d+\.\d+\.\d+):(\d+)")


@cache
def dev_key(index: int) -> bytes:
    """The PUBLIC dev private key number `index` (m/44'/60'/0'/0/index of DEV_MNEMONIC)."""
    Account.enable_unaudited_hdwallet_features()
    return bytes(Account.from_mnemonic(DEV_MNEMONIC, account_path=f"m/44'/60'/0'/0/{index}").key)


def dev_identity(index: int) -> Identity:
    """An Identity for PUBLIC dev account `index` (dev chains only)."""
    return Identity.from_key(dev_key(index))


def anvil_binary() -> Path:
    """Path of the pinned anvil binary; ChainError if `make setup` (npm ci) has not installed it."""
    override = os.environ.get("PRIME_ANVIL_BIN")
    path = Path(override) if override else ANVIL_BIN
    if not path.exists():
        found = shutil.which("anvil")
        if found is None:
            raise ChainError(f"anvil not found at {path}; run `make setup` (npm ci)")
        path = Path(found)
    return path


class DevChain:
    """A running anvil process; stop it with `stop()` or use it as a context manager."""

    def __init__(self, process: subprocess.Popen[bytes], host: str, port: int, log_dir: Path, chain_id: int) -> None:
        self.process = process
        self.host = host
        self.port = port
        self.chain_id = chain_id
        self._log_dir = log_dir
        self._next_base_fee: dict[str, int] = {}
        """snapshot id -> the base fee the next block had when it was taken (`revert` puts it back)."""

    @property
    def rpc_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @classmethod
    def start(
        cls,
        *,
        port: int = 0,
        chain_id: int = DEV_CHAIN_ID,
        accounts: int = DEV_ACCOUNTS,
        block_time: float | None = None,
        timeout: float = 20.0,
    ) -> DevChain:
        """Start anvil on 127.0.0.1 (port 0: a free port chosen by the OS) and wait until it answers."""
        log_dir = Path(tempfile.mkdtemp(prefix="prime-anvil-"))
        log_path = log_dir / "anvil.log"
        cmd = [
            str(anvil_binary()), "--host", "127.0.0.1", "--port", str(port), "--chain-id", str(chain_id),
            "--accounts", str(accounts), "--mnemonic", DEV_MNEMONIC, "--hardfork", "cancun",
        ]
        if block_time is not None:
            cmd += ["--block-time", str(block_time)]
        with open(log_path, "wb") as log:
            process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while True:
            text = log_path.read_text(errors="replace")
            match = _LISTENING.search(text)
            if match:
                chain = cls(process, match.group(1), int(match.group(2)), log_dir, chain_id)
                break
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                process.wait()
                shutil.rmtree(log_dir, ignore_errors=True)
                raise ChainError(f"anvil did not start (exit {process.returncode}): {text[-1000:]}")
            time.sleep(0.02)
        try:
            chain._wait_ready(deadline)
        except BaseException:
            chain.stop()
            raise
        logger.info("anvil pid %d on %s (chain id %d)", process.pid, chain.rpc_url, chain_id)
        return chain

    def _wait_ready(self, deadline: float) -> None:
        w3 = self.web3()
        while True:
            try:
                if w3.eth.chain_id == self.chain_id:
                    return
            except Exception:  # not accepting connections yet
                pass
            if time.monotonic() > deadline:
                raise ChainError(f"anvil at {self.rpc_url} did not answer")
            time.sleep(0.02)

    def web3(self, timeout: float = 10.0) -> Web3:
        """A fresh Web3 connected to this chain."""
        return Web3(HTTPProvider(self.rpc_url, request_kwargs={"timeout": timeout}))

    def rpc(self, method: str, params: list[Any] | None = None) -> Any:
        """A raw JSON-RPC call (anvil's `evm_*` / `anvil_*` methods)."""
        try:
            response = self.web3().provider.make_request(method, params or [])  # type: ignore[arg-type]
        except RPC_FAILURES as exc:
            raise chain_error(exc, method) from exc
        if "error" in response:
            raise ChainError(f"{method}: {response['error']}")
        return response.get("result")

    def account(self, index: int) -> Identity:
        """PUBLIC dev account `index` (funded with 10,000 ETH by anvil)."""
        return dev_identity(index)

    def snapshot(self) -> str:
        fee = self.rpc("eth_getBlockByNumber", ["pending", False])["baseFeePerGas"]
        snapshot_id = str(self.rpc("evm_snapshot"))
        self._next_base_fee[snapshot_id] = int(fee, 16)
        return snapshot_id

    def revert(self, snapshot_id: str) -> None:
        """Back to the chain as it was at `snapshot_id`, the next block's base fee included: anvil's `evm_revert`
        keeps the base fee the reverted blocks led to (a fee spike a test set would outlive it and price every
        later transaction out of the next block)."""
        if self.rpc("evm_revert", [snapshot_id]) is not True:
            raise ChainError(f"evm_revert({snapshot_id}) failed")
        fee = self._next_base_fee.pop(snapshot_id, None)
        if fee is not None:
            self.rpc("anvil_setNextBlockBaseFeePerGas", [hex(fee)])

    def advance_time(self, seconds: int) -> None:
        """Move the chain clock forward and mine a block so `block.timestamp` reflects it."""
        self.rpc("evm_increaseTime", [seconds])
        self.rpc("evm_mine")

    def stop(self) -> None:
        """Terminate anvil (kill after 5 s) and remove its log directory."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self._log_dir, ignore_errors=True)

    def __enter__(self) -> DevChain:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
