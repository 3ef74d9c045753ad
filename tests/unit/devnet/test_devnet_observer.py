"""The devnet's observer never blocks on one peer (issue 26 item 3): roles that accept connections and never
answer, or trickle a byte at a time, are shown as down within the observer's timeout, read all at once; so is
a chain endpoint that trickles (web3's per-read timeout never fires), and the next snapshot does not wait on it
either."""

from __future__ import annotations

import signal
import time
from contextlib import ExitStack
from pathlib import Path

import pytest
from netfixtures import ProxyProcess, hung_server

from contracts.deployment import Deployment, PoolSettings
from devnet.network import Layout
from devnet.observer import Observer

pytestmark = pytest.mark.timeout(60)


def test_hung_roles_are_shown_down_not_waited_on(tmp_path: Path) -> None:
    with ExitStack() as stack:
        urls = [stack.enter_context(hung_server(trickle)) for trickle in (None, 0.2, None, 0.2, None)]
        layout = Layout(state_dir=str(tmp_path), model="tiny", run={}, rpc_url=urls[4],
                        deployment=str(tmp_path / "missing.json"), trainer={"metrics_file": str(tmp_path / "m.jsonl")},
                        origin="", relays=[],
                        validators=[{"name": f"validator-{i}", "address": "0x" + "11" * 20, "url": u}
                                    for i, u in enumerate(urls[:2])],
                        nodes=[{"name": f"node-{i}", "address": "0x" + "22" * 20, "url": u}
                               for i, u in enumerate(urls[2:4])])
        observer = Observer(layout, timeout_s=1.0)
        try:
            snap = observer.snapshot()
        finally:
            observer.close()
    assert [n["up"] for n in snap["nodes"]] == [False, False]
    assert [v["up"] for v in snap["validators"]] == [False, False]
    assert snap["chain"]["up"] is False


def test_a_hung_chain_endpoint_is_shown_not_answering_and_never_holds_a_snapshot(tmp_path: Path) -> None:
    deployment = Deployment(chain_id=31337, pool="0x" + "33" * 20, token="0x" + "44" * 20, start_block=0,
                            deployer="0x" + "55" * 20, treasury="0x" + "66" * 20, settings=PoolSettings())
    deployment.save(tmp_path / "deployment.json")
    with hung_server(0.2) as rpc:  # a byte every 0.2 s: a read that never times out on its own
        layout = Layout(state_dir=str(tmp_path), model="tiny", run={}, rpc_url=rpc,
                        deployment=str(tmp_path / "deployment.json"),
                        trainer={"metrics_file": str(tmp_path / "m.jsonl")}, origin="", relays=[], validators=[],
                        nodes=[])
        observer = Observer(layout, timeout_s=1.0)
        try:
            snaps = [observer.snapshot() for _ in range(3)]
        finally:
            observer.close()
    for snap in snaps:
        assert snap["chain"]["up"] is False
        assert "no answer from the chain" in snap["chain"]["error"], snap["chain"]


def test_a_chain_that_stops_answering_keeps_its_last_values_on_show(tmp_path: Path) -> None:
    """A real anvil behind a proxy that is then stopped: past the deadline and after the read's own RPC timeout
    has failed it, the snapshot still shows the policy version and event counts read before, beside the error."""
    from urllib.parse import urlparse

    from contracts.deployment import deploy_pool
    from contracts.devchain import DevChain
    from contracts.transactor import Transactor, connect

    with DevChain.start() as chain:
        admin = chain.account(0)
        deploy_pool(Transactor(connect(chain.rpc_url), admin), treasury=chain.account(1).address,
                    trainers=[chain.account(2).address]).save(tmp_path / "deployment.json")
        proxy = ProxyProcess(int(urlparse(chain.rpc_url).port or 0))
        try:
            layout = Layout(state_dir=str(tmp_path), model="tiny", run={}, rpc_url=proxy.url,
                            deployment=str(tmp_path / "deployment.json"),
                            trainer={"metrics_file": str(tmp_path / "m.jsonl")}, origin="", relays=[],
                            validators=[], nodes=[])
            observer = Observer(layout, timeout_s=0.5, chain_timeout_s=1.0)
            try:
                before = observer.snapshot()["chain"]
                waited = time.monotonic() + 60
                while not before["up"] and time.monotonic() < waited:  # the first read (events from block 0) may
                    before = observer.snapshot()["chain"]  # outlast one 0.5 s snapshot on a busy box: it goes on
                assert before["up"] is True and before["policy_version"] == 0, before
                proxy.signal(signal.SIGSTOP)
                snaps = [observer.snapshot()["chain"]]
                while "no answer from the chain" in snaps[-1]["error"] and len(snaps) < 20:
                    snaps.append(observer.snapshot()["chain"])  # until the read's own RPC timeout has failed it
                snaps.append(observer.snapshot()["chain"])
            finally:
                observer.close()
                proxy.signal(signal.SIGCONT)
        finally:
            proxy.close()
    assert "no answer from the chain" not in snaps[-2]["error"], snaps  # the read itself failed
    for c in snaps:
        assert c["up"] is False and c["policy_version"] == 0 and c["events"] == before["events"], c
