"""`prime-node appeal`: ask a second validator to re-check work a validator hard-rejected (and slashed).

For each hard verdict kept in the state dir (`SlashingProtection.hard_verdicts`; or only `--work-key`):

1. reads the key's escrow on chain: still held and the appeal window open, the operator key files the
   appeal (`ComputePool.appeal(workKey)`); already filed, it goes on; resolved, released or the window
   closed, it only reports that;
2. seals an `Appeal` with the node key (the verdict exactly as signed, the submission envelope exactly
   as sent) and POSTs it to the validators it knows (`--validators` and their announced peers) except
   the one that slashed, until one decides (`overturned` or `upheld`; a validator that cannot check
   answers 503 `cannot_check` and the next one is asked);
3. prints one JSON object per appeal and records the answer in the state dir.

Exit status 0 when every appeal got a decision (either way), 1 otherwise.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import httpx

from node.commands import PROTECTION_DB, node_key, open_chain, operator_key, run_rules, validator_role
from node.config import NodeConfig
from node.errors import NodeError
from node.protection import HardVerdict, SlashingProtection
from node.worker import ValidatorDirectory
from protocol.appeal import Appeal
from protocol.envelope import seal
from protocol.errors import ChainError
from protocol.identity import Identity
from protocol.nonce import random_nonce
from protocol.upload import upload_headers

logger = logging.getLogger("prime-node")
_DECIDED = ("overturned", "upheld")


def appeal(cfg: NodeConfig) -> int:
    from contracts.pool import PoolClient

    node = node_key(cfg)
    operator = operator_key(cfg, node)
    chain = open_chain(cfg)
    pool: PoolClient = chain.client(operator)
    results = []
    with httpx.Client(timeout=cfg.submit.timeout_s) as http:
        run, _model, domain = run_rules(cfg, chain, http, validator_role(pool))
        directory = ValidatorDirectory(list(cfg.validators), http, validator_role(pool),
                                       timeout_s=cfg.submit.probe_timeout_s, domain=domain)
        directory.refresh()
        with SlashingProtection(cfg.state_dir / PROTECTION_DB) as db:
            verdicts = db.hard_verdicts(run.run_id, node.address)
            wanted = cfg.appeal.work_key.lower() if cfg.appeal.work_key else None
            if wanted is not None:
                verdicts = [v for v in verdicts if v.work_key == wanted]
                if not verdicts:
                    raise NodeError(f"no hard verdict for work key {wanted} in {cfg.state_dir}: only verdicts this "
                                    f"state dir received can be appealed")
            if not verdicts:
                logger.info("no hard verdict kept in %s: nothing to appeal", cfg.state_dir)
            for v in verdicts:
                result = appeal_one(v, pool=pool, node=node, domain=domain, directory=directory,
                                    explicit=wanted is not None)
                db.record_appeal(v.work_key, result)
                results.append(result)
    print(json.dumps(results, indent=2))
    return 0 if all(r.get("outcome") in _DECIDED for r in results) else 1


def appeal_one(v: HardVerdict, *, pool: Any, node: Identity, domain: str, directory: ValidatorDirectory,
               explicit: bool) -> dict[str, Any]:
    """File (if needed) and send the appeal of one hard verdict; the outcome as a JSON-able dict."""
    from contracts.pool import EscrowStatus

    out: dict[str, Any] = {"work_key": v.work_key, "reason": v.reason, "slasher": v.validator}
    evidence, submission = None, v.submission
    if v.reason == "equivocation":  # re-checked from the slasher's evidence: both envelopes the key signed
        evidence = _evidence(v, directory)
        if evidence is None:
            return {**out, "outcome": "not_appealable", "detail": "the slasher's evidence could not be fetched "
                    "(GET /v1/evidence/<evidence_hash> at the slashing validator)"}
        submission = str(json.loads(evidence)["submission"])
    elif v.reason == "near_tie_steering":  # re-checked with the slasher's account of this node's near-ties
        evidence = _evidence(v, directory)
        if evidence is None:
            return {**out, "outcome": "not_appealable", "detail": "the slasher's evidence could not be fetched "
                    "(GET /v1/evidence/<evidence_hash> at the slashing validator)"}
    if submission is None:
        return {**out, "outcome": "not_appealable", "detail": "the submission envelope was not kept"}
    escrow = pool.get_escrow(v.work_key)
    now = pool.pool_time()
    if escrow.status is EscrowStatus.HELD and (now < escrow.appeal_deadline or explicit):
        logger.info("filing the appeal of %s on chain (window closes at pool time %d, now %d)", v.work_key,
                    escrow.appeal_deadline, now)
        try:
            pool.appeal(v.work_key)
        except ChainError as exc:
            return {**out, "outcome": "refused_on_chain", "error": exc.reason, "detail": str(exc)}
    elif escrow.status is EscrowStatus.HELD:
        return {**out, "outcome": "late", "detail": f"the appeal window closed at pool time "
                f"{escrow.appeal_deadline} (now {now})"}
    elif escrow.status is not EscrowStatus.APPEALED:
        return {**out, "outcome": escrow.status.name.lower(), "detail": "already settled on chain"}
    body = Appeal(run_id=v.run_id, node=node.address, work_key=bytes.fromhex(v.work_key[2:]), verdict=v.verdict,
                  submission=submission, evidence=evidence)
    errors: dict[str, Any] = {}
    others = [a for a in sorted(directory.by_address) if a != v.validator]
    if not others and v.validator in directory.by_address and pool.validator_count() == 1:
        others = [v.validator]  # the pool's only validator re-checks its own verdict (the contract allows it)
    if not others:
        return {**out, "outcome": "no_validator", "detail": f"no validator other than the slasher {v.validator} "
                f"is known (give more --validators)"}
    for address in others:
        url = directory.by_address[address]
        data = seal(node, body, domain=domain, nonce=random_nonce()).to_bytes()
        try:
            r = directory.http.post(f"{url}/v1/appeals", content=data, headers={
                "content-type": "application/octet-stream",  # the appellant's upload header: checked before the body
                **upload_headers(node, data, domain=domain, validator=address, path="/v1/appeals")})
            answer = r.json()
        except (httpx.HTTPError, ValueError) as exc:
            errors[url] = f"{type(exc).__name__}: {exc}"
            continue
        if r.status_code == 200 and isinstance(answer, dict):
            problem = _decision_problem(answer, address, domain, v.work_key)
            if problem is not None:  # an answer its validator did not sign is not a decision
                errors[url] = {"error": "unsigned_decision", "detail": problem}
                logger.warning("appeal of %s at %s: %s; asking the next validator", v.work_key, url, problem)
                continue
            logger.info("appeal of %s at %s: %s (%s)", v.work_key, url, answer.get("outcome"), answer.get("detail"))
            return {**out, "validator": address, **answer, "original_reason": v.reason}
        errors[url] = answer if isinstance(answer, dict) else {"status": r.status_code}
        logger.warning("appeal of %s at %s: HTTP %d %s", v.work_key, url, r.status_code, errors[url])
    return {**out, "outcome": "not_decided", "errors": errors}


def _decision_problem(answer: dict[str, Any], validator: str, domain: str, work_key: str) -> str | None:
    """None when `answer` carries an `AppealDecision` that `validator` signed in `domain` about `work_key`, with
    the outcome the answer claims; else what is wrong with it."""
    from protocol.appeal import AppealDecision
    from protocol.envelope import Envelope, open_envelope
    from protocol.errors import PrimeError
    from protocol.replay import RereadRecords

    text = answer.get("decision")
    if not isinstance(text, str):
        return "no signed decision"
    try:
        env = Envelope.from_bytes(text.encode(), max_bytes=64 << 10)
        decision = open_envelope(env, domain=domain, replay_guard=RereadRecords(), expected_signer=validator,
                                 body_types=[AppealDecision], max_age_s=365 * 24 * 3600.0)
    except PrimeError as exc:
        return f"decision refused: {exc}"
    assert isinstance(decision, AppealDecision)
    if "0x" + bytes(decision.work_key).hex() != work_key.lower() or decision.outcome.value != answer.get("outcome"):
        return "the signed decision is about another key or says another outcome"
    return None


def _evidence(v: HardVerdict, directory: ValidatorDirectory) -> str | None:
    """The slasher's evidence document for `v` (checked against the hash its signed verdict carries), or None."""
    import hashlib

    try:
        want = str(json.loads(v.verdict)["body"]["evidence_hash"])
        url = directory.by_address.get(v.validator)
        if url is None:
            return None
        r = directory.http.get(f"{url}/v1/evidence/{want}")
        if r.status_code != 200 or "0x" + hashlib.sha256(r.content).hexdigest() != want:
            return None
        doc = r.content.decode()
        json.loads(doc)["submission"]  # noqa: B018 - it must hold the judged envelope
        return doc
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        logger.warning("evidence of %s from %s: %s", v.work_key, v.validator, exc)
        return None
