"""SHARDCAST errors: every one derives from `protocol.errors.RelayError` (and a finer root where one fits)."""

from __future__ import annotations

from protocol.errors import ConfigError, OversizeError, ProtocolError, RelayError, ReplayError, SignatureError


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


class SourceTimeoutError(SourceError):
    """A relay accepted the request (or the connection) and then said nothing within the time allowed: hung,
    not refusing. The client skips it until it answers again (`SourceBoard.timed_out`)."""

    code = "source_timeout"


class PublishError(RelayError):
    """A checkpoint could not be sharded, hashed or written into the origin's store."""

    code = "publish"


class StorageError(RelayError):
    """Local disk refused a version: no space for a declared file, a file larger than the file system
    allows, or a store/output directory that cannot be created, written or renamed (names the path)."""

    code = "storage"


class RelayConfigError(RelayError, ConfigError):
    """A SHARDCAST setting is unusable: no sources, retention below 1, a port that cannot be bound."""

    code = "config"


class DeltaError(RelayError):
    """A delta version cannot be applied: its index is malformed or points outside its files or the base's."""

    code = "bad_delta"


class DeltaBaseError(DeltaError):
    """A delta names a base this side does not hold: another version, or weights whose hash is not the one
    the delta was made against."""

    code = "wrong_base"


class DeltaMismatchError(DeltaError):
    """Applying a delta did not reproduce, bit for bit, the full weights its signed manifest names."""

    code = "delta_mismatch"
