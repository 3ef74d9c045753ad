"""Ethereum identities: keys, encrypted keystores, EIP-191 and EIP-712 signatures.

Every role (node, validator, trainer, relay operator) is a secp256k1 key. Keys live on disk only as
standard Web3 secret-storage JSON (scrypt-encrypted), read through eth-account.
"""

from __future__ import annotations

import getpass
import json
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eth_account import Account
from eth_account.messages import SignableMessage, encode_defunct, encode_typed_data
from eth_account.signers.local import LocalAccount
from eth_utils.address import to_checksum_address

from protocol.errors import KeystoreError, SignatureError

# py_ecc, imported by eth-account, raises the interpreter's recursion limit to 100000 at import.
# With that limit, deeply nested hostile JSON (200 KB of "[") makes the stdlib parser (json.loads,
# aiohttp's request.json()) overflow the C stack and segfault instead of raising RecursionError:
# a remote crash of any role that parses JSON. Nothing eth-account does for us recurses deeply,
# so put back a limit that still leaves headroom but is safe for the C stack (tested).
SAFE_RECURSION_LIMIT = 10_000
if sys.getrecursionlimit() > SAFE_RECURSION_LIMIT:
    sys.setrecursionlimit(SAFE_RECURSION_LIMIT)

SIGNATURE_BYTES = 65
# secp256k1 group order; signatures with s above half of it are the malleable twin of a low-s one.
_SECP256K1_N = 0xFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFEBAAEDCE6AF48A03BBFD25E8CD0364141


def checksum(address: str) -> str:
    """The EIP-55 checksum form of `address`; raises `SignatureError` if it is not an address."""
    try:
        return str(to_checksum_address(address))
    except (ValueError, TypeError) as exc:
        raise SignatureError(f"not an Ethereum address: {address!r}") from exc


