"""`bench.capacity`: the smoke run answers from the repository's measurements and names them; the arithmetic
follows the measured numbers it is given; missing or hostile measurement files give `null` answers, not a
crash or a guess."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from benchload import load_bench

ROOT = Path(__file__).resolve().parents[3]


capacity = load_bench("capacity")


def _run(tmp_path: Path, *args: str) -> dict[str, Any]:
    out = tmp_path / "capacity.json"
    proc = subprocess.run([sys.executable, "-m", "bench.capacity", "--json", str(out), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "rests on:" in proc.stdout
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def test_smoke_answers_from_the_measurements_and_names_them(tmp_path: Path) -> None:
    result = _run(tmp_path, "--smoke")
    assert result["smoke"] and len(result["networks"]) == 1
    assert result["inputs"] and all(m is not None for m in result["inputs"].values()), result["inputs"]
    assert all(Path(ROOT / "bench" / "measured" / m["source"].split(":")[0]).is_file()
               for m in result["inputs"].values() if ":" in m["source"].split(" ")[0])
    net = result["networks"][0]
    assert net["validators"]["count"] >= 2 and net["relays"][0]["relays"] >= 1
    assert net["chain"]["gas_per_accepted_batch"] > 0 and net["gossip"]["seconds"] > 0
    assert net["trainer"]["devices"] >= 1
    assert len(result["limits"]) >= 5


def _write(dirpath: Path, name: str, data: Any) -> None:
    (dirpath / name).write_text(json.dumps(data))


def test_the_arithmetic_follows_the_numbers_it_is_given(tmp_path: Path) -> None:
    m = tmp_path / "m"
    m.mkdir()
    _write(m, "validator.json", {"validation_over_generation": {"smollm2": 0.5}, "http_intake": {"per_s": 10.0},
                                 "models": {"smollm2": {"rollout_tokens": 1000, "submissions": 1}}})
    _write(m, "load.json", {"relay": {"throughput_mib_s": 100.0}})
    _write(m, "shardcast.json", {"shard_mib": 10})
    result = _run(tmp_path, "--measured", str(m), "--nodes", "100", "1000", "--fanout", "10", "--utilization", "1",
                  "--node-tok-s", "100")
    small, big = result["networks"]
    # compute bound: nodes x 0.5; intake: nodes x 100 tok/s / 1000 tok per submission / 10 per s
    assert (small["validators"]["compute_bound"], small["validators"]["intake_bound"]) == (50, 1)
    assert (big["validators"]["compute_bound"], big["validators"]["intake_bound"]) == (500, 10)
    assert big["validators"]["count"] == 500
    tree = small["relays"][0]
    assert tree["relays"] == capacity.relay_tree(150, 10)[0] == 15 + 2
    size_mib = 62e9 / (1 << 20)
    assert math.isclose(tree["seconds_measured"], size_mib / 10 + (tree["hops"] - 1) * 10 / 10, rel_tol=1e-3)
    assert small["chain"] is None and small["gossip"]["seconds"] is None  # gas.json, discovery.json missing
    assert result["inputs"]["gas"] is None and result["inputs"]["hop_s"] is None


def test_a_delta_version_costs_its_changed_fraction_times_position_and_value_bytes(tmp_path: Path) -> None:
    m = tmp_path / "m"
    m.mkdir()
    _write(m, "load.json", {"relay": {"throughput_mib_s": 100.0}})
    _write(m, "shardcast.json", {"shard_mib": 10})
    result = _run(tmp_path, "--measured", str(m), "--nodes", "100", "--fanout", "10", "--delta-fraction", "0.02",
                  "0.7", "--anchor-every", "4")
    two, most = result["networks"][0]["delta"]
    # bf16: a LEB128 gap (1 byte below 128, 2 below 16384: at 2% changed, 0.98^127 = 7.7% of the gaps take a
    # second byte) + 2 bytes of value per changed element, over 2 bytes per element
    ratio = 0.02 * (1 + 0.98 ** 127 + 0.98 ** 16383 + 2) / 2
    assert two["changed_fraction"] == 0.02 and math.isclose(two["bytes_over_full"], ratio, abs_tol=1e-4)
    assert math.isclose(ratio, 0.0308, abs_tol=1e-4)  # what the delta smoke run measured: 0.0309
    assert math.isclose(two["gb_per_delta"], 62 * ratio, rel_tol=1e-2)
    assert math.isclose(two["gb_per_version"], 62 * (3 * ratio + 1) / 4, rel_tol=1e-2)
    full = result["networks"][0]["relays"][0]
    delta_mib = 62e9 / (1 << 20) * ratio
    assert math.isclose(two["relays"][0]["seconds_measured"],
                        delta_mib / 10 + (full["hops"] - 1) * 10 / 10, rel_tol=1e-2)
    assert most["bytes_over_full"] == 1.0  # past two thirds changed (3 bytes for 2), the version goes out whole
    assert math.isclose(most["relays"][0]["seconds_measured"], full["seconds_measured"], rel_tol=1e-3)


def test_relay_tree_reaches_every_consumer_with_fanout_k() -> None:
    for consumers in (1, 7, 100, 1000, 10_000):
        for k in (2, 4, 16):
            relays, hops = capacity.relay_tree(consumers, k)
            assert k ** hops >= consumers  # the origin's k children, times k per further level
            assert relays >= math.ceil(consumers / k)
    assert capacity.relay_tree(100, 10) == (10, 2)


@pytest.mark.parametrize("junk", ["not json", json.dumps({"validation_over_generation": {"smollm2": -1}}),
                                  json.dumps({"validation_over_generation": {"smollm2": "NaN"}}), json.dumps([1])])
def test_missing_or_hostile_measurements_give_null_answers(tmp_path: Path, junk: str) -> None:
    m = tmp_path / "m"
    m.mkdir()
    (m / "validator.json").write_text(junk)
    (m / "gas.json").write_text(json.dumps({"rows": [{"call": "recordWork"}, "x"]}))
    result = _run(tmp_path, "--measured", str(m), "--smoke")
    net = result["networks"][0]
    assert net["validators"]["count"] is None and net["chain"] is None
    assert net["relays"][0]["seconds_measured"] is None and net["relays"][0]["seconds_10gbit"] > 0
