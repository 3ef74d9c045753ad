"""One exception root for the whole project; every package raises a subclass of `PrimeError`.

Classify once, never swallow: a peer's bad input becomes one of these (and, in a validator, a
recorded verdict carrying `code`), never a crash or a silent drop.
"""

from __future__ import annotations


class PrimeError(Exception):
    """Root of every error this project raises on purpose."""

    code: str = "error"


class ProtocolError(PrimeError):
    """A message or value broke the protocol (malformed, wrong type, wrong size)."""

    code = "protocol"


class SignatureError(ProtocolError):
    """A signature does not verify, or was made by someone other than the claimed signer."""

    code = "bad_signature"


class ReplayError(ProtocolError):
    """A signed message was seen before (its nonce/sequence is not new for that sender)."""

    code = "replay"


class ExpiredError(ProtocolError):
    """A signed message is older than allowed, or dated in the future beyond the clock skew."""

    code = "expired"


class UnknownVersionError(ProtocolError):
    """A message declares a kind or schema version this build does not speak."""

    code = "unknown_version"


class OversizeError(ProtocolError):
    """An input is larger than the configured limit."""

    code = "oversize"


class KeystoreError(PrimeError):
    """A keystore cannot be read, decrypted (wrong password) or written."""

    code = "keystore"


class ConfigError(PrimeError):
    """A configuration source is invalid (unknown key, bad value, unreadable file)."""

    code = "config"


class ModelError(PrimeError):
    """A model or checkpoint cannot be loaded or run (missing file, truncated weights, context overflow)."""

    code = "model"


class ProofError(PrimeError):
    """A TOPLOC proof is malformed (wrong length, bad modulus, wrong chunk count or dtype)."""

    code = "bad_proof"


class RelayError(PrimeError):
    """SHARDCAST failed: bad manifest, bad shard bytes, unreachable or misbehaving relay."""

    code = "relay"


class ChainError(PrimeError):
    """A chain call failed or reverted; `reason` holds the revert reason when there is one."""

    code = "chain"

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason


class EnvironmentError_(PrimeError):
    """An environment is unknown, or a task cannot be built or graded."""

    code = "environment"


# Public name without the trailing underscore would shadow the builtin `EnvironmentError`
# (an alias of OSError) in modules that star-import; callers import it as `TaskEnvironmentError`.
TaskEnvironmentError = EnvironmentError_


class UngradableError(EnvironmentError_):
    """Grading itself failed (a timeout on a starved grader, a dead worker, a sandbox that could not
    start, the grader out of memory): the answer was not judged, so this is not a low reward.

    Raised by `Environment.reward`; a wrong or malformed answer still returns a low reward. A
    validator turns this into a soft verdict (no slash), a trainer drops the sample's group.
    """

    code = "ungradable"


class DomainError(ProtocolError):
    """A signed message belongs to another network or run (its domain is not the receiver's)."""

    code = "wrong_domain"


class TrainerError(PrimeError):
    """The trainer cannot go on: e.g. a checkpoint to resume from does not fit the model or is corrupt."""

    code = "trainer"
