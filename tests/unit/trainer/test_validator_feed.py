"""`data.type = "validators"`: signed feed items from real HTTP servers become groups, checked,
de-duplicated, windowed, bounded, and resumed exactly."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import pytest

from protocol.canonical import to_hex
from protocol.identity import Identity
from protocol.rollout import FeedGroup, FeedItem, FeedSample, submission_domain
from protocol.rollout_files import feed_groups
from tests.unit.trainer.feed_server import (
    DOMAIN,
    POOL,
    RUN_ID,
    FeedServer,
    Listed,
    briefly,
    feed_item,
    oversize_declared,
    oversize_streamed,
    raw,
)
from trainer.config import TrainerConfig, ValidatorsData, load_config
from trainer.source import DataStarvedError, Group
from trainer.validator_feed import ValidatorFeedSource

pytestmark = pytest.mark.timeout(60)

Serve = Callable[..., FeedServer]
Make = Callable[..., ValidatorFeedSource]


@pytest.fixture
def serve() -> Iterator[Serve]:
    with ExitStack() as stack:
        yield lambda **kw: stack.enter_context(FeedServer(**kw))


@pytest.fixture
def make() -> Iterator[Make]:
    """A source reading the given servers (each with its own expected signer), quick to give up."""
    with ExitStack() as stack:
        def build(*servers: FeedServer, **kw: Any) -> ValidatorFeedSource:
            opts: dict[str, Any] = {"addresses": [s.address for s in servers], "run_id": RUN_ID,
                                    "poll_interval_s": 0.02, "wait_timeout_s": 60.0, "request_timeout_s": 5.0,
                                    "vocab_size": 64, **kw}
            if "accepted" in kw:
                del opts["addresses"]
            src = ValidatorFeedSource([s.url for s in servers], DOMAIN, **opts)
            stack.callback(src.close)
            return src

        yield build


def _groups(*items: FeedItem) -> list[Group]:
    return [g for item in items for g in feed_groups(item)]


def test_feed_items_become_groups(serve: Serve, make: Make) -> None:
    v = serve()
    items = [feed_item(0, c, groups=2) for c in range(3)]
    for item in items:
        v.add(item)
    src = make(v)
    batch = src.next_batch(step=0, n_groups=6, async_level=1)
    assert batch.groups == _groups(*items)
    assert batch.counts.accepted == 24 and batch.counts.rejected_files == 0
    first = batch.groups[0][0]  # prompt from the validator, then the completion as a loss span
    assert first.tokens == items[0].groups[0].prompt_tokens + items[0].groups[0].samples[0].tokens
    assert first.loss_mask == (False,) * 4 + (True,) * len(items[0].groups[0].samples[0].tokens)
    assert first.policy_version == 0 and first.reward == items[0].groups[0].samples[0].reward
    with briefly(src), pytest.raises(DataStarvedError):
        src.next_batch(step=0, n_groups=1, async_level=1)
    late = feed_item(0, 9)
    v.add(late)  # the feed grows; the source picks up where it stopped
    assert src.next_batch(step=0, n_groups=1, async_level=1).groups == _groups(late)
    assert [after for after, _ in v.requests][:1] == [0]
    assert src.stats["items"] == 4


def test_the_same_work_from_two_validators_is_trained_once(serve: Serve, make: Make) -> None:
    a, b = serve(), serve()
    shared = [feed_item(0, c) for c in range(3)]
    for item in [*shared, feed_item(0, 10)]:
        a.add(item)
    for item in [feed_item(0, 11), *shared]:
        b.add(item)  # the same work keys, sealed by another validator
    src = make(a, b)
    batch = src.next_batch(step=0, n_groups=5, async_level=0)
    keys = {g[0].group_id for g in batch.groups}
    assert len(keys) == 5
    assert sorted(batch.groups, key=lambda g: g[0].group_id) == sorted(
        _groups(*shared, feed_item(0, 10), feed_item(0, 11)), key=lambda g: g[0].group_id)
    assert src.stats["duplicates"] == 3
    with briefly(src), pytest.raises(DataStarvedError):
        src.next_batch(step=0, n_groups=1, async_level=0)


def test_forged_and_malformed_items_are_refused_and_counted_good_ones_flow(serve: Serve, make: Make) -> None:
    v, stranger = serve(), Identity.create()
    good = [feed_item(0, 1), feed_item(0, 99)]
    v.add(good[0])
    v.add(feed_item(0, 2), envelope=v.seal(feed_item(0, 2), signer=stranger))  # not this validator's key
    v.add_tampered(feed_item(0, 3))  # body changed after signing
    v.add(feed_item(0, 4), envelope=v.seal(feed_item(0, 4), domain=submission_domain(1, POOL, RUN_ID)))
    v.add(feed_item(0, 5), work_key="0x" + "00" * 32)  # the listing names other work than was signed
    v.add(feed_item(0, 6).model_copy(update={"run_id": "another-run"}))
    bad_logprob = FeedGroup(task_id="0" * 32, prompt_tokens=(5, 6), samples=(
        FeedSample(tokens=(7, 8), logprobs=(-1.0, 0.5), reward=1.0),))
    v.add(feed_item(0, 7).model_copy(update={"groups": (bad_logprob,)}))
    out_of_vocab = FeedGroup(task_id="0" * 32, prompt_tokens=(5, 6), samples=(
        FeedSample(tokens=(7, 640), logprobs=(-1.0, -0.5), reward=1.0),))
    v.add(feed_item(0, 8).model_copy(update={"groups": (out_of_vocab,)}))
    v.add(feed_item(0, 9), envelope="not an envelope")
    v.add(good[1])
    src = make(v)
    batch = src.next_batch(step=0, n_groups=2, async_level=0)
    assert batch.groups == _groups(*good)
    assert batch.counts.rejected_files == 8
    refused = {k: n for k, n in src.stats.items() if k.startswith("refused_")}
    assert refused == {"refused_bad_signature": 2, "refused_wrong_domain": 1, "refused_bad_feed": 2,
                       "refused_bad_rollout": 2, "refused_protocol": 1}
    assert src.state_dict()["validators"][v.url]["cursor"] == 10  # refused items are done, never asked again
    assert src.state_dict()["seen"].keys() == {to_hex(g.work_key) for g in good}


def test_accepted_validators_from_any_url(serve: Serve, make: Make) -> None:
    a, b, stranger = serve(), serve(), Identity.create()
    a.add(feed_item(0, 1))
    a.add(feed_item(0, 2), envelope=a.seal(feed_item(0, 2), signer=stranger))
    b.add(feed_item(0, 3), envelope=b.seal(feed_item(0, 3), signer=a.identity))  # a's item, relayed by b
    src = make(a, b, accepted=[a.address, b.address.lower()])
    batch = src.next_batch(step=0, n_groups=2, async_level=0)
    # validators are read concurrently: their groups come in whichever order their answers arrive
    assert sorted(batch.groups, key=lambda g: g[0].group_id) == sorted(_groups(feed_item(0, 1), feed_item(0, 3)),
                                                                       key=lambda g: g[0].group_id)
    assert src.stats["refused_bad_signature"] == 1


def _unordered_page(v: FeedServer) -> bytes:
    items = [feed_item(0, 20), feed_item(0, 21)]
    listed = [Listed(2, to_hex(items[0].work_key), v.seal(items[0])), Listed(1, to_hex(items[1].work_key),
                                                                             v.seal(items[1]))]
    return json.dumps(v.page(0, listed)).encode()  # signed as served: refused for the order alone


def _long_page(v: FeedServer) -> bytes:
    items = [feed_item(0, 30 + i) for i in range(3)]
    return json.dumps(v.page(0, [Listed(i + 1, to_hex(it.work_key), v.seal(it)) for i, it in enumerate(items)])).encode()


@pytest.mark.parametrize("bad", [
    "declared-oversize", "streamed-oversize", "not-json", "wrong-shape", "unordered", "too-many", "http-500",
])
def test_a_refused_response_is_counted_and_the_feed_goes_on(serve: Serve, make: Make, bad: str) -> None:
    v = serve()
    handler = {
        "declared-oversize": lambda: oversize_declared,
        "streamed-oversize": lambda: oversize_streamed,
        "not-json": lambda: raw(b"<html>proxy error</html>"),
        "wrong-shape": lambda: raw(b'{"validator": "x", "domain": "y", "items": 5, "next": 0}'),
        "unordered": lambda: raw(_unordered_page(v)),
        "too-many": lambda: raw(_long_page(v)),
        "http-500": lambda: raw(b"{}", status=500),
    }[bad]()
    v.once.append(handler)
    good = feed_item(0, 1)
    v.add(good)
    src = make(v, max_response_bytes=16 * 1024, page_items=2)
    batch = src.next_batch(step=0, n_groups=1, async_level=0)
    assert batch.groups == _groups(good)  # nothing of the bad response was trained on
    if bad == "http-500":  # not the validator's data: polled again, not counted as refused
        assert batch.counts.rejected_files == 0 and src.stats["unavailable"] == 1
    else:
        assert batch.counts.rejected_files == 1 and src.stats["refused_pages"] == 1
    assert v.requests[1][0] == 0  # the refused page moved no cursor
    if "oversize" in bad:
        assert v.requests[1][1] == 1  # asks for fewer items after a page that was too large


FAR = 2**62


@pytest.mark.parametrize("forgery", ["unsigned", "other-key", "moved-entry", "extra-entry", "other-after"])
def test_a_forged_listing_cannot_push_the_cursor_past_real_work(serve: Serve, make: Make, forgery: str) -> None:
    """Issue 23 item 11: whoever answers in the validator's place lists a genuine item far ahead (or adds an
    entry there); a cursor that followed it would skip every real item for good. The page is refused whole,
    the cursor stays, and the real items are trained."""
    v = serve()
    items = [feed_item(0, c) for c in range(1, 4)]
    for item in items:
        v.add(item)
    first = v.items[0]
    far = Listed(FAR, first.work_key, first.envelope)  # a genuine, validator-signed item listed at seq 2**62
    page = {
        "unsigned": lambda: {k: x for k, x in v.page(0, [far]).items() if k != "listing"},  # the old page shape
        "other-key": lambda: v.page(0, [far], signer=Identity.create()),
        "moved-entry": lambda: v.page(0, [far], signed=[first]),  # the validator's real listing, seq edited
        "extra-entry": lambda: v.page(0, [*v.items, far], signed=list(v.items)),
        "other-after": lambda: v.page(2, [v.items[2]]),  # a genuine page for after=2, served for after=0
    }[forgery]()
    v.once.append(raw(json.dumps(page).encode()))
    src = make(v)
    batch = src.next_batch(step=0, n_groups=3, async_level=0)
    assert batch.groups == _groups(*items)
    assert src.stats["refused_pages"] == 1 and batch.counts.rejected_files == 1
    assert [after for after, _ in v.requests[:2]] == [0, 0]  # the forged page moved nothing
    assert src.cursors() == {v.url: 3}


@pytest.mark.parametrize("replay", ["older", "the-last-one"])
def test_a_replayed_listing_is_refused_and_the_newer_work_still_flows(serve: Serve, make: Make, replay: str) -> None:
    """Whoever sits between trainer and validator keeps a genuine signed page (here: an empty one) and serves it
    again once the validator has newer work: that page is refused whole, so it cannot starve the trainer."""
    v = serve()
    old = v.page(0, [])  # genuine, signed before any page the source verifies below
    time.sleep(0.01)  # so the pages signed from here on carry a later timestamp
    src = make(v)
    with briefly(src), pytest.raises(DataStarvedError):
        src.next_batch(step=0, n_groups=1, async_level=0)  # verifies the validator's (empty) pages
    last = json.loads(v.served[-1]) if replay == "the-last-one" else old
    item = feed_item(0, 1)
    v.add(item)
    v.once.append(raw(json.dumps(last).encode()))
    assert src.next_batch(step=0, n_groups=1, async_level=0).groups == _groups(item)
    assert src.stats["refused_pages"] == 1 and src.cursors() == {v.url: 1}


def test_accepted_validators_pin_the_lister_of_each_url(serve: Serve, make: Make) -> None:
    """Without an address per URL, any accepted validator's listing verifies at first; from then on the URL's
    seqs are that validator's alone, so another accepted key cannot sign positions for it."""
    a, b = serve(), serve()
    a.add(feed_item(0, 1))
    src = make(a, accepted=[a.address, b.address])
    assert src.next_batch(0, 1, 0).groups == _groups(feed_item(0, 1))
    a.add(feed_item(0, 2))
    a.once.append(raw(json.dumps(a.page(1, [Listed(FAR, a.items[1].work_key, a.items[1].envelope)],
                                        signer=b.identity)).encode()))
    assert src.next_batch(0, 1, 0).groups == _groups(feed_item(0, 2))
    assert src.stats["refused_pages"] == 1 and src.cursors() == {a.url: 2}


