"""Churn: the devnet trains on while a node dies for good and a new one joins (issue 26 item 2).

Two runs of the smallest devnet (tiny model, 3 nodes, 1 validator, 1 relay), in this process
(`devnet.network.Network`, as `prime-devnet up` runs it), one after the other on the same machine:

    steady   nothing happens for the measured window
    churn    at the window's start node-0's process group gets SIGKILL (no restart: gone for good);
             a third of the way in (or later, once the trainer has stepped without node-0: a step waits
             `fill_timeout_s` for the missing share), a new node (a spare account: `spare_nodes`) joins,
             stakes and works

For each, over the same window: trainer steps per minute, reward per trained sample (the trainer's
metrics, weighted by samples), samples per step, stale samples dropped; for churn also the steps trained
while node-0 was dead and before the new node joined, and the new node's accepted batches. The anchor is
the steady run: the report gives churn / steady ratios. Then the audit (`prime-devnet audit`: nothing lost,
nothing paid twice; the dead node is read from its record on disk) must reconcile for both runs.

    python -m bench.churn --quick --json out.json     # 60 s windows
    python -m bench.churn --json bench/measured/churn.json
    python -m bench.churn --smoke                      # the report's arithmetic on a synthetic metrics file

Sizes, threads and machine are in the JSON (`info`). Timings on a shared 2-core box move with the load:
read the ratio of the two runs, not absolute speeds.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import harness


class ChurnError(RuntimeError):
    """The network did not do what the bench waited for (the message says what, and where the logs are)."""


def window_stats(metrics: list[dict[str, Any]], first_step: int, last_step: int, seconds: float) -> dict[str, Any]:
    """Steps (first_step, last_step] of the trainer's metrics over a window of `seconds`."""
    steps = [m for m in metrics if first_step < int(m["step"]) <= last_step]
    samples = sum(int(m.get("samples") or 0) for m in steps)
    reward = sum(float(m.get("reward_mean") or 0.0) * int(m.get("samples") or 0) for m in steps)
    return {
        "window_s": round(seconds, 1),
        "steps": len(steps),
        "steps_per_min": round(len(steps) * 60.0 / seconds, 2) if seconds > 0 else None,
        "samples": samples,
        "reward_per_sample": round(reward / samples, 4) if samples else None,
        "samples_per_step": round(samples / len(steps), 2) if steps else None,
        "stale_samples": sum(int(m.get("stale_samples") or 0) for m in steps),
    }


def ratios(steady: dict[str, Any], churn: dict[str, Any]) -> dict[str, float | None]:
    def ratio(key: str) -> float | None:
        a, b = steady.get(key), churn.get(key)
        return round(b / a, 3) if isinstance(a, int | float) and isinstance(b, int | float) and a else None

    return {k: ratio(k) for k in ("steps_per_min", "reward_per_sample", "samples_per_step")}


