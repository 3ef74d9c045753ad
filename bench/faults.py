"""Fault suite: `kill -9` one role at a time on a running devnet, measure how long until the role's next
useful work, then check that the audit reconciles.

`prime-devnet up --restart` runs the whole network on 127.0.0.1 (anvil, origin, relays, validators, the
trainer, nodes; devnet/README.md) and restarts a role whose process dies with the same command and
environment, as a process manager would. One at a time, in the middle of its work, this program
sends SIGKILL to the process group of:

    relay      relay-0, right after the trainer published a new version (so it is fetching shards);
               nodes keep following through relay-1 meanwhile
    validator  validator-0, while it holds work it has not decided yet when it can (else while nodes
               post to it); the restarted validator re-checks its received rows
    trainer    the trainer, in the middle of a step (between two metrics lines); it resumes from its
               last checkpoint and feed cursors
    node       node-0, in the middle of a batch (between two signed assignments); the restarted node
               resends what it signed and was not yet decided

then stops (SIGSTOP, for a window, then SIGCONT) node-0 (`dead_node`: its share of each step is missing),
relay-0 (`hung_relay`: it accepts and answers nothing) and validator-0 (`hung_validator`: nodes fail over),
reporting each window's steps per minute against the window just before (`dead_node_ratio`,
`hung_relay_ratio`, `hung_validator_ratio`; goals 0.6, 0.8, 0.6; issue 39 item 5; a hung validator's "after
failover", as the issue states its goal: from the peers' `failover_after_s` into the window, the whole window's
ratio beside it),

then rolls the chain back `REORG_DEPTH` (32) blocks under the running network (`evm_snapshot`, work
recorded and a version published meanwhile, `anvil_mine` to the depth, `evm_revert`): deeper than any
confirmation count, so every chain writer must notice its transactions are gone, send them again under its
own nonces and go on (issue 39 item 1),

and reports, for each kill, the seconds from the kill to (restart = the devnet's restart; self = without it):

    relay      back (answers /health again), next version served (relay-0 holds a complete version newer
               than any at the kill); self: a node installs a version newer than any at the kill
    validator  back, next batch accepted by validator-0; self: the next batch accepted by any validator
    trainer    back (its metrics endpoint), next step trained (a new line in metrics.jsonl), next version
               on chain
    node       back (/health), next batch accepted for node-0

For the rollback: `deep_reorg_resume_s`, the seconds from the revert until the trainer has trained a step,
the chain shows the version it showed before the revert again and every work record the revert removed is
recorded again; and `deep_reorg_audit_ok`, the audit right after (reported = on chain, no outbox stuck).

After the last fault the network runs until every node has had work accepted since, then
`prime-devnet audit --json` must reconcile (submitted = accepted + rejected + pending per validator,
nodes' records = validators' rows, accepted = trained + dropped stale + queued, chain = reported,
rewards, evidence). Then `prime-devnet down`.

There is no anchor to divide by: each recovery time is reported next to the same event's normal
cadence in this run (the median gap between consecutive steps, versions and accepted batches before
the faults), so a recovery can be read as "n ordinary intervals".

    python -m bench.faults --json bench/measured/faults.json
    python -m bench.faults --quick          # shorter settling, the same four faults
    python -m bench.faults --smoke --json out.json   # the four kills with the least watching and settling
                                                     # (a devnet still takes a minute or more to come up)
    python -m bench.faults --quick --only reorg      # the 32-block rollback alone
    python -m bench.faults --quick --only dead_node hung_relay hung_validator --nodes 3   # the three rates
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import harness
from bench.harness import ROOT

ROLES = ("relay", "validator", "trainer", "node")
DEGRADED = {"dead_node": "node-0", "hung_relay": "relay-0", "hung_validator": "validator-0"}
"""Rate faults: the role's process group is stopped (SIGSTOP: it accepts connections and answers nothing, and
a stopped node submits nothing, as a dead one) for a window, and the steps per minute in that window are
divided by those of the window just before (`<fault>_ratio`); then SIGCONT."""
GOALS = {"dead_node": 0.6, "hung_relay": 0.8, "hung_validator": 0.6}
FAULTS = (*ROLES, "reorg", *DEGRADED)
REORG_DEPTH = 32
AUDIT_S = 300
"""One `prime-devnet audit` run's limit (seconds; it takes a few on an idle box, minutes on a very busy one)."""


