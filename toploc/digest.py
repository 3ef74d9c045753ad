"""`sha256sum`: the reference toploc's file checksum (its `toploc.utils.sha256sum`), same result."""

from __future__ import annotations

import hashlib
import os


def sha256sum(filename: str | os.PathLike[str], chunk_size: int = 65536) -> str:
    """Lowercase hex SHA-256 of a file's bytes, read `chunk_size` bytes at a time (OSError if unreadable)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    digest = hashlib.sha256()
    with open(filename, "rb", buffering=0) as fh:
        while chunk := fh.read(chunk_size):
            digest.update(chunk)
    return digest.hexdigest()
