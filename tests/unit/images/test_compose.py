"""docker/: the compose file and Dockerfiles, checked statically (no Docker daemon here), plus the parts of
it that can run here: the deploy job's command against a real anvil (the pool address the trainer is given
must be where that deploy puts it) and the container healthcheck against that chain."""

from __future__ import annotations

import copy
import importlib.util
import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from contracts.devchain import DevChain

ROOT = Path(__file__).resolve().parents[3]
COMPOSE = ROOT / "docker" / "compose.yaml"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"docker_{name}", ROOT / "docker" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def checker() -> ModuleType:
    return _load("compose_check")


@pytest.fixture
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def _argv(service: dict[str, Any]) -> list[str]:
    return shlex.split(service["command"])


def test_compose_file_passes_every_check(checker: ModuleType) -> None:
    assert checker.check(COMPOSE) == []


def test_compose_has_every_role_and_a_gpu_profile(compose: dict[str, Any]) -> None:
    programs = {s["command"].split()[0] for s in compose["services"].values()}
    assert programs == {"anvil", "prime-chain", "prime-relay", "prime-trainer", "prime-validator", "prime-node"}
    gpu = [name for name, s in compose["services"].items() if "gpu" in s.get("profiles", [])]
    assert gpu == ["node-gpu"]
    assert compose["services"]["node-gpu"]["build"]["dockerfile"] == "docker/Dockerfile.gpu"
    assert "--gpu" in _argv(compose["services"]["node-gpu"])


def _set_flag(argv: list[str], flag: str, value: str) -> list[str]:
    out = list(argv)
    out[out.index(flag) + 1] = value
    return out


@pytest.mark.parametrize("break_it, expected", [
    (lambda c: c["services"]["validator-1"].__setitem__(
        "command", c["services"]["validator-1"]["command"] + " --no-such-flag 1"), "prime-validator refuses"),
    (lambda c: c["services"]["node-1"].__setitem__(
        "command", c["services"]["node-1"]["command"].replace("--monitor.port", "--monitor.prot")), "refuses"),
    (lambda c: c["services"]["relay-1"].__setitem__(
        "command", c["services"]["relay-1"]["command"] + " --concurrency many"), "prime-relay refuses"),
    (lambda c: c["services"]["chain"].__setitem__(
        "command", c["services"]["chain"]["command"] + " --no-such-anvil-flag"), "anvil has no flag"),
    (lambda c: (c["services"]["trainer"]["environment"].pop("PRIME_PUBLISH__CHAIN__RPC_URL"),
                c["services"]["trainer"]["environment"].__setitem__("PRIME_PUBLISH__CHAIN__RPC_UR", "x")),
     "prime-trainer refuses"),
    (lambda c: c["services"]["relay-2"].__setitem__("ports", ["8602:8601"]), "not bound to 127.0.0.1"),
    (lambda c: c["services"]["relay-2"].__setitem__("ports", ["0.0.0.0:8602:8601"]), "not bound to 127.0.0.1"),
    (lambda c: c["services"]["relay-2"].__setitem__("ports", ["127.0.0.1:8601:8601"]), "also published"),
    (lambda c: c["services"]["origin"].pop("healthcheck"), "no healthcheck"),
    (lambda c: c["services"]["trainer"]["depends_on"].__setitem__("orign", {"condition": "service_healthy"}),
     "not a service"),
    (lambda c: (c["services"]["node-1"].pop("build"),
                c["services"]["node-1"].__setitem__("image", "prime-network:cuda")), "built by no service"),
    (lambda c: c["services"]["node-2"]["environment"].pop("NODE_KEY"), "does not set NODE_KEY"),
    (lambda c: c["services"]["node-2"].__setitem__("command", c["services"]["node-2"]["command"].replace(
        "http://validator-2:8700", "http://validator-3:8700")), "names no service"),
    (lambda c: c["services"]["relay-1"].__setitem__("command", c["services"]["relay-1"]["command"].replace(
        "0x3C44CdDdB6a900fa2b585dd299e03d12FA4293BC", "0x70997970C51812dc3A010C7d01b50e0d17dc79C8")),
     "not the trainer key"),
    (lambda c: c["services"]["validator-2"]["environment"].__setitem__(
        "VALIDATOR_KEY", c["services"]["node-1"]["environment"]["NODE_KEY"]), "validator role"),
    (lambda c: c["services"]["validator-1"].__setitem__("command", c["services"]["validator-1"]["command"].replace(
        "--validators 0x70997970C51812dc3A010C7d01b50e0d17dc79C8,0x15d34AAf54267DB7D7c367839AAf71A00a2C6A65",
        "--validators http://validator-1:8700,http://validator-2:8700")), "rendezvous set"),
    (lambda c: c["services"]["trainer"].__setitem__("command", c["services"]["trainer"]["command"].replace(
        "--data.urls http://validator-1:8700,http://validator-2:8700",
        "--data.urls http://validator-2:8700,http://validator-1:8700")), "--data.addresses"),
    (lambda c: c["services"]["validator-2"].__setitem__("command", c["services"]["validator-2"]["command"].replace(
        "--model.hidden-size 128", "--model.hidden-size 64")), "disagree on the model"),
    (lambda c: c["services"]["validator-2"]["healthcheck"].__setitem__(
        "test", ["CMD", "python", "/app/docker/healthcheck.py", "http://127.0.0.1:9999/ready"]), "healthcheck"),
])
def test_check_catches_a_broken_compose(checker: ModuleType, compose: dict[str, Any], break_it: Any,
                                        expected: str) -> None:
    broken = copy.deepcopy(compose)
    break_it(broken)
    problems = checker.check(COMPOSE, broken)
    assert any(expected in p for p in problems), problems