def test_an_oversized_page_halves_the_request_until_it_fits(serve: Serve, make: Make) -> None:
    v = serve()
    items = [feed_item(0, c, groups=2, size=6) for c in range(8)]
    for item in items:
        v.add(item)
    one = len(v.items[0].envelope)
    src = make(v, max_response_bytes=3 * one, page_items=8)
    batch = src.next_batch(step=0, n_groups=16, async_level=0)
    assert batch.groups == _groups(*items)
    assert [limit for _, limit in v.requests][:3] == [8, 4, 2]
    assert batch.counts.rejected_files == 2


def test_an_unreachable_validator_is_skipped_and_polled_again(serve: Serve, make: Make) -> None:
    unreachable = socket.socket()  # bound, never listening, for the whole test: refused, and nobody can take it
    unreachable.bind(("127.0.0.1", 0))
    port = unreachable.getsockname()[1]
    v = serve()
    v.add(feed_item(0, 1))
    down = ValidatorFeedSource([f"http://127.0.0.1:{port}", v.url], DOMAIN,
                               addresses=[Identity.create().address, v.address], poll_interval_s=0.02,
                               wait_timeout_s=1.0, request_timeout_s=2.0)
    try:
        assert down.next_batch(0, 1, 0).groups == _groups(feed_item(0, 1))
        assert down.stats["unavailable"] >= 1
        with pytest.raises(DataStarvedError, match="0/1 fresh groups"):
            down.next_batch(0, 1, 0)
        assert down.stats["unavailable"] >= 2  # polled again while waiting
    finally:
        down.close()
        unreachable.close()


