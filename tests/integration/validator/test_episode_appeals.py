"""Appeals of multi-turn verdicts (`submission` v2) against a real anvil pool and two real validators with the tiny
model on `alphabet-sort`: the appeal re-checks the episodes through the checker's own turn-by-turn check, so
honest episodes a miscalibrated validator slashed are restored (and reach its trainer feed as `feed-item` v3)
while a cheat stays slashed."""

from __future__ import annotations

import time
from typing import Any

import pytest
from chainfixtures import VALIDATOR2, Pools

from bench.adversaries import SimNode
from bench.loopback import RUN
from contracts.pool import EscrowStatus, WorkStatus
from node.engines import ModelsEngine
from node.episodes import build_episode_submission
from protocol.appeal import Appeal
from protocol.envelope import Envelope, seal
from protocol.episodes import EpisodeFeedItem, EpisodeSubmission
from protocol.nonce import random_nonce
from protocol.rollout import submission_venue
from protocol.upload import upload_headers

pytestmark = pytest.mark.timeout(300)

EPISODES = RUN.model_copy(update={"env": "alphabet-sort", "env_version": "1", "max_new_tokens": 12})


def _episodes(node: SimNode, counter: int) -> EpisodeSubmission:
    chain_id, pool = submission_venue(node.domain)
    return build_episode_submission(ModelsEngine(node.loaded), EPISODES, node.identity.address, 1, counter,
                                    node.manifest_hash, chain_id=chain_id, pool=pool)


def _slashed(v: Any, node: SimNode, sub: EpisodeSubmission) -> tuple[str, str, bytes]:
    """(work key, the signed verdict, the submission envelope) of `sub` rejected hard by `v` and slashed."""
    data = node.seal(sub)  # type: ignore[arg-type]
    with v.client() as c:
        r = c.post("/v1/submissions", content=data)
        assert r.status_code in (200, 202), r.text
        key = str(r.json()["work_key"])
    row = v.wait_reported(key)
    assert row["outcome"] == "rejected_hard", row
    return key, str(row["verdict"]), data


def _appeal(v: Any, node: SimNode, key: str, verdict: str, submission: bytes) -> tuple[int, dict[str, Any]]:
    body = Appeal(run_id=EPISODES.run_id, node=node.identity.address, work_key=bytes.fromhex(key[2:]),
                  verdict=verdict, submission=submission.decode())
    data = seal(node.identity, body, domain=node.domain, nonce=random_nonce()).to_bytes()
    headers = upload_headers(node.identity, data, domain=v.service.domain, validator=v.service.identity.address,
                             path="/v1/appeals")
    with v.client() as c:
        r = c.post("/v1/appeals", content=data, headers=headers)
        return r.status_code, dict(r.json())


def test_honest_episodes_wrongly_slashed_are_restored_on_appeal_and_a_cheat_stays_slashed(
        make_validator: Any, make_node: Any, published: Pools) -> None:
    published.admin.grant_role("validator", published.chain.account(VALIDATOR2).address)
    # logprob tolerance 0: the honest decode and the replay's prefill differ by ~1e-7, so honest episodes fail
    strict = make_validator("strict", run=EPISODES, checks={"logprob_tolerance": 0.0})
    fair = make_validator("fair", account=VALIDATOR2, run=EPISODES)
    honest, cheater = make_node(), make_node()
    honest.run = cheater.run = EPISODES

    key, verdict, data = _slashed(strict, honest, _episodes(honest, 0))
    assert strict.wait_reported(key)["reason"] == "logprob_mismatch"
    published.operator.appeal(key)
    status, answer = _appeal(fair, honest, key, verdict, data)
    assert status == 200, answer
    assert (answer["outcome"], answer["reason"], answer["original_reason"]) == \
        ("overturned", "accepted", "logprob_mismatch"), answer
    assert answer["resolved"]
    assert published.admin.get_escrow(key).status is EscrowStatus.OVERTURNED
    assert published.admin.get_work(key).status is WorkStatus.ACCEPTED
    # the restored episodes reach the fair validator's trainer feed, rebuilt by its own replay
    with fair.client() as c:
        feed = c.get("/v1/feed", params={"after": 0}).json()
    items = [Envelope.from_bytes(i["envelope"].encode(), max_bytes=1 << 24) for i in feed["items"]]
    assert [(e.kind, e.version) for e in items] == [("feed-item", 3)]
    item = EpisodeFeedItem.model_validate(items[0].body)
    sub = EpisodeSubmission.model_validate(Envelope.model_validate_json(data).body)
    assert item.work_key == bytes.fromhex(key[2:]) and len(item.groups) == len(sub.tasks)
    for tr, group in zip(sub.tasks, item.groups, strict=True):
        for s, fed in zip(tr.samples, group.samples, strict=True):
            assert [t for t, m in zip(fed.tokens, fed.loss_mask(), strict=True) if m] == \
                [t for turn in s.turns for t in turn.tokens]

    # a cheat (an inflated reward) appealed to the same fair validator stays slashed
    cheat = _episodes(cheater, 0)
    s = cheat.tasks[0].samples[0]
    bad = s.model_copy(update={"reward": 1.0 if s.reward < 0.5 else 0.0})
    cheat = cheat.model_copy(update={"tasks": (cheat.tasks[0].model_copy(update={"samples": (
        bad, *cheat.tasks[0].samples[1:])}), *cheat.tasks[1:])})
    key, verdict, data = _slashed(strict, cheater, cheat)
    assert strict.wait_reported(key)["reason"] == "reward_mismatch"
    published.operator.appeal(key)
    status, answer = _appeal(fair, cheater, key, verdict, data)
    assert status == 200, answer
    assert (answer["outcome"], answer["reason"]) == ("upheld", "reward_mismatch"), answer
    deadline = time.monotonic() + 60
    while published.admin.get_escrow(key).status is not EscrowStatus.UPHELD:
        assert time.monotonic() < deadline, "the upheld appeal was not resolved on chain"
        time.sleep(0.2)
