"""Static checks of docker/compose.yaml and the Dockerfiles (no Docker daemon on these machines).

    python docker/compose_check.py [docker/compose.yaml]      # prints each problem; exit 1 if any

What it checks, per service: an image that some service builds (or a build whose Dockerfile exists and
whose context's .dockerignore is an allowlist that lets in every package pyproject.toml installs);
depends_on names existing services with a known condition (`service_completed_successfully` only on a
one-shot job); a healthcheck that runs docker/healthcheck.py against 127.0.0.1 on a port the command
listens on; host ports published on 127.0.0.1 only, each once; volumes and networks declared. The command
goes through the role's own CLI parser (prime-node/-validator/-trainer: the pydantic config with the
service's environment applied; prime-relay/prime-chain: their argparse parsers; anvil: its --help), so a
flag a role does not have is an error. Environment variables that `--*key-env` flags name must be set,
and every raw private key must be one of anvil's PUBLIC dev keys on a line marked DEV ONLY. Cross-role:
URLs name services and their container ports; the trainer address the relays, validators and nodes trust
is the trainer key's, and the deploy job grants the roles to the validators' and trainer's keys and mints
stake tokens to every node operator; each validator's rendezvous set (`--validators`) is the validators'
key addresses, the trainer's feed addresses are the keys of the validators at its feed URLs, and every
role that names a model names the same one (nodes may take it from the validators' /v1/info).
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker" / "compose.yaml"
CONDITIONS = {"service_started", "service_healthy", "service_completed_successfully"}
KEY_FLAGS = ("--key-env", "--key.key-env", "--operator.key-env", "--publish.key-env", "--announce-key-env")
_PRIVATE_KEY = re.compile(r"0x[0-9a-fA-F]{64}\b")
_URL = re.compile(r"https?://[A-Za-z0-9_.-]+:\d+")


@contextlib.contextmanager
def _environment(env: dict[str, str]) -> Iterator[None]:
    """The service's environment, on top of this process's minus its own PRIME_ settings."""
    saved = dict(os.environ)
    try:
        for name in [n for n in os.environ if n.startswith("PRIME_")]:
            del os.environ[name]
        os.environ.update(env)
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _argparse(parser: Any, args: list[str]) -> Any:
    """argparse exits on errors: turn that into an exception carrying its message."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parser.parse_args(args)
    except SystemExit as exc:
        raise ValueError(err.getvalue().strip().splitlines()[-1] if err.getvalue() else f"exit {exc.code}") from exc


def parse_role_command(argv: list[str], env: dict[str, str]) -> Any:
    """Run the role's own parser over `argv` (a container command); ValueError/PrimeError on a bad one."""
    program, args = argv[0], argv[1:]
    with _environment(env):
        if program == "prime-chain":
            from contracts.deploy import build_parser

            return _argparse(build_parser(), args)
        if program == "prime-relay":
            from shardcast.cli import _parser

            return _argparse(_parser(), args)
        if program == "prime-validator":
            from validator.config import load_config as load_validator

            return load_validator(args)
        if program == "prime-node":
            from node.cli import COMMANDS, expand_flags
            from node.config import load_config as load_node

            if not args or args[0] not in COMMANDS:
                raise ValueError(f"prime-node: unknown command {args[:1]}")
            return load_node(expand_flags(args[1:]), prog=f"prime-node {args[0]}")
        if program == "prime-trainer":
            from trainer import config as trainer_config

            if args and args[0] == "sft":
                return trainer_config.load_sft_config(args[1:])
            if args and args[0] == "eval":
                return trainer_config.load_eval_config(args[1:])
            return trainer_config.load_config(args)
        if program == "anvil":
            return _anvil(args)
    raise ValueError(f"{program!r} is not a role this image runs")


@functools.lru_cache(maxsize=256)
def _refusal(argv: tuple[str, ...], env: tuple[tuple[str, str], ...]) -> str | None:
    """Why the role's parser refuses `argv` under `env` (None: it accepts); remembered per command."""
    try:
        parse_role_command(list(argv), dict(env))
    except Exception as exc:  # noqa: BLE001 - any parser failure is this service's problem, reported
        return f"{type(exc).__name__}: {exc}"
    return None


