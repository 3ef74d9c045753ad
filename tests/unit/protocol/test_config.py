"""Config base: the four sources in order, unknown keys rejected everywhere, help from docstrings."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict

from protocol.config import PrimeConfig, help_text, parse_config
from protocol.errors import ConfigError
from protocol.model_spec import HFModelSpec, ModelSpec, TinyModelSpec


class Server(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    port: int = 8000
    """TCP port to listen on."""
    bind_host: str = "127.0.0.1"
    """Address to bind; loopback unless you mean to expose it."""
    debug: bool = False
    """Log every request."""


class RoleConfig(PrimeConfig):
    """A role for the tests."""

    name: str = "default"
    """Human-readable name of this process."""
    workers: int = 1
    """How many worker threads to run."""
    server: Server = Server()
    """HTTP server settings."""
    model: ModelSpec = TinyModelSpec()
    """The model this role runs."""


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for key in list(os.environ):
        if key.upper().startswith("PRIME_"):
            monkeypatch.delenv(key)


def _toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "role.toml"
    path.write_text(text)
    return path


def test_defaults() -> None:
    cfg = parse_config(RoleConfig, [])
    assert cfg == RoleConfig()
    assert cfg.server.port == 8000 and isinstance(cfg.model, TinyModelSpec)


def test_precedence_of_all_four_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _toml(
        tmp_path,
        'name = "from-toml"\nworkers = 2\n[server]\nport = 9000\nbind_host = "0.0.0.0"\ndebug = true\n',
    )
    # TOML over defaults.
    cfg = parse_config(RoleConfig, ["--config", str(path)])
    assert (cfg.name, cfg.workers, cfg.server.port, cfg.server.bind_host) == ("from-toml", 2, 9000, "0.0.0.0")
    # Environment over TOML (nested with `__`).
    monkeypatch.setenv("PRIME_WORKERS", "3")
    monkeypatch.setenv("PRIME_SERVER__PORT", "9100")
    cfg = parse_config(RoleConfig, ["--config", str(path)])
    assert (cfg.name, cfg.workers, cfg.server.port, cfg.server.bind_host) == ("from-toml", 3, 9100, "0.0.0.0")
    # Flags over environment (dots for nesting, kebab case, implicit --no- flags).
    cfg = parse_config(
        RoleConfig,
        ["--config", str(path), "--server.port", "9200", "--server.bind-host=::1", "--no-server.debug"],
    )
    assert (cfg.name, cfg.workers, cfg.server.port, cfg.server.bind_host) == ("from-toml", 3, 9200, "::1")
    assert cfg.server.debug is False
    # toml_path from code works the same as --config; --config wins over it.
    assert parse_config(RoleConfig, None, toml_path=path).name == "from-toml"
    other = tmp_path / "other.toml"
    other.write_text('name = "other"\n')
    assert parse_config(RoleConfig, ["--config", str(other)], toml_path=path).name == "other"


def test_discriminated_union_from_every_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _toml(tmp_path, '[model]\ntype = "hf"\nname_or_path = "org/model"\n')
    cfg = parse_config(RoleConfig, ["--config", str(path)])
    assert cfg.model == HFModelSpec(name_or_path="org/model")
    monkeypatch.setenv("PRIME_MODEL__REVISION", "abc123")
    cfg = parse_config(RoleConfig, ["--config", str(path)])
    assert cfg.model == HFModelSpec(name_or_path="org/model", revision="abc123")
    monkeypatch.delenv("PRIME_MODEL__REVISION")
    cfg = parse_config(
        RoleConfig, ["--model.type", "tiny", "--model.seed", "4", "--model.vocab-size", "1024"]
    )
    assert cfg.model == TinyModelSpec(seed=4, vocab_size=1024)
    monkeypatch.setenv("PRIME_MODEL", '{"type": "smollm2"}')
    assert parse_config(RoleConfig, []).model.type == "smollm2"


def test_field_of_other_union_member_rejected(tmp_path: Path) -> None:
    path = _toml(tmp_path, '[model]\ntype = "tiny"\nname_or_path = "org/model"\n')
    with pytest.raises(ConfigError, match="name_or_path"):
        parse_config(RoleConfig, ["--config", str(path)])


def test_unknown_key_in_toml(tmp_path: Path) -> None:
    path = _toml(tmp_path, "[server]\nprot = 1\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'server\.prot' in .*role\.toml"):
        parse_config(RoleConfig, ["--config", str(path)])
    path = _toml(tmp_path, "wrokers = 1\n")
    with pytest.raises(ConfigError, match="'wrokers'"):
        parse_config(RoleConfig, None, toml_path=path)


def test_unknown_flag() -> None:
    with pytest.raises(ConfigError, match="--wrokers"):
        parse_config(RoleConfig, ["--wrokers", "2"])
    with pytest.raises(ConfigError, match="server.prot"):
        parse_config(RoleConfig, ["--server.prot", "2"])


def test_unknown_nested_env_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PRIME_SERVER__PROT", "1")
    with pytest.raises(ConfigError, match="server.prot"):
        parse_config(RoleConfig, [])


def test_bad_values() -> None:
    with pytest.raises(ConfigError, match="workers"):
        parse_config(RoleConfig, ["--workers", "many"])


def test_bad_toml_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        parse_config(RoleConfig, ["--config", str(tmp_path / "missing.toml")])
    path = _toml(tmp_path, "this is = = not toml")
    with pytest.raises(ConfigError, match="cannot read"):
        parse_config(RoleConfig, ["--config", str(path)])


def test_help_shows_docstrings(capsys: pytest.CaptureFixture[str]) -> None:
    text = " ".join(help_text(RoleConfig, prog="prime-role").split())  # undo argparse line wrapping
    for needle in [
        "usage: prime-role",
        "A role for the tests.",
        "--config PATH",
        "--workers",
        "How many worker threads to run.",
        "--server.bind-host",
        "Address to bind; loopback unless you mean to expose it.",
        "--model.type {hf,smollm2,tiny}",
        "--model.name-or-path",
    ]:
        assert needle in text, needle
    with pytest.raises(SystemExit) as exc:
        parse_config(RoleConfig, ["--help"], prog="prime-role")
    assert exc.value.code == 0
    assert "How many worker threads to run." in " ".join(capsys.readouterr().out.split())


def test_concurrent_parses_keep_their_own_toml(tmp_path: Path) -> None:
    paths = []
    for i in range(4):
        p = tmp_path / f"c{i}.toml"
        p.write_text(f"workers = {i + 10}\n")
        paths.append(p)
    results: dict[int, int] = {}

    def run(i: int) -> None:
        for _ in range(5):
            results[i] = parse_config(RoleConfig, ["--config", str(paths[i])]).workers
            assert results[i] == i + 10

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == {i: i + 10 for i in range(4)}


def test_weights_base_version_minus_one_means_no_version_is_the_base_model() -> None:
    """-1 (a run started from a checkpoint: every version, v0 included, comes over the relays) parses from a flag;
    below it nothing does."""
    from protocol.config import ShardcastWeights

    class Role(PrimeConfig):
        weights: ShardcastWeights

    trainer = ["--weights.trainer", "0xabc"]
    assert parse_config(Role, [*trainer, "--weights.base-version", "-1"]).weights.base_version == -1
    assert parse_config(Role, trainer).weights.base_version == 0
    with pytest.raises(ConfigError, match="greater than or equal to -1"):
        parse_config(Role, [*trainer, "--weights.base-version=-2"])
