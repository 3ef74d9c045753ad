"""Canonical JSON: the one byte encoding of a value that signatures are made over.

Rules (version 1):

* JSON text, UTF-8, no whitespace (`,` and `:` separators), object keys sorted by code point;
  non-ASCII characters are written as themselves, not as `\\u` escapes.
* Integers are written in full (any size); floats in Python's shortest round-trip form; NaN and
  the infinities are refused.
* `bytes` are written as lowercase `0x`-prefixed hex strings (use `HexBytes` in models so they
  decode back to bytes).
* Only dicts with string keys, lists/tuples, str, int, float, bool, None and bytes are encodable
  (the stdlib encoder turns int/float/bool/None keys into strings; do not rely on that).

Parsing (`parse_json`) is strict: no NaN/Infinity, valid UTF-8 only, bounded nesting; any failure
is a `ProtocolError`.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, PlainSerializer, ValidationInfo
from pydantic_core import from_json

from protocol.errors import ProtocolError


def to_hex(data: bytes) -> str:
    """`0x`-prefixed lowercase hex."""
    return "0x" + data.hex()


def from_hex(value: object) -> bytes:
    """Bytes from a `0x`-prefixed hex string (bytes pass through); `ValueError` otherwise."""
    if isinstance(value, bytes | bytearray):
        return bytes(value)
    if not isinstance(value, str) or not value.startswith("0x"):
        raise ValueError("expected a 0x-prefixed hex string")
    try:
        return bytes.fromhex(value[2:])
    except ValueError as exc:
        raise ValueError(f"invalid hex: {exc}") from exc


HexBytes = Annotated[bytes, BeforeValidator(from_hex), PlainSerializer(to_hex, when_used="json")]
"""A `bytes` field that travels as a 0x-hex string in canonical JSON."""


def _hash32(value: bytes, info: ValidationInfo) -> bytes:
    if len(value) != 32:
        raise ValueError(f"{info.field_name} must be 32 bytes, got {len(value)}")
    return value


Hash32 = Annotated[HexBytes, AfterValidator(_hash32)]
"""A 32-byte value (a work key, a SHA-256 digest) that travels as 0x-hex; any other length is refused."""


def _checksummed(value: str, info: ValidationInfo) -> str:
    # One spelling per address, so the signed bytes are unambiguous. `protocol.identity` loads eth-account
    # (half a second): imported on the first check, so a module that only declares fields stays light.
    from protocol.identity import checksum

    if checksum(value) != value:
        raise ValueError(f"{info.field_name} must be an EIP-55 checksummed address")
    return value


Address = Annotated[str, AfterValidator(_checksummed)]
"""An Ethereum address in its EIP-55 checksum form, the only spelling a wire message takes (a lower-case one
is refused; a string that is no address at all raises `SignatureError`)."""

_HEX_ADDRESS = re.compile(r"^0x[0-9a-fA-F]{40}$")


def _hex_address(value: str) -> str:
    if not _HEX_ADDRESS.match(value):
        raise ValueError(f"{value!r} is not a 0x-prefixed 20-byte address")
    return value


HexAddress = Annotated[str, AfterValidator(_hex_address)]
"""An address as an operator writes it in a config file: 0x and 40 hex digits, any case (the role checksums it
where it matters)."""


def _default(value: Any) -> Any:
    if isinstance(value, bytes | bytearray):
        return to_hex(bytes(value))
    raise TypeError(f"{type(value).__name__} has no canonical encoding")


def canonical_bytes(value: Any) -> bytes:
    """The canonical JSON encoding of `value` (see the module docstring); `ProtocolError` if impossible."""
    try:
        text = json.dumps(
            value,
            sort_keys=True,
            separators=(",", ":"),
            ensure_ascii=False,
            allow_nan=False,
            default=_default,
        )
        return text.encode("utf-8")
    except (TypeError, ValueError, RecursionError, UnicodeEncodeError) as exc:
        raise ProtocolError(f"value has no canonical encoding: {exc}") from exc


def parse_json(data: bytes) -> Any:
    """Parse untrusted JSON bytes; `ProtocolError` on anything malformed.

    Uses pydantic-core's parser (jiter): it refuses invalid UTF-8, lone surrogates and NaN, and stops
    at nesting depth 200 instead of overflowing the C stack as the stdlib parser can. Duplicate
    object keys keep the last value (as the stdlib does); that cannot smuggle unsigned content past
    an envelope check, because signatures are verified over the re-encoded parsed value.
    """
    try:
        return from_json(data, allow_inf_nan=False)
    except ValueError as exc:
        raise ProtocolError(f"malformed JSON: {exc}") from exc