@dataclass(frozen=True)
class Identity:
    """A private key held in memory, with the signing operations the protocol uses."""

    account: LocalAccount

    @property
    def address(self) -> str:
        """The checksummed Ethereum address of this identity."""
        return str(self.account.address)

    @classmethod
    def create(cls) -> Identity:
        """A fresh random key (from the OS's CSPRNG)."""
        return cls(Account.create())

    @classmethod
    def from_key(cls, private_key: str | bytes) -> Identity:
        """An identity from a raw private key (hex string or 32 bytes)."""
        try:
            return cls(Account.from_key(private_key))
        except (ValueError, TypeError) as exc:
            raise KeystoreError("invalid private key") from exc

    # -- keystores -------------------------------------------------------------------------

    def to_keystore(self, password: str, *, scrypt_n: int | None = None) -> dict[str, Any]:
        """The key encrypted as Web3 secret-storage JSON (scrypt KDF).

        `scrypt_n` is the scrypt cost (a power of two); the default is eth-account's 2**18 (~1 s to
        encrypt or decrypt on one core). Lower it only for throwaway keys (tests, dev networks).
        """
        return dict(Account.encrypt(self.account.key, password, kdf="scrypt", iterations=scrypt_n))

    def save_keystore(self, path: str | Path, password: str, *, scrypt_n: int | None = None) -> Path:
        """Write the encrypted keystore to `path` (mode 0600, atomically); returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        keystore = self.to_keystore(password, scrypt_n=scrypt_n)
        tmp = path.with_name(path.name + ".tmp")
        # A stale temp file from a crash may carry looser permissions; O_CREAT would keep them.
        tmp.unlink(missing_ok=True)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as fh:
                json.dump(keystore, fh)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise KeystoreError(f"cannot write keystore {path}: {exc}") from exc
        return path

    @classmethod
    def load_keystore(cls, path: str | Path, password: str) -> Identity:
        """Decrypt a keystore file; `KeystoreError` on a missing file, bad JSON or wrong password."""
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError as exc:
            raise KeystoreError(f"keystore not found: {path}") from exc
        except (OSError, json.JSONDecodeError) as exc:
            raise KeystoreError(f"keystore unreadable: {path}: {exc}") from exc
        if not isinstance(data, dict):
            raise KeystoreError(f"keystore {path} is not Web3 secret-storage JSON")
        try:
            key = Account.decrypt(data, password)
        except ValueError as exc:  # eth-keyfile raises ValueError("MAC mismatch") on a wrong password
            raise KeystoreError(f"cannot decrypt keystore {path}: wrong password or corrupt file") from exc
        except (KeyError, TypeError, AttributeError, NotImplementedError) as exc:
            raise KeystoreError(f"keystore {path} is not Web3 secret-storage JSON: {exc!r}") from exc
        return cls(Account.from_key(key))

    # -- signing ---------------------------------------------------------------------------

    def sign_message(self, data: bytes) -> bytes:
        """EIP-191 (personal_sign) signature over `data`: 65 bytes r||s||v."""
        return bytes(self.account.sign_message(encode_defunct(primitive=data)).signature)

    def sign_typed_data(self, full_message: dict[str, Any]) -> bytes:
        """EIP-712 signature over a full typed-data message (types, primaryType, domain, message)."""
        return bytes(self.account.sign_message(encode_typed_data(full_message=full_message)).signature)


def check_signature_form(signature: object) -> bytes:
    """`signature` as bytes if it is in the one accepted form, else `SignatureError`.

    65 bytes r || s || v with s in the low half of the group order (EIP-2: the high-s twin of a
    valid signature is refused) and v in {27, 28}, the form signing produces and contracts'
    `ecrecover` takes. eth-account would also recover from v in {0, 1}; refusing that spelling
    leaves each message exactly one valid signature encoding. Does not verify anything.
    """
    if not isinstance(signature, bytes | bytearray):
        raise SignatureError(f"signature must be bytes, got {type(signature).__name__}")
    if len(signature) != SIGNATURE_BYTES:
        raise SignatureError(f"signature must be {SIGNATURE_BYTES} bytes, got {len(signature)}")
    if int.from_bytes(signature[32:64], "big") > _SECP256K1_N // 2:
        raise SignatureError("signature is not in canonical low-s form")
    if signature[64] not in (27, 28):
        raise SignatureError(f"signature recovery byte must be 27 or 28, got {signature[64]}")
    return bytes(signature)


def _recover(signable: SignableMessage, signature: bytes) -> str:
    signature = check_signature_form(signature)
    try:
        return str(Account.recover_message(signable, signature=signature))
    except Exception as exc:  # eth-keys raises several unrelated types for malformed signatures
        raise SignatureError(f"signature does not recover: {exc}") from exc


def recover_message(data: bytes, signature: bytes) -> str:
    """The address that made an EIP-191 `signature` over `data`."""
    return _recover(encode_defunct(primitive=data), signature)


def recover_typed_data(full_message: dict[str, Any], signature: bytes) -> str:
    """The address that made an EIP-712 `signature` over `full_message`."""
    try:
        signable = encode_typed_data(full_message=full_message)
    except Exception as exc:
        raise SignatureError(f"malformed typed data: {exc}") from exc
    return _recover(signable, signature)


def verify_message(data: bytes, signature: bytes, expected_signer: str) -> None:
    """Raise `SignatureError` unless `signature` over `data` was made by `expected_signer`."""
    signer = recover_message(data, signature)
    if signer != checksum(expected_signer):
        raise SignatureError(f"signed by {signer}, expected {checksum(expected_signer)}")


def verify_typed_data(full_message: dict[str, Any], signature: bytes, expected_signer: str) -> None:
    """Raise `SignatureError` unless the EIP-712 `signature` was made by `expected_signer`."""
    signer = recover_typed_data(full_message, signature)
    if signer != checksum(expected_signer):
        raise SignatureError(f"signed by {signer}, expected {checksum(expected_signer)}")


def read_password(
    *, env: str | None = None, file: str | Path | None = None, prompt: str | None = None
) -> str:
    """A keystore password from, in order: the env var `env`, the file `file`, or an interactive prompt.

    `KeystoreError` when no source yields one (e.g. no TTY and nothing configured).
    """
    if env and (value := os.environ.get(env)) is not None:
        return value
    if file is not None:
        try:
            return Path(file).read_text().rstrip("\r\n")
        except OSError as exc:
            raise KeystoreError(f"cannot read password file {file}: {exc}") from exc
    if prompt is not None:
        # Without a terminal, getpass would warn and read the password from stdin in clear text
        # (echoed, possibly from a pipe nobody meant as a secret); treat that as "no source".
        with warnings.catch_warnings():
            warnings.simplefilter("error", getpass.GetPassWarning)
            try:
                return getpass.getpass(prompt)
            except (EOFError, OSError, getpass.GetPassWarning) as exc:
                raise KeystoreError("no password: no env var, no file, and no terminal to prompt on") from exc
    raise KeystoreError("no password source configured (env var, file or prompt)")


def load_identity(
    *, keystore: str | Path | None = None, key_env: str | None = None,
    password_env: str | None = "PRIME_KEYSTORE_PASSWORD", password_file: str | Path | None = None,
    prompt: str | None = "Keystore password: ",
) -> Identity:
    """A role's signing key: an encrypted keystore (password via `read_password`), or, for dev chains
    only, a raw private key in the environment variable `key_env`. `KeystoreError` when neither works."""
    if key_env:
        value = os.environ.get(key_env)
        if not value:
            raise KeystoreError(f"environment variable {key_env} is empty or not set")
        return Identity.from_key(value)
    if keystore is None:
        raise KeystoreError("no key: give a keystore (or, on a dev chain, an environment variable with a raw key)")
    return Identity.load_keystore(keystore, read_password(env=password_env, file=password_file, prompt=prompt))
