"""Operator tool for keystores: `python -m protocol.keystore new|address|import ...`.

    python -m protocol.keystore new ~/.prime/node.json            # prompts for a password twice
    PW=... python -m protocol.keystore new key.json --password-env PW
    python -m protocol.keystore address key.json                  # prints the address, no password
    python -m protocol.keystore import key.json --key-env KEY     # encrypt an existing raw key

The keystore is standard Web3 secret-storage JSON (scrypt), readable by geth, foundry (`cast
wallet`), MetaMask imports and eth-account; the file is written with mode 0600.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from protocol.errors import KeystoreError

if TYPE_CHECKING:
    from protocol.identity import Identity

# protocol.identity (eth-account) is imported inside the functions: it takes ~1 s, and `--help`
# should answer at once.


def _new_password(args: argparse.Namespace) -> str:
    from protocol.identity import read_password

    if args.password_env or args.password_file:
        return read_password(env=args.password_env, file=args.password_file)
    first = read_password(prompt="New keystore password: ")
    if read_password(prompt="Repeat password: ") != first:
        raise KeystoreError("passwords do not match")
    return first


def _write(identity: Identity, args: argparse.Namespace) -> None:
    path = Path(args.path)
    if path.exists() and not args.force:
        raise KeystoreError(f"{path} exists; pass --force to overwrite")
    password = _new_password(args)
    if not password:
        raise KeystoreError("refusing an empty password")
    identity.save_keystore(path, password, scrypt_n=args.scrypt_n)
    print(identity.address)


def _address(path: str) -> str:
    from protocol.identity import checksum

    try:
        data = json.loads(Path(path).read_text())
        return checksum("0x" + str(data["address"]).removeprefix("0x"))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise KeystoreError(f"cannot read an address from {path}: {exc}") from exc


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m protocol.keystore", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_ in [("new", "create a fresh key"), ("import", "encrypt an existing raw private key")]:
        p = sub.add_parser(name, help=help_)
        p.add_argument("path", help="keystore file to write")
        p.add_argument("--password-env", metavar="VAR", help="read the password from this env var")
        p.add_argument("--password-file", metavar="FILE", help="read the password from this file")
        p.add_argument("--force", action="store_true", help="overwrite an existing file")
        p.add_argument(
            "--scrypt-n",
            type=int,
            default=None,
            help="scrypt cost (default 2**18); lower only for throwaway dev keys",
        )
        if name == "import":
            p.add_argument(
                "--key-env", metavar="VAR", required=True, help="env var holding the hex private key"
            )
    p = sub.add_parser("address", help="print the address stored in a keystore (no password needed)")
    p.add_argument("path")
    args = parser.parse_args(argv)
    from protocol.identity import Identity

    try:
        if args.command == "address":
            print(_address(args.path))
        elif args.command == "new":
            _write(Identity.create(), args)
        else:
            key = os.environ.get(args.key_env)
            if not key:
                raise KeystoreError(f"environment variable {args.key_env} is not set")
            _write(Identity.from_key(key), args)
    except KeystoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
