"""Fixtures of the discovery unit tests: three keys and the trust that believes two of them."""

from __future__ import annotations

import pytest
from discovery_testkit import Keys, make_admission

from discovery.admission import Admission, Trust, allow, anyone
from protocol.identity import Identity


@pytest.fixture(scope="session")
def keys() -> Keys:
    return Keys(Identity.create(), Identity.create(), Identity.create())


@pytest.fixture
def trust(keys: Keys) -> Trust:
    # the stranger stands for a staked relay signer here (what a role admits is test_relay_signers_need_a_role_or_stake)
    return Trust(trainer=keys.trainer.address, is_validator=allow([keys.validator.address]), relay_signer=anyone)


@pytest.fixture
def admission(trust: Trust) -> Admission:
    return make_admission(trust)
