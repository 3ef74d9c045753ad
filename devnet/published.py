"""What the trainer published through the origin: bytes per version and the delta/full split (`prime-devnet status`).

Read from the origin's store on disk (`<state>/origin/versions/<N>/manifest.json`, the files the origin serves),
so the devnet needs no endpoint of a role for it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from protocol.errors import PrimeError
from shardcast.manifest import SignedManifest


def published_versions(store: Path) -> list[dict[str, Any]]:
    """One row per version in the store, oldest first: its kind, the bytes that travel and the full weights' bytes."""
    rows = []
    versions = store / "versions"
    for path in sorted((p for p in versions.glob("*") if p.name.isdigit()), key=lambda p: int(p.name)) \
            if versions.is_dir() else []:
        try:
            manifest = SignedManifest.parse((path / "manifest.json").read_bytes()).manifest
        except (OSError, PrimeError):
            continue  # being written or removed by retention right now
        rows.append({"version": manifest.version, "kind": "anchor" if manifest.delta is None else "delta",
                     "base": None if manifest.delta is None else manifest.delta.base_version,
                     "bytes": manifest.total_bytes, "full_bytes": manifest.full_bytes, "dtype": manifest.dtype})
    return rows


def published_split(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The delta/full split of `rows` (`published_versions`): versions and deltas among them, the bytes that
    travel, the full weights' bytes and the share of those that travel (None without bytes)."""
    sent, full = sum(r["bytes"] for r in rows), sum(r["full_bytes"] for r in rows)
    return {"versions": len(rows), "deltas": sum(1 for r in rows if r["kind"] == "delta"), "bytes": sent,
            "full_bytes": full, "share": sent / full if full else None}


def published_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The table `prime-devnet status` prints, ending with the delta/full split."""
    if not rows:
        return ["published: no version in the origin's store yet"]
    lines = [f"{'version':>8} {'kind':<7} {'base':>5} {'bytes':>12} {'full bytes':>12} dtype"]
    for r in rows:
        lines.append(f"{r['version']:>8} {r['kind']:<7} {'' if r['base'] is None else r['base']:>5} "
                     f"{r['bytes']:>12} {r['full_bytes']:>12} {r['dtype'] or '-'}")
    split = published_split(rows)
    lines.append(f"published: {split['deltas']} of {split['versions']} versions as deltas; {split['bytes']} bytes "
                 f"travel for {split['full_bytes']} bytes of weights ({split['share']:.1%})"
                 if split["share"] is not None else "published: empty versions")
    return lines