def _anvil(args: list[str]) -> list[str]:
    """Every --flag must appear in `anvil --help` (the pinned binary `make setup` installs)."""
    from contracts.devchain import anvil_binary

    binary = shutil.which("anvil") or str(anvil_binary())
    text = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=30, check=True).stdout
    known = set(re.findall(r"--[a-z][a-z0-9-]*", text))
    unknown = [a for a in args if a.startswith("--") and a.split("=")[0] not in known]
    if unknown:
        raise ValueError(f"anvil has no flag(s) {unknown}")
    return args


def _command(service: dict[str, Any]) -> list[str]:
    cmd = service.get("command", [])
    return shlex.split(cmd) if isinstance(cmd, str) else [str(c) for c in cmd]


def _flag_values(argv: list[str], flag: str) -> list[str]:
    """Values given to `flag` (`--flag v`, `--flag=v`, comma lists and nargs lists split)."""
    out: list[str] = []
    for i, arg in enumerate(argv):
        if arg == flag:
            for value in argv[i + 1:]:
                if value.startswith("--"):
                    break
                out += [v for v in value.split(",") if v]
        elif arg.startswith(flag + "="):
            out += [v for v in arg.split("=", 1)[1].split(",") if v]
    return out


def _listen_ports(argv: list[str]) -> set[int]:
    ports = set()
    for flag in ("--port", "--monitor.port", "--metrics-port"):
        ports |= {int(p) for p in _flag_values(argv, flag) if p.isdigit()}
    return ports


def _dev_keys() -> dict[str, str]:
    """anvil's PUBLIC dev keys (lower-case hex) -> address."""
    from contracts.devchain import DEV_ACCOUNTS, dev_identity, dev_key

    return {"0x" + dev_key(i).hex(): dev_identity(i).address for i in range(DEV_ACCOUNTS)}


def _allowed(context: Path) -> set[str]:
    """Paths the context's .dockerignore lets in (it must be an allowlist: `*`, then `!path` lines)."""
    ignore = context / ".dockerignore"
    lines = [ln.strip() for ln in ignore.read_text().splitlines()] if ignore.is_file() else []
    lines = [ln for ln in lines if ln and not ln.startswith("#")]
    if not lines or lines[0] != "*":
        return set()
    return {ln[1:].strip("/") for ln in lines if ln.startswith("!")}


