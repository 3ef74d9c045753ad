"""A validator refuses a configuration whose held and retried hard verdicts can outlive the pool's windows."""

from __future__ import annotations

from pathlib import Path

import pytest
from chainfixtures import SETTINGS, Pools

from bench.loopback import VALIDATOR, validator_config
from protocol.errors import ConfigError
from validator.service import Service


def test_backoff_reaching_the_invalidation_window_refuses_to_start(published: Pools, deployment_file: Path,
                                                                   tmp_path: Path) -> None:
    # the default back-off (300 s) plus the hold would retry a slash past this pool's 100 s invalidation window
    cfg = validator_config(tmp_path / "v", deployment_file, published.chain.rpc_url,
                           reporter={"interval_s": 0.2, "max_backoff_s": 300.0})
    with pytest.raises(ConfigError, match=r"reaches the pool's invalidation window \(100 s\)"):
        Service(cfg, published.chain.account(VALIDATOR))
    # just below the shorter of the two windows it starts; a validator that reports nothing is not bound by them
    limit = min(SETTINGS.invalidation_window, SETTINGS.unbonding_period)
    ok = validator_config(tmp_path / "ok", deployment_file, published.chain.rpc_url,
                          reporter={"max_backoff_s": limit - 1.0}, systemic={"window_s": 0.5})
    Service(ok, published.chain.account(VALIDATOR)).stop()
    quiet = validator_config(tmp_path / "quiet", deployment_file, published.chain.rpc_url,
                             reporter={"enabled": False, "max_backoff_s": 1000.0})
    Service(quiet, published.chain.account(VALIDATOR)).stop()
