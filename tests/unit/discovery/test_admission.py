"""Admission: every way an announcement can be bad is refused with its own typed error, and the
checks that guard shared state (replay guard, rate buckets) run in the order that keeps a hostile
peer from spending an honest signer's nonce or bucket."""

from __future__ import annotations

import json

import pytest
from discovery_testkit import (
    DOMAIN,
    NOW,
    OTHER_PEER,
    PEER,
    Keys,
    make_admission,
    policy,
    relay,
    sign,
    validator_body,
)

from discovery.admission import Admission, Limits, Trust, allow
from discovery.errors import NotBelievedError, PeerMismatchError, RateLimitedError
from discovery.messages import PolicyAnnounced, Topic
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


def test_each_topic_admits_its_signers(admission: Admission, keys: Keys) -> None:
    ann = admission.admit(sign(keys.trainer, policy(7)), topic=Topic.POLICY, origin_peer=PEER)
    assert isinstance(ann.body, PolicyAnnounced) and ann.body.policy_version == 7
    assert ann.signer == keys.trainer.address and ann.expires_at == NOW + admission.limits.ttl_s
    admission.admit(sign(keys.validator, validator_body()), topic=Topic.VALIDATORS, origin_peer=PEER)
    # Relays: a signer the reader's `relay_signer` admits (this fixture's admits the stranger).
    admission.admit(sign(keys.stranger, relay()), topic=Topic.RELAYS, origin_peer=PEER)


def test_forged_signature_is_refused(admission: Admission, keys: Keys) -> None:
    obj = json.loads(sign(keys.trainer, policy(7)))
    obj["body"]["policy_version"] = 8  # tampered after signing
    forged = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    with pytest.raises(SignatureError):
        admission.admit(forged, topic=Topic.POLICY)
    # Claiming to be the trainer while signing with another key:
    obj = json.loads(sign(keys.stranger, policy(9)))
    obj["signer"] = keys.trainer.address
    with pytest.raises(SignatureError):
        admission.admit(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode(), topic=Topic.POLICY)


def test_replay_is_refused(admission: Admission, keys: Keys) -> None:
    wire = sign(keys.validator, validator_body())
    admission.admit(wire, topic=Topic.VALIDATORS)
    with pytest.raises(ReplayError):
        admission.admit(wire, topic=Topic.VALIDATORS)


@pytest.mark.parametrize("offset", [-121.0, +31.0], ids=["stale", "future"])
def test_outside_the_ttl_or_skew_is_refused(admission: Admission, keys: Keys, offset: float) -> None:
    with pytest.raises(ExpiredError):
        admission.admit(sign(keys.validator, validator_body(), now=NOW + offset), topic=Topic.VALIDATORS)


def test_off_run_is_refused(admission: Admission, keys: Keys) -> None:
    other_run = DOMAIN.replace("run-a", "run-b")
    with pytest.raises(DomainError):
        admission.admit(sign(keys.trainer, policy(), domain=other_run), topic=Topic.POLICY)


def test_a_kind_on_the_wrong_topic_is_refused(admission: Admission, keys: Keys) -> None:
    with pytest.raises(UnknownVersionError):
        admission.admit(sign(keys.trainer, relay()), topic=Topic.POLICY)


def test_oversize_and_malformed_are_refused_unparsed(trust: Trust, keys: Keys) -> None:
    small = make_admission(trust, Limits(max_bytes=600))
    wire = sign(keys.stranger, relay(versions=tuple(range(40))))
    assert len(wire) > 600
    with pytest.raises(OversizeError):
        small.admit(wire, topic=Topic.RELAYS)
    with pytest.raises(ProtocolError):
        small.admit(b"[1,2", topic=Topic.RELAYS)
    with pytest.raises(ProtocolError):  # valid JSON but not canonical (whitespace)
        small.admit(sign(keys.stranger, relay()).replace(b",", b", ", 1), topic=Topic.RELAYS)


def test_only_the_trainer_is_believed_on_policy(admission: Admission, keys: Keys) -> None:
    with pytest.raises(NotBelievedError):
        admission.admit(sign(keys.validator, policy()), topic=Topic.POLICY)
    nobody = make_admission(Trust())
    with pytest.raises(NotBelievedError):
        nobody.admit(sign(keys.trainer, policy()), topic=Topic.POLICY)


def test_only_validators_are_believed_on_validators(admission: Admission, keys: Keys) -> None:
    with pytest.raises(NotBelievedError):
        admission.admit(sign(keys.stranger, validator_body()), topic=Topic.VALIDATORS)


