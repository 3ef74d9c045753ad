"""A validator proves who answers its `/v1/info`: the caller's fresh challenge and the body's digest, signed.

`/v1/info` names the address a URL speaks for, and the address decides whose work goes there. An unsigned body
is anyone's to write: a URL that copies a validator's info would hold that validator's work (issue 35 item 8). So
the caller sends `GET /v1/info?challenge=0x<32 random bytes>`; the validator answers its cached snapshot (the body,
unchanged) with the header `x-prime-info-proof`: an `InfoProof` envelope signed with the validator's key over the
challenge and the SHA-256 of the body bytes. Signing costs one signature per request (no lock, no thread) and the
body stays the snapshot rebuilt off the request path.

The caller checks, with `check_info_proof`: the envelope is signed in its domain by the address the body names,
about its own challenge and exactly these body bytes. A proof cannot be replayed: the challenge is fresh per request
and never reused by the caller. The caller still checks that address against the chain's validator role: a proof
shows only that the key answers at this URL. See docs/protocol/wire-format.md, "Info proof".
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from typing import Any

import httpx

from protocol.canonical import Hash32, parse_json
from protocol.deadline import bounded_request
from protocol.envelope import Body, Envelope, open_envelope, seal
from protocol.errors import ProtocolError, SignatureError
from protocol.identity import Identity, checksum
from protocol.nonce import random_nonce
from protocol.replay import RereadRecords

HEADER = "x-prime-info-proof"
"""The response header carrying the signed `InfoProof` envelope (canonical JSON)."""
QUERY = "challenge"
"""The query parameter of `/v1/info` carrying the caller's challenge (0x + 64 hex)."""
MAX_INFO_BYTES = 1 << 20
"""A `/v1/info` body is a few KiB; a longer one is not read."""
MAX_PROOF_BYTES = 2048
"""An info proof envelope is ~500 bytes; a longer header is not one."""
PROOF_AGE_S = 120.0
"""A proof older than this (by its signer's clock) is refused; the challenge is what makes it fresh."""


class InfoProof(Body):
    """A validator's signature over one `/v1/info` answer: the caller's challenge and the body's digest."""

    kind = "info-proof"
    version = 1

    challenge: Hash32
    """The caller's challenge, as sent (32 random bytes, one per request)."""
    info_sha256: Hash32
    """SHA-256 of the response body bytes this proof covers."""


def new_challenge() -> bytes:
    """32 bytes from the OS's CSPRNG: one per `/v1/info` request, never reused."""
    return secrets.token_bytes(32)


def parse_challenge(text: str | None) -> bytes | None:
    """The challenge of a `?challenge=` value; None when absent. `ProtocolError` unless 0x + 64 lower-case hex."""
    if text is None:
        return None
    if len(text) != 66 or not text.startswith("0x") or text[2:] != text[2:].lower():
        raise ProtocolError("challenge must be 0x followed by 64 lower-case hex digits")
    try:
        return bytes.fromhex(text[2:])
    except ValueError:
        raise ProtocolError("challenge must be 0x followed by 64 lower-case hex digits") from None


def prove_info(identity: Identity, challenge: bytes, body: bytes, *, domain: str) -> str:
    """The `x-prime-info-proof` header value: `identity`'s `InfoProof` over `challenge` and `body`."""
    proof = InfoProof(challenge=challenge, info_sha256=hashlib.sha256(body).digest())
    return seal(identity, proof, domain=domain, nonce=random_nonce()).to_bytes().decode()


def check_info_proof(header: str | None, body: bytes, *, challenge: bytes, domain: str) -> str:
    """The checksummed address that proved `body` for `challenge` (the one the body must name); `SignatureError`
    when the proof is missing, or signed for another challenge, body or domain; `ProtocolError` when malformed."""
    if not header:
        raise SignatureError("/v1/info came without a signed proof (x-prime-info-proof)")
    if len(header) > MAX_PROOF_BYTES:
        raise ProtocolError(f"info proof of {len(header)} bytes (limit {MAX_PROOF_BYTES})")
    envelope = Envelope.from_bytes(header.encode(), max_bytes=MAX_PROOF_BYTES)
    # the challenge is the freshness: no nonce needs remembering (RereadRecords records none)
    proof = open_envelope(envelope, domain=domain, replay_guard=RereadRecords(), body_types=[InfoProof],
                          max_age_s=PROOF_AGE_S)
    assert isinstance(proof, InfoProof)
    if bytes(proof.challenge) != challenge:
        raise SignatureError("the info proof answers another challenge (a replayed proof)")
    if bytes(proof.info_sha256) != hashlib.sha256(body).digest():
        raise SignatureError("the info proof covers another body")
    return checksum(envelope.signer)


@dataclass(frozen=True)
class ProvenInfo:
    """A `/v1/info` body whose signed proof names the address the body names."""

    address: str
    """The checksummed address that signed the proof (still to be checked against the chain's role)."""
    info: dict[str, Any]


def read_info(http: httpx.Client, url: str, *, domain: str | None, timeout_s: float) -> ProvenInfo:
    """`url`'s `/v1/info` with a fresh challenge, believed only when its proof is signed, for this challenge and
    these bytes, by the address the body names, in `domain` (None: the domain the body names, for a caller that
    learns the run from it and compares that domain with its own). `SignatureError` for a missing or wrong proof,
    `ProtocolError` for a malformed body, `httpx.HTTPError` (or `protocol.deadline.PeerTimeoutError`) when it does
    not answer in time."""
    challenge = new_challenge()
    r = bounded_request(http, "GET", url.rstrip("/") + "/v1/info", timeout_s, max_bytes=MAX_INFO_BYTES,
                        params={QUERY: "0x" + challenge.hex()})
    r.raise_for_status()
    info = parse_json(r.content)
    if not isinstance(info, dict) or not isinstance(info.get("validator"), str):
        raise ProtocolError("/v1/info is not an object naming its validator")
    claimed = checksum(info["validator"])
    if domain is None:
        if not isinstance(info.get("domain"), str):
            raise ProtocolError("/v1/info names no domain")
        domain = str(info["domain"])
    proved = check_info_proof(r.headers.get(HEADER), r.content, challenge=challenge, domain=domain)
    if proved != claimed:
        raise SignatureError(f"/v1/info names {claimed} but is proved by {proved}")
    return ProvenInfo(claimed, info)