def test_identical_groups_under_other_work_keys_are_trained_once(serve: Serve, make: Make) -> None:
    """Issue 23 item 5: a node that replays cached samples for a repeated task makes a group identical to one
    already trained under another work key: it is dropped, listed as `duplicate` in the step's work (the
    trainer's work ledger), and still recognised after a resume."""
    v = serve()
    first = feed_item(0, 0, seed=1)
    replayed = feed_item(0, 1, seed=1)  # the same groups, another assignment
    assert replayed.work_key != first.work_key and replayed.groups == first.groups
    g = first.groups[0]
    shuffled = feed_item(0, 2).model_copy(update={"groups": (g.model_copy(update={"samples": g.samples[::-1]}),)})
    fresh = feed_item(0, 3)
    for item in (first, replayed, shuffled, fresh):
        v.add(item)
    src = make(v)
    batch = src.next_batch(step=0, n_groups=2, async_level=1)
    assert batch.groups == _groups(first, fresh)
    assert batch.work["trained"] == [to_hex(first.work_key), to_hex(fresh.work_key)]
    assert batch.work["duplicate"] == [to_hex(replayed.work_key), to_hex(shuffled.work_key)]
    assert batch.counts.accepted == 8 and batch.counts.stale == batch.counts.future == 0
    assert src.stats["duplicate_groups"] == 2
    state = json.loads(json.dumps(src.state_dict()))
    v.add(feed_item(0, 4, seed=1))
    resumed = make(v)
    resumed.load_state_dict(state)
    later = feed_item(0, 5)
    v.add(later)
    batch = resumed.next_batch(step=0, n_groups=1, async_level=1)
    assert batch.groups == _groups(later) and batch.work["duplicate"] == [to_hex(feed_item(0, 4, seed=1).work_key)]


