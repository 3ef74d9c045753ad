"""Compile contracts/src with the pinned npm solc-js and write reproducible artifacts.

    python -m contracts.build            # (re)write contracts/artifacts/*.json
    python -m contracts.build --check    # exit 1 if a clean compile differs from the committed artifacts

Settings are pinned (optimizer, EVM version, no metadata hash, sorted inputs) so the same sources and
npm packages give the same bytes on every machine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from protocol.errors import ChainError

logger = logging.getLogger(__name__)

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_ROOT = PACKAGE_DIR.parent
SOURCE_DIR = PACKAGE_DIR / "src"
ARTIFACT_DIR = PACKAGE_DIR / "artifacts"
COMPILER_SCRIPT = PACKAGE_DIR / "solc_compile.cjs"

EVM_VERSION = "cancun"
OPTIMIZER_RUNS = 200
SETTINGS: dict[str, Any] = {
    "optimizer": {"enabled": True, "runs": OPTIMIZER_RUNS},
    "evmVersion": EVM_VERSION,
    # No IPFS/Swarm hash of the metadata in the bytecode: it would embed absolute paths' side effects and
    # make artifacts differ for reasons unrelated to the code.
    "metadata": {"bytecodeHash": "none", "appendCBOR": False},
    "outputSelection": {"*": {"*": ["abi", "evm.bytecode.object", "evm.deployedBytecode.object"]}},
}


def _sources() -> dict[str, dict[str, str]]:
    files = sorted(SOURCE_DIR.rglob("*.sol"))
    return {f"contracts/src/{p.relative_to(SOURCE_DIR).as_posix()}": {"content": p.read_text()} for p in files}


def compile_sources() -> dict[str, dict[str, Any]]:
    """Compile every source; returns {contract name: artifact dict}. Raises ChainError on compile errors."""
    node = shutil.which("node")
    if node is None:
        raise ChainError("node (Node.js) is not on PATH; it runs the npm solc compiler")
    sources = _sources()
    standard_input = {"language": "Solidity", "sources": sources, "settings": SETTINGS}
    proc = subprocess.run(
        [node, str(COMPILER_SCRIPT)],
        input=json.dumps(standard_input, sort_keys=True),
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        check=False,
    )
    if proc.returncode != 0:
        raise ChainError(f"solc-js failed: {proc.stderr.strip()[-2000:]}")
    result = json.loads(proc.stdout)
    output = result["output"]
    errors = [e for e in output.get("errors", []) if e.get("severity") == "error"]
    if errors:
        raise ChainError("compile errors:\n" + "\n".join(e["formattedMessage"] for e in errors))
    for warning in output.get("errors", []):
        logger.warning("solc: %s", warning.get("formattedMessage", warning).strip())
    artifacts: dict[str, dict[str, Any]] = {}
    for source_name, contracts in sorted(output["contracts"].items()):
        if not source_name.startswith("contracts/src/"):
            continue  # OpenZeppelin's own contracts: not deployed by us
        for name, data in sorted(contracts.items()):
            if not data["evm"]["bytecode"]["object"]:
                continue  # interfaces and abstract contracts: nothing to deploy
            if name in artifacts:
                raise ChainError(f"two contracts named {name}")
            artifacts[name] = {
                "contractName": name,
                "sourceName": source_name,
                "sourceSha256": hashlib.sha256(sources[source_name]["content"].encode()).hexdigest(),
                "compiler": {"solc": result["solcVersion"], "settings": {
                    k: v for k, v in SETTINGS.items() if k != "outputSelection"
                }},
                "abi": data["abi"],
                "bytecode": "0x" + data["evm"]["bytecode"]["object"],
                "deployedBytecode": "0x" + data["evm"]["deployedBytecode"]["object"],
            }
    return artifacts


def render(artifact: dict[str, Any]) -> str:
    """The exact bytes an artifact file holds (stable key order, trailing newline)."""
    return json.dumps(artifact, indent=1, sort_keys=True) + "\n"


def write_artifacts(out_dir: Path = ARTIFACT_DIR) -> list[Path]:
    """Compile and write one `<Contract>.json` per contract into `out_dir`; returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, artifact in compile_sources().items():
        path = out_dir / f"{name}.json"
        path.write_text(render(artifact))
        paths.append(path)
    return paths


def differences(committed_dir: Path = ARTIFACT_DIR) -> list[str]:
    """Names of artifacts that a clean compile would change, add or remove (empty: reproducible)."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = {p.name: p.read_bytes() for p in write_artifacts(Path(tmp))}
    committed = {p.name: p.read_bytes() for p in committed_dir.glob("*.json")}
    return sorted(n for n in fresh.keys() | committed.keys() if fresh.get(n) != committed.get(n))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare a clean compile with the committed files")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.check:
        diff = differences()
        if diff:
            print("artifacts differ from a clean compile: " + ", ".join(diff), file=sys.stderr)
            return 1
        print("artifacts reproduce byte for byte")
        return 0
    for path in write_artifacts():
        print(f"wrote {path.relative_to(REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
