"""EOS near-ties against a real validator and anvil (issue 23 item 9): a node that replaces every EOS that won
the seeded draw narrowly (within the sampling margin) and keeps generating is caught as `termination` and slashed;
honest work passes and is paid for its tokens. Where the validator's `eos_tie_drift` admits such a skip (a bf16
run), the work is accepted but the trainer never sees the tail: the feed carries each sample as the replay drew
it, which is exactly the honest node's sample."""

from __future__ import annotations

import time
from typing import Any

from bench.adversaries import SimNode, narrow_eos_node
from bench.loopback import MANIFEST_V0, RUN
from contracts.pool import WorkStatus
from protocol.envelope import Envelope, open_envelope
from protocol.replay import ReplayGuard
from protocol.rollout import FeedItem


def _post(v: Any, data: bytes) -> str:
    with v.client() as c:
        r = c.post("/v1/submissions", content=data)
        assert r.status_code in (200, 202), r.text
        return str(r.json()["work_key"])


def _narrow_eos_node(v: Any, make_node: Any, published: Any, tiny_model: Any, above: float) -> SimNode:
    """A staked node whose assignment #0 at v1 has an EOS that wins the draw by more than `above` and at most the
    sampling margin (`narrow_eos_node`), once `v` sees it active on chain."""
    key = narrow_eos_node(tiny_model, RUN, 1, above=above, domain=make_node(register=False).domain,
                          manifest_hash=MANIFEST_V0)
    published.operator.register(key, published.admin.params().min_stake)
    deadline = time.monotonic() + 30
    while not v.service.chain.node_active(key.address):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return SimNode(key, tiny_model, make_node(register=False).domain)


def test_a_node_that_skips_every_narrow_eos_is_caught_and_honest_work_passes(make_validator, make_node, published,
                                                                             tiny_model):
    v = make_validator()
    drift = v.service.cfg.checks.eos_tie_drift
    cheater = _narrow_eos_node(v, make_node, published, tiny_model, above=drift)
    sub, data = cheater.build(cheat="skip_eos")
    bad = _post(v, data)
    honest = [make_node() for _ in range(2)]
    good = [_post(v, n.build()[1]) for n in honest]

    row = v.wait_reported(bad)
    assert (row["outcome"], row["reason"]) == ("rejected_hard", "termination"), (row["reason"], row["detail"])
    samples = row["measurements"]["samples"]
    skipped = [s for s in samples if s["eos_skips"]]
    assert skipped and all(drift < m <= 0.5 for s in skipped for _, m in s["eos_near_ties"])
    assert not any(s["sampling_mismatches"] for s in samples)  # every skip was inside the sampling margin
    assert row["measurements"]["units"] < sub.n_tokens()  # nothing after the replay's EOS would be paid
    assert published.admin.get_work(bad).status == WorkStatus.HARD_INVALIDATED
    for k in good:
        ok = v.wait_reported(k)
        assert ok["outcome"] == "accepted", (ok["reason"], ok["detail"])
        assert ok["measurements"]["eos_near_ties"] == 0


def test_a_skip_inside_the_drift_is_accepted_but_the_feed_carries_the_sample_the_replay_drew(
        make_validator, make_node, published, tiny_model):
    v = make_validator(checks={"eos_tie_drift": 0.5})  # the bf16-safe default: every skip within the margin passes
    node = _narrow_eos_node(v, make_node, published, tiny_model, above=0.0)
    honest, _ = node.build(counter=0)  # what this key's assignment #0 is when generated honestly (not sent)
    cheat, data = node.build(counter=0, cheat="skip_eos")
    assert cheat.n_tokens() > honest.n_tokens()  # the skips lengthened it
    row = v.wait_reported(_post(v, data))
    assert row["outcome"] == "accepted", (row["reason"], row["detail"])
    assert sum(len(s["eos_near_ties"]) for s in row["measurements"]["samples"]) > 0
    assert row["measurements"]["units"] < cheat.n_tokens()  # paid up to the replay's EOS

    with v.client() as c:
        (entry,) = c.get("/v1/feed", params={"after": 0}).json()["items"]
    item = open_envelope(Envelope.model_validate_json(entry["envelope"]), domain=v.service.domain,
                         replay_guard=ReplayGuard(":memory:"), expected_signer=v.service.identity.address)
    assert isinstance(item, FeedItem)
    fed = [s for g in item.groups for s in g.samples]
    want = [s for tr in honest.tasks for s in tr.samples]
    sent = [s for tr in cheat.tasks for s in tr.samples]
    assert [s.tokens for s in fed] == [s.tokens for s in want]  # the tail after each skipped EOS is gone
    assert [s.reward for s in fed] == [s.reward for s in want]  # graded as the shorter completion
    for f, w in zip(fed, want, strict=True):
        assert max(abs(a - b) for a, b in zip(f.logprobs, w.logprobs, strict=True)) < 1e-3
    assert sum(f.tokens != s.tokens for f, s in zip(fed, sent, strict=True)) > 0
    assert v.service.core.stats.get("feed_samples_cut_at_replay_eos", 0) == sum(
        f.tokens != s.tokens for f, s in zip(fed, sent, strict=True))
