"""Fixtures for the validator's unit tests: a ledger on each backend (SQLite file, PostgreSQL database)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from pgcluster import pg_cluster, pg_dsn  # noqa: F401 - fixtures used by the backend parameter

from validator.ledger import Ledger

OpenLedger = Callable[..., Ledger]


@pytest.fixture(params=["sqlite", "postgres"])
def open_ledger(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[OpenLedger]:
    """Opens Ledger objects on one fresh database of the parametrized backend (several = several processes)."""
    target: dict[str, object] = (
        {"path": tmp_path / "ledger.sqlite"} if request.param == "sqlite" else {"dsn": request.getfixturevalue("pg_dsn")})
    opened: list[Ledger] = []

    def open_(**kw: object) -> Ledger:
        ledger = Ledger.open(**target, **kw)  # type: ignore[arg-type]
        opened.append(ledger)
        return ledger

    yield open_
    for ledger in opened:
        ledger.close()


@pytest.fixture
def ledger(open_ledger: OpenLedger) -> Ledger:
    return open_ledger()
