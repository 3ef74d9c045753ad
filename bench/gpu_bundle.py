"""Build `.gpu-bundle/`: what travels with the GPU command of `bench.gpu` (issue 38), and check it fits.

    make gpu-bundle                     # = python -m bench.gpu_bundle
    python -m bench.gpu_bundle --offline [--dest DIR]   # wheels from the cache only (no registry)

A GPU machine has Python 3.12 with torch, transformers, safetensors, tokenizers, numpy, httpx and msgpack, and
nothing else: no pydantic, no eth-account/web3, no registry, no network. The device command runs in a copy of
the working tree with the bundle carried beside it (the device tool's `carry`; the folder is ignored by git),
at most 64 MiB in all. The bundle holds:

- `src/`: the packages the device program's code path imports (`bench.gpu`, `bench.harness`, `models`,
  `toploc`, `protocol`), as plain copies of their `.py` files;
- `site/`: the wheels that path needs and the machine lacks (`WHEELS`: pydantic and its four dependencies,
  ~2.8 MB), downloaded once for CPython 3.12 manylinux x86_64 at the versions installed here (so the device
  runs the pydantic this project is tested with) into `.cache/gpu-wheels/`, and unpacked;
- `inputs.json`: the prompts and the protocol's sampling seeds (`bench.gpu.make_inputs`), computed here so the
  device never imports `protocol.seeds` (its address checksum needs eth-utils);
- `manifest.json`: every file with its size and SHA-256, the wheels, the sizes and the command.

It prints the bundle's size in MiB, the size of everything that travels (working tree + bundle) against the
limit, and the exact command to run on the GPU machine (`COMMAND`: `PYTHONPATH` names the bundle's two folders
and `python3 -P -s` keeps the working tree's own folders and the user's site-packages off `sys.path`, so the
device program imports only the bundle and the machine's installed packages); it exits 1 when the limit would
be passed.

`device_site` makes a folder of links to the packages a GPU machine has (those of `DEVICE_HAS` installed here
and their dependencies, pydantic's family left out): the CPU dry run (tests/unit/bench/test_gpu_dry_run.py)
runs the device program with `python -P -S` (no site-packages at all) and `PYTHONPATH` = the bundle's `src/` and
that folder, so any import the GPU machine could not satisfy fails here first.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as md
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

from bench.harness import ROOT

BUNDLE = ROOT / ".gpu-bundle"
WHEEL_CACHE = ROOT / ".cache" / "gpu-wheels"
LIMIT_BYTES = 64 << 20
"""What one device command carries: the working tree plus the carried paths."""
PACKAGES = ("models", "toploc", "protocol")
BENCH_FILES = ("__init__.py", "harness.py", "gpu.py")
WHEELS = ("pydantic", "pydantic-core", "annotated-types", "typing-inspection", "typing-extensions")
"""What the device code path imports that a GPU machine lacks (pydantic: `protocol.model_spec`,
`models.sampling.SamplingParams`, `toploc.thresholds`); typing-extensions is there (torch needs it) but
pydantic may need a newer one, and it is 45 kB."""
DEVICE_HAS = ("torch", "transformers", "safetensors", "tokenizers", "numpy", "httpx", "msgpack")
"""What a GPU machine has installed (/work/shared/NOTES.md, "GPU machines")."""
PYTHON = "3.12"
PLATFORM = "manylinux2014_x86_64"
COMMAND = ("PYTHONPATH=.gpu-bundle/src:.gpu-bundle/site python3 -P -s -m bench.gpu --device cuda "
           "--inputs .gpu-bundle/inputs.json --json $OUT/gpu.json --out $OUT")
"""The device command (run in the repository root of the copy, with `.gpu-bundle` carried). `-P`: the working
tree's own folders are not on `sys.path` (only the bundle's copies are), `-s`: no user site-packages."""

def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_pins() -> list[str]:
    """`name==version` of each of `WHEELS` as installed here."""
    return [f"{w}=={md.version(w)}" for w in WHEELS]


def wheel_ok(name: str) -> bool:
    """A wheel a GPU machine's CPython 3.12 on x86_64 Linux can install (pure Python, or cp312 manylinux)."""
    tags = name[:-4].split("-")[-3:]
    return tags[1:] == ["none", "any"] or (tags[0] == "cp312" and tags[1] in ("cp312", "abi3")
                                            and "manylinux" in tags[2] and tags[2].endswith("x86_64"))


def wheels(offline: bool) -> list[Path]:
    """The wheels of `WHEELS` at the pinned versions, from the cache or (unless `offline`) pip."""
    pins = wheel_pins()

    def cached() -> list[Path]:
        found = []
        for pin in pins:
            name, version = pin.split("==")
            hits = [p for p in WHEEL_CACHE.glob(f"{name.replace('-', '_')}-{version}-*.whl") if wheel_ok(p.name)]
            if hits:
                found.append(sorted(hits)[-1])
        return found

    have = cached()
    if len(have) < len(pins) and not offline:
        WHEEL_CACHE.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
               "--only-binary=:all:", "--python-version", PYTHON, "--implementation", "cp", "--platform", PLATFORM,
               "-d", str(WHEEL_CACHE), *pins]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise SystemExit(f"pip download failed:\n{proc.stderr[-3000:]}")
        have = cached()
    if len(have) < len(pins):
        raise SystemExit(f"wheels missing from {WHEEL_CACHE} (have {[p.name for p in have]}, need {pins}); "
                         "run without --offline once")
    return have


