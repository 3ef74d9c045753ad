"""The signed upload header: who sends a body, and its hash, readable before the body is.

A validator reads the HTTP headers of an upload (`POST /v1/submissions`, `/v1/appeals`, the peers' intake probe)
before its body. An envelope's own signature covers the body, so it can only be checked once the whole body is
in memory; a sender without stake could hold a slot with a body it never finishes. The upload header lets the
receiver check, from a few hundred bytes: the signature of a key over (domain, the receiving validator, the
route, the body's SHA-256, a timestamp), then that key's standing on chain; only then does the body take a slot,
and the body read must hash to what was signed. See docs/protocol/wire-format.md, "Upload header".

The message signed (EIP-191) is `UPLOAD_TAG` followed by the canonical JSON of
`{"body_sha256", "domain", "path", "timestamp_ms", "validator"}`: the tag keeps it apart from every envelope
signature (`prime-envelope/v1`) of the same key. A captured header is worth little: it names one validator and
one route, ages out after `max_age_s`, and admits only the very bytes it hashes (which the validator answers
once, then by their hash).
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass

from protocol.canonical import canonical_bytes
from protocol.errors import ExpiredError, ProtocolError, SignatureError
from protocol.identity import Identity, check_signature_form, checksum, recover_message

UPLOAD_TAG = b"prime-upload/v1\n"
SIGNER = "x-prime-signer"
BODY_SHA256 = "x-prime-body-sha256"
TIMESTAMP_MS = "x-prime-timestamp-ms"
SIGNATURE = "x-prime-signature"
HEADERS = (SIGNER, BODY_SHA256, TIMESTAMP_MS, SIGNATURE)
"""The header names (lower case, as HTTP/1.1 servers hand them over)."""

_HASH = re.compile(r"^0x[0-9a-f]{64}$")
_SIG = re.compile(r"^0x[0-9a-f]{130}$")
_ADDRESS = re.compile(r"^0x[0-9a-fA-F]{40}$")


@dataclass(frozen=True)
class UploadClaim:
    """A checked upload header: `signer` signed that the body hashes to `body_sha256`."""

    signer: str
    body_sha256: bytes


def _message(*, domain: str, validator: str, path: str, body_sha256: bytes, timestamp_ms: int) -> bytes:
    return UPLOAD_TAG + canonical_bytes({"body_sha256": "0x" + body_sha256.hex(), "domain": domain, "path": path,
                                         "timestamp_ms": timestamp_ms, "validator": checksum(validator)})


def upload_headers(identity: Identity, body: bytes, *, domain: str, validator: str, path: str,
                   now: float | None = None) -> dict[str, str]:
    """The headers that let `validator` check `identity` before it reads `body` (POSTed to `path`)."""
    digest = hashlib.sha256(body).digest()
    ts = round((time.time() if now is None else now) * 1000)
    sig = identity.sign_message(_message(domain=domain, validator=validator, path=path, body_sha256=digest,
                                         timestamp_ms=ts))
    return {SIGNER: identity.address, BODY_SHA256: "0x" + digest.hex(), TIMESTAMP_MS: str(ts),
            SIGNATURE: "0x" + sig.hex()}


def read_upload_headers(headers: Mapping[str, str], *, domain: str, validator: str, path: str,
                        max_age_s: float = 120.0, max_skew_s: float = 60.0,
                        now: float | None = None) -> UploadClaim | None:
    """The claim of a request's upload header; None when it carries none of the four headers. A header that is
    partial or malformed is a `ProtocolError`, one out of its time window an `ExpiredError`, one whose
    signature does not recover to its signer a `SignatureError`. Bounded work: each value is length-checked
    before it is decoded, and one signature recovery (~0.2 ms) is the most it costs."""
    values = {name: headers.get(name) for name in HEADERS}
    if all(v is None for v in values.values()):
        return None
    if any(v is None for v in values.values()):
        raise ProtocolError(f"a partial upload header (needs {', '.join(HEADERS)})")
    signer, digest, ts, sig = (str(values[n]) for n in HEADERS)
    if not _ADDRESS.match(signer) or not _HASH.match(digest) or not _SIG.match(sig) or not (
            ts.isascii() and ts.isdigit() and len(ts) <= 16):
        raise ProtocolError("a malformed upload header")
    timestamp_ms = int(ts)
    now_s = time.time() if now is None else now
    if not now_s - max_age_s <= timestamp_ms / 1000 <= now_s + max_skew_s:
        raise ExpiredError(f"upload header dated {timestamp_ms / 1000 - now_s:+.1f} s from now (window "
                           f"-{max_age_s:g} s .. +{max_skew_s:g} s)")
    signature = check_signature_form(bytes.fromhex(sig[2:]))
    body_sha256 = bytes.fromhex(digest[2:])
    recovered = recover_message(_message(domain=domain, validator=validator, path=path, body_sha256=body_sha256,
                                         timestamp_ms=timestamp_ms), signature)
    if recovered != checksum(signer):
        raise SignatureError(f"upload header signed by {recovered}, claims {signer}")
    return UploadClaim(recovered, body_sha256)