def test_stale_and_future_items_are_dropped_and_counted(serve: Serve, make: Make) -> None:
    v = serve()
    for version in (0, 7, 3, 4, 5):
        v.add(feed_item(version, version))
    batch = make(v).next_batch(step=5, n_groups=2, async_level=1)
    assert [g[0].policy_version for g in batch.groups] == [4, 5]
    assert batch.counts.stale == 8 and batch.counts.future == 4 and batch.counts.accepted == 8


def test_resume_fetches_exactly_what_was_not_consumed(serve: Serve, make: Make) -> None:
    a, b = serve(), serve()
    k1, k2, k3 = feed_item(0, 1, groups=2), feed_item(0, 2, groups=2), feed_item(0, 3, groups=2)
    a.add(k1)
    a.add(k2)
    b.add(k2)  # a duplicate: taken from a
    b.add(k3)
    first = make(a, b)
    step0 = first.next_batch(0, 3, 0)  # k1's two groups and the first of k2's
    assert step0.groups == _groups(k1) + _groups(k2)[:1]
    state = json.loads(json.dumps(first.state_dict()))  # what the checkpoint holds
    assert state["validators"] == {a.url: {"cursor": 1, "partial": [2, 1]}, b.url: {"cursor": 1, "partial": None}}
    step1 = first.next_batch(0, 3, 0)
    assert step1.groups == _groups(k2)[1:] + _groups(k3)

    n_requests = len(a.requests), len(b.requests)
    resumed = make(a, b)
    resumed.load_state_dict(state)
    assert resumed.next_batch(0, 3, 0).groups == step1.groups
    assert a.requests[n_requests[0]][0] == 1 and b.requests[n_requests[1]][0] == 1  # from the cursors
    assert resumed.stats["duplicates"] == 0  # b's copy of k2 was behind b's cursor: not even fetched again
    with briefly(resumed), pytest.raises(DataStarvedError):
        resumed.next_batch(0, 1, 0)


