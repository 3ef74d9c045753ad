"""The config base every role uses: one typed tree per process, four sources, one `--help`.

Sources, lowest to highest priority:

1. field defaults in code;
2. a TOML file (`--config PATH`, or `toml_path=` from code);
3. environment variables: `PRIME_` + field name, `__` between nesting levels
   (`PRIME_MODEL__SEED=3` sets `model.seed`);
4. command-line flags: `--name value`, dots for nesting, kebab or snake case
   (`--model.seed 3`, `--model.type tiny`, `--chain.rpc-url http://...`).

Unknown keys are errors in every source (a typo must not silently fall back to a default); every
failure is a `ConfigError` naming the key. Field docstrings (`use_attribute_docstrings`) are the help
text, so write one under every field.

A role defines `class NodeConfig(PrimeConfig): ...` and calls `parse_config(NodeConfig, argv)`
before importing anything heavy, so `prime-node --help` answers instantly.
"""

from __future__ import annotations

import argparse
import contextvars
import os
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, NoReturn, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_settings import (
    BaseSettings,
    CliSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    TomlConfigSettingsSource,
)

from protocol.errors import ConfigError

ENV_PREFIX = "PRIME_"
ENV_NESTED_DELIMITER = "__"

C = TypeVar("C", bound="PrimeConfig")

# The TOML file of the config being built. A context variable because pydantic-settings asks the
# class (not the call) for its sources; a context keeps concurrent parses in threads independent.
_toml_file: contextvars.ContextVar[Path | None] = contextvars.ContextVar("prime_toml_file", default=None)


class PrimeConfig(BaseSettings):
    """Base of every role's configuration; see the module docstring for sources and precedence."""

    model_config = SettingsConfigDict(
        extra="forbid",
        use_attribute_docstrings=True,
        env_prefix=ENV_PREFIX,
        env_nested_delimiter=ENV_NESTED_DELIMITER,
        validate_default=True,
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # First wins. The CLI source, when there is one, is put in front of these by pydantic-settings.
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        toml_file = _toml_file.get()
        if toml_file is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=toml_file))
        return tuple(sources)


def _read_toml(path: Path) -> dict[str, Any]:
    """Load TOML ourselves first: pydantic-settings silently skips a missing file."""
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError as exc:
        raise ConfigError(f"config file not found: {path}") from exc
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from exc


def _has_path(data: Any, loc: Sequence[int | str]) -> bool:
    for part in loc:
        if not isinstance(data, dict) or part not in data:
            return False
        data = data[part]
    return True


def _describe(exc: ValidationError, toml: dict[str, Any], toml_path: Path | None) -> str:
    lines = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            where = f" in {toml_path}" if toml_path and _has_path(toml, err["loc"]) else ""
            env = ENV_PREFIX + ENV_NESTED_DELIMITER.join(str(p) for p in err["loc"]).upper()
            if not where and env in {k.upper() for k in os.environ}:
                where = f" (environment variable {env})"
            lines.append(f"unknown config key {key!r}{where}")
        else:
            lines.append(f"{key or '<root>'}: {err['msg']} (got {err.get('input')!r})")
    return "; ".join(lines)


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of exiting (`exit_on_error=False` misses unknown arguments)."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"bad command line: {message}")


def build_parser(
    cls: type[PrimeConfig], *, prog: str | None = None
) -> CliSettingsSource[argparse.ArgumentParser]:
    """The CLI source for `cls`: an argparse parser with `--config` and one flag per field."""
    parser = _Parser(
        prog=prog,
        description=(cls.__doc__ or "").strip() or None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        exit_on_error=False,
    )
    parser.add_argument(
        "--config",
        metavar="PATH",
        type=Path,
        default=None,
        help="TOML file with settings (below environment variables and flags in priority)",
    )
    return CliSettingsSource(
        cls,
        root_parser=parser,
        cli_prog_name=prog,
        cli_exit_on_error=False,
        cli_kebab_case=True,
        cli_implicit_flags=True,
        cli_avoid_json=True,
        cli_use_class_docs_for_groups=False,
    )


