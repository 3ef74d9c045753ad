"""devnet/dashboard: the collector's pure parts, the node metric it reads (from a real node Monitor), and the
page rendered by a real headless Chromium from a file (offline: no network, no script), hostile strings
escaped; a collection never waits on a hung role. The page against a running devnet is tests/e2e/test_devnet.py."""

from __future__ import annotations

import time
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from headless import dump_dom, marked
from netfixtures import free_port, hung_server
from safetensors.numpy import save_file

from devnet.dashboard.collector import Collector, parse_started, percentile, timeline
from devnet.dashboard.page import render
from devnet.network import Layout
from devnet.published import published_split, published_versions
from devnet.view import View
from node.monitor import Monitor
from node.worker import Tally
from protocol.identity import Identity
from shardcast.publisher import DeltaBase, publish_blocking

EVIL = '<script>document.title="owned"</script><img src=x onerror=alert(1)>'


def test_percentile_is_nearest_rank() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0 and percentile(values, 99) == 99.0 and percentile(values, 100) == 100.0
    assert percentile([5.0, 1.0, 3.0], 50) == 3.0


def test_version_start_times_read_from_a_real_node_monitor() -> None:
    tally = Tally()
    tally.version_started_at.update({0: 1700000000.0, 3: 1700000042.125})
    monitor = Monitor(lambda: tally, lambda: 0, host="127.0.0.1", port=0)
    monitor.start()
    try:
        text = httpx.get(monitor.url + "/metrics", timeout=5).text
    finally:
        monitor.stop()
    assert parse_started(text) == {0: 1700000000.0, 3: 1700000042.125}
    # junk lines, a non-finite value and another metric are ignored
    assert parse_started('prime_node_version_started_timestamp_seconds{version="1"} NaN\n'
                         'prime_node_version_started_timestamp_seconds{version="x"} 5\n'
                         'prime_node_batches_total 3\n') == {}


def test_timeline_bins_every_submission_once_by_verdict() -> None:
    now = 1000.0
    items = [{"received_at": 900.0 + i, "outcome": o} for i, o in enumerate(
        ["accepted"] * 50 + ["rejected_hard"] * 3 + ["rejected_soft"] * 2 + [None] * 5)]
    t = timeline(items, now, bins=10)
    assert t["start"] == 900.0 and t["bin_s"] == 10.0 and len(t["bins"]) == 11
    totals = {k: sum(b[k] for b in t["bins"]) for k in ("accepted", "rejected_hard", "rejected_soft", "pending")}
    assert totals == {"accepted": 50, "rejected_hard": 3, "rejected_soft": 2, "pending": 5}
    assert t["bins"][0]["accepted"] == 10 and t["bins"][5]["rejected_hard"] == 3
    assert timeline([], now)["bins"] == []
    # what a broken or hostile validator may list: no crash, the odd rows binned or dropped
    odd = timeline([{"received_at": float("inf")}, {"received_at": float("nan")}, {"received_at": "x"},
                    {"received_at": 5000.0, "outcome": "accepted"}, {"received_at": 10.0, "outcome": "<b>"}], now)
    assert sum(sum(b[k] for k in ("accepted", "pending")) for b in odd["bins"]) == 2 and len(odd["bins"]) <= 41


PUBLISHED = [{"version": 0, "kind": "anchor", "base": None, "bytes": 4000, "full_bytes": 4000, "dtype": "bfloat16"},
             {"version": 1, "kind": "delta", "base": 0, "bytes": 300, "full_bytes": 4000, "dtype": "bfloat16"}]


def _data() -> dict[str, Any]:
    node = {"name": "node-0", "address": "0x15d34AAf54267DB7D7c367839AAf71A00a2C6A65", "up": True,
            "state": "working", "policy_version": 4,
            "chain": {"stake": 25 * 10**18, "status": "ACTIVE", "accepted_units": 1234},
            "verdicts": {"accepted": {"accepted": 7}, "rejected_soft": {EVIL: 2}}, "pending": 1, "accepted": 7,
            "propagation": {"versions": [{"version": 2, "delay_s": 1.5}, {"version": 3, "delay_s": 2.5}],
                            "p50_s": 1.5, "p99_s": 2.5}}
    return {
        "generated_at": time.time(), "run": {"run_id": "devnet", "env": EVIL}, "model": "tiny",
        "trainer": {"step": 2, "max_steps": 10, "reward": [
            {"step": 0, "reward_mean": 0.1}, {"step": 1, "reward_mean": 0.25}, {"step": 2, "reward_mean": 0.5}]},
        "totals": {"received": 10, "accepted": 7, "rejected_hard": 0, "rejected_soft": 2, "pending": 1},
        "validators": [{"name": "validator-0", "address": "0x7099", "url": "http://127.0.0.1:1", "up": True,
                        "counts": {"received": 10, "accepted": 7, "rejected_hard": 0, "rejected_soft": 2,
                                   "pending": 1}, "listed": 10}],
        "nodes": [node], "propagation": {"p50_s": 1.5, "p99_s": 2.5, "samples": 2},
        "submissions": timeline([{"received_at": 100.0 + i, "outcome": "accepted"} for i in range(7)], 120.0),
        "published": {"versions": PUBLISHED, "split": published_split(PUBLISHED)},
        "chain": {"up": True, "policy_version": 4, "rewards_reserved": 5, "events": {"WorkRecorded": 7, EVIL: 1},
                  "recent": [{"name": EVIL, "block": 9, "args": {"node": EVIL}}], "error": None},
    }


