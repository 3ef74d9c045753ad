"""Signed envelopes: the one wire form of every message that crosses a process boundary.

A message type is a frozen pydantic model deriving from `Body` that names its `kind` and schema
`version`; defining the class registers it. The sender `seal`s a body with its identity; the
receiver parses bytes with `Envelope.from_bytes` (size limit first) and `open_envelope`s them, which
returns the typed body only after every check passed. See protocol/README.md for the wire format.

`from_bytes` accepts only the canonical encoding (bytes equal to `to_bytes()` of what they parse
to; signature with v in {27, 28}), so each envelope has one byte string.

Checks on open, cheapest first, each with its own error (all `ProtocolError` subclasses):

1. domain equals the receiver's (`DomainError`): a message for one network/run is useless on another;
2. (kind, version) is one the receiver accepts (`UnknownVersionError`);
3. timestamp inside [now - max_age_s, now + max_skew_s] (`ExpiredError`);
4. the signature recovers to the claimed signer, and that signer is the expected one (`SignatureError`);
5. the body validates against its model and is in canonical form (`ProtocolError`);
6. the receiver's admission hook, if it gave one (`admit(signer)`): whatever the receiver decides about an
   authenticated sender before it spends a nonce on it (a validator: active stake, rate, quota, room), with the
   receiver's own errors;
7. (domain, signer, nonce) was never accepted before (`ReplayError`), recorded atomically; a message
   sent at or before the guard's pruning horizon is refused (`ExpiredError`).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterable
from typing import Annotated, Any, ClassVar, Protocol, get_args, get_origin

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator

from protocol.canonical import Address, HexBytes, canonical_bytes, from_hex, parse_json
from protocol.errors import (
    DomainError,
    ExpiredError,
    OversizeError,
    ProtocolError,
    SignatureError,
    UnknownVersionError,
)
from protocol.identity import Identity, check_signature_form, checksum, recover_message

log = logging.getLogger(__name__)

# Prefixed to the canonical header+body before EIP-191 signing, so an envelope signature can never be
# mistaken for a signature over some other canonical-JSON object made by the same key.
ENVELOPE_TAG = b"prime-envelope/v1\n"
KIND_PATTERN = r"^[a-z][a-z0-9_.\-]{0,63}$"
MAX_NONCE = 2**128

_REGISTRY: dict[tuple[str, int], type[Body]] = {}


class NonceGuard(Protocol):
    """What `open_envelope` needs from a replay guard (see `protocol.replay.ReplayGuard`)."""

    def check_and_record(
        self, domain: str, signer: str, nonce: int, *, sent_at: float, expires_at: float, now: float | None = None
    ) -> None: ...


def _has_bare_bytes(tp: Any, metadata: Iterable[Any] = (), seen: set[int] | None = None) -> bool:
    """Whether annotation `tp` holds a `bytes` that is not `HexBytes` (it would not survive JSON)."""
    seen = set() if seen is None else seen
    if tp is bytes or tp is bytearray:
        return not any(isinstance(m, BeforeValidator) and m.func is from_hex for m in metadata)
    if get_origin(tp) is Annotated:
        inner, *extra = get_args(tp)
        return _has_bare_bytes(inner, extra, seen)
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        if id(tp) in seen:
            return False
        seen.add(id(tp))
        return any(_has_bare_bytes(f.annotation, f.metadata, seen) for f in tp.model_fields.values())
    return any(_has_bare_bytes(arg, (), seen) for arg in get_args(tp))


class Body(BaseModel):
    """Base of every message body. Subclasses set `kind` and `version` and are registered on definition.

    Use `HexBytes` (not `bytes`) for binary fields; a bare `bytes` field is refused at class
    definition because it has no faithful JSON form.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: ClassVar[str]
    version: ClassVar[int]

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        kind, version = cls.__dict__.get("kind"), cls.__dict__.get("version")
        if kind is None and version is None:
            return  # an intermediate base class, not a message type
        if not isinstance(kind, str) or not re.match(KIND_PATTERN, kind):
            raise TypeError(f"{cls.__qualname__}.kind must match {KIND_PATTERN}, got {kind!r}")
        if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version < 2**31:
            raise TypeError(f"{cls.__qualname__}.version must be an int in [0, 2**31), got {version!r}")
        for name, field in cls.model_fields.items():
            if _has_bare_bytes(field.annotation, field.metadata):
                raise TypeError(f"{cls.__qualname__}.{name}: use protocol.canonical.HexBytes, not bytes")
        previous = _REGISTRY.get((kind, version))
        if previous is not None and (previous.__module__, previous.__qualname__) != (
            cls.__module__,
            cls.__qualname__,
        ):
            raise TypeError(f"message ({kind!r}, v{version}) already defined by {previous.__qualname__}")
        _REGISTRY[(kind, version)] = cls


