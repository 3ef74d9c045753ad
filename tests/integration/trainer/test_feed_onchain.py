"""The trainer trains only on work the chain shows accepted by the validator that signed the feed item (issue 35
item 9): feed servers on 127.0.0.1 sealing with validator keys, and the pool on anvil recording, invalidating or
not yet recording each item's work key."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from chainfixtures import ADMIN, VALIDATOR, VALIDATOR2, Pools
from netfixtures import free_port

from contracts.events import REORG_DEPTH, ChainEvent
from contracts.pool import PoolClient
from contracts.transactor import Transactor, connect
from protocol.identity import Identity
from protocol.rollout import FeedItem, submission_domain
from protocol.rollout_files import feed_groups
from tests.unit.trainer.feed_server import RUN_ID, FeedServer, briefly, feed_item
from trainer.config import ValidatorsData
from trainer.recorded_work import RecordedWork
from trainer.source import DataStarvedError, Group
from trainer.validator_feed import ValidatorFeedSource

pytestmark = pytest.mark.timeout(120)

Make = Callable[..., ValidatorFeedSource]


@pytest.fixture
def node(pools: Pools) -> str:
    return pools.new_node().address


@pytest.fixture
def domain(pools: Pools) -> str:
    return submission_domain(pools.deployment.chain_id, pools.deployment.pool, RUN_ID)


@pytest.fixture
def make(pools: Pools) -> Iterator[Make]:
    """A source reading the given servers and checking their items against the pool on anvil."""
    with ExitStack() as stack:
        def build(*servers: FeedServer, rpc_url: str | None = None, **kw: Any) -> ValidatorFeedSource:
            w3 = connect(rpc_url or pools.chain.rpc_url, timeout=5)
            reader = Identity.create()
            chain = RecordedWork(PoolClient(w3, pools.deployment.pool, reader, Transactor(w3, reader, retries=0)),
                                 pools.deployment.start_block)
            opts: dict[str, Any] = {"addresses": [s.address for s in servers], "run_id": RUN_ID,
                                    "poll_interval_s": 0.02, "wait_timeout_s": 60.0, "request_timeout_s": 5.0,
                                    "vocab_size": 64, "chain": chain, **kw}
            src = ValidatorFeedSource([s.url for s in servers], servers[0].domain, **opts)
            stack.callback(src.close)
            return src

        yield build


@pytest.fixture
def serve(pools: Pools, domain: str) -> Iterator[Callable[[int], FeedServer]]:
    """A feed server signing with anvil account `index` (a validator's key) for the pool's run domain."""
    with ExitStack() as stack:
        yield lambda index: stack.enter_context(FeedServer(pools.chain.account(index), domain))


def _groups(*items: FeedItem) -> list[Group]:
    return [g for item in items for g in feed_groups(item)]


def _record(pool: PoolClient, *items: FeedItem) -> None:
    pool.record_work_batch([(item.node, item.work_key, 1) for item in items])


def test_only_work_recorded_by_its_signer_and_not_invalidated_is_trained(
        pools: Pools, node: str, serve: Callable[[int], FeedServer], make: Make) -> None:
    pools.admin.grant_role("validator", pools.chain.account(VALIDATOR2).address)
    v = serve(VALIDATOR)
    good, elsewhere, invalidated = (feed_item(0, c, node=node) for c in (1, 2, 3))
    for item in (good, elsewhere, invalidated):
        v.add(item)
    _record(pools.validator, good, invalidated)
    _record(pools.client(VALIDATOR2), elsewhere)  # the signer vouches for work another validator recorded
    pools.validator.invalidate_soft(node, invalidated.work_key, 1)
    src = make(v)
    batch = src.next_batch(step=0, n_groups=1, async_level=0)
    assert batch.groups == _groups(good)
    assert batch.counts.rejected_files == 2
    assert src.stats["refused_other_validator"] == 1 and src.stats["refused_invalidated"] == 1
    with briefly(src), pytest.raises(DataStarvedError):
        src.next_batch(step=0, n_groups=1, async_level=0)
    assert src.held() == [] and src.cursors() == {v.url: 3}  # refused items are done, never asked again
    # one chain read for the poll that brought the three items; none while nothing waited to be decided
    assert src.chain is not None and src.chain.refreshes == 1


def test_unrecorded_work_waits_for_the_chain_then_trains(
        pools: Pools, node: str, serve: Callable[[int], FeedServer], make: Make) -> None:
    v = serve(VALIDATOR)
    late, recorded = feed_item(0, 1, node=node), feed_item(0, 2, node=node)
    v.add(late)
    v.add(recorded)
    _record(pools.validator, recorded)
    src = make(v)
    assert src.next_batch(step=0, n_groups=1, async_level=0).groups == _groups(recorded)
    assert src.held() == [v.items[0].work_key]
    with briefly(src), pytest.raises(DataStarvedError):  # held: neither trained nor refused
        src.next_batch(step=0, n_groups=1, async_level=0)
    assert src.cursors() == {v.url: 0} and src.stats["held"] == 1
    assert not any(k.startswith("refused") for k in src.stats)
    _record(pools.validator, late)  # the validator's batch lands
    batch = src.next_batch(step=0, n_groups=1, async_level=0)
    assert batch.groups == _groups(late) and batch.counts.rejected_files == 0
    assert src.held() == [] and src.cursors() == {v.url: 2}


def test_work_never_recorded_is_dropped_as_stale_once_out_of_the_window(
        pools: Pools, node: str, serve: Callable[[int], FeedServer], make: Make) -> None:
    v = serve(VALIDATOR)
    never, fresh = feed_item(0, 1, node=node), feed_item(2, 2, node=node)
    v.add(never)
    v.add(fresh)
    _record(pools.validator, fresh)
    src = make(v)
    assert src.next_batch(step=2, n_groups=1, async_level=1).groups == _groups(fresh)
    assert src.held() == [v.items[0].work_key] and src.cursors() == {v.url: 0}
    later = feed_item(2, 3, node=node)
    v.add(later)
    _record(pools.validator, later)
    batch = src.next_batch(step=2, n_groups=1, async_level=1)  # version 0 is out of the window at step 2
    assert batch.groups == _groups(later)
    assert batch.work["stale"] == [v.items[0].work_key] and batch.counts.stale == 4  # one group of 4 samples
    assert batch.counts.rejected_files == 0 and not any(k.startswith("refused") for k in src.stats)
    assert src.held() == [] and src.cursors() == {v.url: 3}


def test_resume_is_exact_across_a_held_item(
        pools: Pools, node: str, serve: Callable[[int], FeedServer], make: Make) -> None:
    v = serve(VALIDATOR)
    held, k2, k3 = (feed_item(0, c, node=node, groups=2) for c in (1, 2, 3))
    for item in (held, k2, k3):
        v.add(item)
    _record(pools.validator, k2, k3)
    first = make(v)
    assert first.next_batch(step=0, n_groups=3, async_level=0).groups == _groups(k2) + _groups(k3)[:1]
    state = json.loads(json.dumps(first.state_dict()))  # what the checkpoint holds
    assert state["validators"][v.url] == {"cursor": 0, "partial": None, "finished": [2], "started": {"3": 1}}
    _record(pools.validator, held)
    resumed = make(v)
    resumed.load_state_dict(state)
    batch = resumed.next_batch(step=0, n_groups=3, async_level=0)  # k3's second group, then the held item
    assert sorted(batch.groups, key=repr) == sorted(_groups(k3)[1:] + _groups(held), key=repr)
    with briefly(resumed), pytest.raises(DataStarvedError):  # nothing trained before the checkpoint is trained again
        resumed.next_batch(step=0, n_groups=1, async_level=0)
    assert resumed.cursors() == {v.url: 3}


def test_a_chain_that_does_not_answer_holds_the_work(
        pools: Pools, node: str, serve: Callable[[int], FeedServer], make: Make) -> None:
    v = serve(VALIDATOR)
    item = feed_item(0, 1, node=node)
    v.add(item)
    _record(pools.validator, item)
    src = make(v, rpc_url=f"http://127.0.0.1:{free_port()}")  # nothing listens there
    with briefly(src), pytest.raises(DataStarvedError):
        src.next_batch(step=0, n_groups=1, async_level=0)
    assert src.held() == [v.items[0].work_key] and src.stats["chain_unavailable"] >= 1
    assert src.cursors() == {v.url: 0} and not any(k.startswith("refused") for k in src.stats)


def test_the_config_connects_the_feed_to_the_chain(pools: Pools, tmp_path: Path) -> None:
    path = pools.deployment.save(tmp_path / "deployment.json")
    base = {"type": "validators", "urls": ["http://127.0.0.1:1"], "accepted": [pools.chain.account(ADMIN).address],
            "chain_id": pools.deployment.chain_id, "run_id": RUN_ID,
            "chain": {"deployment": str(path), "rpc_url": pools.chain.rpc_url}}
    src = ValidatorFeedSource.from_config(ValidatorsData.model_validate({**base, "pool": pools.deployment.pool}))
    try:
        assert src.chain is not None and src.chain.refresh() >= 0 and src.chain.block >= pools.deployment.start_block
    finally:
        src.close()
    from protocol.errors import ConfigError

    with pytest.raises(ConfigError, match="data names pool"):
        ValidatorFeedSource.from_config(ValidatorsData.model_validate({**base, "pool": "0x" + "12" * 20}))


class _ReadLog(PoolClient):
    """The real pool client, noting the block range of every event read."""

    reads: list[tuple[int, int | None]]

    def events(self, from_block: int, to_block: int | None = None, names: set[str] | None = None,
               chunk: int = 5000) -> list[ChainEvent]:
        self.reads.append((from_block, to_block))
        return super().events(from_block, to_block, names, chunk)


def test_the_chain_is_read_incrementally(pools: Pools, node: str) -> None:
    pools.chain.rpc("anvil_mine", [hex(2 * REORG_DEPTH)])  # a chain longer than the depth read again
    w3 = connect(pools.chain.rpc_url)
    pool = _ReadLog(w3, pools.deployment.pool, Identity.create())
    pool.reads = []
    work = RecordedWork(pool, pools.deployment.start_block)
    assert work.refresh() >= 0
    key = pools.work_key(RUN_ID, node, 0, 1)
    assert work.status(key, pools.validator.identity.address).value == "unknown"
    pools.validator.record_work(node, key, 1)
    assert work.refresh() == 1  # the one new event, whatever was read again
    assert work.status(key, pools.validator.identity.address).value == "accepted"
    assert work.status(key, pools.chain.account(VALIDATOR2).address).value == "other_validator"
    assert work.refresh() == 0
    first_to = pool.reads[0][1]
    assert first_to is not None and first_to + 1 - REORG_DEPTH > pools.deployment.start_block
    # from the last block read (less the reorg depth), never again from the deployment block
    assert pool.reads[1][0] == max(pools.deployment.start_block, first_to + 1 - REORG_DEPTH)
    assert pool.reads[2][0] == max(pools.deployment.start_block, first_to + 2 - REORG_DEPTH)
