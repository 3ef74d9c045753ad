"""The signed `precision` of a submission (issue 35 item 5): a closed set, absent in an old node's envelope (which
still opens, byte for byte, and is judged as `UNDECLARED_PRECISION`), never null. Known-answer envelopes in
tests/data/protocol/submission_vectors.json (`undeclared` was sealed by the code before the field)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from protocol.envelope import Envelope, open_envelope
from protocol.episodes import EpisodeSubmission
from protocol.errors import ProtocolError
from protocol.identity import Identity
from protocol.replay import ReplayGuard
from protocol.rollout import UNDECLARED_PRECISION, Precision, Submission

VECTORS = json.loads((Path(__file__).parents[2] / "data" / "protocol" / "submission_vectors.json").read_text())
KEY = "0xac0974bec39a17e36ba4a6b4d238ff944bacb478cbed5efcae784d7bf4f2ff80"


def _open(data: bytes) -> Submission:
    env = Envelope.from_bytes(data, max_bytes=1 << 20)
    body = open_envelope(env, domain=VECTORS["domain"], replay_guard=ReplayGuard(":memory:"), now=VECTORS["now"])
    assert isinstance(body, Submission)
    return body


def test_an_envelope_sealed_before_the_field_opens_and_is_judged_as_bf16() -> None:
    data = VECTORS["undeclared"].encode()
    assert b"precision" not in data
    sub = _open(data)
    assert sub.precision is None and sub.declared_precision == UNDECLARED_PRECISION == Precision.BF16
    assert Envelope.from_bytes(data, max_bytes=1 << 20).to_bytes() == data  # still its one canonical encoding


def test_a_declared_precision_is_signed() -> None:
    data = VECTORS["fp32"].encode()
    sub = _open(data)
    assert sub.precision == sub.declared_precision == Precision.FP32
    # the same body with another precision is another signed message: the signature no longer recovers
    tampered = data.replace(b'"precision":"fp32"', b'"precision":"bf16"')
    with pytest.raises(ProtocolError):
        _open(tampered)


@pytest.mark.parametrize("value", ["int8", "FP32", "float32", None, 32])
def test_an_unknown_or_null_precision_is_refused(value: object) -> None:
    # properly signed by the node's key, so only the body's `precision` can be what is refused
    env = json.loads(VECTORS["undeclared"])
    env.update(body={**env["body"], "precision": value}, nonce=44)
    unsigned = Envelope.model_validate({**env, "signature": "0x" + "00" * 64 + "1b"}, strict=False)
    bad = unsigned.model_copy(update={"signature": Identity.from_key(KEY).sign_message(unsigned.signing_bytes())})
    with pytest.raises(ProtocolError, match="precision|canonical"):
        open_envelope(bad, domain=VECTORS["domain"], replay_guard=ReplayGuard(":memory:"), now=VECTORS["now"])


def test_episode_submissions_carry_it_too() -> None:
    assert "precision" in EpisodeSubmission.model_fields
    assert EpisodeSubmission.model_fields["precision"].default is None
