"""`prime-devnet audit`: nothing lost. Reconciles what each role accounts for with the chain.

The accounting lives in the roles; this module only reads it and compares:

- validators, `GET /v1/audit`: ledger counts and the work keys by outcome (accepted with units and feed
  seq, hard with evidence hash, soft);
- the trainer's work ledger (`work_ledger`, JSON lines): which work keys each step trained or dropped,
  its feed cursors and what it still holds queued;
- nodes, `GET /health` `records`: the slashing-protection record (posted = submitted + decided; signed
  but not yet taken by any validator = `signed`); a node that does not answer (killed for good) is read
  from the record in its state directory instead;
- the chain: `WorkRecorded`, `WorkInvalidated`, `StakeSlashed`, `WorkRestored` (an overturned appeal),
  `RewardsClaimed` events, `rewardsReserved`, `rewardPerUnit`.

Checks (each one row of the table; any failing row makes the exit status 1):

1. per validator: received = accepted + rejected_hard + rejected_soft + pending;
2. per node: the validators hold between `posted` and `posted + signed` rows for it;
3. every accepted work key (and every one a validator restored by overturning a hard verdict on appeal)
   is trained in some step, dropped by the trainer's async window (stale, counted) or as a duplicate of a
   group already trained, or still queued (held by the trainer, or past its cursor in that validator's
   feed); the trainer trained nothing no validator accepted or restored;
4. work recorded on chain (and not invalidated since) = accepted work the validators reported; and per
   validator, its outbox drains: no accepted work (that can land) decided more than `OUTBOX_STALL_S` before the
   read is still off chain (an outbox that has not moved past a row for that long is stuck: the reporter
   cannot land anything, as after a nonce wedge);
5. rewards reserved on chain = recorded units x rate - claimed, and = the validators' accepted units x rate
   (work restored by an overturned appeal counts with its restored reward: no validator lists it as accepted);
6. every slash has evidence: each hard invalidation carries a non-zero evidence hash that a validator
   serves, whose SHA-256 matches; each `StakeSlashed` follows a hard invalidation of the same work.
"""

from __future__ import annotations

import hashlib
import logging
import sqlite3
import time
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from devnet.network import Layout
from protocol.deadline import PeerTimeoutError, bounded_request, deadline_client
from protocol.identity import checksum
from protocol.work_ledger import read_work_ledger

log = logging.getLogger(__name__)

ZERO32 = "0x" + "00" * 32
OUTBOX_STALL_S = 600.0
"""Longest an accepted row may wait off chain before the audit calls the validator's outbox stuck: twice the
reporter's longest backoff (`reporter.max_backoff_s`, 300 s by default) while the RPC fails."""


@dataclass
class Row:
    check: str
    expected: Any
    actual: Any
    ok: bool
    detail: str = ""


@dataclass
class Inputs:
    """Everything the reconciliation compares (gathered by `gather`, or built by a test)."""

    validators: dict[str, dict[str, Any]]
    """name -> the validator's /v1/audit report (None values: unreachable); each has `url`."""
    trainer_steps: dict[int, dict[str, Any]]
    """step -> its last work-ledger line."""
    nodes: dict[str, dict[str, Any] | None]
    """node address -> its /health `records` (None: unreachable), read before the validators."""
    chain_events: list[dict[str, Any]]
    """{"name", "args"} of the pool's events up to a block read before the validators, oldest first."""
    rewards_reserved: int
    """`rewardsReserved` at that same block."""
    reward_per_unit: int
    evidence: dict[str, bytes | None] = field(default_factory=dict)
    """evidence hash -> the bytes some validator served for it (None: nobody served it)."""
    nodes_after: dict[str, dict[str, Any] | None] | None = None
    """The nodes' records read again after the validators (default: `nodes`)."""
    chain_events_after: list[dict[str, Any]] | None = None
    """The pool's events up to a block read after the validators (default: `chain_events`)."""
    read_at: float | None = None
    """Unix time the validators were read (default: when `reconcile` runs); an accepted row's `decided_at` is
    compared with it."""


def _key(v: Any) -> str:
    if isinstance(v, bytes):
        return "0x" + v.hex()
    return str(v).lower()