def travel_bytes() -> int:
    """Bytes of the working tree that travels with a command: tracked files and untracked ones git does not ignore
    (a link counts as itself)."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, check=True).stdout
    total = 0
    for rel in out.decode().split("\0"):
        if rel:
            try:
                total += os.lstat(ROOT / rel).st_size
            except FileNotFoundError:  # deleted in the working tree, still in the index
                pass
    return total


def _copy_sources(dest: Path) -> None:
    for pkg in PACKAGES:
        for src in sorted((ROOT / pkg).rglob("*.py")):
            if "__pycache__" in src.parts:
                continue
            out = dest / "src" / src.relative_to(ROOT)
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, out)
    (dest / "src" / "bench").mkdir(parents=True, exist_ok=True)
    for name in BENCH_FILES:
        shutil.copy2(ROOT / "bench" / name, dest / "src" / "bench" / name)


def build(dest: Path = BUNDLE, *, offline: bool = False, size: str = "full",
          with_wheels: bool = True) -> dict[str, Any]:
    """Make the bundle at `dest` (replacing it) and return its manifest; see the module docstring.
    `with_wheels=False` leaves `site/` empty (a dry run on a Python other than 3.12 cannot import them anyway)."""
    from bench.gpu import make_inputs

    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    _copy_sources(dest)
    (dest / "site").mkdir()
    shipped = wheels(offline) if with_wheels else []
    for whl in shipped:
        with zipfile.ZipFile(whl) as zf:
            zf.extractall(dest / "site")
    (dest / "inputs.json").write_text(json.dumps(make_inputs(size)) + "\n")
    files = {str(p.relative_to(dest)): {"bytes": p.stat().st_size,
                                        "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
             for p in sorted(dest.rglob("*")) if p.is_file()}
    bundle = sum(f["bytes"] for f in files.values())
    tree = travel_bytes() if dest.resolve().is_relative_to(ROOT) else 0
    manifest = {
        "format": 1, "command": COMMAND, "carry": [str(dest.relative_to(ROOT)) if dest.is_relative_to(ROOT)
                                                   else str(dest)],
        "python": PYTHON, "platform": PLATFORM, "wheels": [w.name for w in shipped], "pins": wheel_pins(),
        "packages": [*PACKAGES, "bench"], "device_has": list(DEVICE_HAS), "size": size,
        "bundle_bytes": bundle, "working_tree_bytes": tree, "travel_bytes": bundle + tree, "limit_bytes": LIMIT_BYTES,
        "files": files,
    }
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def _requires(dist: md.Distribution) -> list[str]:
    from packaging.requirements import Requirement

    out = []
    for r in dist.requires or []:
        req = Requirement(r)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            out.append(req.name)
    return out


def device_distributions() -> list[md.Distribution]:
    """The installed distributions of `DEVICE_HAS` and their dependencies (not following pydantic's family,
    which a GPU machine lacks: a dependency here that wants it, such as a newer typer, is optional there)."""
    skip = {_norm(w) for w in WHEELS}
    seen: dict[str, md.Distribution] = {}
    todo = list(DEVICE_HAS)
    while todo:
        name = _norm(todo.pop())
        if name in seen or name in skip:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        seen[name] = dist
        todo.extend(_requires(dist))
    return list(seen.values())


def device_site(folder: Path, stand_ins: bool) -> list[str]:
    """Fill `folder` with links to the top-level files of `device_distributions()` (and, with `stand_ins`,
    of `WHEELS` as installed here: their wheels are for CPython 3.12) and return the distributions' names."""
    folder.mkdir(parents=True, exist_ok=True)
    dists = device_distributions() + ([md.distribution(w) for w in WHEELS] if stand_ins else [])
    names = []
    for dist in dists:
        names.append(_norm(dist.metadata["Name"]))
        for top in {Path(str(f)).parts[0] for f in dist.files or () if not str(f).startswith("..")}:
            src = Path(str(dist.locate_file(top)))
            link = folder / top
            if src.exists() and not link.exists() and top != "__pycache__":
                link.symlink_to(src)
    return sorted(set(names))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dest", type=Path, default=BUNDLE, help="where to build it (default .gpu-bundle/)")
    ap.add_argument("--offline", action="store_true", help="take the wheels from .cache/gpu-wheels/ only")
    ap.add_argument("--size", default="full", choices=["smoke", "quick", "full"], help="the inputs' size")
    args = ap.parse_args()
    m = build(args.dest.resolve(), offline=args.offline, size=args.size)
    mib = 1 << 20
    where = args.dest.resolve()
    print(f"bundle {where.relative_to(ROOT) if where.is_relative_to(ROOT) else where}: {m['bundle_bytes'] / mib:.2f} MiB ({len(m['files'])} files; wheels: "
          f"{', '.join(m['wheels'])})")
    print(f"travels with the command: {m['travel_bytes'] / mib:.2f} MiB (working tree {m['working_tree_bytes'] / mib:.2f}"
          f" MiB + bundle) of the {m['limit_bytes'] / mib:.0f} MiB limit")
    if m["travel_bytes"] > m["limit_bytes"]:
        print("over the limit: a device command would not carry it", file=sys.stderr)
        return 1
    print(f"on the GPU machine (carry {m['carry']}, timeout_s 600), in the repository root:\n  {m['command']}")
    print("then here, on the files it brought back:\n  python -m bench.gpu check --rollouts <that folder> "
          "--json <that folder>/check.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
