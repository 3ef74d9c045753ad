"""What the operator dashboard shows, read from the roles' public endpoints and the chain.

Sources (nothing here imports a role): the devnet's snapshot (devnet/observer.py: the trainer's metrics
file, nodes' `/health`, validators' `/v1/audit` counts, the pool's events), and beside it
- each validator's `GET /v1/nodes/{address}` (verdicts by outcome and reason) and `GET /v1/submissions`
  (every submission's received time and verdict, read incrementally: submissions over time);
- each node's `/metrics` (`prime_node_version_started_timestamp_seconds{version}`: when its first batch
  at each version began) and the SHARDCAST manifests' signed `created_at_ms` from the origin or a relay
  (`GET /v/{version}/manifest`): how long each version took to reach each node;
- the pool (`getNode`: stake, status, accepted units);
- the versions the trainer published, read from the origin's store on disk (`devnet/published.py`, the rows
  `prime-devnet status` prints): bytes per version and the delta/full split.

A role that does not answer is shown as down; a hostile or broken answer is skipped, never a crash. Nothing
waits on a hung role (issue 26 item 3): every read has a total deadline, and a validator, node or chain the
snapshot already shows as not answering is not asked again in the same collection (its last answers are
shown), so a stopped role costs a collection one timeout, in the snapshot, not one per read.
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from devnet.network import Layout
from devnet.published import published_split, published_versions
from devnet.view import View
from protocol.deadline import PeerTimeoutError, bounded_request, deadline_client

log = logging.getLogger(__name__)

MAX_ITEMS = 200_000
"""Submissions remembered per validator (the timeline's memory bound)."""
TIMELINE_BINS = 40
_STARTED = re.compile(r'^prime_node_version_started_timestamp_seconds\{version="(\d{1,12})"\} (\S+)$', re.M)


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]) of `values`; None for none."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def parse_started(metrics_text: str) -> dict[int, float]:
    """{version: unix time} from a node's /metrics text."""
    out: dict[int, float] = {}
    for version, value in _STARTED.findall(metrics_text):
        try:
            at = float(value)
        except ValueError:
            continue
        if math.isfinite(at):
            out[int(version)] = at
    return out