def parse_config(
    cls: type[C],
    argv: Sequence[str] | None = None,
    *,
    toml_path: str | Path | None = None,
    prog: str | None = None,
) -> C:
    """Build `cls` from defaults < TOML < environment < `argv` flags; `ConfigError` on any problem.

    `argv=None` reads no flags (use `sys.argv[1:]` explicitly in an entry point). `--config PATH`
    in `argv` overrides `toml_path`. `--help` prints the help and raises `SystemExit(0)`.
    """
    cli_values: dict[str, Any] | None = None
    cli: CliSettingsSource[argparse.ArgumentParser] | None = None
    if argv is not None:
        cli = build_parser(cls, prog=prog)
        try:
            namespace = cli.root_parser.parse_args(list(argv))
        except (argparse.ArgumentError, SettingsError) as exc:
            raise ConfigError(f"bad command line: {exc}") from exc
        values = vars(namespace)
        config_flag = values.pop("config", None)
        if config_flag is not None:
            toml_path = config_flag
        cli_values = values
    path = Path(toml_path) if toml_path is not None else None
    toml = _read_toml(path) if path is not None else {}
    token = _toml_file.set(path)
    try:
        if cli is None or cli_values is None:
            return cls()
        return cls(_cli_settings_source=cli(parsed_args=cli_values))
    except ValidationError as exc:
        raise ConfigError(f"invalid {cls.__name__}: {_describe(exc, toml, path)}") from exc
    except SettingsError as exc:
        raise ConfigError(f"invalid {cls.__name__}: {exc}") from exc
    finally:
        _toml_file.reset(token)


def help_text(cls: type[PrimeConfig], *, prog: str | None = None) -> str:
    """The `--help` text of `cls` (for docs and tests)."""
    return build_parser(cls, prog=prog).root_parser.format_help()


class KeySource(BaseModel):
    """Where a role's signing key comes from: an encrypted keystore (the password from an environment
    variable, a file or a prompt), or on dev chains only a raw key in an environment variable. A config
    section; `protocol.identity.load_identity` reads it."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    keystore: Path | None = None
    """Encrypted keystore file (Web3 secret storage JSON)."""
    key_env: str | None = None
    """Dev chains only: an environment variable holding a raw private key instead of a keystore."""
    password_env: str = "PRIME_KEYSTORE_PASSWORD"
    """Environment variable holding the keystore password."""
    password_file: Path | None = None
    """File holding the keystore password."""


class StaticWeights(BaseModel):
    """Every policy version runs on the weights of the run's `model` (tests, benchmarks, a frozen policy)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    type: Literal["static"] = "static"
    """Weight source: `static` (the model spec for every version) or `shardcast` (follow the relays)."""


class ShardcastWeights(BaseModel):
    """Pull each policy version over the SHARDCAST relay tree, checked against the chain's manifest hash."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    type: Literal["shardcast"] = "shardcast"
    """Weight source: `static` (the model spec for every version) or `shardcast` (follow the relays)."""
    relays: list[str] = []
    """Relay (or origin) URLs, http://host:port."""
    trainer: str
    """Address of the trainer key that signs manifests."""
    base_version: int = Field(0, ge=-1)
    """Versions up to this one are the base `model`, built or loaded locally and never pulled (a run whose trainer
    starts from that model: its version 0 is the same weights). -1: no version is the base model, every version,
    version 0 included, is pulled over the relays and checked against the chain like any other (a run started
    from a trained checkpoint, `prime-devnet up --init`); the `model` then only names the architecture and
    tokenizer. Node and validator must agree: a node refuses a validator that announces another value."""


WeightSource = Annotated[StaticWeights | ShardcastWeights, Field(discriminator="type")]
"""Where a role gets the weights of each policy version (a config section shared by node and validator)."""
