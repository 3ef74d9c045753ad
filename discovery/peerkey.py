"""The libp2p identity: an Ed25519 key in a file of the role's state directory.

It is deliberately not the Ethereum key: the libp2p key signs every gossip message and must be
usable without unlocking the keystore, and a leak of it costs a peer id, not stake. Announcements
bind the two (each is signed by the Ethereum key and names the peer id).

The file holds the key in libp2p's standard protobuf encoding (`PrivateKey.serialize()`, what
go-libp2p's `crypto.MarshalPrivateKey` writes); it is created on first use with mode 0600, and a
file readable by group or others is refused, as ssh does.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.keys import KeyPair, KeyType
from libp2p.crypto.serialization import deserialize_private_key
from libp2p.peer.id import ID

from discovery.errors import DiscoveryError

MAX_KEY_FILE_BYTES = 4096


def load_or_create(path: str | Path) -> KeyPair:
    """The key pair stored at `path`, creating it (mode 0600) if the file does not exist."""
    path = Path(path)
    if not path.exists():
        _create(path)
    return _load(path)


def peer_id(keys: KeyPair) -> str:
    """The peer id (base58 text) of a key pair."""
    return str(ID.from_pubkey(keys.public_key).to_base58())


def _create(path: Path) -> None:
    keys = create_new_key_pair()
    data = keys.private_key.serialize()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        try:
            os.link(tmp, path)  # never replaces: a concurrent first start keeps the winner's key
        except FileExistsError:
            pass
    except OSError as exc:
        raise DiscoveryError(f"cannot write libp2p key {path}: {exc}") from exc
    finally:
        tmp.unlink(missing_ok=True)


def _load(path: Path) -> KeyPair:
    try:
        st = path.stat()
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise DiscoveryError(f"libp2p key {path} is accessible by others; chmod 600 it")
        if st.st_size > MAX_KEY_FILE_BYTES:
            raise DiscoveryError(f"libp2p key {path} is {st.st_size} bytes: not a key")
        data = path.read_bytes()
    except OSError as exc:
        raise DiscoveryError(f"cannot read libp2p key {path}: {exc}") from exc
    try:
        private = deserialize_private_key(data)
    except Exception as exc:  # protobuf and key decoders raise several unrelated types
        raise DiscoveryError(f"libp2p key {path} is not a serialized private key: {exc}") from exc
    if private.get_type() is not KeyType.Ed25519:
        raise DiscoveryError(f"libp2p key {path} is {private.get_type().name}, expected Ed25519")
    return KeyPair(private, private.get_public_key())