def test_a_step_that_starves_consumes_nothing(serve: Serve, make: Make) -> None:
    v = serve()
    item = feed_item(0, 1, groups=2)
    v.add(item)
    src = make(v, wait_timeout_s=0.3)
    before = src.state_dict()
    with pytest.raises(DataStarvedError):
        src.next_batch(0, 3, 0)
    assert src.state_dict()["validators"] == before["validators"]
    assert src.next_batch(0, 2, 0).groups == _groups(item)


def test_work_keys_are_forgotten_once_outside_the_window(serve: Serve, make: Make) -> None:
    a, b = serve(), serve()
    old = feed_item(0, 1)
    a.add(old)
    src = make(a, b)
    assert src.next_batch(0, 1, 1).groups == _groups(old)
    a.add(feed_item(5, 2))
    src.next_batch(5, 1, 1)
    assert list(src.state_dict()["seen"]) == [to_hex(feed_item(5, 2).work_key)]  # version 0 < 5 - 1: forgotten
    b.add(old)  # a late copy of trained work: no longer a known key, but stale, so never trained again
    b.add(feed_item(5, 3))
    batch = src.next_batch(5, 1, 1)
    assert batch.groups == _groups(feed_item(5, 3))
    assert batch.counts.stale == 4


def test_config_gives_the_domain_directly_or_from_chain_pool_and_run() -> None:
    addr = Identity.create().address
    cfg = TrainerConfig.model_validate({"data": {
        "type": "validators", "urls": ["http://127.0.0.1:8700"], "addresses": [addr],
        "chain_id": 31337, "pool": POOL, "run_id": RUN_ID}})
    assert isinstance(cfg.data, ValidatorsData)
    assert cfg.data.envelope_domain() == DOMAIN
    direct = ValidatorsData(urls=["http://v1:8700", "http://v2:8700"], accepted=[addr], domain=DOMAIN)
    assert direct.envelope_domain() == DOMAIN and direct.run_id is None
    src = ValidatorFeedSource.from_config(direct)
    try:
        assert [f.url for f in src.feeds] == ["http://v1:8700", "http://v2:8700"]
    finally:
        src.close()
    flags = load_config(["--data.type", "validators", "--data.urls", '["http://127.0.0.1:8700"]',
                         "--data.accepted", f'["{addr}"]', "--data.domain", DOMAIN])
    assert isinstance(flags.data, ValidatorsData) and flags.data.accepted == [addr]