def reconcile(inp: Inputs, outbox_stall_s: float = OUTBOX_STALL_S) -> list[Row]:
    """The checks of the module docstring. A live network keeps moving while it is read, so each bound is
    taken from the side of the read that makes it exact: what was on chain (or posted by a node) before the
    validators were read must be in their ledgers; what they had reported (or received) must be on chain
    (or recorded by the node) after."""
    rows: list[Row] = []
    # 1. ledger identity per validator
    for name, rep in sorted(inp.validators.items()):
        if rep.get("counts") is None:
            rows.append(Row(f"{name}: reachable", "yes", "no", False, str(rep.get("error", ""))))
            continue
        c = rep["counts"]
        parts = c["accepted"] + c["rejected_hard"] + c["rejected_soft"] + c["pending"]
        rows.append(Row(f"{name}: submitted = accepted + hard + soft + pending", c["received"],
                        f"{c['accepted']} + {c['rejected_hard']} + {c['rejected_soft']} + {c['pending']} = {parts}",
                        parts == c["received"]))
    reports = [r for r in inp.validators.values() if r.get("counts") is not None]

    # 2. nodes' records against the validators' rows
    held: dict[str, int] = {}
    for rep in reports:
        for node, counts in rep.get("nodes", {}).items():
            held[node.lower()] = held.get(node.lower(), 0) + int(counts["received"])
    after = inp.nodes_after if inp.nodes_after is not None else inp.nodes
    for node, rec in sorted(inp.nodes.items()):
        rec_after = after.get(node)
        if rec is None or rec_after is None:
            rows.append(Row(f"node {node[:10]}: reachable", "yes", "no", False))
            continue
        posted = rec.get("submitted", 0) + rec.get("decided", 0)
        signed_total = sum(rec_after.get(s, 0) for s in ("signed", "submitted", "decided"))
        n = held.get(node.lower(), 0)
        rows.append(Row(f"node {node[:10]}: submitted (posted..posted+unsent) = rows at validators",
                        f"{posted}..{signed_total}", n, posted <= n <= signed_total))

    # 3. accepted work -> trainer
    accepted: dict[str, dict[str, Any]] = {}
    for rep in reports:
        for a in rep.get("accepted", []):
            accepted.setdefault(a["work_key"].lower(), {**a, "validator_url": rep.get("url")})
    trained: set[str] = set()
    dropped: set[str] = set()
    for line in inp.trainer_steps.values():
        trained.update(k.lower() for k in line.get("trained", []))
        dropped.update(k.lower() for k in line.get("stale", []) + line.get("future", []) + line.get("duplicate", []))
    last = inp.trainer_steps[max(inp.trainer_steps)] if inp.trainer_steps else {}
    queued_keys = {k.lower() for k in last.get("queued", [])}
    # Work restored by an overturned appeal enters the deciding validator's feed: it must reach the trainer
    # too. One whose item was withdrawn (the chain settled the appeal the other way) is owed nowhere.
    restored_keys: set[str] = set()
    for rep in reports:
        for a in rep.get("restored", []):
            key = a["work_key"].lower()
            restored_keys.add(key)
            if a.get("feed_seq") is not None or key in trained | dropped | queued_keys:
                accepted.setdefault(key, {**a, "validator_url": rep.get("url"), "restored": True})
    cursors = {str(u).rstrip("/"): int(c) for u, c in last.get("cursors", {}).items()}
    fates = {"trained": 0, "dropped_stale": 0, "queued": 0, "lost": 0}
    lost = []
    for key, a in accepted.items():
        if key in trained:
            fates["trained"] += 1
        elif key in dropped:
            fates["dropped_stale"] += 1
        elif key in queued_keys or (a.get("feed_seq") is not None
                                    and a["feed_seq"] > cursors.get(str(a.get("validator_url")).rstrip("/"), 0)):
            fates["queued"] += 1
        else:
            fates["lost"] += 1
            lost.append(key)
    n_restored = sum(1 for a in accepted.values() if a.get("restored"))
    rows.append(Row("accepted = trained + dropped (stale) + queued",  # accepted includes work restored by appeal
                    f"{len(accepted) - n_restored} + {n_restored} restored" if n_restored else len(accepted),
                    f"{fates['trained']} + {fates['dropped_stale']} + {fates['queued']} (lost {fates['lost']})",
                    not lost, ("lost: " + ", ".join(k[:18] for k in lost[:5])) if lost else ""))
    unknown = sorted((trained | dropped) - set(accepted) - restored_keys)
    rows.append(Row("trained work that no validator accepted", 0, len(unknown), not unknown,
                    ", ".join(k[:18] for k in unknown[:5])))

    # 4. chain work = accepted and reported
    def on_chain_keys(events: list[dict[str, Any]]) -> set[str]:
        rec = {_key(e["args"]["workKey"]) for e in events if e["name"] == "WorkRecorded"}
        gone = {_key(e["args"]["workKey"]) for e in events if e["name"] == "WorkInvalidated"}
        return rec - gone

    recorded: dict[str, int] = {}
    invalidated: set[str] = set()
    claimed = 0
    hard: dict[str, str] = {}
    slashed: list[str] = []
    restored: dict[str, int] = {}
    for e in inp.chain_events:
        args = e["args"]
        if e["name"] == "WorkRecorded":
            recorded[_key(args["workKey"])] = int(args["reward"])
        elif e["name"] == "WorkInvalidated":
            invalidated.add(_key(args["workKey"]))
            if args["hard"]:
                hard[_key(args["workKey"])] = _key(args["evidenceHash"])
        elif e["name"] == "RewardsClaimed":
            claimed += int(args["amount"])
        elif e["name"] == "StakeSlashed":
            slashed.append(_key(args["workKey"]))
        elif e["name"] == "WorkRestored":  # an appeal overturned its hard invalidation (contracts/README.md)
            restored[_key(args["workKey"])] = int(args["reward"])
    on_chain = {k for k in recorded if k not in invalidated}
    accepted = {k: a for k, a in accepted.items() if not a.get("restored")}  # restored: on chain by WorkRestored
    reported = {k for k, a in accepted.items() if a.get("reported") and not str(a.get("chain_tx") or "").startswith(
        "refused:")}
    on_chain_after = on_chain_keys(inp.chain_events_after if inp.chain_events_after is not None
                                   else inp.chain_events)
    extra, missing = sorted(on_chain - set(accepted)), sorted(reported - on_chain_after)
    rows.append(Row("work recorded on chain = accepted work reported", len(reported), len(on_chain_after),
                    not extra and not missing,
                    (f"on chain, not accepted: {len(extra)}; " if extra else "")
                    + (f"reported, not on chain: {len(missing)}" if missing else "")))
    outbox = len(set(accepted) - on_chain)
    if outbox:
        rows.append(Row("accepted work not yet on chain (validators' outbox)", "-", outbox, True))
    read_at = time.time() if inp.read_at is None else inp.read_at
    for name, rep in sorted(inp.validators.items()):
        if rep.get("counts") is None:
            continue
        waiting = [read_at - float(a["decided_at"]) for a in rep.get("accepted", [])
                   if a.get("decided_at") is not None and not a.get("unreportable")
                   and a["work_key"].lower() not in on_chain_after]
        stuck = sorted(w for w in waiting if w > outbox_stall_s)
        rows.append(Row(f"{name}: outbox drains (accepted work off chain at most {outbox_stall_s:.0f} s)", 0,
                        len(stuck), not stuck,
                        f"{len(stuck)} accepted rows off chain for over {outbox_stall_s:.0f} s (oldest {stuck[-1]:.0f} s): "
                        f"its outbox has not shrunk past them; the reporter lands nothing" if stuck else ""))

    # 5. rewards
    rate = inp.reward_per_unit
    expected_chain = sum(r for k, r in recorded.items() if k not in invalidated) + sum(restored.values()) - claimed
    rows.append(Row("rewards reserved = recorded rewards - claimed", expected_chain, inp.rewards_reserved,
                    expected_chain == inp.rewards_reserved))
    units = sum(int(accepted[k]["units"]) for k in on_chain if k in accepted)
    back = sum(restored.values())
    rows.append(Row("rewards reserved + claimed = accepted units x rate",  # + rewards restored by appeals
                    f"{units} x {rate} + {back} = {units * rate + back}" if back else f"{units} x {rate} = {units * rate}",
                    inp.rewards_reserved + claimed,
                    units * rate + back == inp.rewards_reserved + claimed))
    if restored:
        rows.append(Row("work restored by overturned appeals", "-", len(restored), True))

    # 6. slashes have evidence
    bad = []
    for key, h in hard.items():
        data = inp.evidence.get(h)
        if h == ZERO32 or data is None or "0x" + hashlib.sha256(data).hexdigest() != h:
            bad.append(key)
    orphan = [k for k in slashed if k not in hard]
    rows.append(Row("hard invalidations with evidence served and matching", len(hard), len(hard) - len(bad),
                    not bad, ", ".join(k[:18] for k in bad[:5])))
    rows.append(Row("slashes following a hard invalidation", len(slashed), len(slashed) - len(orphan),
                    not orphan))
    return rows


