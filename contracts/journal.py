"""The transactor's journal: every transaction one key has signed, kept until no rollback can matter.

A transaction is written before it is sent (so a process killed with `kill -9` between the send and its
receipt still knows about it after a restart) and again when it lands (its block number and hash, which
`Transactor.reconcile` compares with the canonical chain, whatever the depth of a rollback). `Journal` keeps
the records in memory (a tool or a test that keeps no state); `FileJournal` keeps them in a SQLite file beside
the role's durable state (the validator's state directory, the trainer's SHARDCAST store), so a restarted role
sends again what a rollback removed while it was down.

A record is a JSON object: `what`, `tx` (the fields last signed), `raw` (the signed bytes, hex), `hashes`
(every hash it was sent under), `block_number`, `block_hash` and `mined` (None until it lands).
"""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path
from typing import Any

from protocol.errors import ChainError


def _plain(value: Any) -> Any:
    if isinstance(value, bytes | bytearray):
        return "0x" + bytes(value).hex()
    raise TypeError(f"not JSON: {type(value).__name__}")


class Journal:
    """Records by id, in memory (gone with the process)."""

    def __init__(self) -> None:
        self._records: dict[str, dict[str, Any]] = {}

    def load(self) -> dict[str, dict[str, Any]]:
        """Every record kept, by id."""
        return dict(self._records)

    def save(self, entry_id: str, record: dict[str, Any]) -> None:
        self._records[entry_id] = json.loads(json.dumps(record, default=_plain))

    def drop(self, entry_ids: list[str]) -> None:
        for entry_id in entry_ids:
            self._records.pop(entry_id, None)


class FileJournal(Journal):
    """Records in a SQLite file (table `tx_journal`), each write committed before the call returns."""

    def __init__(self, path: str | Path) -> None:
        super().__init__()
        self.path = Path(path)
        self._lock = threading.Lock()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(str(self.path), timeout=30.0, isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute("CREATE TABLE IF NOT EXISTS tx_journal (id TEXT PRIMARY KEY, record TEXT NOT NULL)")
        except (OSError, sqlite3.Error) as exc:
            raise ChainError(f"cannot open the transaction journal {self.path}: {exc}", reason="journal") from exc

    def load(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            rows = self._db.execute("SELECT id, record FROM tx_journal").fetchall()
        return {entry_id: json.loads(text) for entry_id, text in rows}

    def save(self, entry_id: str, record: dict[str, Any]) -> None:
        text = json.dumps(record, default=_plain, sort_keys=True)
        with self._lock:
            try:
                self._db.execute("INSERT INTO tx_journal (id, record) VALUES (?, ?) "
                                 "ON CONFLICT (id) DO UPDATE SET record = excluded.record", (entry_id, text))
            except sqlite3.Error as exc:
                raise ChainError(f"cannot write the transaction journal {self.path}: {exc}", reason="journal") from exc

    def drop(self, entry_ids: list[str]) -> None:
        if not entry_ids:
            return
        with self._lock:
            try:
                self._db.executemany("DELETE FROM tx_journal WHERE id = ?", [(i,) for i in entry_ids])
            except sqlite3.Error as exc:
                raise ChainError(f"cannot write the transaction journal {self.path}: {exc}", reason="journal") from exc

    def close(self) -> None:
        with self._lock:
            self._db.close()
