"""Identities: keystores on disk, EIP-191 and EIP-712 signatures, password sources."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from protocol.errors import KeystoreError, SignatureError
from protocol.identity import (
    Identity,
    checksum,
    read_password,
    recover_message,
    recover_typed_data,
    verify_message,
    verify_typed_data,
)

# Cheap scrypt cost for throwaway test keys (the default 2**18 costs ~1 s per encrypt/decrypt).
CHEAP_N = 2**10

# Well-known anvil dev account #0 (public knowledge, never holds real value).
ANVIL_KEY_0 = "0xac0974bec39a17e36ba4a6b4d238ff944bacb478cbed5efcae784d7bf4f2ff80"
ANVIL_ADDR_0 = "0xf39Fd6e51aad88F6F4ce6aB8827279cffFb92266"


def test_from_key_gives_known_address() -> None:
    assert Identity.from_key(ANVIL_KEY_0).address == ANVIL_ADDR_0


def test_from_key_rejects_garbage() -> None:
    with pytest.raises(KeystoreError):
        Identity.from_key("0x1234")


def test_keystore_roundtrip_file_mode(tmp_path: Path) -> None:
    ident = Identity.create()
    path = ident.save_keystore(tmp_path / "keys" / "node.json", "hunter2", scrypt_n=CHEAP_N)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert not path.with_name(path.name + ".tmp").exists()
    data = json.loads(path.read_text())
    assert data["crypto"]["kdf"] == "scrypt"
    assert ANVIL_KEY_0[2:] not in path.read_text()
    loaded = Identity.load_keystore(path, "hunter2")
    assert loaded.address == ident.address
    assert loaded.account.key == ident.account.key


def test_save_keystore_replaces_loose_stale_temp_file(tmp_path: Path) -> None:
    path = tmp_path / "node.json"
    stale = tmp_path / "node.json.tmp"
    stale.write_text("junk")
    os.chmod(stale, 0o644)
    Identity.create().save_keystore(path, "pw", scrypt_n=CHEAP_N)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_default_keystore_uses_strong_scrypt() -> None:
    # Only encrypts (no decrypt): checks the default cost without paying for a roundtrip twice.
    data = Identity.create().to_keystore("pw")
    assert data["crypto"]["kdfparams"]["n"] >= 2**18


def test_wrong_password(tmp_path: Path) -> None:
    path = Identity.create().save_keystore(tmp_path / "k.json", "right", scrypt_n=CHEAP_N)
    with pytest.raises(KeystoreError, match="wrong password"):
        Identity.load_keystore(path, "wrong")


def test_missing_keystore(tmp_path: Path) -> None:
    with pytest.raises(KeystoreError, match="not found"):
        Identity.load_keystore(tmp_path / "absent.json", "pw")


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: "not json at all {",
        lambda d: json.dumps([1, 2, 3]),
        lambda d: json.dumps({"version": 3}),
        lambda d: json.dumps({**d, "crypto": {**d["crypto"], "ciphertext": "zz-not-hex"}}),
        lambda d: json.dumps({**d, "crypto": {**d["crypto"], "kdf": "argon9"}}),
        lambda d: json.dumps({**d, "version": 99}),
    ],
    ids=["not-json", "json-list", "no-crypto", "bad-ciphertext", "unknown-kdf", "unknown-version"],
)
def test_corrupt_keystore(tmp_path: Path, mutate: Any) -> None:
    path = Identity.create().save_keystore(tmp_path / "k.json", "pw", scrypt_n=CHEAP_N)
    path.write_text(mutate(json.loads(path.read_text())))
    with pytest.raises(KeystoreError):
        Identity.load_keystore(path, "pw")


def test_sign_and_recover_eip191() -> None:
    ident = Identity.create()
    sig = ident.sign_message(b"hello network")
    assert len(sig) == 65
    assert recover_message(b"hello network", sig) == ident.address
    verify_message(b"hello network", sig, ident.address.lower())


def test_tampered_message_fails() -> None:
    ident = Identity.create()
    sig = ident.sign_message(b"pay 1")
    with pytest.raises(SignatureError):
        verify_message(b"pay 2", sig, ident.address)


def test_wrong_signer_fails() -> None:
    a, b = Identity.create(), Identity.create()
    sig = a.sign_message(b"x")
    with pytest.raises(SignatureError, match="expected"):
        verify_message(b"x", sig, b.address)


@pytest.mark.parametrize(
    "signature",
    [b"", b"\x00" * 64, b"\x00" * 66, b"\xff" * 65, b"\x00" * 65, "0x" + "00" * 65],
    ids=["empty", "short", "long", "all-ff", "all-zero", "hex-string"],
)
def test_malformed_signature(signature: Any) -> None:
    with pytest.raises(SignatureError):
        recover_message(b"x", signature)


def test_high_s_twin_rejected() -> None:
    n = 0xFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFEBAAEDCE6AF48A03BBFD25E8CD0364141
    ident = Identity.create()
    sig = ident.sign_message(b"x")
    r, s, v = sig[:32], int.from_bytes(sig[32:64], "big"), sig[64]
    twin = r + (n - s).to_bytes(32, "big") + bytes([v ^ 1])  # also a valid ECDSA signature
    with pytest.raises(SignatureError, match="low-s"):
        recover_message(b"x", twin)


def test_checksum() -> None:
    assert checksum(ANVIL_ADDR_0.lower()) == ANVIL_ADDR_0
    for bad in ["0x123", "hello", "", "0x" + "g" * 40]:
        with pytest.raises(SignatureError):
            checksum(bad)


def _typed(amount: int) -> dict[str, Any]:
    return {
        "types": {
            "EIP712Domain": [
                {"name": "name", "type": "string"},
                {"name": "chainId", "type": "uint256"},
            ],
            "Claim": [{"name": "node", "type": "address"}, {"name": "amount", "type": "uint256"}],
        },
        "primaryType": "Claim",
        "domain": {"name": "prime", "chainId": 31337},
        "message": {"node": ANVIL_ADDR_0, "amount": amount},
    }


def test_eip712_sign_verify() -> None:
    ident = Identity.create()
    sig = ident.sign_typed_data(_typed(5))
    assert recover_typed_data(_typed(5), sig) == ident.address
    verify_typed_data(_typed(5), sig, ident.address)
    with pytest.raises(SignatureError):
        verify_typed_data(_typed(6), sig, ident.address)  # different message
    with pytest.raises(SignatureError):
        verify_typed_data(_typed(5), sig, Identity.create().address)  # wrong signer


def test_eip712_malformed_typed_data() -> None:
    sig = Identity.create().sign_typed_data(_typed(5))
    with pytest.raises(SignatureError, match="malformed"):
        recover_typed_data({"types": {}, "primaryType": "Nope"}, sig)


def test_read_password_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PRIME_TEST_PW", "from-env")
    pwfile = tmp_path / "pw"
    pwfile.write_text("from-file\n")
    assert read_password(env="PRIME_TEST_PW", file=pwfile) == "from-env"


def test_read_password_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("PRIME_TEST_PW", raising=False)
    pwfile = tmp_path / "pw"
    pwfile.write_text("from-file\r\n")
    assert read_password(env="PRIME_TEST_PW", file=pwfile) == "from-file"
    with pytest.raises(KeystoreError, match="password file"):
        read_password(file=tmp_path / "missing")


def test_read_password_nothing_configured() -> None:
    with pytest.raises(KeystoreError, match="no password source"):
        read_password()


def test_read_password_prompt_without_tty() -> None:
    # A new session has no controlling terminal, so /dev/tty cannot be opened; stdin carries a
    # would-be secret that must NOT be read in clear text.
    code = (
        "from protocol.identity import read_password\n"
        "from protocol.errors import KeystoreError\n"
        "try:\n"
        "    read_password(prompt='pw: ')\n"
        "except KeystoreError as e:\n"
        "    print('KeystoreError', e)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        input="leaked-secret\n",
        capture_output=True,
        text=True,
        timeout=60,
        start_new_session=True,
        cwd=Path(__file__).resolve().parents[3],
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("KeystoreError"), proc.stdout


@pytest.mark.parametrize("typed", [False, True], ids=["eip191", "eip712"])
def test_recovery_byte_has_one_form(typed: bool) -> None:
    # eth-account recovers from v = 0/1 as well as 27/28: two encodings of one signature.
    # Only the 27/28 form that signing produces (and contracts' ecrecover takes) is accepted.
    ident = Identity.create()
    if typed:
        message = _typed(5)
        sig = ident.sign_typed_data(message)
        assert recover_typed_data(message, sig) == ident.address
    else:
        sig = ident.sign_message(b"x")
        assert recover_message(b"x", sig) == ident.address
    assert sig[64] in (27, 28)
    for v in (sig[64] - 27, sig[64] + 8, 29, 0xFF):
        other = sig[:64] + bytes([v])
        with pytest.raises(SignatureError, match="recovery byte"):
            if typed:
                recover_typed_data(message, other)
            else:
                recover_message(b"x", other)
