"""A served validator takes multi-turn episodes (`submission` v2) end to end: intake, the turn-by-turn check
(`validator.episodes`), the verdict, the ledger and the trainer's feed (`feed-item` v3)."""

from __future__ import annotations

import pytest

from bench.adversaries import SimNode
from bench.loopback import RUN
from node.engines import ModelsEngine
from node.episodes import build_episode_submission
from protocol.envelope import Envelope
from protocol.episodes import EpisodeFeedItem, EpisodeSubmission
from protocol.rollout import submission_venue

pytestmark = pytest.mark.timeout(300)

EPISODES = RUN.model_copy(update={"env": "alphabet-sort", "env_version": "1", "max_new_tokens": 12})


def _episodes(node: SimNode, counter: int) -> EpisodeSubmission:
    chain_id, pool = submission_venue(node.domain)
    return build_episode_submission(ModelsEngine(node.loaded), EPISODES, node.identity.address, 1, counter,
                                    node.manifest_hash, chain_id=chain_id, pool=pool)


def test_a_served_validator_accepts_honest_episodes_and_slashes_an_inflated_reward(make_validator, make_node):
    node = make_node()
    node.run = EPISODES
    v = make_validator(run=EPISODES)
    honest = _episodes(node, 0)
    cheat = _episodes(node, 1)
    s = cheat.tasks[0].samples[0]
    bad = s.model_copy(update={"reward": 1.0 if s.reward < 0.5 else 0.0})
    cheat = cheat.model_copy(update={"tasks": (cheat.tasks[0].model_copy(update={"samples": (
        bad, *cheat.tasks[0].samples[1:])}), *cheat.tasks[1:])})
    with v.client() as c:
        r = c.post("/v1/submissions", content=node.seal(honest))  # type: ignore[arg-type]
        assert r.status_code == 202, r.text
        row = v.wait_decided(r.json()["work_key"])
        assert row["outcome"] == "accepted", row
        r2 = c.post("/v1/submissions", content=node.seal(cheat))  # type: ignore[arg-type]
        assert r2.status_code == 202, r2.text
        row2 = v.wait_decided(r2.json()["work_key"])
        assert (row2["outcome"], row2["reason"]) == ("rejected_hard", "reward_mismatch"), row2
        feed = c.get("/v1/feed", params={"after": 0}).json()
    items = [Envelope.from_bytes(i["envelope"].encode(), max_bytes=1 << 24) for i in feed["items"]]
    assert [(e.kind, e.version) for e in items] == [("feed-item", 3)]
    body = EpisodeFeedItem.model_validate(items[0].body)
    assert body.policy_version == 1 and len(body.groups) == EPISODES.tasks_per_batch
    assert all(not all(s.loss_mask()) for g in body.groups for s in g.samples)  # holes at environment spans


def test_episodes_for_a_single_turn_run_are_schema(make_validator, make_node):
    # version 2 naming the run's own single-turn environment and its assigned tasks: refused by its version
    from environments import get as get_environment
    from protocol.seeds import task_seed

    node = make_node()
    v = make_validator()  # RUN: reverse-text, single-turn
    sub = _episodes(node, 0)
    chain_id, pool = submission_venue(node.domain)
    assigned = get_environment(RUN.env, RUN.env_version).sample(
        task_seed(node.identity.address, 1, 0, run_id=RUN.run_id, chain_id=chain_id, pool=pool,
                  manifest_hash=node.manifest_hash), RUN.tasks_per_batch)
    sub = sub.model_copy(update={"env": RUN.env, "env_version": RUN.env_version, "tasks": tuple(
        tr.model_copy(update={"task_id": t.task_id}) for tr, t in zip(sub.tasks, assigned, strict=True))})
    with v.client() as c:
        r = c.post("/v1/submissions", content=node.seal(sub))  # type: ignore[arg-type]
    assert r.status_code in (200, 202), r.text
    row = v.wait_decided(r.json()["work_key"])
    assert (row["outcome"], row["reason"]) == ("rejected_hard", "schema"), row
    assert "version 2" in row["detail"]


def test_accepted_episodes_are_written_as_rollout_files(make_validator, make_node, tmp_path):
    # the validator's feed directory (a trainer reading files) gets accepted episodes too, holes in the loss mask
    # at environment spans (version 3 items were skipped as an older validator's before)
    import time

    from protocol.rollout_files import read_rollouts

    node = make_node()
    node.run = EPISODES
    feed_dir = tmp_path / "feed"
    v = make_validator(run=EPISODES, feed_dir=feed_dir)
    with v.client() as c:
        r = c.post("/v1/submissions", content=node.seal(_episodes(node, 0)))  # type: ignore[arg-type]
        assert r.status_code == 202, r.text
        assert v.wait_decided(r.json()["work_key"])["outcome"] == "accepted"
    deadline = time.monotonic() + 60
    while not (files := sorted(feed_dir.glob("*.parquet"))):
        assert time.monotonic() < deadline, "no rollout file for the accepted episodes"
        time.sleep(0.1)
    rows = read_rollouts(files[0])
    assert len(rows) == EPISODES.tasks_per_batch * EPISODES.samples_per_task
    for s in rows:  # model spans, then an environment span (a hole), then model spans again
        first = s.loss_mask.index(True)
        assert s.policy_version == 1 and not all(s.loss_mask[first:]) and any(s.loss_mask[first:])