# -- gathering ----------------------------------------------------------------------------------

def _nodes(http: httpx.Client, layout: Layout) -> dict[str, dict[str, Any] | None]:
    nodes: dict[str, dict[str, Any] | None] = {}
    for n in layout.nodes:
        try:
            body = bounded_request(http, "GET", n["url"] + "/health", 5.0).json()
            nodes[n["address"]] = body.get("records") if isinstance(body, dict) else None
        except (httpx.HTTPError, ValueError, PeerTimeoutError):
            nodes[n["address"]] = _records_on_disk(layout, n)
    return nodes


def _records_on_disk(layout: Layout, node: dict[str, str]) -> dict[str, Any] | None:
    """A node that does not answer (killed for good, stopped): its slashing-protection record read, read-only,
    from its state directory (`node/protection.py`'s `signed` table, what its /health `records` counts), so a
    dead node's work is still accounted for (issue 26 item 2); None without one. SQL rather than an import:
    the devnet does not import the node role (docs/architecture.md, "Where the code lives")."""
    path = Path(layout.state_dir) / node["name"] / "protection.sqlite"
    if not path.exists():
        return None
    try:
        with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)) as db:
            rows = db.execute("SELECT state, COUNT(*) FROM signed WHERE run_id=? AND node=? GROUP BY state",
                              (str(layout.run["run_id"]), checksum(node["address"]))).fetchall()
    except sqlite3.Error as exc:
        log.warning("%s: cannot read its record at %s: %s", node["name"], path, exc)
        return None
    out = {"signed": 0, "submitted": 0, "decided": 0}
    out.update({str(state): int(n) for state, n in rows})
    return out


