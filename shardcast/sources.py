"""Relay scoring: which source to ask next for a shard.

Each source has a throughput estimate (EWMA of bytes/s over finished shards), a count of requests
in flight, a cool-down after failures (exponential, capped), and a ban flag set when it served bytes
that did not match the signed hash. Untried sources score optimistically so that every source gets
probed once; after that a source's share of the work follows its measured throughput.

Health outlives a pull (a `Client` or a relay keeps its board): a source whose request timed out (it
accepted and then said nothing: a stopped process, a wedged proxy) is `hung` and skipped by `pick` and
`order` while any other source is usable, until it answers again (`answered`, from the index probes the
client keeps sending it without waiting for them). `order` ranks the rest by health for the next pull:
not cooling down first, then measured speed, then how many versions it served that verified.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from protocol.errors import RelayError
from shardcast.errors import RelayConfigError

_EWMA = 0.3
_COOLDOWN_BASE_S = 0.2
_COOLDOWN_MAX_S = 5.0


@dataclass
class SourceStats:
    """What a client knows about one relay during a pull."""

    url: str
    throughput: float | None = None
    """Bytes per second (EWMA over shards), None until one shard finished."""
    inflight: int = 0
    ok: int = 0
    failures: int = 0
    consecutive_failures: int = 0
    bad_shards: int = 0
    banned: bool = False
    ban_reason: str | None = None
    cooldown_until: float = 0.0
    hung: bool = False
    """Its last request timed out and it has not answered since: skipped while another source is usable."""
    timeouts: int = 0
    probed_at: float = -float("inf")
    """time.monotonic() when its version index was last asked for."""
    versions: int = 0
    """Manifests it served that verified."""
    bytes: int = 0
    extra: dict[str, int] = field(default_factory=dict)

    def score(self) -> float:
        """Higher is better: expected throughput shared among the requests already in flight."""
        expected = self.throughput if self.throughput is not None else 1e12  # optimistic: try it once
        return expected / (1 + self.inflight)


class SourceBoard:
    """Scores a set of relays for one pull (or for a relay's upstreams)."""

    def __init__(self, urls: list[str]) -> None:
        if not urls:
            raise RelayConfigError("no sources given")
        self.sources = {url.rstrip("/"): SourceStats(url.rstrip("/")) for url in urls}

    def usable(self) -> list[SourceStats]:
        return [s for s in self.sources.values() if not s.banned]

    def live(self) -> list[SourceStats]:
        """The usable sources not known to be hung (all usable ones when every one is hung: nothing else to ask)."""
        usable = self.usable()
        return [s for s in usable if not s.hung] or usable

    def order(self, urls: list[str]) -> list[str]:
        """`urls` (known sources, banned ones dropped) best first for the next request: live before hung, out
        of cool-down before cooling, then by score, then by versions served."""
        now = time.monotonic()
        known = [self.sources[u.rstrip("/")] for u in urls if not self.sources[u.rstrip("/")].banned]
        return [s.url for s in sorted(known, key=lambda s: (s.hung, s.cooldown_until > now, -s.score(), -s.versions))]

    def pick(self, exclude: set[str] | None = None) -> SourceStats | float:
        """The best source now, or the seconds to wait until one leaves its cool-down.

        `exclude`: sources that already failed this shard (ignored if nothing else is left).
        Raises `RelayError` when every source is banned.
        """
        usable = self.usable()
        if not usable:
            raise RelayError("every source is banned: " + "; ".join(f"{s.url}: {s.ban_reason}" for s in self.sources.values()))
        usable = self.live()
        now = time.monotonic()
        ready = [s for s in usable if s.cooldown_until <= now]
        preferred = [s for s in ready if not exclude or s.url not in exclude] or ready
        if not preferred:
            return max(0.01, min(s.cooldown_until for s in usable) - now)
        return max(preferred, key=lambda s: s.score())

    def success(self, source: SourceStats, nbytes: int, seconds: float) -> None:
        rate = nbytes / max(seconds, 1e-6)
        source.throughput = rate if source.throughput is None else (1 - _EWMA) * source.throughput + _EWMA * rate
        source.ok += 1
        source.bytes += nbytes
        source.consecutive_failures = 0
        source.hung = False

    def answered(self, source: SourceStats) -> None:
        """The source answered a request (whatever it said): not hung."""
        source.hung = False

    def failure(self, source: SourceStats, *, soft: bool = False, timed_out: bool = False) -> None:
        """A failed request; `soft` (the shard is not there yet) cools the source down without blame;
        `timed_out` (accepted, then silent) marks it hung as well."""
        if timed_out:
            source.hung = True
            source.timeouts += 1
        if not soft:
            source.failures += 1
            source.consecutive_failures += 1
            delay = min(_COOLDOWN_MAX_S, _COOLDOWN_BASE_S * 2 ** (source.consecutive_failures - 1))
        else:
            delay = _COOLDOWN_BASE_S
        source.cooldown_until = time.monotonic() + delay

    def ban(self, source: SourceStats, reason: str) -> None:
        source.banned = True
        source.bad_shards += 1
        source.ban_reason = reason

    def summary(self) -> dict[str, dict[str, object]]:
        return {
            s.url: {
                "ok": s.ok, "failures": s.failures, "banned": s.banned, "ban_reason": s.ban_reason, "bytes": s.bytes,
                "hung": s.hung, "timeouts": s.timeouts, "versions": s.versions,
                "throughput_mb_s": round((s.throughput or 0) / 1e6, 1),
            }
            for s in self.sources.values()
        }