class FaultError(RuntimeError):
    """The network did not do what the suite waited for (the message says what, and where the logs are)."""


class Devnet:
    """A `prime-devnet up --restart` process and read-only probes of the network it runs."""

    def __init__(self, state: Path, nodes: int, extra: list[str]) -> None:
        import httpx

        self.state = state
        self.http = httpx.Client(timeout=5.0)
        self.log = state.parent / "devnet-up.log"
        cmd = [sys.executable, "-m", "devnet.cli", "up", "--state-dir", str(state), "--nodes", str(nodes),
               "--validators", "2", "--relays", "2", "--dashboard-port", "0", "--summary-interval-s", "1",
               "--restart", *extra]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.layout: dict[str, Any] = {}
        self.pool: Any = None
        self.start_block = 0

    # -- lifecycle -------------------------------------------------------------------------------

    def wait_up(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        layout = self.state / "devnet.json"
        while not layout.exists():
            self.alive_or_raise("coming up")
            if time.monotonic() > deadline:
                raise FaultError(f"the devnet did not come up in {timeout:.0f} s; see {self.log}")
            time.sleep(0.5)
        self.layout = json.loads(layout.read_text())
        from contracts.deployment import Deployment
        from contracts.devchain import dev_identity
        from contracts.pool import PoolClient
        from contracts.transactor import connect

        dep = Deployment.load(self.layout["deployment"])
        self.pool = PoolClient(connect(self.layout["rpc_url"], timeout=5.0), dep.pool, dev_identity(0))  # reads only
        self.start_block = int(dep.start_block)

    def alive_or_raise(self, what: str) -> None:
        if self.proc.poll() is not None:
            raise FaultError(f"prime-devnet up exited ({self.proc.returncode}) while {what}; see {self.log}")

    def audit(self) -> dict[str, Any]:
        """`prime-devnet audit --json`; one that runs past AUDIT_S (a busy box) is a report that is not ok yet."""
        try:
            out = subprocess.run([sys.executable, "-m", "devnet.cli", "audit", "--state-dir", str(self.state),
                                  "--json"], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                                 capture_output=True, timeout=AUDIT_S)
        except subprocess.TimeoutExpired:
            return {"ok": False, "error": f"audit ran past {AUDIT_S} s"}
        try:
            return dict(json.loads(out.stdout))
        except ValueError as exc:
            raise FaultError(f"audit printed no JSON: {out.stderr.decode()[-2000:]}") from exc

    def down(self) -> None:
        subprocess.run([sys.executable, "-m", "devnet.cli", "down", "--state-dir", str(self.state)], cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, timeout=180)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.http.close()

    # -- probes (each answers None when the role does not answer) --------------------------------

    def entry(self, name: str) -> dict[str, Any]:
        data = json.loads((self.state / "processes.json").read_text())
        for e in data["processes"]:
            if e["name"] == name:
                return dict(e)
        raise FaultError(f"no process {name} in the devnet's table")

    def _json(self, url: str) -> Any:
        try:
            r = self.http.get(url)
            return r.json() if r.status_code == 200 else None
        except Exception:  # noqa: BLE001 - a role that is down answers nothing
            return None

    def steps(self) -> int:
        from devnet.observer import read_metrics

        return len(read_metrics(Path(self.layout["trainer"]["metrics_file"])))

    def chain_version(self) -> int | None:
        try:
            return int(self.pool.policy()[0])
        except Exception:  # noqa: BLE001
            return None

    def relay_version(self, url: str) -> int | None:
        index = self._json(url + "/versions")
        if not isinstance(index, dict):
            return None
        done = [int(v["version"]) for v in index.get("versions", []) if v.get("complete")]
        return max(done) if done else None

    def node_version(self, i: int) -> int | None:
        h = self._json(self.layout["nodes"][i]["url"] + "/health")
        return h.get("policy_version") if isinstance(h, dict) else None

    def node_batches(self, i: int) -> int | None:
        h = self._json(self.layout["nodes"][i]["url"] + "/health")
        return h.get("batches") if isinstance(h, dict) else None

    def audits(self) -> list[dict[str, Any] | None]:
        return [self._json(v["url"] + "/v1/audit") for v in self.layout["validators"]]

    def accepted(self, validator: int | None = None, node: str | None = None) -> int:
        """Accepted rows (of one validator / one node); unreachable validators count 0."""
        total = 0
        for j, a in enumerate(self.audits()):
            if a is None or (validator is not None and j != validator):
                continue
            if node is None:
                total += int(a["counts"]["accepted"])
            else:
                total += sum(int(c.get("accepted", 0)) for n, c in a.get("nodes", {}).items()
                             if n.lower() == node.lower())
        return total

    def up(self, url: str) -> bool:
        try:
            return self.http.get(url).status_code == 200
        except Exception:  # noqa: BLE001
            return False


def wait_for(what: str, check: Callable[[], bool], timeout: float, net: Devnet, poll: float = 0.2) -> float:
    """Seconds until `check()` holds (FaultError after `timeout`)."""
    t0 = time.monotonic()
    while not check():
        net.alive_or_raise(f"waiting for {what}")
        if time.monotonic() - t0 > timeout:
            raise FaultError(f"no {what} within {timeout:.0f} s; logs in {net.state}/logs")
        time.sleep(poll)
    return time.monotonic() - t0


def kill9(net: Devnet, name: str) -> tuple[float, int]:
    """SIGKILL the role's process group; (monotonic time of the kill, the killed pid)."""
    e = net.entry(name)
    pid = int(e["pid"])
    os.killpg(pid, signal.SIGKILL)
    return time.monotonic(), pid


class Timer:
    """Seconds from one kill to each event, watched together (one polling loop)."""

    def __init__(self, net: Devnet, t_kill: float, events: dict[str, Callable[[], bool]], timeout: float) -> None:
        self.at: dict[str, float] = {}
        deadline = t_kill + timeout
        while len(self.at) < len(events):
            for name, check in events.items():
                if name not in self.at and check():
                    self.at[name] = round(time.monotonic() - t_kill, 2)
            if time.monotonic() > deadline:
                missing = sorted(set(events) - set(self.at))
                raise FaultError(f"after the kill, no {missing} within {timeout:.0f} s; logs in {net.state}/logs")
            net.alive_or_raise("recovering")
            time.sleep(0.2)


def restarted(net: Devnet, name: str, old_pid: int, url: str | None) -> Callable[[], bool]:
    def check() -> bool:
        e = net.entry(name)
        return int(e["pid"]) != old_pid and (url is None or net.up(url))
    return check


# -- the four faults ----------------------------------------------------------------------------------


def fault_relay(net: Devnet, timeout: float) -> dict[str, Any]:
    relay = net.layout["relays"][0]
    v0 = net.chain_version() or 0
    wait_for("a new version on chain", lambda: (net.chain_version() or 0) > v0, timeout, net)
    newest_at_kill = max(x for x in [net.chain_version(), net.relay_version(relay)] if x is not None)
    node_versions = [v for v in (net.node_version(i) for i in range(len(net.layout["nodes"]))) if v is not None]
    t, pid = kill9(net, "relay-0")
    newest_node = max(node_versions) if node_versions else 0
    events = {
        "back": restarted(net, "relay-0", pid, relay + "/health"),
        "next_version_served": lambda: (net.relay_version(relay) or -1) > newest_at_kill,
        "self_next_version_installed_by_a_node": lambda: max(
            [v for v in (net.node_version(i) for i in range(len(net.layout["nodes"]))) if v is not None] or [0]
        ) > newest_node,
    }
    return {"killed": "relay-0", "pid": pid, "while": f"v{newest_at_kill} just published", "recovery_s":
            Timer(net, t, events, timeout).at,
            "how": "restarted by the devnet; nodes and validators followed relay-1 meanwhile"}


def fault_validator(net: Devnet, timeout: float) -> dict[str, Any]:
    v = net.layout["validators"][0]
    base = net.accepted(validator=0)
    wait_for("validator-0 accepting work", lambda: net.accepted(validator=0) > base, timeout, net)
    pending = 0
    t_end = time.monotonic() + 20
    while time.monotonic() < t_end:  # prefer a moment when it holds undecided work
        a = net.audits()[0]
        pending = int(a["counts"]["pending"]) if a else 0
        if pending:
            break
        time.sleep(0.05)
    before, before_all = net.accepted(validator=0), net.accepted()
    t, pid = kill9(net, "validator-0")
    events = {
        "back": restarted(net, "validator-0", pid, v["url"] + "/health"),
        "next_batch_accepted": lambda: net.accepted(validator=0) > before,
        "self_next_batch_accepted_anywhere": lambda: net.accepted() > before_all,
    }
    return {"killed": "validator-0", "pid": pid, "while": f"{pending} submissions undecided",
            "recovery_s": Timer(net, t, events, timeout).at,
            "how": "restarted by the devnet; it re-checks its received rows; validator-1 kept taking its own share"}


def fault_trainer(net: Devnet, timeout: float, rng: random.Random) -> dict[str, Any]:
    s0 = net.steps()
    wait_for("a trainer step", lambda: net.steps() > s0, timeout, net)
    time.sleep(rng.uniform(0.2, 1.5))  # into the next step (waiting for samples, training or publishing)
    steps, version = net.steps(), net.chain_version() or 0
    t, pid = kill9(net, "trainer")
    url = net.layout["trainer"]["metrics_url"] + "/metrics"
    events = {
        "back": restarted(net, "trainer", pid, url),
        "next_step_trained": lambda: net.steps() > steps,
        "next_version_on_chain": lambda: (net.chain_version() or 0) > version,
    }
    return {"killed": "trainer", "pid": pid, "while": f"after step {steps - 1}",
            "recovery_s": Timer(net, t, events, timeout).at,
            "how": "restarted by the devnet; resumed from its last checkpoint and feed cursors"}


def fault_node(net: Devnet, timeout: float, rng: random.Random) -> dict[str, Any]:
    node = net.layout["nodes"][0]
    b0 = net.node_batches(0) or 0
    wait_for("a batch of node-0", lambda: (net.node_batches(0) or 0) > b0, timeout, net)
    time.sleep(rng.uniform(0.05, 0.5))  # into the next batch
    t, pid = kill9(net, "node-0")
    # Every assignment the node signed before it died is in its slashing-protection record: those are
    # the work to finish (resent if they were not decided); a batch beyond them is new work.
    signed = signed_assignments(Path(net.layout["state_dir"]) / "node-0" / "protection.sqlite")
    events = {
        "back": restarted(net, "node-0", pid, node["url"] + "/health"),
        "all_signed_before_kill_accepted": lambda: net.accepted(node=node["address"]) >= signed,
        "next_batch_accepted": lambda: net.accepted(node=node["address"]) > signed,
    }
    return {"killed": "node-0", "pid": pid, "while": f"after signing {signed} assignments",
            "recovery_s": Timer(net, t, events, timeout).at,
            "how": "restarted by the devnet; it resends what it signed and was not decided, then works on"}


def steps_per_minute(net: Devnet, seconds: float) -> tuple[float, int]:
    """(steps per minute, steps) trained in the next `seconds`."""
    s0, t0 = net.steps(), time.monotonic()
    while time.monotonic() - t0 < seconds:
        net.alive_or_raise("watching the step rate")
        time.sleep(0.5)
    steps = net.steps() - s0
    return 60.0 * steps / (time.monotonic() - t0), steps


def failover_after_s(net: Devnet) -> float:
    """How long the validators wait after a peer stops answering before they take its work over (their config's
    `failover_after_s`; every devnet validator has the same)."""
    import tomllib

    from validator.config import ValidatorConfig

    path = Path(net.layout["state_dir"]) / "config" / "validator-1.toml"
    value = tomllib.loads(path.read_text()).get("failover_after_s") if path.is_file() else None
    return float(value if value is not None else ValidatorConfig.model_fields["failover_after_s"].default)


def fault_degraded(net: Devnet, kind: str, window: float) -> dict[str, Any]:
    """One rate fault (`DEGRADED`): the rate in `window` s before, the role stopped for `window` s, the ratio. A
    hung validator's ratio is the issue's "after failover": the rate once its peers take its work over
    (`failover_after_s` into the window, a safety margin they wait by design) against the rate before; the whole
    window's ratio is reported beside it (`ratio_whole_window`)."""
    name = DEGRADED[kind]
    before, steps_before = steps_per_minute(net, window)
    pid = int(net.entry(name)["pid"])
    failover = failover_after_s(net) if kind == "hung_validator" else 0.0
    os.killpg(pid, signal.SIGSTOP)
    try:
        first, steps_first = steps_per_minute(net, failover) if failover else (0.0, 0)
        rest, steps_rest = steps_per_minute(net, window - failover)
    finally:
        os.killpg(pid, signal.SIGCONT)
    during, steps_during = 60.0 * (steps_first + steps_rest) / window, steps_first + steps_rest
    ratio = round(rest / before, 3) if before else None
    out = {"fault": kind, "stopped": name, "window_s": window, "steps_before": steps_before,
           "steps_during": steps_during, "steps_per_min_before": round(before, 2),
           "steps_per_min_during": round(during, 2), "ratio": ratio, "goal": GOALS[kind],
           "met": ratio is not None and ratio >= GOALS[kind]}
    if failover:
        out.update(failover_after_s=failover, steps_before_failover=steps_first, steps_after_failover=steps_rest,
                   steps_per_min_after_failover=round(rest, 2),
                   ratio_whole_window=round(during / before, 3) if before else None)
    return out


def recorded_on_chain(net: Devnet) -> int:
    """Work keys recorded on the canonical chain and not invalidated."""
    events = net.pool.events(net.start_block, names={"WorkRecorded", "WorkInvalidated"})
    recorded = {bytes(e.args["workKey"]) for e in events if e.name == "WorkRecorded"}
    return len(recorded - {bytes(e.args["workKey"]) for e in events if e.name == "WorkInvalidated"})


def fault_deep_reorg(net: Devnet, timeout: float) -> dict[str, Any]:
    """Roll the chain back `REORG_DEPTH` blocks, with work recorded and a version published in them."""
    w3 = net.pool.tx.w3

    def rpc(method: str, params: list[Any] | None = None) -> Any:
        answer = w3.provider.make_request(method, params or [])
        if answer.get("error"):
            raise FaultError(f"{method}: {answer['error']}")
        return answer.get("result")

    recorded0, version0 = recorded_on_chain(net), net.chain_version() or 0
    snapshot, head0 = rpc("evm_snapshot"), int(w3.eth.block_number)
    wait_for("work recorded after the snapshot", lambda: recorded_on_chain(net) > recorded0, timeout, net)
    wait_for("a version published after the snapshot", lambda: (net.chain_version() or 0) > version0, timeout, net)
    depth = int(w3.eth.block_number) - head0
    if depth < REORG_DEPTH:
        rpc("anvil_mine", [hex(REORG_DEPTH - depth)])
    recorded, version, steps = recorded_on_chain(net), net.chain_version() or 0, net.steps()
    depth = int(w3.eth.block_number) - head0
    t = time.monotonic()
    if rpc("evm_revert", [snapshot]) is not True:
        raise FaultError("evm_revert refused the snapshot")
    removed = recorded - recorded0  # recorded in blocks after the snapshot: the revert removed them all
    events = {
        "training_resumed": lambda: net.steps() > steps,
        "version_on_chain_again": lambda: (net.chain_version() or 0) >= version,
        "work_recorded_again": lambda: recorded_on_chain(net) >= recorded,
    }
    at = Timer(net, t, events, timeout).at
    return {"depth_blocks": depth, "records_removed": removed, "versions_removed": version - version0,
            "recovery_s": at, "resume_s": max(at.values()), "audit": audit_until_settled(net, 120)}


def signed_assignments(db: Path) -> int:
    """Assignments in a node's slashing-protection record (read-only; the node is dead)."""
    import sqlite3

    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10) as c:
        return int(c.execute("SELECT COUNT(*) FROM signed").fetchone()[0])


