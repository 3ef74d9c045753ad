"""Pool notes on a real ledger (issue 35 item 7): the near-tie accounts the ledger keeps row by row, the bounded
document a validator signs (`validator.notes`), and how a peer's notes are trusted and bounded
(`validator.poolview`): the claim bound, the age bound, holes counted once per version."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from protocol.envelope import seal
from protocol.errors import ExpiredError, ProtocolError, SignatureError
from protocol.identity import Identity
from protocol.nonce import random_nonce
from protocol.pool_notes import MAX_WORK_KEYS, NodeNote, PoolNotes, VersionHoles
from validator.config import PoolNotesSettings, ValidatorConfig
from validator.ledger import Decision, Ledger
from validator.notes import Notes
from validator.poolview import PoolView, StaleNotesError
from validator.stats import Stats

pytestmark = pytest.mark.timeout(60)

DOMAIN = "prime/31337/0x0000000000000000000000000000000000000001/run"


def _accepted(tokens: int, near: int, eos: int) -> Decision:
    return Decision(outcome="accepted", reason="accepted", measurements={
        "units": tokens, "near_ties": near, "eos_near_ties": eos, "samples": [{"paid_tokens": tokens}]})


def _hard(key: str) -> Decision:
    return Decision(outcome="rejected_hard", reason="wrong_task", evidence=b"e-" + key.encode(),
                    evidence_hash="0x" + key[2:].rjust(64, "0"))


def _add(ledger: Ledger, key: str, node: str, decision: Decision | None, *, counter: int = 0, at: float = 0) -> None:
    assert ledger.insert(work_key=key, submission_hash="h" + key, node=node, policy_version=1, counter=counter,
                         envelope=b"{}", decision=decision, now=at or None)


def test_the_ledger_keeps_each_nodes_near_tie_account_with_its_rows(ledger: Ledger, open_ledger) -> None:
    a, b = Identity.create().address, Identity.create().address
    _add(ledger, "0x01", a, _accepted(100, 3, 1))
    _add(ledger, "0x02", a, None, counter=1)
    assert ledger.decide("0x02", _accepted(50, 2, 0))
    _add(ledger, "0x03", b, _accepted(10, 0, 0))
    assert ledger.near_tie_account(a) == (150, 5, 1)
    ledger.redecide("0x01", _hard("0x01"))  # equivocation turns accepted work hard: out of the account
    assert ledger.near_tie_account(a) == (50, 2, 0)
    assert ledger.near_tie_accounts(10) == {a: (50, 2, 0), b: (10, 0, 0)}
    assert ledger.near_tie_account(Identity.create().address) == (0, 0, 0)
    assert open_ledger().near_tie_account(a) == (50, 2, 0)  # kept in the database, not in memory


def test_a_ledger_from_before_the_accounts_counts_them_once_at_open(tmp_path: Path) -> None:
    a = Identity.create().address
    ledger = Ledger.open(path=tmp_path / "l.sqlite")
    _add(ledger, "0x01", a, _accepted(100, 3, 1))
    ledger._db.execute("DELETE FROM node_ties")  # as written by a validator that had no accounts
    ledger._db.execute("DELETE FROM tallies WHERE kind = 'node_ties:v1'")
    ledger.close()
    ledger = Ledger.open(path=tmp_path / "l.sqlite")
    assert ledger.near_tie_account(a) == (100, 3, 1)
    ledger.close()
    assert Ledger.open(path=tmp_path / "l.sqlite").near_tie_account(a) == (100, 3, 1)  # not counted twice


def _cfg(**pool_notes: object) -> ValidatorConfig:
    return ValidatorConfig.model_validate({"pool_notes": pool_notes, "flood": {"holes_window": 4}})


def test_the_notes_list_pending_hard_verdicts_first_and_count_what_the_cap_drops(ledger: Ledger) -> None:
    me = Identity.create()
    cheat, skipper, *steady = (Identity.create().address for _ in range(5))
    for i in range(MAX_WORK_KEYS + 2):
        key = f"0x{i + 1:064x}"
        _add(ledger, key, cheat, _hard(key), counter=i, at=1000.0 + i)
    ledger.record_holes(skipper, 1, 0, 5, 2)
    ledger.record_holes(skipper, 9, 0, 5, 1)
    for i, node in enumerate(steady):
        _add(ledger, f"0x2{i:02d}", node, _accepted(100, i + 1, 0))
    notes = Notes(_cfg(max_nodes=3), me, ledger, current_version=lambda: 10, domain=DOMAIN).build()
    assert [n.node for n in notes.nodes] == [cheat, skipper, steady[-1]] and notes.dropped == 2
    first = notes.nodes[0]
    assert (first.hard_pending, first.hard_oldest_ms) == (MAX_WORK_KEYS + 2, 1_000_000)
    assert first.hard_work_keys == tuple((i + 1).to_bytes(32, "big") for i in range(MAX_WORK_KEYS))  # the oldest
    assert notes.nodes[1].holes == (VersionHoles(policy_version=9, holes=1),)  # v1 is outside the holes window
    assert (notes.nodes[2].tokens, notes.nodes[2].near_ties) == (100, 3)
    sealed = Notes(_cfg(), me, ledger, current_version=lambda: 10, domain=DOMAIN)
    assert sealed.sealed() == sealed.sealed()  # cached: one signature per `cache_s`


def _view(ledger: Ledger, me: Identity, peer: Identity, *, window: int | None = 7200, **cfg: object) -> PoolView:
    return PoolView(PoolNotesSettings.model_validate(cfg), ledger=ledger, domain=DOMAIN, me=me.address,
                    peers=dict, validators=lambda: [me.address, peer.address], invalidation_window=lambda: window,
                    stats=Stats())


def _sealed(who: Identity, body: PoolNotes, at: float) -> bytes:
    return seal(who, body, domain=DOMAIN, nonce=random_nonce(), now=at).to_bytes()


def test_a_peers_hard_verdict_holds_a_node_only_within_the_claim_bound(ledger: Ledger) -> None:
    me, peer, node = Identity.create(), Identity.create(), Identity.create().address
    t = time.time()
    view = _view(ledger, me, peer, window=600, max_age_s=60.0, claim_max_s=3600.0)
    assert view.claim_s() == 600.0  # the chain's invalidation window is shorter than claim_max_s

    def claim(decided: float, at: float) -> bytes:
        return _sealed(peer, PoolNotes(nodes=(NodeNote(node=node, hard_pending=1, hard_oldest_ms=int(decided * 1000)),)),
                       at)

    assert view.take(peer.address, claim(t - 10, t - 1), now=t)
    assert view.hard_pending_at(node, now=t) == peer.address
    assert view.hard_pending_at(node, now=t + 30) == peer.address
    assert view.hard_pending_at(node, now=t + 61) is None  # the peer stopped reporting: its notes aged out
    assert view.take(peer.address, claim(t - 601, t), now=t)  # decided past the window: it can never land
    assert view.hard_pending_at(node, now=t) is None
    with pytest.raises(ProtocolError):  # a decision dated after its own document
        view.take(peer.address, claim(t + 50, t + 1), now=t + 1)


def test_a_peers_notes_are_taken_only_signed_by_it_fresh_and_newer(ledger: Ledger) -> None:
    me, peer, node = Identity.create(), Identity.create(), Identity.create().address
    t = time.time()
    view = _view(ledger, me, peer, max_age_s=60.0)
    body = PoolNotes(nodes=(NodeNote(node=node, tokens=100, near_ties=4, eos_near_ties=1),))
    with pytest.raises(SignatureError):
        view.take(peer.address, _sealed(Identity.create(), body, t), now=t)  # another key
    with pytest.raises(SignatureError):
        view.take(Identity.create().address, _sealed(peer, body, t), now=t)  # not an announced validator
    with pytest.raises(ExpiredError):
        view.take(peer.address, _sealed(peer, body, t - 61), now=t)
    newer = _sealed(peer, body, t)
    assert view.take(peer.address, newer, now=t)
    assert not view.take(peer.address, newer, now=t)  # the same document fetched again: nothing new
    with pytest.raises(StaleNotesError):
        view.take(peer.address, _sealed(peer, body, t - 1), now=t)
    ledger.insert(work_key="0x01", submission_hash="h1", node=node, policy_version=1, counter=0, envelope=b"{}",
                  decision=_accepted(50, 1, 0))
    assert view.near_tie_account(node, now=t) == (150, 5, 1)  # here and at the peer


def test_holes_count_across_the_pool_once_per_version(ledger: Ledger) -> None:
    me, peer, node = Identity.create(), Identity.create(), Identity.create().address
    t = time.time()
    view = _view(ledger, me, peer)
    ledger.record_holes(node, 3, 0, 4, 2)
    holes = (VersionHoles(policy_version=3, holes=1), VersionHoles(policy_version=5, holes=2),
             VersionHoles(policy_version=1, holes=4))
    view.take(peer.address, _sealed(peer, PoolNotes(nodes=(NodeNote(node=node, holes=holes),)), t), now=t)
    assert view.holes_since(node, 2, now=t) == 2 + 2  # v3: the larger count (2 here); v5: the peer's; v1: too old
