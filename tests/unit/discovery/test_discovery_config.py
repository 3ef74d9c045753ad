"""The discovery config section."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from discovery.admission import Limits
from discovery.config import DiscoveryConfig


def test_off_unless_enabled_or_bootstrapped() -> None:
    assert not DiscoveryConfig().active
    assert DiscoveryConfig(enabled=True).active
    assert DiscoveryConfig(bootstrap=["/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWJeBihrd6fXLo9Z5ShnedY1ahcqVjAikAJZ1qQGpD4ohP"]).active


def test_limits_follow_config() -> None:
    lim = Limits.from_config(DiscoveryConfig(ttl_s=90, max_message_bytes=4096, signer_burst=3))
    assert (lim.ttl_s, lim.max_bytes, lim.signer_burst) == (90, 4096, 3)


def test_typos_and_bad_values_are_errors() -> None:
    with pytest.raises(ValidationError):
        DiscoveryConfig(bootstap=[])  # type: ignore[call-arg]
    with pytest.raises(ValidationError):
        DiscoveryConfig(listen=["127.0.0.1:4001"])
    with pytest.raises(ValidationError):
        DiscoveryConfig(reannounce_s=0)


def test_bootstrap_from_chain_only_when_enabled_and_none_configured() -> None:
    from discovery.config import MAX_CHAIN_BOOTSTRAP, usable_bootstrap

    good = "/ip4/10.0.0.5/tcp/4001/p2p/12D3KooWA"
    record = ["not a multiaddr", "/ip4/10.0.0.5/tcp/4001", good, good, 7, "/" + "a" * 300]
    assert usable_bootstrap(record) == ([good], ["not a multiaddr", "/ip4/10.0.0.5/tcp/4001", 7, "/" + "a" * 300])
    many = [f"/ip4/10.0.0.{i}/tcp/1/p2p/X{i}" for i in range(40)]
    assert len(usable_bootstrap(many)[0]) == MAX_CHAIN_BOOTSTRAP

    enabled = DiscoveryConfig(enabled=True)
    assert enabled.with_chain_bootstrap(lambda: record).bootstrap == [good]
    configured = DiscoveryConfig(enabled=True, bootstrap=["/ip4/127.0.0.1/tcp/9/p2p/Y"])
    assert configured.with_chain_bootstrap(lambda: [good]) is configured  # config wins
    off = DiscoveryConfig()
    assert off.with_chain_bootstrap(lambda: [good]) is off  # discovery off: nothing is read

    def unreachable() -> list[str]:
        raise ConnectionError("rpc down")

    assert enabled.with_chain_bootstrap(unreachable) is enabled  # a chain it cannot read is not fatal