def cadence(net: Devnet, seconds: float) -> dict[str, Any]:
    """Median gaps between steps, versions on chain and accepted batches, watched for `seconds`."""
    seen: dict[str, list[float]] = {"step": [], "version": [], "accepted": []}
    last = {"step": net.steps(), "version": net.chain_version(), "accepted": net.accepted()}
    t_end = time.monotonic() + seconds
    while time.monotonic() < t_end:
        now = {"step": net.steps(), "version": net.chain_version(), "accepted": net.accepted()}
        for k in seen:
            if now[k] is not None and last[k] is not None and now[k] > last[k]:
                seen[k].append(time.monotonic())
            last[k] = now[k] if now[k] is not None else last[k]
        time.sleep(0.2)

    def gap(ts: list[float]) -> float | None:
        return round(statistics.median(b - a for a, b in zip(ts, ts[1:], strict=False)), 2) if len(ts) > 2 else None

    return {"watched_s": seconds, "step_gap_s": gap(seen["step"]), "version_gap_s": gap(seen["version"]),
            "accepted_gap_s": gap(seen["accepted"]), "steps_seen": len(seen["step"])}


def run(nodes: int, quick: bool, state_root: Path, seed: int = 0, extra: list[str] | None = None,
        only: list[str] | None = None, smoke: bool = False) -> dict[str, Any]:
    rng = random.Random(seed)
    timeout = 240.0
    net = Devnet(state_root / "devnet", nodes, extra or [])
    res: dict[str, Any] = {"faults": [], "devnet_log": str(net.log)}
    try:
        t0 = time.monotonic()
        net.wait_up(600)
        wait_for("the first trained step", lambda: net.steps() >= 1, 600, net)
        wait_for("work accepted from every node", lambda: all(
            net.accepted(node=n["address"]) > 0 for n in net.layout["nodes"]), 600, net)
        res["up_to_first_step_s"] = round(time.monotonic() - t0, 1)
        res["cadence"] = cadence(net, 5 if smoke else 20 if quick else 60)
        plan = {"relay": lambda: fault_relay(net, timeout), "validator": lambda: fault_validator(net, timeout),
                "trainer": lambda: fault_trainer(net, timeout, rng), "node": lambda: fault_node(net, timeout, rng)}
        # the rollback and the rate faults are not in --smoke (the default tier runs that beside everything else):
        # --only reorg / dead_node / hung_relay / hung_validator, the slow tier (tests/e2e/test_deep_reorg.py) or
        # a full run
        chosen = only or (ROLES if smoke else FAULTS)
        for kind in [r for r in chosen if r in DEGRADED]:
            window = 30 if smoke else 60 if quick else 120
            print(f"faults: {DEGRADED[kind]} stopped for {window} s ({kind}) ...", flush=True)
            r = fault_degraded(net, kind, window)
            after = (f" ({r['steps_per_min_after_failover']} after the peers' {r['failover_after_s']:.0f} s failover, "
                     f"the ratio's; the whole window {r['ratio_whole_window']}x)" if "failover_after_s" in r else "")
            print(f"faults: {kind}: {r['steps_per_min_during']} steps/min against {r['steps_per_min_before']} "
                  f"before{after}: {r['ratio']}x (goal {r['goal']}x)", flush=True)
            res.setdefault("degraded", []).append(r)
            res[f"{kind}_ratio"] = r["ratio"]
            time.sleep(2 if quick else 10)  # the stopped role catches up before the next fault
        for role in [r for r in chosen if r in ROLES]:
            print(f"faults: kill -9 {role} ...", flush=True)
            r = plan[role]()
            print(f"faults: {r['killed']} ({r['while']}): {r['recovery_s']}", flush=True)
            res["faults"].append({"role": role, **r})
            time.sleep(1 if smoke else 2 if quick else 10)  # settle before the next fault
        if "reorg" in chosen:
            print(f"faults: rolling the chain back {REORG_DEPTH} blocks ...", flush=True)
            r = fault_deep_reorg(net, timeout)
            print(f"faults: rollback of {r['depth_blocks']} blocks ({r['records_removed']} records, "
                  f"{r['versions_removed']} versions removed): {r['recovery_s']}", flush=True)
            res.update(deep_reorg=r, deep_reorg_resume_s=r["resume_s"], deep_reorg_audit_ok=r["audit"]["ok"])
        # every node has work accepted after the last fault, then the audit
        marks = {n["address"]: net.accepted(node=n["address"]) for n in net.layout["nodes"]}
        wait_for("work accepted from every node after the faults", lambda: all(
            net.accepted(node=a) > m for a, m in marks.items()), timeout, net)
        res["audit"] = audit_until_settled(net, 60 if quick else 120)
        res["restarts"] = restarts(net)
    finally:
        net.down()
    return res


