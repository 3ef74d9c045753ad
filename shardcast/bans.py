"""Sources a client or relay has banned, remembered across pulls and restarts for a limited time.

A client keeps them in `<out_dir>/bans.json`, a relay (banning its upstreams) in `<store>/bans.json`.

A relay is banned when it alone served shard bytes that did not match the signed manifest, or served
a manifest that failed verification: both are deliberate or broken, never bad luck. Within one pull
the ban already holds (`SourceBoard.ban`); this file makes the next pull skip the relay too, instead
of spending a shard (and the time to fetch and hash it) on finding out again. Bans expire after
`duration_s` (default one day) so that a relay that was fixed gets another chance, and
`prime-relay pull --forget-bans` (`relay --forget-bans`) clears them. A relay runs for weeks: it lifts
a ban when it runs out (`lift_expired`). The file is local state, but it is still parsed defensively:
a corrupt or oversized file is ignored with a warning and rewritten at the next ban; a file that
cannot be written is a warning too (the ban still holds for this process).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from shardcast.sources import SourceBoard

log = logging.getLogger(__name__)

DEFAULT_BAN_S = 24 * 3600.0
MAX_BANS = 10_000
_MAX_FILE_BYTES = 4 * 1024 * 1024


class BanList:
    """`{url: {"reason": str, "until": unix seconds}}` in a JSON file, written atomically."""

    def __init__(self, path: str | Path, *, duration_s: float = DEFAULT_BAN_S) -> None:
        self.path = Path(path)
        self.duration_s = duration_s
        self._until: dict[str, float] = {}
        """When each ban this list applied or recorded runs out (unix seconds)."""

    def load(self) -> dict[str, tuple[str, float]]:
        """`{url: (reason, until)}` of the bans that have not expired (empty when there is no readable file)."""
        try:
            if self.path.stat().st_size > _MAX_FILE_BYTES:
                log.warning("ignoring %s: larger than %d bytes", self.path, _MAX_FILE_BYTES)
                return {}
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.warning("ignoring unreadable ban list %s: %s", self.path, exc)
            return {}
        if not isinstance(data, dict):
            log.warning("ignoring ban list %s: not a JSON object", self.path)
            return {}
        now = time.time()
        bans: dict[str, tuple[str, float]] = {}
        for url, entry in data.items():
            if not isinstance(entry, dict):
                continue
            reason, until = entry.get("reason"), entry.get("until")
            if isinstance(reason, str) and isinstance(until, int | float) and until > now:
                bans[str(url)] = (reason, float(until))
        return bans

    def apply(self, board: SourceBoard) -> list[str]:
        """Mark the sources on `board` that are still banned; returns their URLs."""
        if self.duration_s <= 0:
            return []
        bans = self.load()
        applied = []
        for url, source in board.sources.items():
            if url not in bans:
                continue
            reason, until = bans[url]
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(until))
            source.banned = True
            source.ban_reason = f"banned until {when} by an earlier pull ({self.path}): {reason}"
            self._until[url] = until
            applied.append(url)
        if applied:
            log.info("skipping %d source(s) banned by earlier pulls: %s", len(applied), ", ".join(applied))
        return applied

    def record(self, board: SourceBoard) -> None:
        """Remember the sources banned during this pull (earlier bans keep their expiry)."""
        if self.duration_s <= 0:
            return
        banned = [s for s in board.sources.values() if s.banned and s.url not in self._until]
        if not banned:
            return
        bans = self.load()
        until = time.time() + self.duration_s
        fresh = {s.url: s.ban_reason or "banned" for s in banned if s.url not in bans}
        for s in banned:  # an earlier ban (another process's) keeps its expiry
            self._until[s.url] = bans[s.url][1] if s.url in bans else until
        if not fresh:
            return
        for url, reason in fresh.items():
            bans[url] = (reason[:500], until)
        if len(bans) > MAX_BANS:  # keep the ones that last longest
            bans = dict(sorted(bans.items(), key=lambda kv: -kv[1][1])[:MAX_BANS])
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        doc = {url: {"reason": reason, "until": round(t, 3)} for url, (reason, t) in bans.items()}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(doc, indent=1, sort_keys=True))
            os.replace(tmp, self.path)
        except OSError as exc:
            log.warning("cannot remember bans in %s (%s); they hold for this process only: %s", self.path, exc,
                        ", ".join(fresh))
            return
        log.warning("banned for %.1f h: %s", self.duration_s / 3600, ", ".join(fresh))

    def expires(self, url: str) -> float | None:
        """When the ban of `url` this list applied or recorded runs out (unix seconds), if there is one."""
        return self._until.get(url)

    def lift_expired(self, board: SourceBoard) -> list[str]:
        """Lift the bans on `board` that this list applied or recorded and that have run out; their URLs."""
        now = time.time()
        lifted = []
        for url, until in list(self._until.items()):
            if until > now:
                continue
            del self._until[url]
            source = board.sources.get(url)
            if source is not None and source.banned:
                source.banned, source.ban_reason = False, None
                lifted.append(url)
        if lifted:
            log.info("ban ran out, asking again: %s", ", ".join(lifted))
        return lifted

    def forget(self) -> None:
        self._until.clear()
        self.path.unlink(missing_ok=True)
