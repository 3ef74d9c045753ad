"""A node whose assigned validator is down sends its work to the next one in rendezvous order, which takes
it only once it cannot reach the first one itself (so no node shops for a validator by claiming one is down)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from chainfixtures import STRANGER, VALIDATOR, Pools
from test_node_join import make_worker, node_config, start_loop

from bench.loopback import RUN, TINY
from node import commands
from node.protection import SlashingProtection
from protocol.canonical import to_hex
from protocol.seeds import validator_ranking

pytestmark = pytest.mark.timeout(300)


def test_work_fails_over_to_the_next_validator_only_when_the_assigned_one_is_down(
        published: Pools, deployment_file: Path, make_validator: Any, tmp_path: Path) -> None:
    a, b = published.chain.account(VALIDATOR).address, published.chain.account(STRANGER).address
    published.admin.grant_role("validator", b)
    node = published.new_node()
    first, second = validator_ranking(RUN.run_id, node.address, 1, [a, b])
    account = {a: VALIDATOR, b: STRANGER}
    both = [a, b]
    assigned = make_validator("first", account=account[first], validators=both)
    backup = make_validator("second", account=account[second], validators=both, peers=[assigned.url],
                            failover_after_s=1.0)
    key = to_hex(published.work_key(RUN.run_id, node.address, 1, 0))

    # while the assigned validator is up, the next one refuses the work (421): no shopping
    cfg = node_config(tmp_path, deployment_file, published.chain.rpc_url, [backup.url], run=RUN, model=TINY)
    chain = commands.open_chain(cfg)
    with httpx.Client(timeout=5) as http, SlashingProtection(tmp_path / "p.sqlite") as db:
        worker = make_worker(cfg, node, chain, db, http, [backup.url])
        # learned from the backup's /v1/info: a snapshot (rebuilt every INFO_REFRESH_S) that names the assigned
        # validator once the backup's peer probe has reached it, so the node may need a few refreshes
        deadline = time.monotonic() + 60
        worker.validators.refresh()
        while worker.validators.url_of(first) is None:
            assert time.monotonic() < deadline, "the backup's /v1/info never named the assigned validator's URL"
            time.sleep(0.2)
            worker.validators.refresh()
        assert worker.validators.url_of(first) == assigned.url
        worker.validators.by_address.pop(first)  # as if the node knew only the backup
        from node.rollouts import build_submission

        sub = build_submission(worker.weights.select().engine, RUN, node.address, 1, 0,
                               worker.weights.select().manifest_hash, chain_id=worker.chain_id, pool=worker.pool)
        answer = worker.submit(sub)
        assert answer["error"] == "not_assigned_here" and answer["assigned_validator"] == first
        assert [r.state for r in db.unfinished(RUN.run_id, node.address)] == ["signed"]

        # the assigned validator dies: the node's resend goes to the backup, which takes it over
        assigned.stop()
        worker.validators.by_address[first] = assigned.url
        failure: list[BaseException] = []

        thread = start_loop(worker, failure)
        row = backup.wait_decided(key, timeout=120)
        assert row["outcome"] == "accepted", row
        thread.join(timeout=120)
        assert not thread.is_alive() and not failure, failure
        # the kept #0 was resent unchanged (not generated again), then one new batch (#1) went the same way
        assert worker.tally.batches == 1 and worker.tally.accepted == 2 and worker.tally.submit_failures >= 1
        assert [db.get(RUN.run_id, node.address, 1, c).state for c in (0, 1)] == ["decided", "decided"]  # type: ignore[union-attr]
    assert backup.wait_reported(key)["outcome"] == "accepted"


def test_work_fails_over_from_a_stopped_validator(
        published: Pools, deployment_file: Path, make_validator: Any, tmp_path: Path) -> None:
    """Issue 26 item 3: the assigned validator is SIGSTOPped (here the process its address is reached through:
    it accepts connections and never answers). The node gives up on it at its submission deadline without
    retrying it, the next validator's peer watch sees it down within its probe deadline, takes the work over
    and accepts it. Before, the node tried the hung validator 6 times x `timeout_s` before failing over."""
    import signal
    from urllib.parse import urlparse

    from netfixtures import ProxyProcess

    a, b = published.chain.account(VALIDATOR).address, published.chain.account(STRANGER).address
    published.admin.grant_role("validator", b)
    node = published.new_node()
    first, second = validator_ranking(RUN.run_id, node.address, 1, [a, b])
    account = {a: VALIDATOR, b: STRANGER}
    assigned = make_validator("first", account=account[first], validators=[a, b])
    proxy = ProxyProcess(int(urlparse(assigned.url).port or 0))
    try:
        backup = make_validator("second", account=account[second], validators=[a, b], peers=[proxy.url],
                                failover_after_s=1.0)
        deadline = time.monotonic() + 60
        while httpx.get(backup.url + "/v1/info", timeout=5).json().get("validator_urls", {}).get(first) != proxy.url:
            assert time.monotonic() < deadline, "the backup never identified its peer"
            time.sleep(0.2)
        key = to_hex(published.work_key(RUN.run_id, node.address, 1, 0))
        cfg = node_config(tmp_path, deployment_file, published.chain.rpc_url, [proxy.url, backup.url], run=RUN,
                          model=TINY, submit={"attempts": 6, "backoff_s": 0.5, "max_backoff_s": 2.0, "timeout_s": 20.0,
                                              "probe_timeout_s": 2.0, "decide_timeout_s": 120})
        chain = commands.open_chain(cfg)
        with httpx.Client(timeout=5) as http, SlashingProtection(tmp_path / "p.sqlite") as db:
            worker = make_worker(cfg, node, chain, db, http, [proxy.url, backup.url])
            worker.validators.refresh()
            assert worker.validators.url_of(first) == proxy.url
            proxy.signal(signal.SIGSTOP)
            failure: list[BaseException] = []

            thread = start_loop(worker, failure)
            row = backup.wait_decided(key, timeout=90)  # the old 6 x 20 s of retries alone would pass this
            assert row["outcome"] == "accepted", row
            thread.join(timeout=120)
            assert not thread.is_alive() and not failure, failure
            assert worker.tally.accepted == 1 and worker.tally.submit_failures >= 1
    finally:
        proxy.signal(signal.SIGCONT)
        proxy.close()


def test_a_hung_validator_is_polled_for_old_verdicts_ever_more_rarely(
        published: Pools, deployment_file: Path, tmp_path: Path) -> None:
    """Issue 39 item 4: after failover, a node asked the hung validator for the verdicts it still owed every
    `max_backoff_s`, each time at the price of a poll timeout (halving the node's rate). Its back-off now doubles
    each time in a row it hangs, the validator that took over is asked every round, and an answer starts the
    back-off over."""
    import time

    import httpx
    from fastapi import FastAPI, Response
    from netfixtures import hung_server, serve_asgi
    from test_node_join import make_worker, node_config

    from bench.loopback import RUN, TINY
    from node import commands
    from node.protection import SlashingProtection
    from node.rollouts import build_submission
    from protocol.identity import Identity

    node = published.new_node()
    stuck, other = Identity.create().address, Identity.create().address
    asked: list[str] = []
    app = FastAPI()

    @app.get("/v1/submissions/{key}")
    def poll(key: str) -> Response:
        asked.append(key)
        return Response('{"error": "unknown"}', status_code=404, media_type="application/json")

    base = 0.2
    with hung_server() as hung, serve_asgi(app) as live:
        cfg = node_config(tmp_path, deployment_file, published.chain.rpc_url, [live], run=RUN, model=TINY,
                          submit={"attempts": 2, "backoff_s": 0.05, "max_backoff_s": base, "probe_timeout_s": 0.3})
        chain = commands.open_chain(cfg)
        with httpx.Client(timeout=10) as http, SlashingProtection(tmp_path / "p.sqlite") as db:
            worker = make_worker(cfg, node, chain, db, http, [live])
            worker.validators.by_address.update({stuck: hung, other: live})
            worker.validators.announced = [stuck, other]
            selected = worker.weights.select()
            sub = build_submission(selected.engine, RUN, node.address, 1, 0, selected.manifest_hash,
                                   chain_id=worker.chain_id, pool=worker.pool)
            assert db.check_and_record(sub)
            db.mark(RUN.run_id, node.address, 1, 0, "submitted")  # sent to the hung one: its verdict is owed
            for hangs in range(1, 7):
                worker._down_until[stuck] = 0.0  # its back-off ran out: it is asked again, and hangs again
                start = time.monotonic()
                worker.poll_pending()
                assert worker._down_until[stuck] >= start + base * 2 ** (hangs - 1)
                assert len(asked) == hangs  # the validator that took over is asked every round
            worker.validators.by_address[stuck] = live  # it answers again
            worker._down_until[stuck] = 0.0
            worker.poll_pending()
            assert worker._down_until.get(stuck, 0.0) < time.monotonic()  # the back-off starts over


def test_a_validator_that_hung_is_probed_before_it_gets_another_submission(
        published: Pools, deployment_file: Path, tmp_path: Path) -> None:
    """Issue 39 (bench.faults hung_validator, 0.375x): a stopped validator cost every node `submit.timeout_s` (30 s)
    for its first submission there, and again for each one after its back-off ended (every 5 s on the devnet). A
    submission's deadline is now `probe_timeout_s` plus its bytes at `min_rate_bytes_s` (at most `timeout_s`), and
    once its back-off ends a validator that hung must answer `/health` within `probe_timeout_s` first: still hung,
    it is marked down again and gets no body."""
    import time
    from collections.abc import Callable

    import httpx
    from fastapi import FastAPI
    from netfixtures import hung_server, serve_asgi
    from test_node_join import make_worker, node_config

    from bench.loopback import RUN, TINY
    from node import commands
    from node.protection import SlashingProtection
    from node.rollouts import build_submission
    from protocol.identity import Identity

    node = published.new_node()
    stuck = Identity.create().address
    heard: list[str] = []

    def wait_until(what: Callable[[], bool]) -> None:
        deadline = time.monotonic() + 30
        while not what():
            assert time.monotonic() < deadline, "not within 30 s"
            time.sleep(0.05)

    def heard_so_far(n: int) -> list[str]:
        deadline = time.monotonic() + 30
        while len(heard) < n and time.monotonic() < deadline:
            time.sleep(0.05)
        return list(heard)

    with hung_server(heard=heard) as hung:
        cfg = node_config(tmp_path, deployment_file, published.chain.rpc_url, [hung], run=RUN, model=TINY,
                          submit={"attempts": 2, "backoff_s": 0.05, "max_backoff_s": 0.2, "timeout_s": 1.0,
                                  "probe_timeout_s": 0.3})
        chain = commands.open_chain(cfg)
        with httpx.Client(timeout=10) as http, SlashingProtection(tmp_path / "p.sqlite") as db:
            worker = make_worker(cfg, node, chain, db, http, [hung])
            worker.validators.by_address.update({stuck: hung})
            worker.validators.announced = [stuck]
            selected = worker.weights.select()

            def submit(counter: int) -> dict[str, object]:
                return worker.submit(build_submission(selected.engine, RUN, node.address, 1, counter,
                                                      selected.manifest_hash, chain_id=worker.chain_id,
                                                      pool=worker.pool))

            assert submit(0) == {}  # hung: kept
            assert heard_so_far(1) == ["POST /v1/submissions"] and worker._strikes[stuck] == 1
            for strikes in (2, 3):
                worker._down_until[stuck] = 0.0  # its back-off ran out
                assert submit(strikes - 1) == {}  # not posted there: kept at once, it is probed on the side
                assert heard_so_far(strikes) == ["POST /v1/submissions"] + ["GET /health"] * (strikes - 1)
                wait_until(lambda n=strikes: worker._strikes.get(stuck) == n)  # marked down again, doubling
            assert worker.tally.submit_failures == 1  # only the one post that hung

            app = FastAPI()

            @app.get("/health")
            def health() -> dict[str, str]:
                return {"status": "ok"}

            with serve_asgi(app) as back:  # it answers again (at its URL: the hung server cannot, so both move)
                worker.validators.by_address[stuck] = worker._down_url[stuck] = back
                worker._down_until[stuck] = 0.0
                assert submit(3) == {}
                wait_until(lambda: stuck not in worker._strikes and not worker._down_until.get(stuck))
            # a submission's own deadline: the probe's plus its bytes at the slowest upload allowed, capped
            assert worker.submit_deadline(50_000) == 0.3 + 50_000 / worker.cfg.submit.min_rate_bytes_s
            assert worker.submit_deadline(10**9) == 1.0
