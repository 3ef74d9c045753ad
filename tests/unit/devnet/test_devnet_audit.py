"""The reconciliation: a consistent network reconciles, and each kind of loss is caught."""

from __future__ import annotations

import copy
import hashlib
from pathlib import Path
from typing import Any

from devnet.audit import Inputs, reconcile

NODE_A, NODE_B = "0x" + "aa" * 20, "0x" + "bb" * 20
RATE = 10**15
URL = "http://127.0.0.1:9"


def k(i: int) -> str:
    return "0x" + f"{i:064x}"


EVIDENCE = b'{"evidence": "bad proof"}'
EVIDENCE_HASH = "0x" + hashlib.sha256(EVIDENCE).hexdigest()


def consistent() -> Inputs:
    """Node A: 3 accepted (trained, stale, queued past the cursor); node B: 1 accepted (trained), 1 hard, 1 soft."""
    accepted = [
        {"work_key": k(1), "node": NODE_A, "units": 10, "feed_seq": 1, "reported": True, "chain_tx": "0x1"},
        {"work_key": k(2), "node": NODE_A, "units": 20, "feed_seq": 2, "reported": True, "chain_tx": "0x1"},
        {"work_key": k(3), "node": NODE_B, "units": 30, "feed_seq": 3, "reported": True, "chain_tx": "0x1"},
        {"work_key": k(4), "node": NODE_A, "units": 40, "feed_seq": 4, "reported": False, "chain_tx": None},
    ]
    validator = {
        "url": URL,
        "counts": {"received": 6, "accepted": 4, "rejected_hard": 1, "rejected_soft": 1, "pending": 0},
        "nodes": {NODE_A: {"received": 3}, NODE_B: {"received": 3}},
        "accepted": accepted,
        "rejected_hard": [{"work_key": k(5), "node": NODE_B, "evidence_hash": EVIDENCE_HASH}],
        "rejected_soft": [{"work_key": k(6), "node": NODE_B}],
    }
    steps = {
        0: {"step": 0, "trained": [k(1)], "stale": [], "future": [], "cursors": {URL: 1}, "queued": []},
        1: {"step": 1, "trained": [k(3)], "stale": [k(2)], "future": [], "cursors": {URL: 3}, "queued": []},
    }
    events: list[dict[str, Any]] = [
        {"name": "WorkRecorded", "args": {"workKey": bytes.fromhex(k(i)[2:]), "reward": u * RATE}}
        for i, u in ((1, 10), (2, 20), (3, 30))
    ] + [
        {"name": "WorkInvalidated", "args": {"workKey": bytes.fromhex(k(5)[2:]), "hard": True,
                                             "evidenceHash": bytes.fromhex(EVIDENCE_HASH[2:])}},
        {"name": "StakeSlashed", "args": {"workKey": bytes.fromhex(k(5)[2:]), "amount": 1}},
    ]
    return Inputs(
        validators={"validator-0": validator}, trainer_steps=steps,
        nodes={NODE_A: {"signed": 0, "submitted": 1, "decided": 2}, NODE_B: {"signed": 0, "submitted": 0, "decided": 3}},
        chain_events=events, rewards_reserved=60 * RATE, reward_per_unit=RATE, evidence={EVIDENCE_HASH: EVIDENCE},
    )


def failing(rows: list[Any]) -> list[str]:
    return [r.check for r in rows if not r.ok]


def test_a_consistent_network_reconciles() -> None:
    rows = reconcile(consistent())
    assert failing(rows) == []
    fate = next(r for r in rows if r.check.startswith("accepted = trained"))
    assert fate.actual == "2 + 1 + 1 (lost 0)"


def test_an_accepted_rollout_the_trainer_never_saw_is_lost() -> None:
    inp = consistent()
    inp.trainer_steps[1]["cursors"] = {URL: 4}  # the trainer claims to be past key 4 without having trained it
    assert failing(reconcile(inp)) == ["accepted = trained + dropped (stale) + queued"]


def test_trained_work_no_validator_accepted_is_caught() -> None:
    inp = consistent()
    inp.trainer_steps[1]["trained"].append(k(99))
    assert failing(reconcile(inp)) == ["trained work that no validator accepted"]


def test_ledger_counts_that_do_not_add_up_are_caught() -> None:
    inp = consistent()
    inp.validators["validator-0"]["counts"]["received"] = 7
    assert failing(reconcile(inp)) == ["validator-0: submitted = accepted + hard + soft + pending"]


def test_a_node_whose_submissions_are_missing_at_the_validators_is_caught() -> None:
    inp = consistent()
    inp.nodes[NODE_A] = {"signed": 0, "submitted": 2, "decided": 2}
    assert [c for c in failing(reconcile(inp))] == [f"node {NODE_A[:10]}: submitted (posted..posted+unsent) = "
                                                    "rows at validators"]


def test_reported_work_missing_on_chain_and_unpaid_rewards_are_caught() -> None:
    inp = consistent()
    inp.chain_events = [e for e in inp.chain_events if not (e["name"] == "WorkRecorded"
                                                            and e["args"]["workKey"] == bytes.fromhex(k(2)[2:]))]
    bad = failing(reconcile(inp))
    assert "work recorded on chain = accepted work reported" in bad
    assert "rewards reserved = recorded rewards - claimed" in bad


