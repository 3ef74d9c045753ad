"""The discovery config section."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from discovery.config import DiscoveryConfig


def test_off_unless_enabled_or_bootstrapped() -> None:
    assert not DiscoveryConfig().active
    assert DiscoveryConfig(enabled=True).active
    assert DiscoveryConfig(bootstrap=["/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWJeBihrd6fXLo9Z5ShnedY1ahcqVjAikAJZ1qQGpD4ohP"]).active


def test_limits_follow_config() -> None:
    lim = DiscoveryConfig(ttl_s=90, max_message_bytes=4096, signer_burst=3).limits()
    assert (lim.ttl_s, lim.max_bytes, lim.signer_burst) == (90, 4096, 3)


def test_typos_and_bad_values_are_errors() -> None:
    with pytest.raises(ValidationError):
        DiscoveryConfig(bootstap=[])  # type: ignore[call-arg]
    with pytest.raises(ValidationError):
        DiscoveryConfig(listen=["127.0.0.1:4001"])
    with pytest.raises(ValidationError):
        DiscoveryConfig(reannounce_s=0)
