"""`prime-node <command>`: parse the config first (no torch, web3 or HTTP), then import what the command needs.

    prime-node join [--cpu | --gpu N] --deployment deployment.json --keystore node.json [flags]
    prime-node status | claim | leave | withdraw [flags]
    prime-node appeal [--work-key 0x...] [flags]
    prime-node protection export PATH | import PATH [flags]

Flags are the `NodeConfig` fields (`prime-node join --help`); `--cpu`, `--gpu N`, `--deployment`,
`--rpc-url`, `--pool`, `--keystore`, `--work-key` and `--force` are short for `--engine.device cpu|cuda:N`
(`--gpu N` also picks `--engine.type vllm` when vLLM is installed and no engine type is given),
`--chain.deployment`, `--chain.rpc-url`, `--chain.pool`, `--key.keystore`, `--appeal.work-key` and
`--preflight.force`.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import TextIO

from protocol.errors import PrimeError

COMMANDS = {
    "join": "create or open the node key, stake and register (unless registered), then work",
    "preflight": "generate a few batches here and measure them as a validator would (margins to each threshold)",
    "status": "stake, state on chain, verdict counts, claimable and locked rewards, policy version, validators",
    "claim": "claim every unlocked reward (operator key)",
    "leave": "start leaving the pool (unbonding; operator key)",
    "withdraw": "withdraw the stake once unbonded (operator key)",
    "appeal": "appeal hard verdicts inside the appeal window: file on chain (operator key), ask another validator",
    "protection": "export PATH | import PATH: the slashing-protection record in its interchange format",
}
ALIASES = {"--deployment": "--chain.deployment", "--rpc-url": "--chain.rpc-url", "--pool": "--chain.pool",
           "--keystore": "--key.keystore", "--work-key": "--appeal.work-key"}


def _usage() -> str:
    lines = ["usage: prime-node COMMAND [flags]   (prime-node COMMAND --help for the flags)", "", "commands:"]
    lines += [f"  {name:<11} {text}" for name, text in COMMANDS.items()]
    return "\n".join(lines)


def expand_flags(argv: list[str]) -> list[str]:
    """Rewrite the short spellings into `NodeConfig` flags (see the module docstring)."""
    out: list[str] = []
    engine_type_given = any(a == "--engine.type" or a.startswith("--engine.type=") for a in argv)
    it = iter(argv)
    for arg in it:
        name, eq, value = arg.partition("=")
        if name == "--force":
            out += ["--preflight.force"]
        elif name == "--cpu":
            out += ["--engine.device", "cpu"]
        elif name == "--gpu":
            out += ["--engine.device", f"cuda:{value if eq else next(it, '0')}"]
            from node.engines import vllm_importable  # finds the package without importing it

            if not engine_type_given and vllm_importable():  # a GPU node runs vLLM when it is installed
                out += ["--engine.type", "vllm"]
        elif name in ALIASES:
            out += [ALIASES[name] + (eq + value if eq else "")]
        else:
            out.append(arg)
    return out


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return json.dumps({"ts": round(record.created, 3), "level": record.levelname, "logger": record.name,
                           "msg": record.getMessage()})


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever `sys.stderr` is at the time of each record (not the stream of when it was made), so
    an in-process `main()` (tests, embedding) never logs into a stream someone has since closed."""

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, _value: object) -> None:
        pass


def configure_logging(fmt: str) -> None:
    """Install prime-node's one root handler (replacing one installed by an earlier call, and no one else's)."""
    handler = _StderrHandler()
    if fmt == "json":
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        handler.formatter.converter = time.gmtime  # type: ignore[union-attr]
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _StderrHandler)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    for noisy in ("httpx", "libp2p"):  # a line per HTTP request or dial would bury the one line per batch
        logging.getLogger(noisy).setLevel(logging.WARNING)


def main(argv: list[str] | None = None) -> int:
    from node.config import load_config

    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0
    command, rest = args[0], args[1:]
    if command not in COMMANDS:
        print(f"prime-node: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    log = logging.getLogger("prime-node")
    try:
        action = path = None
        if command == "protection":
            if len(rest) < 2 or rest[0] not in ("export", "import"):
                if rest and rest[0] in ("-h", "--help"):
                    print("usage: prime-node protection export|import PATH [flags]")
                    return 0
                print("usage: prime-node protection export|import PATH [flags]", file=sys.stderr)
                return 2
            action, path, rest = rest[0], rest[1], rest[2:]
        cfg = load_config(expand_flags(rest), prog=f"prime-node {command}")  # --help exits here, before torch
        configure_logging(cfg.log_format)
        if command == "protection":
            from node.commands import protection

            return protection(cfg, str(action), str(path))
        if command == "appeal":
            from node.appeal import appeal

            return appeal(cfg)
        from node import commands

        return int(getattr(commands, command)(cfg))
    except PrimeError as exc:
        log.error("%s", exc)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