@pytest.mark.parametrize("bad, why", [
    ({"addresses": []}, "exactly one"),
    ({"accepted": ["0x" + "11" * 20]}, "exactly one"),
    ({"addresses": ["0x" + "11" * 20] * 2}, "2 given for 1 urls"),
    ({"addresses": ["0x1234"]}, "not a 0x-prefixed 20-byte address"),
    ({"urls": ["ftp://x"]}, "not an http"),
    ({"urls": ["http://a:1", "http://a:1/"], "addresses": ["0x" + "11" * 20] * 2}, "listed twice"),
    ({"domain": None}, "give `domain`"),
    ({"chain_id": 1}, "not both"),
])
def test_config_refuses_an_ambiguous_feed_setup(bad: dict[str, Any], why: str) -> None:
    data = {"type": "validators", "urls": ["http://127.0.0.1:8700"], "addresses": ["0x" + "11" * 20],
            "domain": DOMAIN, **bad}
    with pytest.raises(ValueError, match=why):
        TrainerConfig.model_validate({"data": data})


@pytest.mark.parametrize("trickle_s", [None, 0.5])
def test_a_hung_validator_does_not_hold_up_the_others(serve: Serve, trickle_s: float | None) -> None:
    """Issue 26 item 3: one validator accepts and never answers (or a byte every half second); the other's
    groups are trained at once, not after the hung one's request timeout (300 s, past this test's limit)."""
    from tests.netfixtures import hung_server

    v = serve()
    v.add(feed_item(0, 1))
    with hung_server(trickle_s) as hung:
        src = ValidatorFeedSource([hung, v.url], DOMAIN, addresses=[Identity.create().address, v.address],
                                  poll_interval_s=0.02, wait_timeout_s=20.0, request_timeout_s=300.0)
        try:
            assert src.next_batch(0, 1, 0).groups == _groups(feed_item(0, 1))
            v.add(feed_item(0, 2))
            assert src.next_batch(0, 1, 0).groups == _groups(feed_item(0, 2))
            assert src.cursors()[v.url] == 2 and src.cursors()[hung] == 0
        finally:
            src.close()


@pytest.mark.timeout(60)
def test_a_validator_trickling_its_headers_is_given_up_at_the_request_timeout(serve: Serve) -> None:
    """The status line and headers a byte every 1.5 s, inside every per-read timeout: a plain client would wait
    ~80 s for them before it could check the deadline; the feed reader gives up at `request_timeout_s`."""
    from tests.netfixtures import hung_server

    v = serve()
    with hung_server(1.5) as hung:
        src = ValidatorFeedSource([hung, v.url], DOMAIN, addresses=[Identity.create().address, v.address],
                                  poll_interval_s=0.02, wait_timeout_s=0.5, request_timeout_s=2.0)
        try:
            deadline = time.monotonic() + 15
            while not src.stats["unavailable"]:
                assert time.monotonic() < deadline, "the trickling validator still holds its request"
                with pytest.raises(DataStarvedError):
                    src.next_batch(0, 1, 0)
        finally:
            src.close()


def test_a_step_trains_on_what_arrived_after_the_fill_timeout(serve: Serve, make: Make) -> None:
    """Issue 26 item 2: a node that died leaves its share of a step missing; after `fill_timeout_s` the step
    trains on the fresh groups it has (at least `min_groups`), still dropping stale ones; below the minimum
    it keeps waiting and then starves as before."""
    v = serve()
    v.add(feed_item(0, 1))
    v.add(feed_item(2, 2, groups=2))
    src = make(v, wait_timeout_s=2.0)
    with pytest.raises(DataStarvedError):  # no bound on the wait: the missing groups are waited for
        src.next_batch(step=2, n_groups=4, async_level=1)
    batch = src.next_batch(step=2, n_groups=4, async_level=1, min_groups=2, fill_timeout_s=0.1)
    assert batch.groups == _groups(feed_item(2, 2, groups=2))
    assert batch.counts.stale == len(_groups(feed_item(0, 1))[0])  # v0 is outside step 2's window
    v.add(feed_item(2, 3))
    with pytest.raises(DataStarvedError):  # one fresh group, the minimum is two
        src.next_batch(step=2, n_groups=4, async_level=1, min_groups=2, fill_timeout_s=0.1)
