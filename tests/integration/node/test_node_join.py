"""prime-node against a real anvil pool and a real validator on 127.0.0.1 with the tiny model."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from chainfixtures import OPERATOR, SETTINGS, Pools
from netfixtures import forward_info

from bench.loopback import RUN, TINY
from contracts.pool import NodeStatus, WorkStatus
from node import commands
from node.cli import main
from node.config import NodeConfig
from node.errors import DoubleSignError
from node.protection import SlashingProtection
from protocol.canonical import to_hex

pytestmark = pytest.mark.timeout(300)
PASSWORD = "correct horse"


def node_config(tmp_path: Path, deployment_file: Path, rpc_url: str, validators: list[str], **extra: Any) -> NodeConfig:
    values: dict[str, Any] = {
        "state_dir": tmp_path / "node", "validators": validators, "max_batches": 1,
        "key": {"keystore": tmp_path / "node-key.json", "scrypt_n": 2**4},
        "operator": {"key_env": "TEST_OPERATOR_KEY"},
        "chain": {"deployment": deployment_file, "rpc_url": rpc_url, "poll_s": 0.2},
        "submit": {"attempts": 2, "backoff_s": 0.05, "max_backoff_s": 0.2, "decide_timeout_s": 120},
        "monitor": {"port": 0},
    }
    values.update(extra)
    return NodeConfig.model_validate(values)


def make_worker(cfg: NodeConfig, node: Any, chain: commands.Chain, db: Any, http: Any, urls: list[str], *,
                run: Any = RUN, model: Any = TINY) -> Any:
    """A node's work loop on the base (static) weights, talking to `urls`."""
    from contracts.policy import PolicyHistory
    from node.engines import build_engine
    from node.weights import PolicyWeights
    from node.worker import ValidatorDirectory, Worker
    from protocol.config import StaticWeights

    weights = PolicyWeights(StaticWeights(), model, run, PolicyHistory(chain.client(node), chain.start_block),
                            lambda spec: build_engine(cfg.engine, spec), cfg.state_dir / "weights")
    return Worker(cfg, node, run, commands.submission_domain(chain.chain_id, chain.pool, run.run_id), weights, db,
                  ValidatorDirectory(list(urls), http, commands.validator_role(chain.client(node))),
                  is_active=lambda: bool(chain.client(node).is_active(node.address)))