def test_page_renders_in_a_headless_browser_offline_with_hostile_strings_escaped(tmp_path: Path) -> None:
    data = _data()
    page = tmp_path / "dashboard.html"
    page.write_text(render(data))
    dom = dump_dom(page.as_uri())
    shown = marked(dom)
    assert shown.one("trainer.step") == "2" and shown.one("trainer.reward") == "0.500"
    assert shown.one("totals.received") == "10" and shown.one("totals.accepted") == "7"
    assert shown.one("totals.rejected_soft") == "2" and shown.one("totals.pending") == "1"
    assert shown.one("chain.policy_version") == "4"
    n = "node.0x15d34AAf54267DB7D7c367839AAf71A00a2C6A65."
    assert shown.one(n + "stake") == str(25 * 10**18) and shown.one(n + "accepted") == "7"
    assert shown.one(n + "status") == "ACTIVE" and shown.one(n + "pending") == "1"
    assert shown.one(n + "verdict.accepted.accepted") == "7" and shown.one(n + f"verdict.rejected_soft.{EVIL}") == "2"
    assert shown.one(n + "p50") == "1.50" and shown.one(n + "p99") == "2.50"
    assert shown.one("validator.0x7099.accepted") == "7" and shown.one("validator.0x7099.rejected_soft") == "2"
    assert shown.one("published.1.kind") == "delta" and shown.one("published.1.bytes") == "300"
    assert shown.one("published.deltas") == "1" and shown.one("published.share") == "53.8%"
    points = [(e["data-step"], e["data-value"]) for e in shown.elements if e["<tag>"] == "circle" and "data-step" in e]
    assert points == [("0", "0.100000"), ("1", "0.250000"), ("2", "0.500000")]
    bars = sum(int(e["data-value"]) for e in shown.elements if e["<tag>"] == "rect" and e.get("data-kind"))
    assert bars == 7
    # nothing hostile became markup: no script or img element, the title is the page's own
    assert not [e for e in shown.elements if e["<tag>"] in ("script", "img")]
    assert "<title>prime-devnet: devnet</title>" in dom and "owned" not in dom.split("</title>")[0]


HOSTILE = ['<script>document.title="owned"</script>', '"><img src=x onerror=alert(1)>', "'><svg onload=alert(2)>",
           '</svg><script>alert(3)</script>', '</td></tr></table><iframe src="//evil">', "&lt;b&gt;"]