def timeline(items: list[dict[str, Any]], now: float, bins: int = TIMELINE_BINS) -> dict[str, Any]:
    """Submissions per time bin by verdict (`pending` for none yet), from the first one received to `now`."""
    items = [i for i in items if isinstance(i.get("received_at"), int | float) and math.isfinite(i["received_at"])]
    if not items:
        return {"start": now, "bin_s": 1.0, "bins": []}
    start = min(i["received_at"] for i in items)
    end = max(now, max(i["received_at"] for i in items), start + 1.0)  # a validator's clock may run ahead
    bin_s = max(1.0, math.ceil((end - start) / bins))
    out = [{"t": start + k * bin_s, "accepted": 0, "rejected_hard": 0, "rejected_soft": 0, "pending": 0}
           for k in range(int((end - start) // bin_s) + 1)]
    for i in items:
        k = min(int((i["received_at"] - start) // bin_s), len(out) - 1)
        outcome = i.get("outcome") or "pending"
        out[k][outcome if outcome in out[k] else "pending"] += 1
    return {"start": start, "bin_s": bin_s, "bins": out}


class Collector:
    """Builds the dashboard's data for one devnet (see the module docstring); thread-safe."""

    def __init__(self, layout: Layout, view: View, timeout_s: float = 3.0) -> None:
        self.layout = layout
        self.view = view
        self.timeout_s = timeout_s
        self.http = deadline_client(timeout_s)
        self._lock = threading.Lock()
        self._items: dict[str, dict[str, dict[str, Any]]] = {v["url"]: {} for v in layout.validators}
        self._cursor: dict[str, float] = {v["url"]: 0.0 for v in layout.validators}
        self._created: dict[int, float] = {}
        self._pool: Any = None
        self._chain_last: dict[str, dict[str, Any]] = {}
        self._metrics_last: dict[str, str] = {}

    def close(self) -> None:
        self.http.close()

    def _json(self, url: str, **params: Any) -> Any:
        try:
            r = bounded_request(self.http, "GET", url, self.timeout_s, params=params or None, max_bytes=64 << 20)
            return r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, PeerTimeoutError):
            return None

    def _text(self, url: str) -> str | None:
        try:
            r = bounded_request(self.http, "GET", url, self.timeout_s)
            return r.text if r.status_code == 200 else None
        except (httpx.HTTPError, PeerTimeoutError):
            return None

    def _submissions(self, url: str) -> bool:
        """Read the validator's new submissions; re-read the undecided ones' verdicts. False if it is down."""
        known = self._items[url]
        for _ in range(50):  # pages of 1000
            page = self._json(url + "/v1/submissions", after=self._cursor[url], limit=1000)
            if not isinstance(page, dict) or not isinstance(page.get("items"), list):
                return False
            for item in page["items"]:
                if isinstance(item, dict) and isinstance(item.get("received_at"), int | float) and \
                        isinstance(item.get("work_key"), str) and len(known) < MAX_ITEMS:
                    known[item["work_key"]] = item
            nxt = page.get("next")
            if not page["items"] or not isinstance(nxt, int | float) or not math.isfinite(nxt) \
                    or nxt <= self._cursor[url] or nxt > time.time() + 3600:
                break
            self._cursor[url] = float(nxt)
        pending = [i for i in known.values() if not i.get("outcome")]
        if pending:  # verdicts arrive after receipt: re-read from the oldest undecided one
            since = min(i["received_at"] for i in pending) - 1e-6
            page = self._json(url + "/v1/submissions", after=since, limit=10_000)
            if isinstance(page, dict) and isinstance(page.get("items"), list):
                for item in page["items"]:
                    if isinstance(item, dict) and item.get("work_key") in known:
                        known[item["work_key"]] = item
        return True

    def _manifest_created(self, version: int) -> float | None:
        if version not in self._created:
            for base in [self.layout.origin, *self.layout.relays]:
                doc = self._json(f"{base}/v/{version}/manifest")
                manifest = doc.get("manifest") if isinstance(doc, dict) else None
                created = manifest.get("created_at_ms") if isinstance(manifest, dict) else None
                if isinstance(created, int) and created > 0:
                    self._created[version] = created / 1000.0
                    break
        return self._created.get(version)

    def _scan_versions(self) -> None:
        """Remember the signing time of every version the origin holds now (it keeps only the newest few)."""
        for base in [self.layout.origin, *self.layout.relays]:
            index = self._json(base + "/versions")
            versions = index.get("versions") if isinstance(index, dict) else None
            if isinstance(versions, list):
                for v in versions[-64:]:
                    if isinstance(v, dict) and isinstance(v.get("version"), int) and v["version"] not in self._created:
                        self._manifest_created(v["version"])
                return

    def _chain_nodes(self, chain_up: bool) -> dict[str, dict[str, Any]]:
        """Each node's record on chain; while the snapshot shows the chain not answering, the last one read."""
        if not chain_up:
            return self._chain_last
        out: dict[str, dict[str, Any]] = {}
        try:
            if self._pool is None:
                from contracts.deployment import Deployment
                from contracts.devchain import dev_identity
                from contracts.pool import PoolClient
                from contracts.transactor import connect

                dep = Deployment.load(self.layout.deployment)
                # reads only; any identity will do (DEV ONLY: the public deployer account)
                self._pool = PoolClient(connect(self.layout.rpc_url, timeout=5.0), dep.pool, dev_identity(0))
            for n in self.layout.nodes:
                info = self._pool.get_node(n["address"])
                out[n["address"]] = {"stake": int(info.stake), "status": getattr(info.status, "name", str(info.status)),
                                     "accepted_units": int(info.accepted_units)}
        except Exception as exc:  # noqa: BLE001 - the chain being down is shown, not raised
            log.debug("dashboard: chain read failed: %s", exc)
        if out:
            self._chain_last = out
        return out

    def collect(self) -> dict[str, Any]:
        with self._lock:
            return self._collect()

    def _collect(self) -> dict[str, Any]:
        now = time.time()
        snap = self.view.refresh()  # what the roles say now: the summary loop's may be seconds old
        validators = []
        totals = {"received": 0, "accepted": 0, "rejected_hard": 0, "rejected_soft": 0, "pending": 0}
        down = {v["url"] for v, seen in zip(self.layout.validators, snap.get("validators", []), strict=False)
                if isinstance(seen, dict) and seen.get("up") is False}
        for v, seen in zip(self.layout.validators, snap.get("validators", []), strict=False):
            up = v["url"] not in down and self._submissions(v["url"])
            counts = seen.get("counts", {}) if isinstance(seen, dict) else {}
            for k in totals:
                totals[k] += int(counts.get(k, 0)) if isinstance(counts.get(k, 0), int) else 0
            validators.append({"name": v["name"], "address": v["address"], "url": v["url"], "up": up,
                               "counts": counts, "listed": len(self._items[v["url"]])})
        self._scan_versions()
        chain_nodes = self._chain_nodes(bool(snap.get("chain", {}).get("up", True)))
        health = {n.get("address"): n for n in snap.get("nodes", []) if isinstance(n, dict)}
        nodes, all_delays = [], []
        for n in self.layout.nodes:
            addr = n["address"]
            verdicts: dict[str, dict[str, int]] = {}
            pending = 0
            for v in self.layout.validators:
                if v["url"] in down:
                    continue
                summary = self._json(f"{v['url']}/v1/nodes/{addr}")
                if not isinstance(summary, dict):
                    continue
                for outcome, reasons in (summary.get("verdicts") or {}).items():
                    if isinstance(reasons, dict):
                        for reason, count in reasons.items():
                            if isinstance(count, int):
                                slot = verdicts.setdefault(str(outcome), {})
                                slot[str(reason)] = slot.get(str(reason), 0) + count
                pending += int(summary.get("pending", 0)) if isinstance(summary.get("pending"), int) else 0
            h = health.get(addr, {})
            metrics = None if h.get("up") is False else self._text(n["url"] + "/metrics")
            if metrics is not None:
                self._metrics_last[addr] = metrics
            last = self._metrics_last.get(addr)
            started = parse_started(last) if last is not None else {}
            delays = []
            for version, at in sorted(started.items()):
                created = self._manifest_created(version) if version > 0 else None
                if created is not None:
                    delays.append({"version": version, "delay_s": round(max(0.0, at - created), 3)})
            all_delays += [d["delay_s"] for d in delays]
            nodes.append({
                "name": n["name"], "address": addr, "up": bool(h.get("up")) or metrics is not None,
                "state": h.get("state"), "policy_version": h.get("policy_version"),
                "chain": chain_nodes.get(addr), "verdicts": verdicts, "pending": pending,
                "accepted": sum(verdicts.get("accepted", {}).values()),
                "propagation": {"versions": delays,
                                "p50_s": percentile([d["delay_s"] for d in delays], 50),
                                "p99_s": percentile([d["delay_s"] for d in delays], 99)},
            })
        items = [i for known in self._items.values() for i in known.values()]
        chain = snap.get("chain", {})
        published = published_versions(Path(self.layout.state_dir) / "origin")
        return {
            "generated_at": now, "run": self.layout.run, "model": self.layout.model,
            "trainer": snap.get("trainer", {}), "totals": totals, "validators": validators, "nodes": nodes,
            "propagation": {"p50_s": percentile(all_delays, 50), "p99_s": percentile(all_delays, 99),
                            "samples": len(all_delays)},
            "submissions": timeline(items, now),
            "published": {"versions": published, "split": published_split(published)},
            "chain": {"up": chain.get("up", False), "policy_version": chain.get("policy_version"),
                      "rewards_reserved": chain.get("rewards_reserved"), "events": chain.get("events", {}),
                      "recent": list(reversed(chain.get("recent", [])))[:20], "error": chain.get("error")},
        }
