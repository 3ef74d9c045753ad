"""Assignment (issue 23 items 5, 6, 7) against a real validator and anvil: work is bound to its chain and
pool, a task drawn again is sampled afresh, and counters are taken in order (a node cannot grind them)."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from chainfixtures import ADMIN, BUDGET, OPERATOR, SETTINGS, TOKEN, TRAINER, TREASURY, VALIDATOR, Pools

from bench.adversaries import SimNode
from bench.loopback import MANIFEST_V0, RUN, serve, validator_config
from contracts.deployment import deploy_pool
from contracts.pool import PoolClient
from contracts.transactor import Transactor, connect
from environments import registry
from environments.reverse_text import ReverseText
from environments.task import Task
from protocol.envelope import seal
from protocol.nonce import random_nonce
from protocol.rollout import submission_domain

pytestmark = pytest.mark.timeout(300)


def _post(v, data: bytes) -> tuple[int, dict]:  # type: ignore[no-untyped-def]
    with v.client() as c:
        r = c.post("/v1/submissions", content=data)
        return r.status_code, r.json()


def test_work_accepted_in_one_pool_is_not_paid_again_in_a_second_pool(make_validator, make_node, published,
                                                                      tmp_path: Path) -> None:
    """Item 7: the same run id and weights in a second pool on the same chain; the accepted rollouts resealed
    for it are another assignment there (other tasks, other seeds, another work key): refused, never paid."""
    node: SimNode = make_node()
    first = make_validator()
    sub, data = node.build()
    status, body = _post(first, data)
    assert status == 202, body
    assert first.wait_decided(body["work_key"])["outcome"] == "accepted"

    c = published.chain
    second_pool = deploy_pool(
        Transactor(connect(c.rpc_url), c.account(ADMIN)), treasury=c.account(TREASURY).address, settings=SETTINGS,
        validators=[c.account(VALIDATOR).address], trainers=[c.account(TRAINER).address],
        mint={c.account(OPERATOR).address: 1000 * TOKEN}, fund_rewards=BUDGET)
    pools2 = Pools(c, second_pool, *(PoolClient(connect(c.rpc_url), second_pool.pool, c.account(i))
                                     for i in (ADMIN, VALIDATOR, TRAINER, OPERATOR, OPERATOR, OPERATOR)))
    pools2.trainer.publish_policy(1, MANIFEST_V0)  # the same weights, the same run id
    pools2.operator.register(node.identity, SETTINGS.min_stake)
    other = serve(validator_config(tmp_path / "pool2", second_pool.save(tmp_path / "pool2.json"), c.rpc_url),
                  c.account(VALIDATOR))
    try:
        deadline = time.monotonic() + 30
        while not other.service.chain.node_active(node.identity.address):
            assert time.monotonic() < deadline, "the second pool's validator never saw the node registered"
            time.sleep(0.05)
        domain2 = submission_domain(second_pool.chain_id, second_pool.pool, RUN.run_id)
        resealed = seal(node.identity, sub, domain=domain2, nonce=random_nonce()).to_bytes()
        status, answer = _post(other, resealed)
        assert status in (200, 202), answer
        assert answer["work_key"] != body["work_key"]  # another pool: another assignment
        row = other.wait_decided(answer["work_key"])
        assert (row["outcome"], row["reason"]) == ("rejected_hard", "wrong_task"), row["detail"]
        assert pools2.validator.get_work(bytes.fromhex(answer["work_key"][2:])).units == 0  # never paid there
    finally:
        other.stop()


# -- item 5: a task drawn again is sampled afresh ------------------------------------------------------


class _OneTask(ReverseText):
    """Every draw is the same task: a node meets it again at every counter."""

    name = "test-one-task"

    def _generate(self, rng: random.Random) -> Task:
        return self.task_from("owl bear", "raeb lwo")


ONE_TASK = RUN.model_copy(update={"env": "test-one-task", "tasks_per_batch": 1})


@pytest.fixture
def one_task_env() -> Iterator[None]:
    """`test-one-task` registered for this test only (the registry is process-wide: other tests list it)."""
    registry.register(_OneTask.name, _OneTask.version, _OneTask)
    try:
        yield
    finally:
        registry.unregister(_OneTask.name, _OneTask.version)


def test_a_task_drawn_again_is_sampled_afresh_and_a_cached_answer_is_refused(make_validator, make_node,
                                                                               one_task_env) -> None:
    """Item 5: counters 0 and 1 draw the same task; the honest samples differ (the seed binds the counter), and
    counter 0's samples replayed from a cache as counter 1 fail the sampling replay (before: paid twice)."""
    node: SimNode = make_node()
    node.run = ONE_TASK
    v = make_validator(run=ONE_TASK)
    first, data = node.build(counter=0)
    status, body = _post(v, data)
    assert status == 202, body
    assert v.wait_decided(body["work_key"])["outcome"] == "accepted"
    honest, _ = node.build(counter=1)
    assert honest.tasks[0].task_id == first.tasks[0].task_id
    assert [s.tokens for s in honest.tasks[0].samples] != [s.tokens for s in first.tasks[0].samples]
    cached = first.model_copy(update={"counter": 1})
    status, body = _post(v, node.seal(cached))
    assert status == 202, body
    row = v.wait_decided(body["work_key"])
    assert (row["outcome"], row["reason"]) == ("rejected_hard", "sampling_mismatch"), row["detail"]