def start_loop(worker: Any, failures: list[BaseException]) -> threading.Thread:
    """The node's work loop in a daemon thread, started; whatever it raises is appended to `failures`."""

    def run() -> None:
        try:
            worker.run_loop()
        except BaseException as exc:  # noqa: BLE001 - recorded for the test's assertions
            failures.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def operator_env(published: Pools, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("PRIME_KEYSTORE_PASSWORD", PASSWORD)
    monkeypatch.setenv("TEST_OPERATOR_KEY", published.chain.account(OPERATOR).account.key.hex())
    return published.chain.account(OPERATOR).address


def test_join_stakes_registers_works_and_is_recorded_on_chain(
        published: Pools, deployment_file: Path, make_validator: Any, operator_env: str, tmp_path: Path) -> None:
    served = make_validator()
    cfg = node_config(tmp_path, deployment_file, published.chain.rpc_url, [served.url])
    token = published.token()
    before = token.balance_of(operator_env)

    assert commands.join(cfg) == 0

    node = commands.node_key(cfg)  # created by join, opened again with the same password
    info = published.admin.get_node(node.address)
    assert info.status is NodeStatus.ACTIVE and info.operator == operator_env and info.stake == SETTINGS.min_stake
    assert token.balance_of(operator_env) == before - SETTINGS.min_stake
    key = to_hex(published.work_key(RUN.run_id, node.address, 1, 0))
    row = served.wait_reported(key)
    assert row["outcome"] == "accepted", row
    assert published.admin.get_work(key).status is WorkStatus.ACCEPTED

    # the record refuses a second, different payload for the assignment it signed
    with SlashingProtection(cfg.state_dir / commands.PROTECTION_DB) as db:
        rec = db.get(RUN.run_id, node.address, 1, 0)
        assert rec is not None and rec.state == "decided"
        import hashlib

        from protocol.rollout import SampleRollout, Submission, TaskRollouts
        other = Submission(run_id=RUN.run_id, node=node.address, policy_version=1,
                           manifest_hash=hashlib.sha256(b"x").digest(), counter=0, env=RUN.env,
                           env_version=RUN.env_version, tasks=(TaskRollouts(task_id="0" * 32, samples=(
                               SampleRollout(tokens=(1,), logprobs=(0.0,), finish_reason="length", reward=0.0,
                                             proofs=()),)),))
        with pytest.raises(DoubleSignError):
            db.check_and_record(other)

    # joining again skips registration and works the next counter
    assert commands.join(cfg) == 0
    assert served.wait_decided(to_hex(published.work_key(RUN.run_id, node.address, 1, 1)))["outcome"] == "accepted"
    assert published.admin.get_node(node.address).stake == SETTINGS.min_stake

    # claim pays the accepted work once its reward has unlocked (anvil's clock moved past the lock)
    served.wait_reported(to_hex(published.work_key(RUN.run_id, node.address, 1, 1)))
    held = token.balance_of(operator_env)
    assert commands.claim(cfg) == 0 and token.balance_of(operator_env) == held  # still locked
    published.chain.advance_time(SETTINGS.reward_lock_period + 1)
    assert commands.claim(cfg) == 0
    paid = token.balance_of(operator_env) - held
    assert paid > 0 and published.admin.get_work(key).status is WorkStatus.CLAIMED
    assert commands.status(cfg) == 0


def test_a_validator_that_is_down_does_not_crash_the_node_and_the_work_is_kept(
        published: Pools, deployment_file: Path, make_validator: Any, tmp_path: Path) -> None:
    node = published.new_node()
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    cfg = node_config(tmp_path, deployment_file, published.chain.rpc_url, [dead], run=RUN, model=TINY)
    chain = commands.open_chain(cfg)
    stop = threading.Event()
    failure: list[BaseException] = []

    import httpx

    from node.protection import SlashingProtection

    http = httpx.Client(timeout=5)
    db = SlashingProtection(tmp_path / "p.sqlite")
    worker = make_worker(cfg, node, chain, db, http, [dead])

    thread = start_loop(worker, failure)
    time.sleep(3)
    assert thread.is_alive() and not failure
    assert worker.tally.batches == 0  # nothing generated without a validator to send it to
    # the validator comes up: the node finds it, generates, submits, and gets paid
    served = make_validator()
    worker.validators.urls.append(served.url)
    thread.join(timeout=200)
    assert not thread.is_alive() and not failure, failure
    key = to_hex(published.work_key(RUN.run_id, node.address, 1, 0))
    assert served.wait_decided(key)["outcome"] == "accepted"
    stop.set()
    http.close()
    db.close()


def test_clear_one_line_errors(published: Pools, deployment_file: Path, operator_env: str, tmp_path: Path,
                               capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from protocol.identity import Identity

    Identity.create().save_keystore(tmp_path / "k.json", "other", scrypt_n=2**4)
    base = ["--chain.deployment", str(deployment_file), "--chain.rpc-url", published.chain.rpc_url,
            "--state-dir", str(tmp_path / "s")]
    assert main(["status", "--keystore", str(tmp_path / "k.json"), *base]) == 2
    assert "wrong password" in capsys.readouterr().err
    monkeypatch.setenv("PRIME_KEYSTORE_PASSWORD", "other")
    assert main(["status", "--keystore", str(tmp_path / "k.json"), *base, "--pool",
                 "0x000000000000000000000000000000000000dEaD"]) == 2
    assert "no pool contract" in capsys.readouterr().err
    poor = Identity.create()
    monkeypatch.setenv("TEST_OPERATOR_KEY", poor.account.key.hex())
    assert main(["join", "--keystore", str(tmp_path / "k.json"), *base, "--operator.key-env",
                 "TEST_OPERATOR_KEY", "--validators", "[]", "--run.run-id", "x"]) == 2
    assert f"operator {poor.address} cannot stake" in capsys.readouterr().err
    # export / import of the protection record through the CLI
    out = tmp_path / "export.json"
    assert main(["protection", "export", str(out), "--state-dir", str(tmp_path / "s")]) == 0
    assert json.loads(out.read_text())["metadata"]["interchange_format"] == "prime-slashing-protection"
    assert main(["protection", "import", str(out), "--state-dir", str(tmp_path / "s2")]) == 0


@pytest.mark.parametrize("misbehaviour", ["garbage", "hang", "error"])
def test_a_validator_that_answers_garbage_hangs_or_fails_does_not_crash_the_node(
        published: Pools, deployment_file: Path, make_validator: Any, tmp_path: Path, misbehaviour: str) -> None:
    """A server that proxies the real validator's /v1/info but answers submissions badly."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import httpx

    from node.protection import SlashingProtection

    served = make_validator()

    class Bad(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            path, _, query = self.path.partition("?")
            # a proxy of the real /v1/info (the challenge's proof included): it holds the validator's address
            info, headers = forward_info(served.url, query) if path == "/v1/info" else (b"\x00garbage", {})
            self.send_response(200)
            for name, value in headers.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(info)

        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers.get("content-length", "0")))
            if misbehaviour == "hang":
                time.sleep(2)
            self.send_response(500 if misbehaviour == "error" else 200)
            self.end_headers()
            self.wfile.write(b"<html>not json")

    bad = ThreadingHTTPServer(("127.0.0.1", 0), Bad)
    threading.Thread(target=bad.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{bad.server_address[1]}"
    node = published.new_node()
    cfg = node_config(tmp_path, deployment_file, published.chain.rpc_url, [url], run=RUN, model=TINY,
                      max_batches=None, submit={"attempts": 2, "backoff_s": 0.05, "max_backoff_s": 0.2,
                                                "timeout_s": 0.5, "decide_timeout_s": 1})
    chain = commands.open_chain(cfg)
    failure: list[BaseException] = []
    with httpx.Client(timeout=5) as http, SlashingProtection(tmp_path / "p.sqlite") as db:
        worker = make_worker(cfg, node, chain, db, http, [url])

        thread = start_loop(worker, failure)
        # the state, not a window: the loop holds its signed batch and says so (it makes no more work while
        # one waits), however long a loaded machine took to generate and fail to send it
        deadline = time.monotonic() + 120
        while not (worker.tally.state == "waiting" and "signed submissions wait" in worker.tally.detail):
            assert thread.is_alive() and not failure, failure
            assert time.monotonic() < deadline, f"the node never held its batch: {worker.tally}"
            time.sleep(0.05)
        assert thread.is_alive() and not failure, failure
        assert worker.tally.batches == 1  # one batch made, kept unsent, no more generated
        assert [r.state for r in db.unfinished(RUN.run_id, node.address)] == ["signed"]
        worker.stop()
        thread.join(timeout=30)
        assert not thread.is_alive() and not failure, failure
    bad.shutdown()