def registered_bodies() -> dict[tuple[str, int], type[Body]]:
    """A copy of the registry: every (kind, version) this process can open."""
    return dict(_REGISTRY)


def _resolve(kind: str, version: int, body_types: Iterable[type[Body]] | None) -> type[Body]:
    table = _REGISTRY if body_types is None else {(t.kind, t.version): t for t in body_types}
    found = table.get((kind, version))
    if found is None:
        known = sorted(v for (k, v) in table if k == kind)
        if known:
            raise UnknownVersionError(f"{kind!r} version {version} not accepted here (accepted: {known})")
        raise UnknownVersionError(f"message kind {kind!r} not accepted here")
    return found


class Envelope(BaseModel):
    """A signed message as it travels: header fields, the body as signed JSON, and the signature."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    kind: str = Field(pattern=KIND_PATTERN)
    """Message type name; with `version`, selects the body model."""
    version: int = Field(ge=0, lt=2**31)
    """Schema version of the body."""
    domain: str = Field(min_length=1, max_length=256)
    """The network/run this message is for (e.g. `prime/31337/0xPool.../run-1`)."""
    signer: Address
    """Checksummed address of the sender; the signature must recover to it."""
    nonce: int = Field(ge=0, lt=MAX_NONCE)
    """Unique per (domain, signer) within the age window; see `protocol.nonce`."""
    timestamp_ms: int = Field(ge=0, lt=2**63)
    """Sender's clock when sealed, unix milliseconds."""
    body: dict[str, Any]
    """The body exactly as signed (canonical JSON object)."""
    signature: HexBytes
    """65-byte EIP-191 signature over `ENVELOPE_TAG + canonical(header + body)`."""

    @field_validator("signature")
    @classmethod
    def _signature_form(cls, value: bytes) -> bytes:
        # One spelling per signature (65 bytes, low s, v in {27, 28}), checked before anything else.
        try:
            return check_signature_form(value)
        except SignatureError as exc:
            raise ValueError(str(exc)) from None

    def signing_bytes(self) -> bytes:
        """The exact bytes the signature is over."""
        return signing_bytes(
            kind=self.kind,
            version=self.version,
            domain=self.domain,
            signer=self.signer,
            nonce=self.nonce,
            timestamp_ms=self.timestamp_ms,
            body=self.body,
        )

    def to_bytes(self) -> bytes:
        """Canonical JSON of the whole envelope (what goes on the wire)."""
        return canonical_bytes(self.model_dump(mode="json"))

    @classmethod
    def from_bytes(cls, data: bytes, *, max_bytes: int) -> Envelope:
        """Parse wire bytes; `OversizeError` before parsing if too big, `ProtocolError` if malformed.

        Only the canonical encoding is accepted: the bytes must equal `to_bytes()` of what they
        parse to. Whitespace, key order, duplicate keys, `\\u` or `\\/` escapes, number spellings
        (`1.50`, `15e-1`), upper-case hex and the v = 0/1 signature form are all refused, so one
        envelope has exactly one byte string and a hash of the bytes is a safe identity.
        """
        if len(data) > max_bytes:
            raise OversizeError(f"envelope is {len(data)} bytes, limit {max_bytes}")
        obj = parse_json(data)
        if not isinstance(obj, dict):
            raise ProtocolError("envelope must be a JSON object")
        try:
            envelope = cls.model_validate(obj)
        except ValidationError as exc:
            raise ProtocolError(f"malformed envelope: {_short(exc)}") from exc
        if envelope.to_bytes() != data:
            raise ProtocolError("envelope bytes are not in canonical form")
        return envelope


def signing_bytes(
    *, kind: str, version: int, domain: str, signer: str, nonce: int, timestamp_ms: int, body: dict[str, Any]
) -> bytes:
    """`ENVELOPE_TAG` followed by the canonical JSON of the header fields and the body."""
    header = {
        "kind": kind,
        "version": version,
        "domain": domain,
        "signer": signer,
        "nonce": nonce,
        "timestamp_ms": timestamp_ms,
        "body": body,
    }
    return ENVELOPE_TAG + canonical_bytes(header)