# -- item 6: counters in order -------------------------------------------------------------------------


def test_a_node_grinding_counters_gains_nothing(make_validator, make_node, published) -> None:
    """Item 6: a node hashes counters offline and sends the one whose task it likes best: refused (no row,
    the assignment stays free). In order it is paid; a batch held back (it scored badly) blocks every
    counter past the gap at that version, and once the version is stale the skipped counter is counted."""
    node: SimNode = make_node()
    v = make_validator()
    core = v.service.core
    # offline grinding: the counter (past the first two) whose task is the shortest text to reverse
    easiest = min(range(2, 300), key=lambda k: len(core.assignment.tasks(node.identity.address, 1, k)[0].messages[-1].content))
    status, body = _post(v, node.build(counter=easiest)[1])
    assert (status, body["error"], body["expected_counter"]) == (409, "counter_out_of_order", 0), body
    assert v.service.ledger.get("0x" + published.work_key(RUN.run_id, node.identity.address, 1, easiest).hex()) \
        is None

    status, body = _post(v, node.build(counter=0)[1])
    assert status == 202, body
    assert v.wait_decided(body["work_key"])["outcome"] == "accepted"
    _, held_back = node.build(counter=1)  # scored badly: the node keeps it to itself
    status, body = _post(v, node.build(counter=2)[1])  # inside the gap (1): taken
    assert status == 202, body
    status, body = _post(v, node.build(counter=3)[1])  # counter 1 is still missing: nothing further
    assert (status, body["error"], body["expected_counter"]) == (409, "counter_out_of_order", 1), body

    # the version leaves the async window (v3 on chain, async level 1): the hole is counted against the node
    published.trainer.publish_policy(2, MANIFEST_V0)
    published.trainer.publish_policy(3, MANIFEST_V0)
    deadline = time.monotonic() + 60
    with v.client() as c:
        while (holes := c.get("/v1/audit?rows=false").json()["counter_holes"]) != {node.identity.address: 1}:
            assert time.monotonic() < deadline, holes
            time.sleep(0.1)
        assert c.get(f"/v1/nodes/{node.identity.address}").json()["counter_holes"] == 1
    status, body = _post(v, held_back)  # sent late: stale, refused, not paid
    assert status == 410 and (body["outcome"], body["error"]) == ("rejected_soft", "stale_version"), body
    assert core.stats.get("counter_holes") == 1
    assert core.stats.get("refused_counter_out_of_order") == 2


def test_skipping_past_the_hole_budget_is_refused_until_the_holes_leave_the_window(make_validator, make_node,
                                                                                    published) -> None:
    """Issue 35 item 4: a skipped assignment costs something real and stated. Past `flood.max_holes` holes at the
    last `flood.holes_window` versions, every submission of the node is refused (429 `too_many_holes`, no row)
    until those versions leave the window; a node that skipped nothing is taken as before."""
    skipper: SimNode = make_node()
    honest: SimNode = make_node()
    v = make_validator(flood={"max_holes": 0, "holes_window": 4})
    for counter in (0, 2):  # counter 1 skipped (inside the gap, so #2 is taken)
        status, body = _post(v, skipper.build(counter=counter)[1])
        assert status == 202, body
    status, body = _post(v, honest.build(counter=0)[1])
    assert status == 202, body

    published.trainer.publish_policy(2, MANIFEST_V0)
    published.trainer.publish_policy(3, MANIFEST_V0)  # v1 leaves the async window: its hole is counted
    deadline = time.monotonic() + 60
    with v.client() as c:
        while c.get("/v1/audit?rows=false").json()["counter_holes"] != {skipper.identity.address: 1}:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    status, body = _post(v, honest.build(version=3, counter=0)[1])
    assert status == 202, body
    _, data = skipper.build(version=3, counter=0)
    status, body = _post(v, data)
    assert (status, body["error"]) == (429, "too_many_holes"), body
    assert v.service.ledger.get("0x" + published.work_key(RUN.run_id, skipper.identity.address, 3, 0).hex()) is None

    published.trainer.publish_policy(4, MANIFEST_V0)
    published.trainer.publish_policy(5, MANIFEST_V0)  # v1 is older than the last 4 versions: the hole has aged out
    deadline = time.monotonic() + 60
    while v.service.chain.current_version() != 5:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    status, body = _post(v, skipper.build(version=5, counter=0)[1])
    assert status == 202, body