def test_check_catches_keys_that_are_not_public_dev_keys(checker: ModuleType, tmp_path: Path) -> None:
    text = COMPOSE.read_text()
    secret = "0x" + "ab" * 32
    path = tmp_path / "compose.yaml"
    path.write_text(text.replace(
        "0x8b3a350cf5c34c9194ca85829a2df0ec3153be0318b5e2d3348e872092edffba", secret))
    assert any("not an anvil dev key" in p for p in checker.check(path, yaml.safe_load(text)))
    path.write_text(text.replace("# DEV ONLY: anvil account 5", "# anvil account 5"))
    assert any("not marked DEV ONLY" in p for p in checker.check(path, yaml.safe_load(text)))


def test_images_take_every_package_and_pin_the_cpu_torch(checker: ModuleType, tmp_path: Path) -> None:
    problems: list[str] = []
    for name in ("Dockerfile", "Dockerfile.gpu"):
        checker._check_dockerfile(name, ROOT, ROOT / "docker" / name, problems)
    assert problems == []
    cpu = (ROOT / "docker" / "Dockerfile").read_text()
    assert 'pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"' in cpu
    assert "ARG TORCH_VERSION=2.13.0" in cpu  # the Makefile's pin
    assert "torch==2.13.0" in (ROOT / "Makefile").read_text()
    gpu = (ROOT / "docker" / "Dockerfile.gpu").read_text()
    assert "FROM nvidia/cuda:" in gpu and '"vllm==${VLLM_VERSION}"' in gpu and ".[gpu]" in gpu
    for text in (cpu, gpu):
        assert "USER 10001" in text and "0x" not in text  # unprivileged; no key baked in
    # a build context that leaves out a package, or lets everything in, is caught
    context = tmp_path / "context"
    context.mkdir()
    (context / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    ignore = (ROOT / ".dockerignore").read_text()
    (context / ".dockerignore").write_text(ignore.replace("!discovery\n", ""))
    problems = []
    checker._check_dockerfile("Dockerfile", context, ROOT / "docker" / "Dockerfile", problems)
    assert any("discovery" in p for p in problems), problems
    (context / ".dockerignore").write_text(ignore.replace("\n*\n", "\n.venv\n"))
    problems = []
    checker._check_dockerfile("Dockerfile", context, ROOT / "docker" / "Dockerfile", problems)
    assert any("not an allowlist" in p for p in problems), problems


def test_hadolint_passes() -> None:
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(hadolint).exists():
        pytest.skip("hadolint is not installed (it is in the dev extra: pip install -e '.[dev]')")
    files = [str(ROOT / "docker" / n) for n in ("Dockerfile", "Dockerfile.gpu")]
    run = subprocess.run([hadolint, *files], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr


def test_deploy_job_and_healthcheck_against_a_real_chain(compose: dict[str, Any], tmp_path: Path) -> None:
    """The deploy job's own command, on a fresh anvil, puts the pool where the trainer looks for it."""
    from contracts.deploy import main as deploy_main

    health = [sys.executable, str(ROOT / "docker" / "healthcheck.py")]
    argv = _argv(compose["services"]["deploy"])[1:]
    out = tmp_path / "deployment.json"
    with DevChain.start() as chain:
        assert subprocess.run([*health, "--rpc", chain.rpc_url], timeout=30).returncode == 0
        assert subprocess.run([*health, "--file", str(out)], timeout=30).returncode == 1  # not yet written
        argv = _set_flag(_set_flag(argv, "--rpc", chain.rpc_url), "--out", str(out))
        assert deploy_main(argv) == 0
        assert subprocess.run([*health, "--file", str(out)], timeout=30).returncode == 0
        port = chain.rpc_url.rsplit(":", 1)[1]
        assert subprocess.run([*health, f"http://127.0.0.1:{port}/nothing-here"], timeout=30).returncode == 1
    deployment = json.loads(out.read_text())
    trainer = _argv(compose["services"]["trainer"])
    assert trainer[trainer.index("--data.pool") + 1].lower() == deployment["pool"].lower()
    assert int(trainer[trainer.index("--data.chain-id") + 1]) == deployment["chain_id"]