class Run:
    """One devnet in this process, with read-only probes."""

    def __init__(self, state: Path, churn: bool, fill_timeout_s: float, extra: list[str] | None = None) -> None:
        from devnet.config import load_config
        from devnet.network import Network

        argv = ["--state-dir", str(state), "--nodes", "3", "--validators", "1", "--relays", "1",
                "--spare-nodes", "1" if churn else "0", "--dashboard-port", "0",
                "--trainer.fill-timeout-s", str(fill_timeout_s), *(extra or [])]
        self.net = Network(load_config(argv))
        self.state = state

    def up(self) -> None:
        self.net.up(None)

    @property
    def layout(self) -> Any:
        assert self.net.layout is not None
        return self.net.layout

    def metrics(self) -> list[dict[str, Any]]:
        from devnet.observer import read_metrics

        return read_metrics(Path(self.layout.trainer["metrics_file"]))

    def step(self) -> int:
        m = self.metrics()
        return int(m[-1]["step"]) if m else -1

    def wait(self, what: str, check: Any, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            if time.monotonic() > deadline:
                raise ChurnError(f"no {what} within {timeout:.0f} s; logs in {self.state}/logs")
            time.sleep(0.5)

    def kill_for_good(self, name: str) -> int:
        entry = self.net.table.entries[name]
        os.killpg(entry.pid, signal.SIGKILL)
        return int(entry.pid)

    def accepted(self, address: str) -> int:
        import httpx

        total = 0
        for v in self.layout.validators:
            try:
                body = httpx.get(v["url"] + "/v1/audit", timeout=10).json()
            except (httpx.HTTPError, ValueError):
                continue
            total += sum(1 for a in body.get("accepted", []) if str(a.get("node", "")).lower() == address.lower())
        return total

    def audit(self, timeout: float) -> dict[str, Any]:
        """The devnet's audit, retried while work is in flight (a row counted by one role, not yet the next)."""
        from devnet.audit import audit

        t0 = time.monotonic()
        while True:
            report = audit(self.layout)
            if report["ok"] or time.monotonic() - t0 > timeout:
                bad = [r for r in report["rows"] if not r["ok"]]
                return {"ok": report["ok"], "after_s": round(time.monotonic() - t0, 1), "rows": len(report["rows"]),
                        "mismatches": bad}
            time.sleep(3)

    def stop(self) -> None:
        self.net.stop()


def run(churn: bool, window_s: float, state_root: Path, fill_timeout_s: float = 20.0,
        warmup_steps: int = 2) -> dict[str, Any]:
    mode = "churn" if churn else "steady"
    r = Run(state_root / mode, churn, fill_timeout_s)
    out: dict[str, Any] = {"mode": mode}
    try:
        t0 = time.monotonic()
        r.up()
        r.wait(f"{warmup_steps} trained steps", lambda: r.step() >= warmup_steps, 900)
        out["up_to_warm_s"] = round(time.monotonic() - t0, 1)
        start_step, start = r.step(), time.monotonic()
        if churn:
            out["killed"] = {"node": "node-0", "pid": r.kill_for_good("node-0"), "at_step": start_step}
            time.sleep(window_s / 3)
            # and until the trainer has stepped without node-0: such a step waits `fill_timeout_s` for the dead
            # node's share first, so a fixed third of the window (20 s in --quick, the default fill timeout)
            # raced it and the new node could join before any step had shown training going on without node-0
            r.wait("a step trained while node-0 was dead", lambda: r.step() > start_step, 3 * fill_timeout_s + 120)
            before_join = r.step()
            out["steps_while_dead_before_join"] = before_join - start_step
            joined = r.net.add_node()
            out["joined"] = {"node": joined["name"], "address": joined["address"], "at_step": r.step(),
                             "after_s": round(time.monotonic() - start, 1)}
        time.sleep(max(0.0, window_s - (time.monotonic() - start)))
        end_step, seconds = r.step(), time.monotonic() - start
        out["window"] = window_stats(r.metrics(), start_step, end_step, seconds)
        if churn:
            joined_address = out["joined"]["address"]
            r.wait("accepted work from the node that joined", lambda: r.accepted(joined_address) > 0, 300)
            out["joined"]["accepted"] = r.accepted(joined_address)
            out["steps_after_join"] = r.step() - out["joined"]["at_step"]
        out["audit"] = r.audit(120)
    finally:
        r.stop()
    return out


def smoke() -> dict[str, Any]:
    """The report's arithmetic on a synthetic metrics file (no devnet): seconds, for the default test tier."""
    steady = [{"step": s, "samples": 48, "reward_mean": 0.5, "stale_samples": 0} for s in range(1, 13)]
    churn = [{"step": s, "samples": 32 if s > 3 else 48, "reward_mean": 0.5, "stale_samples": 0} for s in range(1, 9)]
    a, b = window_stats(steady, 0, 12, 60.0), window_stats(churn, 0, 8, 60.0)
    return {"smoke": True, "steady": {"window": a}, "churn": {"window": b}, "ratio": ratios(a, b)}


def machine() -> dict[str, Any]:
    return {**harness.machine(threads=1),
            "sizes": "tiny model, 3 nodes (+1 joining), 1 validator, 1 relay; torch 1 thread per role"}


def report(res: dict[str, Any]) -> None:
    print(f"{'run':<8}{'steps/min':>10}{'reward/sample':>15}{'samples/step':>14}{'stale':>7}  audit")
    for mode in ("steady", "churn"):
        r = res.get(mode) or {}
        w = r.get("window", {})
        audit = r.get("audit")
        status = "-" if audit is None else ("reconciled" if audit["ok"] else f"MISMATCH {audit['mismatches']}")
        print(f"{mode:<8}{w.get('steps_per_min')!s:>10}{w.get('reward_per_sample')!s:>15}"
              f"{w.get('samples_per_step')!s:>14}{w.get('stale_samples')!s:>7}  {status}")
    print(f"churn / steady: {res.get('ratio')}")
    c = res.get("churn") or {}
    if "killed" in c:
        print(f"node-0 killed at step {c['killed']['at_step']}; {c.get('steps_while_dead_before_join')} steps before "
              f"{c['joined']['node']} joined, {c.get('steps_after_join')} after; it had {c['joined'].get('accepted')} "
              f"batches accepted")


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser(__doc__, smoke="no devnet: the report on synthetic metrics (seconds)",
                        quick="60 s windows instead of 180 s")
    ap.add_argument("--fill-timeout-s", type=float, default=20.0, help="the trainer's trainer.fill_timeout_s")
    ap.add_argument("--state-root", type=Path, help="keep the devnets' state and logs here (default: a temporary "
                    "directory, removed at the end)")
    args = ap.parse_args(argv)
    res: dict[str, Any] = {"info": machine(), "quick": args.quick,
                           "command": harness.command("churn", argv)}
    code = 0
    if args.smoke:
        res.update(smoke())
    else:
        window = 60.0 if args.quick else 180.0
        with tempfile.TemporaryDirectory(prefix="churn-") as tmp:
            root = args.state_root or Path(tmp)
            root.mkdir(parents=True, exist_ok=True)
            try:
                res["steady"] = run(False, window, root, args.fill_timeout_s)
                res["churn"] = run(True, window, root, args.fill_timeout_s)
                res["ratio"] = ratios(res["steady"]["window"], res["churn"]["window"])
            except (ChurnError, RuntimeError) as exc:
                res["error"] = str(exc)
                print(f"churn: {exc}", file=sys.stderr)
                code = 1
    res["info"]["load_average_end"] = list(os.getloadavg())
    report(res)
    harness.write_json(args.json, res)
    return code


if __name__ == "__main__":
    sys.exit(main())
