"""`prime-relay` end to end as processes: origin + publish (keystore) + ls + pull, and its error exit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from netfixtures import free_port
from shardcast_harness import REPO

from bench.loopback import make_checkpoint, same_tree
from protocol.identity import Identity

pytestmark = pytest.mark.timeout(90)


def _cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shardcast.cli", "--log-level", "WARNING", *args], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)


def test_help_is_fast_and_imports_nothing_heavy() -> None:
    code = ("import sys; from shardcast.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "heavy = [m for m in ('torch', 'aiohttp', 'eth_account', 'pydantic') if m in sys.modules]\n"
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, capture_output=True, timeout=30,
                   env={**os.environ, "PYTHONPATH": str(REPO)})


def test_origin_publish_ls_pull(tmp_path: Path) -> None:
    trainer = Identity.create()
    keystore = trainer.save_keystore(tmp_path / "trainer.json", "pw")
    ckpt = make_checkpoint(tmp_path / "ckpt", {"model.bin": 300_000, "cfg/config.json": 50})
    store = tmp_path / "store"
    published = _cli("publish", str(ckpt), "--store", str(store), "--run-id", "run-x", "--keystore", str(keystore),
                     "--shard-mib", "1", env={"PRIME_KEYSTORE_PASSWORD": "pw"})
    assert published.returncode == 0, published.stderr
    assert json.loads(published.stdout)["version"] == 1
    port = free_port()
    origin = subprocess.Popen([sys.executable, "-m", "shardcast.cli", "--log-level", "WARNING", "origin", "--store",
                               str(store), "--run-id", "run-x", "--port", str(port)], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert origin.stdout is not None
        assert "listening on" in origin.stdout.readline()
        url = f"http://127.0.0.1:{port}"
        listing = _cli("ls", url)
        assert listing.returncode == 0 and "v1" in listing.stdout and "complete" in listing.stdout
        out = tmp_path / "out"
        pulled = _cli("pull", "--from", url, "--trainer", trainer.address, "--out", str(out), "--json", "--no-progress")
        assert pulled.returncode == 0, pulled.stderr
        assert json.loads(pulled.stdout)["version"] == 1
        assert same_tree(out / "current", ckpt)
        wrong = _cli("pull", "--from", url, "--trainer", Identity.create().address, "--out", str(tmp_path / "o2"),
                     "--no-progress")
        assert wrong.returncode == 2 and "RelayError" in wrong.stderr
    finally:
        origin.terminate()
        origin.wait(10)


def test_pull_refuses_a_source_that_is_not_plain_http(tmp_path: Path) -> None:
    trainer = "0x" + "11" * 20
    result = _cli("pull", "--from", "https://127.0.0.1:9", "--trainer", trainer, "--out", str(tmp_path / "w"))
    assert result.returncode == 2
    assert "SourceError" in result.stderr and "plain http://" in result.stderr
    assert not (tmp_path / "w").exists()
