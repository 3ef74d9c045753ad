"""The devnet's config: every shipped TOML parses, flags override it, and typos are refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from devnet.config import load_config
from protocol.errors import ConfigError

CONFIGS = sorted((Path(__file__).resolve().parents[3] / "configs" / "devnet").glob("*.toml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_parse(path: Path) -> None:
    cfg = load_config(["--config", str(path)])
    assert cfg.nodes >= 1 and cfg.validators >= 1


def test_flags_override_the_file_and_typos_are_refused() -> None:
    cfg = load_config(["--config", str(CONFIGS[0]), "--nodes", "2", "--model", "smollm2"])
    assert (cfg.nodes, cfg.model, cfg.validators) == (2, "smollm2", 3)
    with pytest.raises(ConfigError):
        load_config(["--nodez", "2"])