def audit_until_settled(net: Devnet, timeout: float) -> dict[str, Any]:
    """The audit, retried while work is in flight (a row counted by one role and not yet by the next)."""
    t0, ran_past = time.monotonic(), 0
    while True:
        report = net.audit()
        ran_past += "error" in report  # a slow audit says nothing about the ledgers: up to 3 are retried anyway
        if report.get("ok") or time.monotonic() - t0 > timeout and ("error" not in report or ran_past >= 3):
            return {"ok": bool(report.get("ok")), "after_s": round(time.monotonic() - t0, 1), "rows": report.get("rows")}
        time.sleep(3)


def restarts(net: Devnet) -> list[str]:
    try:
        return [line.strip() for line in net.log.read_text(errors="replace").splitlines() if "restart" in line]
    except OSError:
        return []


def report(res: dict[str, Any]) -> None:
    c = res.get("cadence", {})
    print(f"\nnormal cadence: step every {c.get('step_gap_s')} s, version every {c.get('version_gap_s')} s, "
          f"an accepted batch every {c.get('accepted_gap_s')} s")
    print(f"{'killed':<13}{'while':<34}recovery (s from kill -9)")
    for f in res["faults"]:
        rec = ", ".join(f"{k} {v}" for k, v in f["recovery_s"].items())
        print(f"{f['killed']:<13}{f['while'][:33]:<34}{rec}")
    if "deep_reorg" in res:
        r = res["deep_reorg"]
        print(f"rollback of {r['depth_blocks']} blocks: resumed in {r['resume_s']} s ({r['recovery_s']}), audit "
              f"{'reconciled' if r['audit']['ok'] else 'MISMATCH'}")
    for r in res.get("degraded", []):
        during = (f"{r['steps_per_min_after_failover']} steps/min after the {r['failover_after_s']:.0f} s failover "
                  f"({r['steps_per_min_during']} over the window: {r['ratio_whole_window']}x)"
                  if "failover_after_s" in r else f"{r['steps_per_min_during']} steps/min")
        print(f"{r['stopped']} stopped {r['window_s']:.0f} s ({r['fault']}): {during} against "
              f"{r['steps_per_min_before']} just before = {r['ratio']}x (goal >= {r['goal']}x)")
    a = res.get("audit", {})
    print(f"audit after the faults: {'reconciled' if a.get('ok') else 'MISMATCH'}")
    for row in a.get("rows") or []:
        print(f"  {'ok ' if row['ok'] else 'BAD'} {row['check']}: expected {row['expected']}, actual {row['actual']}")


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser(__doc__, smoke="the four faults with a 5 s cadence watch and 1 s settling (checks the bench; "
                        "the devnet's start-up still takes a minute or more)", quick="shorter cadence watch and settling")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--only", nargs="+", choices=FAULTS, help="these faults only (reorg: the 32-block rollback)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--state-root", type=Path, help="keep the devnet's state and logs here (default: a temporary "
                    "directory, removed at the end)")
    args = ap.parse_args(argv)
    res: dict[str, Any] = {"info": harness.machine(threads=1), "quick": args.quick or args.smoke, "smoke": args.smoke,
                           "command": harness.command("faults", argv)}
    with tempfile.TemporaryDirectory(prefix="faults-") as tmp:
        root = args.state_root or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        try:
            res.update(run(args.nodes, args.quick or args.smoke, root, args.seed, only=args.only, smoke=args.smoke))
        except FaultError as exc:
            res["error"] = str(exc)
            print(f"faults: {exc}", file=sys.stderr)
            log = root / "devnet-up.log"
            if log.exists():
                print(log.read_text(errors="replace")[-4000:], file=sys.stderr)
    res["info"]["load_average_end"] = list(os.getloadavg())
    if "faults" in res:
        report(res)
    harness.write_json(args.json, res)
    return 0 if not res.get("error") and res.get("audit", {}).get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
