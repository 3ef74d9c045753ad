"""Errors of the discovery library, under the project's one root (`protocol.errors`).

A peer's bad announcement is one of the `ProtocolError` subclasses (it is counted and dropped,
never forwarded); a failure on our own side (key file, host that cannot start) is `DiscoveryError`.
"""

from __future__ import annotations

from protocol.errors import PrimeError, ProtocolError, SignatureError


class DiscoveryError(PrimeError):
    """Discovery cannot run here: unreadable key file, a host that does not start, a call after stop."""

    code = "discovery"


class NotBelievedError(SignatureError):
    """The signer holds no right to announce on this topic (not the run's trainer, not a validator),
    or the announcement contradicts the chain."""

    code = "not_believed"


class PeerMismatchError(SignatureError):
    """The announcement names another libp2p peer than the one that published it."""

    code = "peer_mismatch"


class RateLimitedError(ProtocolError):
    """A peer or signer sends announcements faster than its limit."""

    code = "rate_limited"


class StaleError(ProtocolError):
    """An announcement older than the one already held from the same signer (or past its TTL)."""

    code = "stale"
