"""SHARDCAST: the trainer's checkpoints, signed and sharded, broadcast over a tree of HTTP relays.

`Origin` (publish + serve), `Relay` (follow + verify + re-serve), `Client` (pull + verify + swap in).
Names are imported lazily so that `import shardcast` (and `prime-relay --help`) stays cheap.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Client", "Origin", "PullResult", "Relay", "SignedManifest", "Manifest", "pull"]

_WHERE = {
    "Client": "shardcast.client", "PullResult": "shardcast.client", "pull": "shardcast.client",
    "Origin": "shardcast.origin", "Relay": "shardcast.relay",
    "SignedManifest": "shardcast.manifest", "Manifest": "shardcast.manifest",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(name)
    import importlib

    return getattr(importlib.import_module(_WHERE[name]), name)