def _check_dockerfile(name: str, context: Path, dockerfile: Path, problems: list[str]) -> None:
    """COPY sources exist and pass the .dockerignore allowlist; the allowlist covers every installed package."""
    if not dockerfile.is_file():
        problems.append(f"{name}: build.dockerfile {dockerfile} does not exist")
        return
    allowed = _allowed(context)
    if not allowed:
        problems.append(f"{context}/.dockerignore is not an allowlist ('*' first, then '!path' lines): "
                        "keystores or state could enter an image")
    for line in dockerfile.read_text().splitlines():
        parts = line.split()
        if not parts or parts[0] != "COPY" or any(p.startswith("--from") for p in parts):
            continue
        for src in [p for p in parts[1:-1] if not p.startswith("--")]:
            src = src.removeprefix("./").rstrip("/") or "."
            if src == ".":
                continue
            if not (context / src).exists():
                problems.append(f"{dockerfile.name}: COPY source {src} is not in the build context {context}")
            elif allowed and src not in allowed:
                problems.append(f"{dockerfile.name}: COPY source {src} is excluded by .dockerignore")
    packages = tomllib.loads((context / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    missing = [p.rstrip("*") for p in packages["include"] if p.rstrip("*") not in allowed]
    if missing:
        problems.append(f".dockerignore leaves out packages pyproject.toml installs: {missing}")
    for needed in ("pyproject.toml", "README.md", "docker/healthcheck.py"):
        if needed not in allowed:
            problems.append(f".dockerignore leaves out {needed}, which the images need")


def check(path: Path = COMPOSE, compose: dict[str, Any] | None = None) -> list[str]:
    """Every problem found in the compose file at `path` (or in `compose`, parsed from it and modified)."""
    text = path.read_text()
    doc: dict[str, Any] = compose if compose is not None else yaml.safe_load(text)
    problems: list[str] = []
    services: dict[str, dict[str, Any]] = doc.get("services") or {}
    if not services:
        return ["no services"]
    volumes, networks = set(doc.get("volumes") or {}), set(doc.get("networks") or {})
    built = {s["image"] for s in services.values() if s.get("build") and s.get("image")}
    dev_keys = _dev_keys()
    host_ports: dict[str, str] = {}
    listens = {name: _listen_ports(_command(s)) for name, s in services.items()}

    for line in text.splitlines():
        for key in _PRIVATE_KEY.findall(line):
            if key.lower() not in dev_keys:
                problems.append(f"a private key that is not an anvil dev key: {key[:10]}...")
            elif "DEV ONLY" not in line:
                problems.append(f"dev key {key[:10]}... on a line not marked DEV ONLY")

    for name, svc in services.items():
        # image / build
        build = svc.get("build")
        if build:
            context = (path.parent / build.get("context", ".")).resolve()
            _check_dockerfile(name, context, context / build.get("dockerfile", "Dockerfile"), problems)
        elif svc.get("image") not in built:
            problems.append(f"{name}: image {svc.get('image')!r} is built by no service (and has no build)")
        # depends_on
        deps = svc.get("depends_on") or {}
        for dep, spec in (deps.items() if isinstance(deps, dict) else ((d, {}) for d in deps)):
            if dep not in services:
                problems.append(f"{name}: depends_on {dep!r}, which is not a service")
                continue
            cond = (spec or {}).get("condition", "service_started")
            if cond not in CONDITIONS:
                problems.append(f"{name}: depends_on {dep}: unknown condition {cond!r}")
            if cond == "service_completed_successfully" and services[dep].get("restart") != "no":
                problems.append(f"{name}: waits for {dep} to complete, but {dep} restarts (restart: 'no' expected)")
            if cond == "service_healthy" and not services[dep].get("healthcheck"):
                problems.append(f"{name}: waits for {dep} to be healthy, but {dep} has no healthcheck")
        # networks, volumes
        for net in svc.get("networks") or []:
            if net not in networks:
                problems.append(f"{name}: network {net!r} is not declared")
        for vol in svc.get("volumes") or []:
            source = str(vol).split(":")[0]
            if not source.startswith((".", "/")) and source not in volumes:
                problems.append(f"{name}: volume {source!r} is not declared")
        # ports: loopback on the host side, each host port once, a container port the command listens on
        for spec in svc.get("ports") or []:
            parts = str(spec).split(":")
            if len(parts) != 3 or parts[0] != "127.0.0.1":
                problems.append(f"{name}: port {spec!r} is not bound to 127.0.0.1 on the host")
                continue
            if parts[1] in host_ports:
                problems.append(f"{name}: host port {parts[1]} is also published by {host_ports[parts[1]]}")
            host_ports[parts[1]] = name
            if int(parts[2]) not in listens[name]:
                problems.append(f"{name}: publishes container port {parts[2]}, which its command does not listen on")
        # healthcheck
        hc = svc.get("healthcheck")
        test = [str(t) for t in (hc or {}).get("test") or []]
        if not hc or hc.get("disable"):
            problems.append(f"{name}: no healthcheck")
        elif test[:3] != ["CMD", "python", "/app/docker/healthcheck.py"] or len(test) < 4:
            problems.append(f"{name}: healthcheck {test} does not run /app/docker/healthcheck.py")
        else:
            target = test[-1]
            if target.startswith("http"):
                url = urlsplit(target)
                if url.hostname != "127.0.0.1" or url.port not in listens[name]:
                    problems.append(f"{name}: healthcheck {target} is not 127.0.0.1 on a port the command listens on")
        # the command, through the role's own parser
        argv = _command(svc)
        env = {str(k): str(v) for k, v in (svc.get("environment") or {}).items()}
        if not argv:
            problems.append(f"{name}: no command")
            continue
        refused = _refusal(tuple(argv), tuple(sorted(env.items())))
        if refused:
            problems.append(f"{name}: {argv[0]} refuses its command: {refused}")
        for flag in KEY_FLAGS:
            for var in _flag_values(argv, flag):
                if var not in env:
                    problems.append(f"{name}: {flag} {var}, but the service's environment does not set {var}")
        for url in _URL.findall(" ".join(argv)):
            parts = urlsplit(url)
            if parts.hostname not in services:
                problems.append(f"{name}: {url} names no service")
            elif parts.port not in listens[str(parts.hostname)]:
                problems.append(f"{name}: {url}: {parts.hostname} does not listen on {parts.port}")
    problems += _cross_role(services, dev_keys)
    return problems


def _cross_role(services: dict[str, dict[str, Any]], dev_keys: dict[str, str]) -> list[str]:
    problems: list[str] = []

    def address(svc: dict[str, Any], flag: str) -> str | None:
        env = svc.get("environment") or {}
        var = next(iter(_flag_values(_command(svc), flag)), None)
        key = str(env.get(var, "")).lower() if var else ""
        return dev_keys.get(key)

    by_program: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for name, svc in services.items():
        argv = _command(svc)
        if argv:
            by_program.setdefault(argv[0], []).append((name, svc))
    deploys = by_program.get("prime-chain", [])
    if len(deploys) != 1:
        return problems + [f"expected one prime-chain deploy job, found {len(deploys)}"]
    deploy = _command(deploys[0][1])
    granted_validators = {a.lower() for a in _flag_values(deploy, "--validator")}
    granted_trainers = {a.lower() for a in _flag_values(deploy, "--trainer")}
    minted = {m.split("=")[0].lower() for m in _flag_values(deploy, "--mint")}
    trainer_addresses = set()
    for name, svc in by_program.get("prime-trainer", []):
        addr = address(svc, "--publish.key-env")
        if addr is None or addr.lower() not in granted_trainers:
            problems.append(f"{name}: the publishing key is not granted the trainer role by the deploy job")
        if addr:
            trainer_addresses.add(addr.lower())
    validator_by_service: dict[str, str] = {}
    for name, svc in by_program.get("prime-validator", []):
        addr = address(svc, "--key.key-env")
        if addr is None or addr.lower() not in granted_validators:
            problems.append(f"{name}: its key is not granted the validator role by the deploy job")
        if addr:
            validator_by_service[name] = addr.lower()
    validator_set = set(validator_by_service.values())
    for name, svc in by_program.get("prime-validator", []):
        announced = {a.lower() for a in _flag_values(_command(svc), "--validators")}
        if announced and announced != validator_set:
            problems.append(f"{name}: --validators (the rendezvous set: validator addresses) is not the "
                            f"validators' key addresses {sorted(validator_set)}")
    for name, svc in by_program.get("prime-trainer", []):
        argv = _command(svc)
        urls, addrs = _flag_values(argv, "--data.urls"), [a.lower() for a in _flag_values(argv, "--data.addresses")]
        expected = [validator_by_service.get(str(urlsplit(u).hostname)) for u in urls]
        if addrs and addrs != expected:
            problems.append(f"{name}: --data.addresses are not the keys of the validators at --data.urls")
    specs = {name: _model_spec(_command(svc)) for name, svc in services.items() if _command(svc)
             and _command(svc)[0] in ("prime-trainer", "prime-validator", "prime-node")}
    given = {n: spec for n, spec in specs.items() if spec is not None}
    if len({tuple(sorted(spec.items())) for spec in given.values()}) > 1:
        problems.append(f"roles disagree on the model (--model.* flags): {given}")
    for name, svc in by_program.get("prime-node", []):
        addr = address(svc, "--operator.key-env")
        if addr is None or addr.lower() not in minted:
            problems.append(f"{name}: its operator is minted no stake tokens by the deploy job")
    for name, svc in [*by_program.get("prime-relay", []), *by_program.get("prime-validator", []),
                      *by_program.get("prime-node", [])]:
        argv = _command(svc)
        trusted = {a.lower() for a in _flag_values(argv, "--trainer") + _flag_values(argv, "--weights.trainer")}
        if trusted and not trusted <= trainer_addresses:
            problems.append(f"{name}: trusts trainer {sorted(trusted)}, not the trainer key's address")
    return problems


def _model_spec(argv: list[str]) -> dict[str, str] | None:
    """The `--model.*` flags of a command (None when it gives none: a node takes the validators' model)."""
    spec = {a: argv[i + 1] for i, a in enumerate(argv[:-1]) if a.startswith("--model.")}
    return spec or None


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    path = Path(args[0]) if args else COMPOSE
    problems = check(path)
    for p in problems:
        print(f"{path}: {p}")
    print(f"{path}: {len(problems)} problem(s)" if problems else f"{path}: ok ({len(yaml.safe_load(path.read_text())['services'])} services)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
