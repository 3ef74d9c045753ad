"""The operator keystore tool, run as a real subprocess."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from protocol.identity import Identity

ROOT = Path(__file__).resolve().parents[3]
# Anvil dev key #1 (public, test only).
ANVIL_KEY_1 = "0x59c6995e998f97a5a0044966f0945389dc9e86dae88c7a8412f4603b6b78690d"
ANVIL_ADDR_1 = "0x70997970C51812dc3A010C7d01b50e0d17dc79C8"


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "protocol.keystore", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        stdin=subprocess.DEVNULL,
        start_new_session=True,  # no controlling terminal: prompts must fail, not hang
    )


def test_new_then_address_then_load(tmp_path: Path) -> None:
    path = tmp_path / "node.json"
    proc = _run("new", str(path), "--password-env", "PW", "--scrypt-n", "1024", env={"PW": "s3cret"})
    assert proc.returncode == 0, proc.stderr
    address = proc.stdout.strip()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert _run("address", str(path)).stdout.strip() == address
    assert Identity.load_keystore(path, "s3cret").address == address
    # Refuses to overwrite without --force.
    again = _run("new", str(path), "--password-env", "PW", "--scrypt-n", "1024", env={"PW": "x"})
    assert again.returncode == 1 and "exists" in again.stderr


def test_import_known_key(tmp_path: Path) -> None:
    path = tmp_path / "k.json"
    pw = tmp_path / "pw"
    pw.write_text("pw\n")
    proc = _run(
        "import",
        str(path),
        "--key-env",
        "KEY",
        "--password-file",
        str(pw),
        "--scrypt-n",
        "1024",
        env={"KEY": ANVIL_KEY_1},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ANVIL_ADDR_1
    assert Identity.load_keystore(path, "pw").address == ANVIL_ADDR_1


def test_no_password_source_without_terminal(tmp_path: Path) -> None:
    proc = _run("new", str(tmp_path / "k.json"), "--scrypt-n", "1024")
    assert proc.returncode == 1
    assert "no terminal" in proc.stderr
    assert not (tmp_path / "k.json").exists()


def test_address_of_garbage(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    proc = _run("address", str(bad))
    assert proc.returncode == 1 and "cannot read an address" in proc.stderr


def test_load_identity_from_keystore_or_dev_key_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from protocol.errors import KeystoreError
    from protocol.identity import Identity, load_identity

    ident = Identity.create()
    keystore = ident.save_keystore(tmp_path / "k.json", "pw", scrypt_n=2)
    monkeypatch.setenv("PRIME_KEYSTORE_PASSWORD", "pw")
    assert load_identity(keystore=keystore, prompt=None).address == ident.address
    monkeypatch.setenv("DEV_KEY", "0x" + bytes(ident.account.key).hex())
    assert load_identity(key_env="DEV_KEY").address == ident.address
    monkeypatch.setenv("DEV_KEY", "")
    with pytest.raises(KeystoreError, match="DEV_KEY"):
        load_identity(key_env="DEV_KEY")
    with pytest.raises(KeystoreError, match="no key"):
        load_identity()
    monkeypatch.setenv("PRIME_KEYSTORE_PASSWORD", "wrong")
    with pytest.raises(KeystoreError):
        load_identity(keystore=keystore, prompt=None)
