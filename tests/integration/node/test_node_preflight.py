"""Pre-flight: this machine's honest work measured the way a validator measures it, before any stake moves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from chainfixtures import Pools
from test_node_join import node_config

from bench.loopback import RUN, TINY
from contracts.pool import NodeStatus
from node import commands
from node.cli import main
from node.config import CpuEngineSettings
from node.engines import build_engine
from node.errors import NodeError
from node.preflight import run_preflight

pytestmark = pytest.mark.timeout(300)


def test_honest_work_passes_with_margins_printed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["preflight", "--validators", "[]", "--run", RUN.model_dump_json(), "--model", TINY.model_dump_json(),
                 "--state-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "pre-flight passed" in out and "toploc exponent mismatches" in out and "WOULD BE REJECTED" not in out


def test_work_from_another_model_is_caught_by_every_check() -> None:
    wrong = build_engine(CpuEngineSettings(), TINY.model_copy(update={"seed": 1}))
    report = run_preflight(wrong, TINY, RUN, {}, batches=1)
    assert not report.ok
    failed = {c.name for c in report.checks if not c.ok}
    assert {"toploc exponent mismatches", "sampling mismatches"} <= failed
    assert report.as_dict()["ok"] is False


def test_a_context_too_short_for_the_runs_prompts_fails_preflight_before_anything_is_generated() -> None:
    """An engine whose context cannot hold the run's longest prompt plus `max_new_tokens` would cut honest
    completions short (vLLM with a small `max_model_len`): an early `length`, a hard verdict. Pre-flight says so
    and names the setting, before generating anything."""
    engine = build_engine(CpuEngineSettings(), TINY)
    run = RUN.model_copy(update={"max_new_tokens": engine.context_limit - 2})
    report = run_preflight(engine, TINY, run, {}, batches=1)
    assert not report.ok and report.samples == 0
    context = report.checks[0]
    assert context.name == "longest prompt + max_new_tokens" and not context.ok
    assert context.limit == TINY.max_position_embeddings and context.worst > context.limit
    assert any("engine.max_model_len" in p for p in report.problems)
    fits = run_preflight(engine, TINY, RUN, {}, batches=1)
    assert fits.checks[0].name == "longest prompt + max_new_tokens" and fits.checks[0].ok


def test_join_refuses_to_stake_when_preflight_fails_unless_forced(
        published: Pools, deployment_file: Path, make_validator: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    # a validator whose mantissa threshold bf16 generation cannot meet against its fp32 prefill
    served = make_validator(checks={"max_mant_err_mean": 0.01, "max_mant_err_median": 0.0})
    operator = published.chain.account(3)
    monkeypatch.setenv("PRIME_KEYSTORE_PASSWORD", "pw")
    monkeypatch.setenv("TEST_OPERATOR_KEY", operator.account.key.hex())
    cfg = node_config(tmp_path, deployment_file, published.chain.rpc_url, [served.url],
                      engine={"dtype": "bfloat16"})
    token = published.token()
    before = token.balance_of(operator.address)
    with pytest.raises(NodeError, match="not staking: pre-flight"):
        commands.join(cfg)
    node = commands.node_key(cfg)
    assert published.admin.get_node(node.address).status is NodeStatus.NONE
    assert token.balance_of(operator.address) == before  # no stake moved, nothing approved either
    assert published.token().allowance(operator.address, published.deployment.pool) == 0

    forced = cfg.model_copy(update={"preflight": cfg.preflight.model_copy(update={"force": True}),
                                    "max_batches": None})
    commands.ensure_registered(forced, commands.open_chain(forced), node, commands.operator_key(forced, node))
    assert published.admin.get_node(node.address).status is NodeStatus.ACTIVE
