"""docker/compose.yaml run without Docker (no daemon here): every CPU service's own command, started as a
process on 127.0.0.1 in the compose file's dependency order, with each `http://service:port` and listen
port mapped to a free loopback port, `--host 0.0.0.0` to 127.0.0.1 and each named volume to a directory.
The network the compose file describes must come up and work: validators ready, both nodes' work
accepted, the trainer through a step. What this cannot check is the images themselves (never built here).
Slow tier (~3 minutes on 2 cores)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from netfixtures import free_port

from contracts.devchain import anvil_binary

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker" / "compose.yaml"
PORT_FLAGS = ("--port", "--monitor.port", "--metrics-port")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]


def _checker() -> Any:
    spec = importlib.util.spec_from_file_location("docker_compose_check_e2e", REPO / "docker" / "compose_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Local:
    """The compose file's CPU services as local processes (see the module docstring)."""

    def __init__(self, compose: dict[str, Any], root: Path) -> None:
        self.services = {n: s for n, s in compose["services"].items() if not s.get("profiles")}
        self.root = root
        self.ports: dict[tuple[str, int], int] = {}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.check = _checker()
        for name, svc in self.services.items():
            for port in self.check._listen_ports(self.check._command(svc)):
                self.ports[(name, port)] = free_port()

    def url(self, name: str, port: int) -> str:
        return f"http://127.0.0.1:{self.ports[(name, port)]}"

    def _paths(self, name: str) -> list[tuple[str, str]]:
        out = []
        for vol in self.services[name].get("volumes", []):
            source, target = str(vol).split(":")[:2]
            host = self.root / "volumes" / source
            host.mkdir(parents=True, exist_ok=True)
            out.append((target, str(host)))
        return sorted(out, key=lambda p: -len(p[0]))

    def _map(self, name: str, text: str) -> str:
        text = re.sub(r"http://([a-z0-9-]+):(\d+)", lambda m: self.url(m.group(1), int(m.group(2))), text)
        for target, host in self._paths(name):
            text = re.sub(rf"(^|[=\s]){re.escape(target)}(?=/|$|\s)", lambda m, h=host: m.group(1) + h, text)
        return text

    def argv(self, name: str) -> list[str]:
        argv = [self._map(name, a) for a in self.check._command(self.services[name])]
        for i, arg in enumerate(argv[:-1]):
            if arg in PORT_FLAGS:
                argv[i + 1] = str(self.ports[(name, int(argv[i + 1]))])
            elif arg in ("--host", "--monitor.host") and argv[i + 1] == "0.0.0.0":
                argv[i + 1] = "127.0.0.1"  # tests talk only to 127.0.0.1
        program = argv[0]
        argv[0] = str(anvil_binary()) if program == "anvil" else str(Path(sys.executable).parent / program)
        return argv

    def start(self, name: str) -> subprocess.Popen[bytes]:
        svc = self.services[name]
        env = {k: v for k, v in os.environ.items() if not k.startswith("PRIME_")}
        env.update({k: self._map(name, str(v)) for k, v in (svc.get("environment") or {}).items()})
        env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
        cwd = self.root / "cwd" / name
        cwd.mkdir(parents=True, exist_ok=True)
        log = (self.root / f"{name}.log").open("wb")
        proc = subprocess.Popen(self.argv(name), cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs[name] = proc
        return proc

    def healthy(self, name: str) -> bool:
        test = [self._map(name, str(t)) for t in self.services[name]["healthcheck"]["test"][1:]]
        test = [re.sub(r"http://127\.0\.0\.1:(\d+)", lambda m: self.url(name, int(m.group(1))), t) for t in test]
        test[0:2] = [sys.executable, str(REPO / "docker" / "healthcheck.py")]
        return subprocess.run(test, capture_output=True, timeout=30).returncode == 0

    def log(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text(errors="replace")[-3000:]

    def up(self, deadline: float) -> None:
        """Start every service once its dependencies meet their conditions (compose's order)."""
        pending = list(self.services)
        done: set[str] = set()
        while pending:
            for name in list(pending):
                deps = self.services[name].get("depends_on") or {}
                if all(self._met(dep, spec.get("condition", "service_started"), done) for dep, spec in deps.items()):
                    self.start(name)
                    pending.remove(name)
            for name, proc in self.procs.items():
                if proc.poll() is not None and name not in done:
                    assert proc.returncode == 0 and self.services[name].get("restart") == "no", \
                        f"{name} exited {proc.returncode}:\n{self.log(name)}"
                    done.add(name)
            assert time.monotonic() < deadline, {n: self.log(n) for n in self.procs}
            time.sleep(0.5)

    def _met(self, dep: str, condition: str, done: set[str]) -> bool:
        if dep not in self.procs:
            return False
        if condition == "service_completed_successfully":
            return dep in done
        if condition == "service_healthy":
            return self.healthy(dep)
        return True

    def stop(self) -> None:
        for proc in reversed(list(self.procs.values())):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        end = time.monotonic() + 30
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


def test_the_compose_network_comes_up_and_works_as_local_processes(tmp_path: Path) -> None:
    if not shutil.which("prime-node", path=str(Path(sys.executable).parent)):
        pytest.skip("the project's entry points are not installed in this venv (make setup)")
    local = Local(yaml.safe_load(COMPOSE.read_text()), tmp_path)
    try:
        local.up(time.monotonic() + 240)
        deployment = json.loads((tmp_path / "volumes" / "shared" / "deployment.json").read_text())
        trainer = local.check._command(local.services["trainer"])
        assert trainer[trainer.index("--data.pool") + 1].lower() == deployment["pool"].lower()
        deadline = time.monotonic() + 180
        nodes = [n for n, s in local.services.items() if local.check._command(s)[0] == "prime-node"]
        while True:
            health = {}
            for n in nodes:
                try:
                    health[n] = httpx.get(local.url(n, 8710) + "/health", timeout=5).json()
                except httpx.HTTPError:  # still joining: its monitor is not up yet
                    health[n] = {}
                assert local.procs[n].poll() is None, local.log(n)
            metrics = tmp_path / "volumes" / "trainer" / "metrics.jsonl"
            if all(h.get("accepted", 0) > 0 for h in health.values()) and metrics.exists() and metrics.read_text():
                break
            assert time.monotonic() < deadline, (health, {n: local.log(n) for n in ("trainer", *nodes)})
            time.sleep(2)
        assert all(h["rejected"] == {} for h in health.values()), health  # nothing rejected, hard or soft
        for v in ("validator-1", "validator-2"):
            assert httpx.get(local.url(v, 8700) + "/ready", timeout=5).status_code == 200
        assert json.loads(metrics.read_text().splitlines()[0])["step"] == 0
        versions = httpx.get(local.url("relay-2", 8601) + "/versions", timeout=5).json()
        assert versions["run_id"] == "devnet" and versions["latest"] >= 0
    finally:
        local.stop()
    assert all(p.poll() is not None for p in local.procs.values())
