"""The multi-turn wire format: episode submissions (v2), the environment digest, feed items (v3)."""

from __future__ import annotations

import hashlib

import pytest
from pydantic import ValidationError

from protocol.envelope import open_envelope, seal
from protocol.episodes import (
    MAX_TURNS,
    EpisodeFeedItem,
    EpisodeFeedSample,
    EpisodeRollout,
    EpisodeSubmission,
    TaskEpisodes,
    TurnRollout,
    environment_digest,
)
from protocol.errors import ProtocolError
from protocol.identity import Identity
from protocol.replay import ReplayGuard
from protocol.rollout import Reason, Submission
from protocol.run import MAX_TOKENS

TASK = "0" * 32


def _turn(n: int, finish: str = "eos") -> TurnRollout:
    return TurnRollout(tokens=tuple(range(1, n + 1)), logprobs=(-0.5,) * n, finish_reason=finish,  # type: ignore[arg-type]
                       proofs=(b"\x00" * 258,) * ((n + 31) // 32))


def _episode(*turns: int) -> EpisodeRollout:
    return EpisodeRollout(turns=tuple(_turn(n) for n in turns), env_digest=environment_digest([[9, 9]]),
                          ended="done", reward=1.0)


def _submission(sample: EpisodeRollout) -> EpisodeSubmission:
    return EpisodeSubmission(run_id="r", node="0xf39Fd6e51aad88F6F4ce6aB8827279cffFb92266", policy_version=0,
                             manifest_hash="0x" + "11" * 32, counter=0, env="calc-arith", env_version="1",
                             tasks=(TaskEpisodes(task_id=TASK, samples=(sample,)),))


def test_environment_digest_encoding() -> None:
    # pinned: the node's commitment and the validator's replay must agree byte for byte
    assert environment_digest([[1, 2], [3]]).hex() == \
        "ea9e340dc4905f2f780b0d6737e2bf5235cbfe24c9ebe276e7d6ad78c96543ad"
    expected = hashlib.sha256(b"\0\0\0\x02" b"\0\0\0\x01" b"\0\0\0\x02" b"\0\0\0\x01" b"\0\0\0\x03").digest()
    assert environment_digest([[1, 2], [3]]) == expected
    assert environment_digest([]) == hashlib.sha256(b"").digest()
    # spans are length-prefixed: moving a boundary changes the digest
    assert environment_digest([[1], [2, 3]]) != environment_digest([[1, 2], [3]])
    with pytest.raises(ProtocolError):
        environment_digest([[2**32]])


def test_episode_submission_is_version_2_of_submission_and_round_trips() -> None:
    ident = Identity.create()
    sub = _submission(_episode(3, 2)).model_copy(update={"node": ident.address})
    env = seal(ident, sub, domain="d", nonce=1)
    with pytest.raises(ProtocolError, match="version 2 not accepted"):  # a v1-only receiver: refused by version
        open_envelope(env, domain="d", replay_guard=ReplayGuard(":memory:"), body_types=[Submission])
    opened = open_envelope(env, domain="d", replay_guard=ReplayGuard(":memory:"),
                           body_types=[Submission, EpisodeSubmission])
    assert opened == sub and (type(sub).kind, type(sub).version) == ("submission", 2)
    assert sub.n_tokens() == 5 and sub.n_samples() == 1


def test_episode_limits() -> None:
    with pytest.raises(ValidationError, match="logprobs"):
        TurnRollout(tokens=(1, 2), logprobs=(0.0,), finish_reason="eos", proofs=())
    with pytest.raises(ValidationError):
        EpisodeRollout(turns=(), env_digest=b"\0" * 32, ended="done", reward=0.0)
    with pytest.raises(ValidationError):
        EpisodeRollout(turns=(_turn(1),) * (MAX_TURNS + 1), env_digest=b"\0" * 32, ended="done", reward=0.0)
    with pytest.raises(ValidationError):
        EpisodeRollout(turns=(_turn(1),), env_digest=b"\0" * 31, ended="done", reward=0.0)
    with pytest.raises(ValidationError):
        EpisodeRollout(turns=(_turn(1),), env_digest=b"\0" * 32, ended="gave_up", reward=0.0)  # type: ignore[arg-type]
    # an oversize episode: every turn within bounds, the whole over MAX_TOKENS model tokens
    half = MAX_TOKENS // 2 + 1
    with pytest.raises(ValidationError, match="model tokens in one episode"):
        EpisodeRollout(turns=(_turn(half), _turn(half)), env_digest=b"\0" * 32, ended="done", reward=0.0)


def test_feed_sample_spans_and_loss_mask() -> None:
    s = EpisodeFeedSample(tokens=(5, 6, 7, 8, 9, 10), spans=((0, 2), (4, 2)), logprobs=(-1.0,) * 4, reward=0.5)
    assert s.loss_mask() == (True, True, False, False, True, True)
    for spans in (((1, 2),), ((0, 2), (1, 2)), ((0, 2), (5, 2)), ((0, 0),)):
        with pytest.raises(ValidationError):
            EpisodeFeedSample(tokens=(5, 6, 7, 8, 9, 10), spans=spans, logprobs=(-1.0,) * 2, reward=0.0)
    with pytest.raises(ValidationError, match="logprobs"):
        EpisodeFeedSample(tokens=(5, 6, 7), spans=((0, 2),), logprobs=(-1.0,), reward=0.0)
    assert (EpisodeFeedItem.kind, EpisodeFeedItem.version) == ("feed-item", 3)


def test_env_mismatch_is_hard_and_appended() -> None:
    # appended last: no existing uint16 code on chain moves
    assert list(Reason)[-2] is Reason.ENV_MISMATCH and Reason.ENV_MISMATCH.hard
    assert Reason.TERMINATION.code == Reason.ENV_MISMATCH.code - 1