def test_an_outbox_that_has_not_drained_past_a_row_for_longer_than_the_bound_fails() -> None:
    """Issue 39 item 1: a wedged reporter's outbox only grew, and the audit called it "ok"."""
    inp = consistent()
    inp.read_at = 10_000.0
    for a in inp.validators["validator-0"]["accepted"]:
        a["decided_at"] = 9_990.0
    assert failing(reconcile(inp, outbox_stall_s=600.0)) == []  # key 4 waits 10 s: an outbox at work
    inp.validators["validator-0"]["accepted"][3]["decided_at"] = 10_000.0 - 900.0
    rows = reconcile(inp, outbox_stall_s=600.0)
    assert failing(rows) == ["validator-0: outbox drains (accepted work off chain at most 600 s)"]
    assert "oldest 900 s" in next(r.detail for r in rows if not r.ok)
    inp.validators["validator-0"]["accepted"][3]["unreportable"] = "NodeNotActive: ..."  # given up, not stuck
    assert failing(reconcile(inp, outbox_stall_s=600.0)) == []


def test_reserved_rewards_that_differ_from_units_times_rate_are_caught() -> None:
    inp = copy.deepcopy(consistent())
    inp.rewards_reserved += 1
    assert failing(reconcile(inp)) == ["rewards reserved = recorded rewards - claimed",
                                       "rewards reserved + claimed = accepted units x rate"]


def test_a_slash_without_matching_evidence_is_caught() -> None:
    inp = consistent()
    inp.evidence = {EVIDENCE_HASH: b"something else"}
    assert failing(reconcile(inp)) == ["hard invalidations with evidence served and matching"]
    inp = consistent()
    inp.chain_events = [e for e in inp.chain_events if e["name"] != "WorkInvalidated"]
    assert failing(reconcile(inp)) == ["slashes following a hard invalidation"]


def test_work_restored_by_an_overturned_appeal_reconciles() -> None:
    """An appeal overturned the hard verdict on k(5): the pool accepted the work again with its reward (no
    validator lists it as accepted: the slasher's ledger keeps its hard row, the resolver keeps an appeal)."""
    inp = consistent()
    inp.chain_events.append({"name": "WorkRestored", "args": {"workKey": bytes.fromhex(k(5)[2:]), "units": 7,
                                                               "reward": 7 * RATE}})
    assert failing(reconcile(inp)) == ["rewards reserved = recorded rewards - claimed",
                                       "rewards reserved + claimed = accepted units x rate"]
    inp.rewards_reserved += 7 * RATE  # what the pool holds after the restore
    rows = reconcile(inp)
    assert failing(rows) == []
    assert next(r for r in rows if r.check == "work restored by overturned appeals").actual == 1


def test_work_restored_by_an_overturned_appeal_must_reach_the_trainer() -> None:
    """The resolving validator lists k(5) as restored, with its feed seq (issue 23 item 13): the trainer must
    train it (or drop it stale, or hold it queued) like accepted work, and training it is not 'unknown' work."""
    inp = consistent()
    inp.chain_events.append({"name": "WorkRestored", "args": {"workKey": bytes.fromhex(k(5)[2:]), "units": 7,
                                                               "reward": 7 * RATE}})
    inp.rewards_reserved += 7 * RATE
    resolver = {"url": "http://127.0.0.1:10", "counts": {"received": 0, "accepted": 0, "rejected_hard": 0,
                                                          "rejected_soft": 0, "pending": 0}, "nodes": {},
                "accepted": [], "rejected_hard": [], "rejected_soft": [],
                "restored": [{"work_key": k(5), "node": NODE_B, "units": 7, "feed_seq": 1, "resolved": True}]}
    inp.validators["validator-1"] = resolver
    inp.trainer_steps[1]["cursors"]["http://127.0.0.1:10"] = 1  # past it, never trained: lost
    assert failing(reconcile(inp)) == ["accepted = trained + dropped (stale) + queued"]
    inp.trainer_steps[1]["trained"].append(k(5))
    rows = reconcile(inp)
    assert failing(rows) == []
    assert next(r for r in rows if r.check.startswith("accepted = trained")).expected == "4 + 1 restored"
    # withdrawn from the feed (the chain settled the appeal as upheld elsewhere) and never trained: owed nowhere
    inp.trainer_steps[1]["trained"].remove(k(5))
    resolver["restored"][0]["feed_seq"] = None
    assert failing(reconcile(inp)) == []


def test_a_dead_or_hung_node_is_audited_from_its_record_on_disk(tmp_path: Path) -> None:
    """Issue 26 item 2: a node killed for good (nothing listens) or hung (accepts, never answers) no longer
    answers /health; the audit reads its slashing-protection record from its state directory instead."""
    import httpx
    from netfixtures import free_port, hung_server

    from devnet.audit import _nodes
    from devnet.network import Layout
    from node.protection import SlashingProtection

    with SlashingProtection(tmp_path / "node-0" / "protection.sqlite"):
        pass
    with hung_server() as hung, httpx.Client(timeout=1.0) as http:
        layout = Layout(state_dir=str(tmp_path), model="tiny", run={"run_id": "devnet"}, rpc_url="", deployment="",
                        trainer={}, origin="", relays=[], validators=[],
                        nodes=[{"name": "node-0", "address": NODE_A, "url": f"http://127.0.0.1:{free_port()}"},
                               {"name": "node-1", "address": NODE_B, "url": hung}])
        records = _nodes(http, layout)
    assert records[NODE_A] is not None and set(records[NODE_A].values()) == {0}
    assert records[NODE_B] is None  # no record on disk: unreachable, as before
