"""Replay guard and sender nonce counter: durability, atomicity under races, bounded growth."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import pytest

from protocol.errors import ExpiredError, ReplayError
from protocol.nonce import NonceCounter, random_nonce
from protocol.replay import ReplayGuard

SIGNER = "0xf39Fd6e51aad88F6F4ce6aB8827279cffFb92266"
NOW = 1_800_000_000.0


def test_survives_restart(tmp_path: Path) -> None:
    path = tmp_path / "guard.sqlite"
    with ReplayGuard(path) as g:
        g.check_and_record("d", SIGNER, 2**127 + 5, sent_at=NOW, expires_at=NOW + 600, now=NOW)
    with ReplayGuard(path) as g:
        with pytest.raises(ReplayError):
            g.check_and_record("d", SIGNER, 2**127 + 5, sent_at=NOW + 1, expires_at=NOW + 600, now=NOW + 1)
        g.check_and_record("d", SIGNER, 2**127 + 6, sent_at=NOW + 1, expires_at=NOW + 600, now=NOW + 1)
    assert (tmp_path / "guard.sqlite-wal").exists() or (tmp_path / "guard.sqlite").stat().st_size > 0


def test_keys_are_independent() -> None:
    g = ReplayGuard(":memory:")
    g.check_and_record("d", SIGNER, 1, sent_at=NOW, expires_at=NOW + 10, now=NOW)
    g.check_and_record("d2", SIGNER, 1, sent_at=NOW, expires_at=NOW + 10, now=NOW)
    g.check_and_record("d", "0x70997970C51812dc3A010C7d01b50e0d17dc79C8", 1, sent_at=NOW, expires_at=NOW + 10, now=NOW)
    # Out-of-order nonces from one sender are fine (several messages in flight).
    g.check_and_record("d", SIGNER, 0, sent_at=NOW, expires_at=NOW + 10, now=NOW)
    assert len(g) == 4


@pytest.mark.parametrize("shared", [True, False], ids=["one-guard", "guard-per-thread"])
def test_race_exactly_one_wins(tmp_path: Path, shared: bool) -> None:
    path = tmp_path / "race.sqlite"
    n_threads = 8
    guards = [ReplayGuard(path)] * n_threads if shared else [ReplayGuard(path) for _ in range(n_threads)]
    barrier = threading.Barrier(n_threads)
    wins: list[int] = []
    losses: list[int] = []
    errors: list[BaseException] = []

    def attempt(i: int) -> None:
        barrier.wait(timeout=10)
        for nonce in range(20):
            try:
                guards[i].check_and_record("d", SIGNER, nonce, sent_at=NOW, expires_at=NOW + 60, now=NOW)
                wins.append(nonce)
            except ReplayError:
                losses.append(nonce)
            except BaseException as exc:  # noqa: BLE001 - surfaced by the assertion below
                errors.append(exc)

    threads = [threading.Thread(target=attempt, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    assert sorted(wins) == list(range(20))  # every nonce won exactly once
    assert len(losses) == 20 * (n_threads - 1)
    for g in set(guards):
        g.close()


def test_prune_bounds_growth() -> None:
    g = ReplayGuard(":memory:", prune_every=50)
    for i in range(500):
        t = NOW + i  # one message per second, each valid for 100 s
        g.check_and_record("d", SIGNER, i, sent_at=t, expires_at=t + 100, now=t)
    assert len(g) <= 150  # only the last window (plus one prune interval) is kept
    assert g.prune(now=NOW + 10_000) > 0
    assert len(g) == 0


def test_expired_entry_behaves_like_pruned() -> None:
    g = ReplayGuard(":memory:")
    g.check_and_record("d", SIGNER, 1, sent_at=NOW, expires_at=NOW + 10, now=NOW)
    with pytest.raises(ReplayError):
        g.check_and_record("d", SIGNER, 1, sent_at=NOW, expires_at=NOW + 10, now=NOW + 5)
    # Once expired the entry is as good as pruned, whether or not prune() ran: the same message is
    # refused by the horizon (not re-accepted), a later message reusing the nonce is accepted.
    with pytest.raises(ExpiredError, match="horizon"):
        g.check_and_record("d", SIGNER, 1, sent_at=NOW, expires_at=NOW + 100, now=NOW + 20)
    assert g.horizon == NOW and len(g) == 0
    g.check_and_record("d", SIGNER, 1, sent_at=NOW + 19, expires_at=NOW + 29, now=NOW + 20)
    with pytest.raises(ReplayError):
        g.check_and_record("d", SIGNER, 1, sent_at=NOW + 19, expires_at=NOW + 29, now=NOW + 21)


@pytest.mark.parametrize("prune", [True, False], ids=["pruned", "expired-not-pruned"])
def test_horizon_refuses_forgotten_messages_across_restart(tmp_path: Path, prune: bool) -> None:
    path = tmp_path / "guard.sqlite"
    with ReplayGuard(path) as g:
        assert g.horizon == float("-inf")
        g.check_and_record("d", SIGNER, 1, sent_at=NOW, expires_at=NOW + 660, now=NOW)
        g.check_and_record("d", SIGNER, 2, sent_at=NOW + 50, expires_at=NOW + 710, now=NOW + 50)
        if prune:
            assert g.prune(now=NOW + 700) == 1
            assert g.horizon == NOW and len(g) == 1
    with ReplayGuard(path) as g:
        # The receiver now allows an hour (expires_at = sent + 3660): message 1 is young enough
        # for it, but its record is gone, so it is refused rather than accepted a second time.
        for nonce, sent in [(1, NOW), (3, NOW - 1)]:  # any message at or before the horizon
            with pytest.raises(ExpiredError, match="horizon"):
                g.check_and_record("d", SIGNER, nonce, sent_at=sent, expires_at=sent + 3660, now=NOW + 700)
        with pytest.raises(ReplayError):  # still remembered
            g.check_and_record("d", SIGNER, 2, sent_at=NOW + 50, expires_at=NOW + 3710, now=NOW + 700)
        g.check_and_record("d", SIGNER, 4, sent_at=NOW + 1, expires_at=NOW + 3661, now=NOW + 700)
        assert g.horizon == NOW


def test_old_schema_file_is_migrated(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite"
    conn = sqlite3.connect(path)
    conn.executescript(
        "CREATE TABLE seen (domain TEXT NOT NULL, signer TEXT NOT NULL, nonce TEXT NOT NULL,"
        " expires_at REAL NOT NULL, PRIMARY KEY (domain, signer, nonce)) WITHOUT ROWID;"
        f"INSERT INTO seen VALUES ('d', '{SIGNER}', '1', {NOW + 660});"
    )
    conn.commit()
    conn.close()
    with ReplayGuard(path) as g:
        with pytest.raises(ReplayError):
            g.check_and_record("d", SIGNER, 1, sent_at=NOW, expires_at=NOW + 660, now=NOW + 1)
        assert g.prune(now=NOW + 700) == 1
        # The send time of a migrated entry is unknown; its expiry is an upper bound of it.
        assert g.horizon == NOW + 660


def test_nonce_counter_monotonic_and_durable(tmp_path: Path) -> None:
    path = tmp_path / "nonce.sqlite"
    with NonceCounter(path) as c:
        a = c.next("d", now=NOW)
        b = c.next("d", now=NOW)
        assert b == a + 1
        assert a == int(NOW * 1_000_000)
        other = c.next("other", now=NOW)
        assert other == a  # separate counter per domain
    with NonceCounter(path) as c:
        # The clock stepped back an hour after a restart: still strictly increasing.
        assert c.next("d", now=NOW - 3600) == b + 1
        # The clock moved on: the floor takes over.
        assert c.next("d", now=NOW + 1) == int((NOW + 1) * 1_000_000)


def test_nonce_counter_lost_file_still_fresh(tmp_path: Path) -> None:
    with NonceCounter(tmp_path / "a.sqlite") as c:
        first = c.next("d", now=NOW)
    with NonceCounter(tmp_path / "fresh.sqlite") as c:  # state lost, later start
        assert c.next("d", now=NOW + 1) > first


def test_nonce_counter_threads_unique(tmp_path: Path) -> None:
    path = tmp_path / "n.sqlite"
    counters = [NonceCounter(path) for _ in range(4)]
    got: list[int] = []
    lock = threading.Lock()

    def take(c: NonceCounter) -> None:
        for _ in range(25):
            v = c.next("d", now=NOW)
            with lock:
                got.append(v)

    threads = [threading.Thread(target=take, args=(c,)) for c in counters]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(got) == 100 and len(set(got)) == 100
    for c in counters:
        c.close()


def test_random_nonce() -> None:
    values = {random_nonce() for _ in range(100)}
    assert len(values) == 100
    assert all(0 <= v < 2**128 for v in values)