def _short(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or '<root>'}: {e['msg']}" for e in exc.errors()[:5])


def seal(identity: Identity, body: Body, *, domain: str, nonce: int, now: float | None = None) -> Envelope:
    """Sign `body` for `domain` with `identity`; `nonce` must be new for this (domain, signer)."""
    kind, version = type(body).kind, type(body).version
    body_json = body.model_dump(mode="json")
    timestamp_ms = round((time.time() if now is None else now) * 1000)
    data = signing_bytes(
        kind=kind,
        version=version,
        domain=domain,
        signer=identity.address,
        nonce=nonce,
        timestamp_ms=timestamp_ms,
        body=body_json,
    )
    try:
        return Envelope(
            kind=kind,
            version=version,
            domain=domain,
            signer=identity.address,
            nonce=nonce,
            timestamp_ms=timestamp_ms,
            body=body_json,
            signature=identity.sign_message(data),
        )
    except ValidationError as exc:
        raise ProtocolError(f"cannot seal: {_short(exc)}") from exc


def open_envelope(
    envelope: Envelope,
    *,
    domain: str,
    replay_guard: NonceGuard,
    expected_signer: str | None = None,
    body_types: Iterable[type[Body]] | None = None,
    max_age_s: float = 600.0,
    max_skew_s: float = 60.0,
    now: float | None = None,
    admit: Callable[[str], None] | None = None,
) -> Body:
    """Check `envelope` (see the module docstring for the order) and return its typed body.

    `body_types` limits which message types this receiver accepts (default: every registered one).
    `admit(signer)` is the receiver's admission hook: it runs once the signer is authenticated and the body
    valid, and refuses by raising. The nonce is recorded only when every other check passed (admission
    included), so bad or refused messages consume nothing and can be sent again.
    """
    if envelope.domain != domain:
        raise DomainError(f"message is for domain {envelope.domain!r}, this is {domain!r}")
    body_type = _resolve(envelope.kind, envelope.version, body_types)
    now_s = time.time() if now is None else now
    sent_s = envelope.timestamp_ms / 1000
    if sent_s < now_s - max_age_s:
        raise ExpiredError(f"message is {now_s - sent_s:.1f} s old, limit {max_age_s} s")
    if sent_s > now_s + max_skew_s:
        raise ExpiredError(f"message is dated {sent_s - now_s:.1f} s in the future, limit {max_skew_s} s")
    signer = recover_message(envelope.signing_bytes(), envelope.signature)
    if signer != envelope.signer:
        raise SignatureError(f"signature recovers to {signer}, not the claimed signer {envelope.signer}")
    if expected_signer is not None and signer != checksum(expected_signer):
        raise SignatureError(f"signed by {signer}, expected {checksum(expected_signer)}")
    try:
        body = body_type.model_validate(envelope.body)
    except ValidationError as exc:
        raise ProtocolError(f"invalid {envelope.kind} v{envelope.version} body: {_short(exc)}") from exc
    # Lax validation may coerce ("5" -> 5) or fill defaults; insist the signed JSON was already the
    # canonical form of the body, so one body has exactly one signed encoding.
    if canonical_bytes(body.model_dump(mode="json")) != canonical_bytes(envelope.body):
        raise ProtocolError(f"{envelope.kind} v{envelope.version} body is not in canonical form")
    if admit is not None:
        admit(signer)
    replay_guard.check_and_record(
        domain, signer, envelope.nonce, sent_at=sent_s, expires_at=sent_s + max_age_s + max_skew_s, now=now_s
    )
    log.debug("opened %s v%d from %s nonce %d", envelope.kind, envelope.version, signer, envelope.nonce)
    return body


def open_bytes(
    data: bytes,
    *,
    max_bytes: int,
    domain: str,
    replay_guard: NonceGuard,
    expected_signer: str | None = None,
    body_types: Iterable[type[Body]] | None = None,
    max_age_s: float = 600.0,
    max_skew_s: float = 60.0,
    now: float | None = None,
    admit: Callable[[str], None] | None = None,
) -> tuple[Envelope, Body]:
    """`Envelope.from_bytes` then `open_envelope`: the usual receive path for a network handler."""
    envelope = Envelope.from_bytes(data, max_bytes=max_bytes)
    body = open_envelope(
        envelope,
        domain=domain,
        replay_guard=replay_guard,
        expected_signer=expected_signer,
        body_types=body_types,
        max_age_s=max_age_s,
        max_skew_s=max_skew_s,
        now=now,
        admit=admit,
    )
    return envelope, body
