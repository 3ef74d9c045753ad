"""SHARDCAST errors: every one derives from `protocol.errors.RelayError` (and a finer root where one fits)."""

from __future__ import annotations

from protocol.errors import OversizeError, ProtocolError, RelayError, ReplayError, SignatureError


class ManifestError(RelayError, ProtocolError):
    """A manifest is malformed: bad JSON, unknown format, inconsistent shard table, unsafe file name."""

    code = "bad_manifest"


class ManifestSignatureError(ManifestError, SignatureError):
    """A manifest's signature does not verify or was made by a key other than the trainer's."""

    code = "bad_signature"


class StaleManifestError(ManifestError, ReplayError):
    """A validly signed manifest for another run, or older than what was already held or asked for."""

    code = "stale_manifest"


class ManifestTooLargeError(ManifestError, OversizeError):
    """A manifest (or an answer from a relay) is larger than the configured limit."""

    code = "oversize"


class ShardHashError(RelayError):
    """A relay served bytes whose hash (or length) does not match the signed manifest."""

    code = "bad_shard"


class SourceError(RelayError):
    """A relay could not be reached, answered with an error, or cut a transfer short."""

    code = "source"


class PublishError(RelayError):
    """A checkpoint could not be sharded, hashed or written into the origin's store."""

    code = "publish"