def _events(watch: Any, to_block: int) -> list[dict[str, Any]]:
    return [{"name": e.name, "args": e.args} for e in watch.pool.events(watch.start_block, to_block)]


def gather(layout: Layout, timeout_s: float = 10.0) -> Inputs:
    """Read every side, in the order `reconcile` relies on: the trainer's ledger, the nodes and the chain
    (at a fixed block) before the validators; the nodes and the chain again after them."""
    from devnet.observer import ChainWatch

    trainer_steps = read_work_ledger(Path(layout.trainer["work_ledger"]))
    watch = ChainWatch(layout)
    with deadline_client(timeout_s) as http:
        nodes = _nodes(http, layout)
        before = int(watch.pool.tx.w3.eth.block_number)
        events = _events(watch, before)
        functions = watch.pool.contract.functions
        reserved = int(functions.rewardsReserved().call(block_identifier=before))
        rate = int(functions.rewardPerUnit().call(block_identifier=before))
        validators: dict[str, dict[str, Any]] = {}
        read_at = time.time()
        for v in layout.validators:
            try:
                r = http.get(v["url"] + "/v1/audit")
                r.raise_for_status()
                validators[v["name"]] = {**r.json(), "url": v["url"]}
            except (httpx.HTTPError, ValueError) as exc:
                validators[v["name"]] = {"counts": None, "url": v["url"], "error": str(exc)}
        nodes_after = _nodes(http, layout)
        events_after = _events(watch, int(watch.pool.tx.w3.eth.block_number))
        evidence: dict[str, bytes | None] = {}
        for e in events:
            if e["name"] == "WorkInvalidated" and e["args"]["hard"]:
                h = _key(e["args"]["evidenceHash"])
                evidence[h] = None
                for v in layout.validators:
                    try:
                        r = http.get(f"{v['url']}/v1/evidence/{h}")
                    except httpx.HTTPError:
                        continue
                    if r.status_code == 200:
                        evidence[h] = r.content
                        break
    return Inputs(validators=validators, trainer_steps=trainer_steps, nodes=nodes, chain_events=events,
                  rewards_reserved=reserved, reward_per_unit=rate, evidence=evidence,
                  nodes_after=nodes_after, chain_events_after=events_after, read_at=read_at)


def audit(layout: Layout) -> dict[str, Any]:
    rows = reconcile(gather(layout))
    return {"ok": all(r.ok for r in rows), "rows": [r.__dict__ for r in rows]}


def table(report: dict[str, Any]) -> str:
    rows = report["rows"]
    w = max(len(r["check"]) for r in rows)
    we = max(len(str(r["expected"])) for r in rows)
    lines = [f"{'check':<{w}}  {'expected':<{we}}  actual", "-" * (w + we + 30)]
    for r in rows:
        mark = "ok " if r["ok"] else "MISMATCH"
        lines.append(f"{r['check']:<{w}}  {r['expected']!s:<{we}}  {r['actual']!s}  {mark}"
                     + (f"  ({r['detail']})" if r["detail"] else ""))
    lines.append("audit: " + ("reconciled" if report["ok"] else "MISMATCH"))
    return "\n".join(lines)
