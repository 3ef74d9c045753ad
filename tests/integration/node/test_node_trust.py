"""A node believes only what it can check (issue 23, item 10; issue 35 item 8): which URL speaks for a validator
is decided by the chain's validator role, the address's signature over a fresh `/v1/info` challenge and the
verdicts the URL signs, a 200/202 counts only with the validator's signed receipt for the bytes sent, a verdict
counts only as its validator's signed envelope about exactly the work this node sent, a payload is kept until
such a verdict is held, and no answer from a peer stops the node. Driven against a hostile validator on loopback (FastAPI) that claims
a real validator's address, and the real validator beside it."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from chainfixtures import VALIDATOR, Pools
from fastapi import FastAPI, Request, Response
from netfixtures import forward_info, serve_asgi
from test_node_join import make_worker, node_config

from bench.loopback import RUN, TINY
from node import commands
from node.protection import SlashingProtection
from node.rollouts import build_submission
from protocol import info_proof
from protocol.envelope import Envelope, seal
from protocol.identity import Identity
from protocol.nonce import random_nonce
from protocol.rollout import Outcome, Reason, Receipt, Submission, Verdict, submission_venue
from protocol.seeds import work_key

pytestmark = pytest.mark.timeout(300)


PRIME_HEADERS = ("x-prime-signer", "x-prime-body-sha256", "x-prime-timestamp-ms", "x-prime-signature")


def hostile_validator(real_url: str, mode: dict[str, Any], domain: str, real_key: Identity) -> FastAPI:
    """Stands between the node and the validator at `real_url` (a proxy: it forwards `/v1/info` with the node's
    challenge, so it holds the real validator's address) and answers submissions as `mode["answer"]` says: answers
    without a receipt, with a forged or replayed one, or with the real receipt (the submission forwarded) beside an
    unsigned, forged or misdirected verdict, or an odd status. With `mode["claim"]` it names another address (and
    then cannot prove it); with `mode["copy_info"]` it serves the real body without the challenge's proof."""
    app = FastAPI()

    @app.get("/v1/info")
    def info(request: Request) -> Response:
        content, headers = forward_info(real_url, "" if mode.get("copy_info") else request.url.query)
        if mode.get("claim"):
            body = json.loads(content)
            body["validator"] = mode["claim"]
            body["validators"] = [mode["claim"]]
            content = json.dumps(body).encode()
        return Response(content, media_type="application/json", headers=headers)

    def verdict(sub: Submission, key: Identity, sub_hash: bytes, outcome: Outcome = Outcome.ACCEPTED) -> str:
        chain_id, pool = submission_venue(domain)
        v = Verdict(run_id=sub.run_id, work_key=work_key(sub.run_id, sub.node, sub.policy_version, sub.counter,
                                                         chain_id=chain_id, pool=pool),
                    node=sub.node, policy_version=sub.policy_version, counter=sub.counter, submission_hash=sub_hash,
                    outcome=outcome, reason=Reason.ACCEPTED if outcome is Outcome.ACCEPTED else Reason.PROOF_MISMATCH,
                    evidence_hash=None if outcome is Outcome.ACCEPTED else b"\x11" * 32)
        return seal(key, v, domain=domain, nonce=random_nonce()).to_bytes().decode()

    def receipt(sub: Submission, key: Identity, sub_hash: bytes) -> str:
        chain_id, pool = submission_venue(domain)
        r = Receipt(run_id=sub.run_id, work_key=work_key(sub.run_id, sub.node, sub.policy_version, sub.counter,
                                                         chain_id=chain_id, pool=pool),
                    node=sub.node, policy_version=sub.policy_version, counter=sub.counter, submission_hash=sub_hash,
                    state="received")
        return seal(key, r, domain=domain, nonce=random_nonce()).to_bytes().decode()

    @app.post("/v1/submissions")
    async def submissions(request: Request) -> Response:
        data = await request.body()
        sub = Submission.model_validate(Envelope.model_validate_json(data).body)
        real_hash = hashlib.sha256(data).digest()
        answer = mode["answer"]
        mode.setdefault("seen", []).append(answer)
        status, body = 200, {"state": "decided", "outcome": "accepted", "reason": "accepted"}
        if answer in ("forged", "misdirected", "forged_hard"):  # the real receipt: the work did reach the validator
            real = httpx.post(real_url + "/v1/submissions", content=data, timeout=60,
                              headers={h: request.headers[h] for h in PRIME_HEADERS if h in request.headers})
            assert real.status_code in (200, 202), real.text
            body["receipt"] = real.json()["receipt"]
        if answer == "unsigned_accept":
            body["verdict"] = None
        elif answer == "unsigned_202":  # "taken, wait for the verdict": the node would wait forever on it
            status, body = 202, {}
        elif answer == "forged_receipt":  # the right fields, signed by some other key
            status, body = 202, {"state": "received", "receipt": receipt(sub, Identity.create(), real_hash)}
        elif answer == "misdirected_receipt":  # the real validator's signature, about other bytes
            status, body = 202, {"state": "received", "receipt": receipt(sub, real_key, b"\x33" * 32)}
        elif answer == "forged":  # the right fields, signed by some other key
            body["verdict"] = verdict(sub, Identity.create(), real_hash)
        elif answer == "misdirected":  # the real validator's signature, about an envelope the node never sent
            body["verdict"] = verdict(sub, real_key, b"\x22" * 32)
        elif answer == "forged_hard":  # an unsigned slash: must not stop the node
            body.update(outcome="rejected_hard", reason="proof_mismatch", verdict=None)
        elif answer == "forged_equivocation":
            status, body = 409, {"error": "duplicate_work", "outcome": "rejected_hard", "reason": "equivocation",
                                 "verdict": verdict(sub, Identity.create(), real_hash, Outcome.REJECTED_HARD)}
        elif not answer.isdigit():
            raise AssertionError(answer)
        else:  # an HTTP status
            status, body = int(answer), {"error": "nonsense", "detail": "<odd>"}
        return Response(json.dumps(body), status_code=status, media_type="application/json")

    @app.get("/v1/submissions/{key}")
    def poll(key: str) -> Response:
        return Response(json.dumps({"state": "decided", "outcome": "accepted", "verdict": None}),
                        media_type="application/json")

    return app


def test_the_node_believes_only_signed_verdicts_of_on_chain_validators(
        published: Pools, deployment_file: Path, make_validator: Any, tmp_path: Path) -> None:
    real_key = published.chain.account(VALIDATOR)
    a = real_key.address
    real = make_validator()
    node = published.new_node()
    domain = commands.submission_domain(published.deployment.chain_id, published.deployment.pool, RUN.run_id)
    mode: dict[str, Any] = {"answer": "unsigned_accept"}
    nobody: dict[str, Any] = {"answer": "200", "claim": Identity.create().address}
    copycat: dict[str, Any] = {"answer": "unsigned_202", "copy_info": True}
    with serve_asgi(hostile_validator(real.url, mode, domain, real_key)) as hostile, \
            serve_asgi(hostile_validator(real.url, nobody, domain, real_key)) as roleless, \
            serve_asgi(hostile_validator(real.url, copycat, domain, real_key)) as copy:
        cfg = node_config(tmp_path, deployment_file, published.chain.rpc_url, [real.url, hostile, roleless],
                          run=RUN, model=TINY)
        chain = commands.open_chain(cfg)
        with httpx.Client(timeout=10) as http, SlashingProtection(tmp_path / "p.sqlite") as db:
            # a URL serving the real validator's /v1/info without the proof of our challenge (issue 35 item 8)
            # speaks for no one, even asked first and with nobody else answering for the address
            worker = make_worker(cfg, node, chain, db, http, [copy])
            worker.validators.refresh()
            assert worker.validators.url_of(a) is None and worker.validators.announced == []
            assert worker.validators.refused["unproven"] == 1
            # identity: the chain's role decides, and a second claimant of an address does not take it over
            worker = make_worker(cfg, node, chain, db, http, [real.url, hostile, roleless])
            worker.validators.refresh()
            assert worker.validators.url_of(a) == real.url  # not the hostile one that answered last
            assert worker.validators.announced == [a]  # the claimant of another address cannot prove it
            assert nobody["claim"] not in worker.validators.by_address
            assert worker.validators.refused["unproven"] == 1
            # a holder that stops answering gives the address to the stand-by that still answers
            with serve_asgi(hostile_validator(real.url, dict(mode), domain, real_key)) as first:
                worker = make_worker(cfg, node, chain, db, http, [first, real.url])
                worker.validators.refresh()
                assert worker.validators.url_of(a) == first
            worker.validators.refresh()
            assert worker.validators.url_of(a) == real.url

            # the hostile proxy holds the address (asked first): its "accepted" without a receipt deletes nothing
            worker = make_worker(cfg, node, chain, db, http, [hostile, real.url])
            worker.validators.refresh()
            assert worker.validators.url_of(a) == hostile
            engine, manifest = worker.weights.select().engine, worker.weights.select().manifest_hash

            def state(counter: int) -> tuple[str, bool]:
                rec = db.get(RUN.run_id, node.address, 1, counter)
                assert rec is not None
                return rec.state, rec.payload is not None

            sub0 = build_submission(engine, RUN, node.address, 1, 0, manifest, chain_id=worker.chain_id, pool=worker.pool)
            assert worker.submit(sub0) == {}
            assert state(0) == ("signed", True) and worker.tally.accepted == 0
            assert worker.tally.peer_errors["unsigned_receipt"] == 1
            assert worker.validators.url_of(a) is None  # caught lying: dropped for a
            worker.validators.refresh()  # the stand-by (the real one) now speaks for a; the kept work goes there
            assert worker.validators.url_of(a) == real.url
            assert worker.resend_unsent()
            worker.wait_decided(120)
            assert state(0) == ("decided", False) and worker.tally.accepted == 1

            # forged, misdirected and hard-but-unsigned verdicts (beside the real receipt), answers without a real
            # receipt (issue 35 item 8: "202 {}" made a node wait forever), then odd statuses: none acted on, none
            # stops the node, the work stays kept to resend
            for counter, answer, kind in [(1, "forged", "forged_verdict"), (2, "misdirected", "misdirected_verdict"),
                                          (3, "forged_hard", "unsigned_verdict"),
                                          (4, "forged_equivocation", "forged_verdict"),
                                          (5, "400", "http_400"), (6, "403", "http_403"), (7, "418", "http_418"),
                                          (8, "unsigned_202", "unsigned_receipt"),
                                          (9, "forged_receipt", "forged_receipt"),
                                          (10, "misdirected_receipt", "misdirected_receipt")]:
                worker.validators.shunned.clear()
                worker.validators.by_address[a] = hostile
                worker._down_until.clear()
                worker._strikes.clear()  # forgiven: else, after its back-off, it is probed before it gets a body
                mode["answer"] = answer
                before = worker.tally.peer_errors[kind]
                sub = build_submission(engine, RUN, node.address, 1, counter, manifest, chain_id=worker.chain_id,
                                       pool=worker.pool)
                assert worker.submit(sub) == {}, answer
                assert mode["seen"][-1] == answer
                assert worker.tally.peer_errors[kind] == before + 1, (answer, worker.tally.peer_errors)
                assert state(counter) == ("signed", True), answer  # kept, to be resent
                assert worker.tally.accepted == 1 and not worker.tally.rejected
                assert db.hard_verdicts(RUN.run_id, node.address) == []

            # a lie on the polling path: a "submitted" record whose poll answer is unsigned goes back to "signed"
            worker.validators.by_address[a] = hostile
            worker._down_until.clear()
            db.mark(RUN.run_id, node.address, 1, 1, "submitted")
            worker.poll_pending()
            assert state(1) == ("signed", True)
            assert worker.tally.peer_errors["unsigned_verdict"] == 2

            # and the real validator's signed verdicts are acted on: everything kept ends decided there
            worker.validators.shunned[hostile] = float("inf")
            worker.validators.by_address.pop(a, None)
            worker._down_until.clear()
            worker.validators.refresh()
            assert worker.validators.url_of(a) == real.url
            assert worker.resend_unsent()
            worker.wait_decided(180)
            assert [state(c)[0] for c in range(11)] == ["decided"] * 11
            assert worker.tally.accepted == 11


def _other_run_info(real_url: str, signer: Identity | None) -> FastAPI:
    """A URL serving another run's rules under the real validator's body: proved by `signer`'s own key (an
    address without the validator role), or (None) not proved at all."""
    app = FastAPI()

    @app.get("/v1/info")
    def info(request: Request) -> Response:
        body = httpx.get(real_url + "/v1/info").json()
        body["run"]["run_id"] = "other-run"
        body["domain"] = body["domain"].rsplit("/", 1)[0] + "/other-run"
        if signer is None:
            return Response(json.dumps(body), media_type="application/json")
        body["validator"] = signer.address
        data = json.dumps(body).encode()
        challenge = info_proof.parse_challenge(request.query_params.get("challenge"))
        assert challenge is not None
        return Response(data, media_type="application/json", headers={
            info_proof.HEADER: info_proof.prove_info(signer, challenge, data, domain=body["domain"])})

    return app


def test_the_run_rules_come_only_from_a_proved_validator_of_the_pool(
        published: Pools, deployment_file: Path, make_validator: Any, tmp_path: Path) -> None:
    """Issue 35 item 8: a node reads the run's rules (and so its envelope domain) from the first configured
    validator's `/v1/info`; a URL listed first that serves another run's rules, unproved or proved by a key
    without the validator role, is ignored, and the rules come from the real validator."""
    real = make_validator()
    node = published.new_node()
    for signer in (None, Identity.create()):
        with serve_asgi(_other_run_info(real.url, signer)) as fake, httpx.Client(timeout=10) as http:
            cfg = node_config(tmp_path, deployment_file, published.chain.rpc_url, [fake, real.url])
            chain = commands.open_chain(cfg)
            run, _model, domain = commands.run_rules(cfg, chain, http, commands.validator_role(chain.client(node)))
            assert run == RUN and domain == real.service.domain, signer
