"""node.monitor: /metrics carries when each policy version's first batch began (the dashboard's
propagation view reads it), served by a real Monitor on a loopback port."""

from __future__ import annotations

import httpx

from node.monitor import Monitor
from node.worker import Tally


def test_metrics_export_the_start_time_of_each_version() -> None:
    tally = Tally()
    tally.version_started_at.update({1: 1700000000.25, 2: 1700000012.5})
    monitor = Monitor(lambda: tally, lambda: 0, host="127.0.0.1", port=0)
    monitor.start()
    try:
        text = httpx.get(f"{monitor.url}/metrics", timeout=5).text
    finally:
        monitor.stop()
    lines = [ln for ln in text.splitlines() if ln.startswith("prime_node_version_started_timestamp_seconds{")]
    assert lines == ['prime_node_version_started_timestamp_seconds{version="1"} 1.70000000025e+09',
                     'prime_node_version_started_timestamp_seconds{version="2"} 1.7000000125e+09']


def test_metrics_count_validator_answers_not_believed() -> None:
    """Issue 23 item 10: the answers a node refused to believe are counted by kind, for the operator."""
    tally = Tally()
    tally.peer_errors.update({"unsigned_verdict": 2, "http_418": 1})
    monitor = Monitor(lambda: tally, lambda: 0, host="127.0.0.1", port=0)
    monitor.start()
    try:
        text = httpx.get(f"{monitor.url}/metrics", timeout=5).text
    finally:
        monitor.stop()
    lines = sorted(ln for ln in text.splitlines() if ln.startswith("prime_node_peer_errors_total{"))
    assert lines == ['prime_node_peer_errors_total{kind="http_418"} 1.0',
                     'prime_node_peer_errors_total{kind="unsigned_verdict"} 2.0']