class _Markup(HTMLParser):
    """Every element and attribute a page parses into (what a browser would build)."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: set[str] = set()
        self.attrs: list[tuple[str, str]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.add(tag)
        self.attrs += [(k, v or "") for k, v in attrs]

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def test_every_node_and_validator_supplied_field_is_escaped() -> None:
    """Issue 23 item 13: whatever a node (`/health`, `/metrics`) or a validator (`/v1/audit`, `/v1/nodes`) returns
    lands in the page as text, never as markup; checked for each hostile string in every such field at once."""
    honest = _Markup()
    honest.feed(render(_data()))
    for evil in HOSTILE:
        data = _data()
        node = data["nodes"][0]
        # the node's /health and the node-derived columns
        node.update({"name": evil, "address": evil, "state": evil, "policy_version": evil, "pending": evil,
                     "accepted": evil, "up": False})
        node["chain"] = {"stake": evil, "status": evil, "accepted_units": evil}
        node["verdicts"] = {"accepted": {evil: evil}, evil: {evil: 1}, "rejected_hard": {"equivocation": evil}}
        node["propagation"] = {"versions": [{"version": evil, "delay_s": 1.0}], "p50_s": evil, "p99_s": evil}
        # the validators' counts and the totals summed from them
        data["validators"] = [{"name": evil, "address": evil, "url": evil, "up": True, "listed": evil,
                               "counts": dict.fromkeys(("received", "accepted", "rejected_hard", "rejected_soft",
                                                        "pending"), evil)}]
        data["totals"] = dict.fromkeys(("received", "accepted", "rejected_hard", "rejected_soft", "pending"), evil)
        data["propagation"] = {"p50_s": evil, "p99_s": evil, "samples": evil}
        data["trainer"] = {"step": evil, "max_steps": evil, "reward": [{"step": 1, "reward_mean": 0.5}]}
        data["run"], data["model"] = {"run_id": evil, "env": evil}, evil
        data["chain"] = {"up": True, "policy_version": evil, "events": {evil: evil},
                         "recent": [{"name": evil, "block": evil, "args": {evil: evil}}], "error": evil}
        data["published"] = {"versions": [dict.fromkeys(("version", "kind", "base", "bytes", "full_bytes", "dtype"),
                                                        evil)], "split": dict.fromkeys(("deltas", "versions"), evil)}
        bins = data["submissions"]["bins"]
        bins[0]["accepted"] = 3  # counts are the collector's own integers; the rest of a bin is from ledgers
        page = render(data)
        seen = _Markup()
        seen.feed(page)
        assert seen.tags <= honest.tags, (evil, seen.tags - honest.tags)
        assert not [k for k, _ in seen.attrs if k.startswith("on")], evil
        assert {k for k, _ in seen.attrs} <= {k for k, _ in honest.attrs}, evil
        # and the string itself is shown (as text), not dropped
        assert any(evil in t for t in seen.text), evil


def _ckpt(directory: Path, weights: np.ndarray) -> Path:
    directory.mkdir()
    save_file({"w": weights}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text("{}")
    return directory


def test_the_page_shows_bytes_per_version_and_the_split_from_the_origins_store(tmp_path: Path) -> None:
    """The collector reads the versions the trainer published from the origin's store (the rows `prime-devnet status`
    prints, `devnet/published.py`), and the page shows each version's kind and bytes and the delta/full split."""
    trainer, store = Identity.create(), tmp_path / "origin"
    w = np.arange(65536, dtype=np.float32)
    moved = w.copy()
    moved[::100] += 1  # 1% of the weights move: a delta
    first = publish_blocking(_ckpt(tmp_path / "v0", w), store, identity=trainer, run_id="r", version=0,
                             shard_size=1 << 16, dtype="float32")
    second = publish_blocking(_ckpt(tmp_path / "v1", moved), store, identity=trainer, run_id="r", version=1,
                              shard_size=1 << 16, dtype="float32", base=DeltaBase(tmp_path / "v0", first.manifest))
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: every read of a role fails at once
    layout = Layout(state_dir=str(tmp_path), model="tiny", run={}, rpc_url=dead,
                    deployment=str(tmp_path / "deployment.json"), trainer={}, origin=dead, relays=[],
                    validators=[], nodes=[])
    snap: dict[str, Any] = {"trainer": {}, "validators": [], "nodes": [], "chain": {"up": False}}
    collector = Collector(layout, View(layout, lambda: snap, dict), timeout_s=2.0)
    try:
        data = collector.collect()
    finally:
        collector.close()
    rows = published_versions(store)
    assert data["published"]["versions"] == rows and [r["kind"] for r in rows] == ["anchor", "delta"]
    sent, full = first.manifest.total_bytes + second.manifest.total_bytes, 2 * first.manifest.full_bytes
    assert data["published"]["split"] == {"versions": 2, "deltas": 1, "bytes": sent, "full_bytes": full,
                                          "share": sent / full}
    shown = marked(render(data))
    assert shown.one("published.0.kind") == "anchor" and shown.one("published.1.kind") == "delta"
    assert shown.one("published.1.base") == "0"
    assert shown.one("published.1.bytes") == str(second.manifest.total_bytes)
    assert shown.one("published.1.full_bytes") == str(second.manifest.full_bytes)
    assert shown.one("published.deltas") == "1" and shown.one("published.versions") == "2"
    assert shown.one("published.share") == f"{sent / full:.1%}"


@pytest.mark.timeout(60)
def test_a_collection_never_waits_on_a_hung_role(tmp_path: Path) -> None:
    """Roles that answer a body a byte every 0.2 s (httpx's per-read timeout never fires): the validator, node
    and chain the snapshot shows as not answering are not asked again, and the origin and relay the collector
    reads on its own are given up at its deadline."""
    with hung_server(0.2, head_first=True) as hung:
        layout = Layout(state_dir=str(tmp_path), model="tiny", run={}, rpc_url=hung,
                        deployment=str(tmp_path / "deployment.json"), trainer={}, origin=hung, relays=[hung],
                        validators=[{"name": "validator-0", "address": "0x" + "11" * 20, "url": hung}],
                        nodes=[{"name": "node-0", "address": "0x" + "22" * 20, "url": hung}])
        snap = {"trainer": {}, "validators": [{"name": "validator-0", "up": False, "counts": {}}],
                "nodes": [{"name": "node-0", "address": "0x" + "22" * 20, "up": False}],
                "chain": {"up": False, "error": "no answer"}}
        collector = Collector(layout, View(layout, lambda: snap, dict), timeout_s=1.0)
        try:
            data = collector.collect()
        finally:
            collector.close()
    assert [v["up"] for v in data["validators"]] == [False]
    assert [n["up"] for n in data["nodes"]] == [False]
    assert data["chain"]["up"] is False
