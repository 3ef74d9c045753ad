"""Fixtures of the discovery unit tests: three keys and the trust that believes two of them."""

from __future__ import annotations

import pytest
from discovery_testkit import Keys, make_admission

from discovery.admission import Admission, Trust, allow
from protocol.identity import Identity


@pytest.fixture(scope="session")
def keys() -> Keys:
    return Keys(Identity.create(), Identity.create(), Identity.create())


@pytest.fixture
def trust(keys: Keys) -> Trust:
    return Trust(trainer=keys.trainer.address, is_validator=allow([keys.validator.address]))


@pytest.fixture
def admission(trust: Trust) -> Admission:
    return make_admission(trust)
