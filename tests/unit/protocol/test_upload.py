"""The signed upload header (`protocol.upload`): read back exactly as signed, refused when it is partial, forged,
replayed at another validator or route, or out of its time window."""

from __future__ import annotations

import pytest

from protocol.errors import ExpiredError, ProtocolError, SignatureError
from protocol.identity import Identity
from protocol.upload import BODY_SHA256, SIGNATURE, SIGNER, read_upload_headers, upload_headers

DOMAIN = "prime/31337/0x5FbDB2315678afecb367f032d93F642f64180aa3/run"
VALIDATOR = Identity.create().address


def _read(headers: dict[str, str], **kw: object) -> object:
    args: dict[str, object] = {"domain": DOMAIN, "validator": VALIDATOR, "path": "/v1/submissions", **kw}
    return read_upload_headers(headers, **args)  # type: ignore[arg-type]


def test_a_header_reads_back_as_signed() -> None:
    node = Identity.create()
    headers = upload_headers(node, b"body", domain=DOMAIN, validator=VALIDATOR, path="/v1/submissions")
    claim = _read(headers)
    assert claim is not None and claim.signer == node.address  # type: ignore[attr-defined]
    assert _read({}) is None  # no header at all: anonymous


def test_a_header_is_bound_to_its_validator_route_body_and_time() -> None:
    node = Identity.create()
    headers = upload_headers(node, b"body", domain=DOMAIN, validator=VALIDATOR, path="/v1/submissions", now=1000.0)
    assert _read(headers, now=1000.0) is not None
    with pytest.raises(SignatureError):
        _read(headers, now=1000.0, validator=Identity.create().address)  # captured and sent to another validator
    with pytest.raises(SignatureError):
        _read(headers, now=1000.0, path="/v1/appeals")
    with pytest.raises(SignatureError):
        _read({**headers, SIGNER: Identity.create().address}, now=1000.0)  # someone else's stake claimed
    with pytest.raises(SignatureError):
        _read({**headers, BODY_SHA256: "0x" + "00" * 32}, now=1000.0)
    with pytest.raises(ExpiredError):
        _read(headers, now=1000.0 + 121.0)
    with pytest.raises(ProtocolError):
        _read({k: v for k, v in headers.items() if k != SIGNATURE}, now=1000.0)
    with pytest.raises(ProtocolError):
        _read({**headers, SIGNATURE: "0x" + "zz" * 65}, now=1000.0)