def test_an_unbelieved_signer_spends_no_nonce(keys: Keys) -> None:
    # The role check runs before the nonce is recorded: the same bytes pass once the signer is believed.
    believed: set[str] = set()
    adm = make_admission(Trust(is_validator=believed.__contains__))
    wire = sign(keys.validator, validator_body())
    with pytest.raises(NotBelievedError):
        adm.admit(wire, topic=Topic.VALIDATORS)
    believed.add(keys.validator.address)
    adm.admit(wire, topic=Topic.VALIDATORS)


def test_peer_binding_is_checked_before_the_nonce_is_spent(admission: Admission, keys: Keys) -> None:
    # A peer re-publishing someone's fresh announcement must not burn its nonce (that would
    # suppress the genuine copy arriving later from its own peer).
    wire = sign(keys.validator, validator_body(peer=PEER))
    with pytest.raises(PeerMismatchError):
        admission.admit(wire, topic=Topic.VALIDATORS, origin_peer=OTHER_PEER)
    admission.admit(wire, topic=Topic.VALIDATORS, origin_peer=PEER)


def test_policy_hook_can_refuse(trust: Trust, keys: Keys) -> None:
    on_chain = {(3, b"\x11" * 32)}
    hooked = make_admission(
        Trust(trainer=trust.trainer, policy_check=lambda b: (b.policy_version, b.manifest_hash) in on_chain)
    )
    hooked.admit(sign(keys.trainer, policy(3)), topic=Topic.POLICY)
    with pytest.raises(NotBelievedError, match="not on chain"):
        hooked.admit(sign(keys.trainer, policy(4)), topic=Topic.POLICY)


def test_rate_limits_per_forwarder_origin_and_signer(trust: Trust, keys: Keys) -> None:
    lim = Limits(forwarder_rate=1e-9, forwarder_burst=2, origin_rate=1e-9, origin_burst=2,
                 signer_rate=1e-9, signer_burst=2)
    adm = make_admission(trust, lim)
    # Forwarder: checked before parsing, so junk counts too.
    for _ in range(2):
        with pytest.raises(ProtocolError):
            adm.admit(b"junk", topic=Topic.RELAYS, forwarder="fwd")
    with pytest.raises(RateLimitedError):
        adm.admit(sign(keys.stranger, relay()), topic=Topic.RELAYS, forwarder="fwd")
    # Origin: per publishing peer.
    adm = make_admission(trust, lim)
    for _ in range(2):
        adm.admit(sign(keys.stranger, relay()), topic=Topic.RELAYS, origin_peer=PEER)
    with pytest.raises(RateLimitedError, match="publishes"):
        adm.admit(sign(keys.validator, relay()), topic=Topic.RELAYS, origin_peer=PEER)
    adm.admit(sign(keys.validator, relay(peer=OTHER_PEER)), topic=Topic.RELAYS, origin_peer=OTHER_PEER)
    # Signer: per Ethereum key, whichever peer carries it.
    adm = make_admission(trust, lim)
    for _ in range(2):
        adm.admit(sign(keys.stranger, relay()), topic=Topic.RELAYS)
    with pytest.raises(RateLimitedError, match="announces"):
        adm.admit(sign(keys.stranger, relay()), topic=Topic.RELAYS)
    adm.admit(sign(keys.validator, relay()), topic=Topic.RELAYS)


def test_replays_do_not_spend_the_signers_bucket(trust: Trust, keys: Keys) -> None:
    adm = make_admission(trust, Limits(signer_rate=1e-9, signer_burst=2))
    wire = sign(keys.stranger, relay())
    adm.admit(wire, topic=Topic.RELAYS)
    for _ in range(5):
        with pytest.raises(ReplayError):
            adm.admit(wire, topic=Topic.RELAYS)
    adm.admit(sign(keys.stranger, relay()), topic=Topic.RELAYS)


def test_relay_signers_need_a_role_or_stake(keys: Keys) -> None:
    """Issue 23 item 12: by default only the trainer (its origin) and validators may announce relays; a reader
    with a chain adds staked nodes (`relay_signer`); a key made for free is not believed, and its announcement
    is refused before its nonce is recorded."""
    default = make_admission(Trust(trainer=keys.trainer.address, is_validator=allow([keys.validator.address])))
    default.admit(sign(keys.trainer, relay()), topic=Topic.RELAYS)
    default.admit(sign(keys.validator, relay()), topic=Topic.RELAYS)
    wire = sign(keys.stranger, relay())
    with pytest.raises(NotBelievedError):
        default.admit(wire, topic=Topic.RELAYS)
    staked = make_admission(Trust(trainer=keys.trainer.address, relay_signer=allow([keys.stranger.address])))
    staked.admit(wire, topic=Topic.RELAYS)  # the same envelope, now from a staked signer: believed
    with pytest.raises(NotBelievedError):
        staked.admit(sign(Identity.create(), relay()), topic=Topic.RELAYS)
