"""Envelopes: sealing, the wire format, and every way a received message is rejected."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from protocol.canonical import HexBytes, canonical_bytes
from protocol.envelope import (
    ENVELOPE_TAG,
    Body,
    Envelope,
    open_bytes,
    open_envelope,
    registered_bodies,
    seal,
    signing_bytes,
)
from protocol.errors import (
    DomainError,
    ExpiredError,
    OversizeError,
    ProtocolError,
    ReplayError,
    SignatureError,
    UnknownVersionError,
)
from protocol.identity import Identity
from protocol.replay import ReplayGuard

DOMAIN = "prime/31337/test-run"
NOW = 1_800_000_000.0
# Anvil dev key #0 (public, test only): a fixed key makes the wire-format test pinnable.
ANVIL_KEY_0 = "0xac0974bec39a17e36ba4a6b4d238ff944bacb478cbed5efcae784d7bf4f2ff80"


class EnvTestPing(Body):
    kind = "test.ping"
    version = 1

    n: int
    note: str = ""
    blob: HexBytes = b""


class EnvTestPingV2(Body):
    kind = "test.ping"
    version = 2

    n: int
    tags: tuple[str, ...] = ()


class EnvTestOther(Body):
    kind = "test.other"
    version = 1

    x: float


@pytest.fixture
def ident() -> Identity:
    return Identity.create()


@pytest.fixture
def guard() -> ReplayGuard:
    return ReplayGuard(":memory:")


def _open(env: Envelope, guard: ReplayGuard, **kw: Any) -> Body:
    kw.setdefault("domain", DOMAIN)
    kw.setdefault("now", NOW)
    return open_envelope(env, replay_guard=guard, **kw)


def _reseal_raw(ident: Identity, fields: dict[str, Any]) -> bytes:
    """Sign arbitrary header/body values the way a (possibly buggy) sender would."""
    sig = ident.sign_message(signing_bytes(**fields))
    return canonical_bytes({**fields, "signature": sig})


def _fields(ident: Identity, **over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "kind": "test.ping",
        "version": 1,
        "domain": DOMAIN,
        "signer": ident.address,
        "nonce": 1,
        "timestamp_ms": int(NOW * 1000),
        "body": {"n": 1, "note": "", "blob": "0x"},
    }
    return {**base, **over}


def test_roundtrip(ident: Identity, guard: ReplayGuard) -> None:
    body = EnvTestPing(n=7, note="héllo", blob=b"\x00\xff")
    env = seal(ident, body, domain=DOMAIN, nonce=5, now=NOW)
    data = env.to_bytes()
    got_env, got = open_bytes(data, max_bytes=4096, domain=DOMAIN, replay_guard=guard, now=NOW)
    assert got == body and isinstance(got, EnvTestPing)
    assert got_env == env
    assert Envelope.from_bytes(data, max_bytes=4096).to_bytes() == data


def test_wire_format_is_canonical_and_pinned() -> None:
    ident = Identity.from_key(ANVIL_KEY_0)
    env = seal(ident, EnvTestPing(n=1, note="é", blob=b"\xab"), domain="d", nonce=2, now=1.5)
    data = env.to_bytes()
    assert data.startswith(
        b'{"body":{"blob":"0xab","n":1,"note":"\xc3\xa9"},"domain":"d","kind":"test.ping",'
    )
    assert b" " not in data and b"\n" not in data
    obj = json.loads(data)
    assert list(obj) == sorted(obj)
    assert obj["timestamp_ms"] == 1500 and obj["signer"] == ident.address
    signed = ENVELOPE_TAG + canonical_bytes({k: v for k, v in obj.items() if k != "signature"})
    assert env.signing_bytes() == signed
    # RFC 6979 signatures are deterministic: pin the bytes so encoders in other builds must agree.
    assert obj["signature"] == ("0x" + ident.sign_message(signed).hex())
    assert len(bytes.fromhex(obj["signature"][2:])) == 65


def test_registry_and_versions(ident: Identity, guard: ReplayGuard) -> None:
    assert registered_bodies()[("test.ping", 2)] is EnvTestPingV2
    v2 = seal(ident, EnvTestPingV2(n=1, tags=("a", "b")), domain=DOMAIN, nonce=1, now=NOW)
    assert _open(v2, guard) == EnvTestPingV2(n=1, tags=("a", "b"))


def test_unknown_kind_and_version(ident: Identity, guard: ReplayGuard) -> None:
    raw = _reseal_raw(ident, _fields(ident, version=9))
    with pytest.raises(UnknownVersionError, match=r"accepted: \[1, 2\]"):
        open_bytes(raw, max_bytes=4096, domain=DOMAIN, replay_guard=guard, now=NOW)
    raw = _reseal_raw(ident, _fields(ident, kind="test.nope"))
    with pytest.raises(UnknownVersionError, match="not accepted"):
        open_bytes(raw, max_bytes=4096, domain=DOMAIN, replay_guard=guard, now=NOW)


def test_body_types_restricts(ident: Identity, guard: ReplayGuard) -> None:
    env = seal(ident, EnvTestOther(x=1.5), domain=DOMAIN, nonce=1, now=NOW)
    with pytest.raises(UnknownVersionError):
        _open(env, guard, body_types=[EnvTestPing])
    assert _open(env, guard, body_types=[EnvTestPing, EnvTestOther]) == EnvTestOther(x=1.5)


def test_wrong_domain(ident: Identity, guard: ReplayGuard) -> None:
    env = seal(ident, EnvTestPing(n=1), domain="prime/1/other-run", nonce=1, now=NOW)
    with pytest.raises(DomainError):
        _open(env, guard)


@pytest.mark.parametrize(
    "change",
    [
        {"nonce": 2},
        {"timestamp_ms": int(NOW * 1000) + 1},
        {"body": {"n": 2, "note": "", "blob": "0x"}},
        {"kind": "test.other", "body": {"x": 1.0}},
    ],
    ids=["nonce", "timestamp", "body", "kind"],
)
def test_tampering_breaks_signature(ident: Identity, guard: ReplayGuard, change: dict[str, Any]) -> None:
    obj = json.loads(_reseal_raw(ident, _fields(ident)))
    obj.update(change)
    with pytest.raises(SignatureError):
        open_bytes(canonical_bytes(obj), max_bytes=4096, domain=DOMAIN, replay_guard=guard, now=NOW)


def test_domain_swap_breaks_signature(ident: Identity, guard: ReplayGuard) -> None:
    # An attacker relabels a message from another network with ours: the signature covers domain.
    obj = json.loads(_reseal_raw(ident, _fields(ident, domain="prime/1/other")))
    obj["domain"] = DOMAIN
    with pytest.raises(SignatureError):
        open_bytes(canonical_bytes(obj), max_bytes=4096, domain=DOMAIN, replay_guard=guard, now=NOW)


def test_claimed_signer_swapped(ident: Identity, guard: ReplayGuard) -> None:
    victim = Identity.create()
    obj = json.loads(_reseal_raw(ident, _fields(ident)))
    obj["signer"] = victim.address
    with pytest.raises(SignatureError, match="claimed signer"):
        open_bytes(canonical_bytes(obj), max_bytes=4096, domain=DOMAIN, replay_guard=guard, now=NOW)


def test_expected_signer(ident: Identity, guard: ReplayGuard) -> None:
    env = seal(ident, EnvTestPing(n=1), domain=DOMAIN, nonce=1, now=NOW)
    with pytest.raises(SignatureError, match="expected"):
        _open(env, guard, expected_signer=Identity.create().address)
    assert _open(env, guard, expected_signer=ident.address.lower()) == EnvTestPing(n=1)


def test_expiry_window(ident: Identity, guard: ReplayGuard) -> None:
    old = seal(ident, EnvTestPing(n=1), domain=DOMAIN, nonce=1, now=NOW - 601)
    with pytest.raises(ExpiredError, match="old"):
        _open(old, guard, max_age_s=600)
    future = seal(ident, EnvTestPing(n=1), domain=DOMAIN, nonce=2, now=NOW + 61)
    with pytest.raises(ExpiredError, match="future"):
        _open(future, guard, max_skew_s=60)
    edge_old = seal(ident, EnvTestPing(n=1), domain=DOMAIN, nonce=3, now=NOW - 599)
    edge_new = seal(ident, EnvTestPing(n=1), domain=DOMAIN, nonce=4, now=NOW + 59)
    _open(edge_old, guard, max_age_s=600)
    _open(edge_new, guard, max_skew_s=60)


def test_replay_rejected_and_failures_consume_nothing(ident: Identity, guard: ReplayGuard) -> None:
    env = seal(ident, EnvTestPing(n=1), domain=DOMAIN, nonce=42, now=NOW)
    _open(env, guard)
    with pytest.raises(ReplayError):
        _open(env, guard)
    # A different message reusing the nonce is a replay too.
    with pytest.raises(ReplayError):
        _open(seal(ident, EnvTestPing(n=2), domain=DOMAIN, nonce=42, now=NOW), guard)
    # Another sender's nonce 42 and the same sender's nonce 42 in another domain are independent.
    _open(seal(Identity.create(), EnvTestPing(n=1), domain=DOMAIN, nonce=42, now=NOW), guard)
    _open(seal(ident, EnvTestPing(n=1), domain="other", nonce=42, now=NOW), guard, domain="other")
    # A message that fails a check does not burn its nonce.
    late = seal(ident, EnvTestPing(n=1), domain=DOMAIN, nonce=43, now=NOW - 10_000)
    with pytest.raises(ExpiredError):
        _open(late, guard)
    _open(seal(ident, EnvTestPing(n=1), domain=DOMAIN, nonce=43, now=NOW), guard)


def test_the_admission_hook_sees_the_authenticated_signer_and_a_refusal_consumes_nothing(
        ident: Identity, guard: ReplayGuard) -> None:
    """`admit(signer)` runs after the signature and body checks and before the nonce is spent: a receiver refuses
    a sender (stake, rate, quota) with its own error, and the same envelope goes through once admitted."""

    class Refused(ProtocolError):
        code = "refused"

    seen: list[str] = []

    def refuse(signer: str) -> None:
        seen.append(signer)
        raise Refused("not now")

    env = seal(ident, EnvTestPing(n=1), domain=DOMAIN, nonce=7, now=NOW)
    with pytest.raises(Refused):
        _open(env, guard, admit=refuse)
    assert seen == [ident.address]
    assert _open(env, guard, admit=seen.append) == EnvTestPing(n=1)  # the nonce was not spent by the refusal
    with pytest.raises(ReplayError):
        _open(env, guard, admit=seen.append)
    # a forged or malformed envelope never reaches the hook
    forged = env.model_copy(update={"signer": Identity.create().address})
    with pytest.raises(SignatureError):
        _open(forged, guard, admit=refuse)
    assert seen == [ident.address, ident.address, ident.address]


def test_replay_rejected_after_restart(ident: Identity, tmp_path: Path) -> None:
    data = seal(ident, EnvTestPing(n=1), domain=DOMAIN, nonce=1, now=NOW).to_bytes()
    with ReplayGuard(tmp_path / "replay.sqlite") as g:
        open_bytes(data, max_bytes=4096, domain=DOMAIN, replay_guard=g, now=NOW)
    with ReplayGuard(tmp_path / "replay.sqlite") as g, pytest.raises(ReplayError):
        open_bytes(data, max_bytes=4096, domain=DOMAIN, replay_guard=g, now=NOW + 1)


def test_oversize_before_parsing(guard: ReplayGuard) -> None:
    with pytest.raises(OversizeError):
        Envelope.from_bytes(b"\xff" * 5000, max_bytes=4096)  # garbage: would be ProtocolError if parsed
    with pytest.raises(OversizeError):
        open_bytes(b"{}" * 3000, max_bytes=4096, domain=DOMAIN, replay_guard=guard)


def test_invalid_body_is_protocol_error(ident: Identity, guard: ReplayGuard) -> None:
    raw = _reseal_raw(ident, _fields(ident, body={"n": "lots", "note": "", "blob": "0x"}))
    with pytest.raises(ProtocolError, match="body"):
        open_bytes(raw, max_bytes=4096, domain=DOMAIN, replay_guard=guard, now=NOW)
    raw = _reseal_raw(ident, _fields(ident, body={"n": 1, "note": "", "blob": "0x", "extra": 1}))
    with pytest.raises(ProtocolError, match="extra"):
        open_bytes(raw, max_bytes=4096, domain=DOMAIN, replay_guard=guard, now=NOW)
    assert len(guard) == 0


@pytest.mark.parametrize(
    "body",
    [
        {"n": "1", "note": "", "blob": "0x"},  # coercible string
        {"n": 1.0, "note": "", "blob": "0x"},  # float for int
        {"n": 1},  # defaults left out
        {"n": 1, "note": "", "blob": "0xAB"},  # upper-case hex
    ],
    ids=["str-int", "float-int", "missing-defaults", "upper-hex"],
)
def test_non_canonical_body_rejected(ident: Identity, guard: ReplayGuard, body: dict[str, Any]) -> None:
    raw = _reseal_raw(ident, _fields(ident, body=body))
    with pytest.raises(ProtocolError, match="canonical"):
        open_bytes(raw, max_bytes=4096, domain=DOMAIN, replay_guard=guard, now=NOW)


def _valid_obj() -> dict[str, Any]:
    ident = Identity.from_key(ANVIL_KEY_0)
    return dict(json.loads(_reseal_raw(ident, _fields(ident))))


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"not json",
        b"\xff\xfe{}",
        b"[]",
        b'"string"',
        b"{}",
        b"[" * 100_000 + b"]" * 100_000,
        b'{"body":{"n":NaN}}',
        canonical_bytes({**_valid_obj(), "extra": 1}),
        canonical_bytes({k: v for k, v in _valid_obj().items() if k != "nonce"}),
        canonical_bytes({**_valid_obj(), "nonce": "1"}),
        canonical_bytes({**_valid_obj(), "nonce": -1}),
        canonical_bytes({**_valid_obj(), "nonce": 2**128}),
        canonical_bytes({**_valid_obj(), "version": True}),
        canonical_bytes({**_valid_obj(), "signer": _valid_obj()["signer"].lower()}),
        canonical_bytes({**_valid_obj(), "signer": "0x1234"}),
        canonical_bytes({**_valid_obj(), "signature": "0x" + "00" * 64}),
        canonical_bytes({**_valid_obj(), "signature": "0xzz"}),
        canonical_bytes({**_valid_obj(), "signature": 12}),
        canonical_bytes({**_valid_obj(), "kind": "Bad Kind!"}),
        canonical_bytes({**_valid_obj(), "body": [1, 2]}),
        canonical_bytes({**_valid_obj(), "domain": ""}),
    ],
)
def test_malformed_envelopes(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        Envelope.from_bytes(data, max_bytes=10**7)


def test_random_mutations_never_crash(ident: Identity) -> None:
    guard = ReplayGuard(":memory:")
    data = seal(ident, EnvTestPing(n=3, note="x", blob=b"\x01"), domain=DOMAIN, nonce=1, now=NOW).to_bytes()
    rng = random.Random(1234)
    accepted = 0
    for _ in range(400):
        buf = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            op = rng.random()
            pos = rng.randrange(len(buf))
            if op < 0.6:
                buf[pos] = rng.randrange(256)
            elif op < 0.8:
                del buf[pos]
            else:
                buf.insert(pos, rng.randrange(256))
        try:
            open_bytes(bytes(buf), max_bytes=4096, domain=DOMAIN, replay_guard=guard, now=NOW)
            accepted += 1
        except ProtocolError:
            pass
    # A mutation can only be accepted if it left the signed content intact (e.g. it hit nothing
    # semantic); after the first acceptance the nonce is spent, so at most one can get through.
    assert accepted <= 1


def test_body_class_rules() -> None:
    with pytest.raises(TypeError, match="HexBytes"):

        class RawBytes(Body):
            kind = "test.raw"
            version = 1
            data: list[bytes]

    with pytest.raises(TypeError, match="kind"):

        class BadKind(Body):
            kind = "Has Spaces"
            version = 1

    with pytest.raises(TypeError, match="already defined"):

        class Clash(Body):
            kind = "test.ping"
            version = 1

    class Intermediate(Body):  # no kind/version: a base class, not registered
        shared: int = 0

    assert all(t is not Intermediate for t in registered_bodies().values())


def test_seal_refuses_unencodable(ident: Identity) -> None:
    with pytest.raises(ProtocolError):
        seal(ident, EnvTestOther(x=float("nan")), domain=DOMAIN, nonce=1, now=NOW)
    with pytest.raises(ProtocolError):
        seal(ident, EnvTestPing(n=1), domain=DOMAIN, nonce=-1, now=NOW)


# -- one envelope, one encoding ------------------------------------------------------------------
# Every variant below decodes to the same (validly signed) envelope as the canonical bytes. The
# receiver must refuse all of them, so "hash of the envelope bytes" is a safe identity.


def _canonical_pair() -> tuple[Identity, bytes]:
    ident = Identity.from_key(ANVIL_KEY_0)
    env = seal(ident, EnvTestPing(n=3, note="é/x", blob=b"\xab\xcd"), domain=DOMAIN, nonce=7, now=NOW)
    return ident, env.to_bytes()


def _respell_signature(data: bytes, change: Any) -> bytes:
    obj = json.loads(data)
    obj["signature"] = change(obj["signature"])
    return canonical_bytes(obj)


def _flip_v(sig_hex: str) -> str:
    sig = bytes.fromhex(sig_hex[2:])
    return "0x" + (sig[:64] + bytes([sig[64] - 27])).hex()


_VARIANTS: dict[str, Any] = {
    "v-byte-0-1": lambda d: _respell_signature(d, _flip_v),
    "upper-hex-signature": lambda d: _respell_signature(d, lambda s: "0x" + s[2:].upper()),
    "escaped-non-ascii": lambda d: d.replace("é".encode(), b"\\u00e9"),
    "escaped-slash": lambda d: d.replace(b"/x", b"\\/x"),
    "escaped-ascii": lambda d: d.replace(b'"test.ping"', b'"\\u0074est.ping"'),
    "duplicate-key": lambda d: b'{"nonce":99,' + d[1:],
    "duplicate-key-same-value": lambda d: b'{"nonce":7,' + d[1:],
    "whitespace-pretty": lambda d: json.dumps(json.loads(d), indent=1, sort_keys=True, ensure_ascii=False).encode(),
    "whitespace-trailing": lambda d: d + b"\n",
    "whitespace-leading": lambda d: b" " + d,
    "unsorted-keys": lambda d: json.dumps(dict(reversed(list(json.loads(d).items()))), separators=(",", ":"),
                                          ensure_ascii=False).encode(),
}


@pytest.mark.parametrize("variant", sorted(_VARIANTS))
def test_only_the_canonical_encoding_is_accepted(variant: str) -> None:
    _, data = _canonical_pair()
    other = _VARIANTS[variant](data)
    assert other != data
    # Sanity: the variant is the same envelope in a different spelling (or, for the v byte, the
    # same signature in eth-account's other recovery-byte convention), not a broken one.
    assert {k: v for k, v in json.loads(other).items() if k != "signature"} == {
        k: v for k, v in json.loads(data).items() if k != "signature"
    }
    guard = ReplayGuard(":memory:")
    with pytest.raises(ProtocolError, match="canonical|recovery byte"):
        open_bytes(other, max_bytes=4096, domain=DOMAIN, replay_guard=guard, now=NOW)
    assert len(guard) == 0  # refused before anything was recorded
    open_bytes(data, max_bytes=4096, domain=DOMAIN, replay_guard=guard, now=NOW)


def test_float_body_spellings_refused(ident: Identity, guard: ReplayGuard) -> None:
    data = seal(ident, EnvTestOther(x=1.5), domain=DOMAIN, nonce=1, now=NOW).to_bytes()
    for spelling in (b"1.50", b"15e-1", b"1.5E0"):
        other = data.replace(b'"x":1.5', b'"x":' + spelling)
        assert other != data
        with pytest.raises(ProtocolError, match="canonical"):
            open_bytes(other, max_bytes=4096, domain=DOMAIN, replay_guard=guard, now=NOW)
    open_bytes(data, max_bytes=4096, domain=DOMAIN, replay_guard=guard, now=NOW)


def test_sealed_envelopes_are_canonical(ident: Identity) -> None:
    # Whatever `seal` produces, `from_bytes` takes back unchanged (floats, unicode, control
    # characters, big ints, empty and long blobs), so nothing that worked before is refused now.
    rng = random.Random(7)
    alphabet = ["a", "é", "\n", "\t", '"', "\\", "/", "\u2028", "\x00", "\x7f", "😀", "<", "&"]
    for i in range(200):
        note = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
        blob = rng.randbytes(rng.randint(0, 40))
        body: Body = (
            EnvTestOther(x=rng.choice([rng.uniform(-1e6, 1e6), rng.random() * 1e-300, 1e300, 0.1, -0.0, 2.0]))
            if i % 3 == 0
            else EnvTestPing(n=rng.randint(-(2**70), 2**70), note=note, blob=blob)
        )
        env = seal(ident, body, domain=DOMAIN, nonce=rng.randrange(2**128), now=NOW)
        data = env.to_bytes()
        assert Envelope.from_bytes(data, max_bytes=1 << 16) == env
        got_env, got = open_bytes(data, max_bytes=1 << 16, domain=DOMAIN, replay_guard=ReplayGuard(":memory:"),
                                  now=NOW)
        assert got == body and got_env.to_bytes() == data


@pytest.mark.parametrize("how", ["prune", "lazy"], ids=["pruned", "expired-not-pruned"])
def test_raising_max_age_does_not_reopen_pruned_replays(ident: Identity, tmp_path: Path, how: str) -> None:
    # Accepted under max_age 600, its record expires at NOW + 660 and is pruned; the receiver then
    # restarts with max_age 3600, under which the envelope is young enough again.
    data = seal(ident, EnvTestPing(n=1), domain=DOMAIN, nonce=1, now=NOW).to_bytes()
    path = tmp_path / "replay.sqlite"
    with ReplayGuard(path) as g:
        open_bytes(data, max_bytes=4096, domain=DOMAIN, replay_guard=g, now=NOW, max_age_s=600)
        if how == "prune":
            assert g.prune(now=NOW + 700) == 1
            assert len(g) == 0
    with ReplayGuard(path) as g:
        with pytest.raises((ReplayError, ExpiredError)):
            open_bytes(data, max_bytes=4096, domain=DOMAIN, replay_guard=g, now=NOW + 700, max_age_s=3600)
        # A fresh message from the same sender is still fine, and so is one sent after the horizon.
        fresh = seal(ident, EnvTestPing(n=2), domain=DOMAIN, nonce=2, now=NOW + 690).to_bytes()
        open_bytes(fresh, max_bytes=4096, domain=DOMAIN, replay_guard=g, now=NOW + 700, max_age_s=3600)
