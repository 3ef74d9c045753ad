"""The libp2p identity file: created once with mode 0600, stable, refused when exposed or foreign."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from libp2p.crypto.secp256k1 import create_new_key_pair as secp256k1_pair

from discovery.errors import DiscoveryError
from discovery.peerkey import load_or_create, peer_id


def test_created_once_private_and_stable(tmp_path: Path) -> None:
    path = tmp_path / "state" / "libp2p.key"
    first = peer_id(load_or_create(path))
    assert first.startswith("12D3KooW")  # an Ed25519 peer id
    assert path.stat().st_mode & 0o777 == 0o600
    assert peer_id(load_or_create(path)) == first
    assert list(path.parent.iterdir()) == [path]  # no temp file left


def test_exposed_key_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "libp2p.key"
    load_or_create(path)
    os.chmod(path, 0o644)
    with pytest.raises(DiscoveryError, match="chmod 600"):
        load_or_create(path)


@pytest.mark.parametrize("content", [b"", b"garbage" * 10, b"x" * 5000])
def test_garbage_is_refused(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "libp2p.key"
    path.write_bytes(content)
    os.chmod(path, 0o600)
    with pytest.raises(DiscoveryError):
        load_or_create(path)


def test_a_non_ed25519_key_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "libp2p.key"
    path.write_bytes(secp256k1_pair().private_key.serialize())
    os.chmod(path, 0o600)
    with pytest.raises(DiscoveryError, match="Ed25519"):
        load_or_create(path)
