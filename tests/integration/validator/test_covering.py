"""A validator covering for a down peer, against anvil (issue 35 item 4): it continues a node's counters from what
the pool knows (the chain's frontier for that node and version), never from a first counter the node picks; and
a chain it cannot read meanwhile is its own failure, a retry, never a verdict or a refusal held against the node."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import pytest
from chainfixtures import STRANGER, VALIDATOR, Pools
from netfixtures import ProxyProcess

from bench.adversaries import SimNode
from bench.loopback import RUN, Served, serve, validator_config
from protocol.seeds import validator_ranking

pytestmark = pytest.mark.timeout(300)


def _post(v: Served, data: bytes) -> httpx.Response:
    with v.client() as c:
        return c.post("/v1/submissions", content=data)


def test_a_covering_validator_continues_from_the_chains_frontier_and_a_dead_chain_is_its_own_failure(
        published: Pools, deployment_file: Path, make_validator: Any, make_node: Any, tmp_path: Path) -> None:
    a, b = published.chain.account(VALIDATOR).address, published.chain.account(STRANGER).address
    published.admin.grant_role("validator", b)
    node: SimNode = make_node()
    address = node.identity.address
    first, second = validator_ranking(RUN.run_id, address, 1, [a, b])
    account = {a: VALIDATOR, b: STRANGER}
    assigned = make_validator("first", account=account[first], validators=[a, b])
    chain = ProxyProcess(urlparse(published.chain.rpc_url).port or 0)  # the backup reads the chain through it
    backup = serve(validator_config(tmp_path / "second", deployment_file, chain.url, validators=[a, b],
                                    peers=[assigned.url], failover_after_s=0.5), published.chain.account(account[second]))
    try:
        # the assigned validator took counters 0..2 and reported them (the pool has their work keys), then dies
        published.validator.record_work_batch([(address, published.work_key(RUN.run_id, address, 1, c), 1)
                                               for c in range(3)])
        assigned.stop()
        deadline = time.monotonic() + 60
        while not backup.service.peers.down(first):
            assert time.monotonic() < deadline, backup.service.peers.peers[0].error
            time.sleep(0.1)

        # a hand-picked first counter (one whose tasks the node liked): refused, no row, the frontier is 3
        r = _post(backup, node.build(counter=228)[1])
        assert (r.status_code, r.json()["error"], r.json()["expected_counter"]) == (409, "counter_out_of_order", 3)
        assert backup.service.ledger.get("0x" + published.work_key(RUN.run_id, address, 1, 228).hex()) is None
        r = _post(backup, node.build(counter=3)[1])
        assert r.status_code == 202, r.json()

        # the chain stops answering: the frontier cannot be read, so the next submission is answered with a
        # retry (503 + Retry-After), recorded nowhere and held against no one; its nonce is not spent, so the
        # very same envelope is taken once the chain answers again
        _, data = node.build(counter=4)
        chain.close()
        r = _post(backup, data)
        assert (r.status_code, r.json()["error"]) == (503, "chain_unavailable"), r.json()
        assert int(r.headers["Retry-After"]) >= 1
        key = "0x" + published.work_key(RUN.run_id, address, 1, 4).hex()
        assert backup.service.ledger.get(key) is None
        assert backup.service.ledger.node_summary(address)["refused"] == {"counter_out_of_order": 1}
        chain = ProxyProcess(urlparse(published.chain.rpc_url).port or 0, port=chain.port)
        r = _post(backup, data)
        assert r.status_code == 202 and r.json()["work_key"] == key, r.json()
    finally:
        backup.stop()
        chain.close()
