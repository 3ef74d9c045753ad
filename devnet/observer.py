"""What the devnet shows: a snapshot read from the roles' public endpoints and files and from the chain.

Sources: the trainer's metrics JSON lines (step, reward), each node's `/health` (state, policy version,
batches, verdicts, its slashing-protection record counts), each validator's `/v1/audit` counts, and
the pool's events. A role that does not answer is shown as such; nothing here raises for a peer's fault,
and nothing waits on one: the roles are read at once, each within a total deadline (a stopped role
accepts connections and never answers). The chain is read in a thread of its own that a snapshot waits on
for the same deadline at most: a stopped chain endpoint is shown as not answering (with the last counts read)
while its read goes on, instead of holding the summary line for a few RPC timeouts.
The dashboard (devnet/server.py) serves the same snapshot as JSON.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from devnet.network import Layout
from devnet.processes import ProcessTable
from protocol.deadline import PeerTimeoutError, bounded_request, deadline_client
from protocol.work_ledger import read_step_lines

log = logging.getLogger(__name__)

MAX_EVENTS = 200


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The trainer's per-step metrics, in step order (the last line of each step wins; a torn line is skipped)."""
    steps = read_step_lines(path)
    return [steps[k] for k in sorted(steps)]


class ChainWatch:
    """The pool's events, read incrementally (from the deployment's start block)."""

    def __init__(self, layout: Layout, timeout_s: float = 5.0) -> None:
        from contracts.deployment import Deployment
        from contracts.devchain import dev_identity
        from contracts.pool import PoolClient
        from contracts.transactor import connect

        dep = Deployment.load(layout.deployment)
        # reads only; any identity will do (DEV ONLY: the public deployer account)
        self.pool = PoolClient(connect(layout.rpc_url, timeout=timeout_s), dep.pool, dev_identity(0))
        self.start_block = self.next_block = dep.start_block
        self.counts: Counter[str] = Counter()
        self.recent: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def poll(self) -> None:
        with self._lock:
            head = int(self.pool.tx.w3.eth.block_number)
            if head < self.next_block:
                return
            for e in self.pool.events(self.next_block, head):
                self.counts[e.name] += 1
                self.recent.append({"name": e.name, "block": e.block_number, "tx": e.tx_hash,
                                    "args": {k: _plain(v) for k, v in e.args.items()}})
            self.recent = self.recent[-MAX_EVENTS:]
            self.next_block = head + 1


def _without(d: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k not in keys}


def _plain(v: Any) -> Any:
    if isinstance(v, bytes):
        return "0x" + v.hex()
    if isinstance(v, int | str | bool) or v is None:
        return v
    return str(v)


class Observer:
    """Builds snapshots of a running devnet (see the module docstring)."""

    def __init__(self, layout: Layout, timeout_s: float = 3.0, chain_timeout_s: float = 5.0) -> None:
        """`timeout_s`: how long a snapshot waits for any role; `chain_timeout_s`: each chain RPC's own timeout
        (a read past `timeout_s` goes on in its thread until then)."""
        self.layout = layout
        self.timeout_s = timeout_s
        self.chain_timeout_s = chain_timeout_s
        self.http = deadline_client(timeout_s)
        self.chain: ChainWatch | None = None
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="observer")
        self._chain_lock = threading.Lock()
        self._chain_read: tuple[threading.Thread, threading.Event] | None = None
        self._chain_last: dict[str, Any] = {"up": False}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.http.close()

    def _get(self, url: str) -> Any:
        """The JSON `url` answers within `timeout_s` (connect to last byte), else None: a hung role is shown
        as down, it never holds up the snapshot (issue 26 item 3)."""
        try:
            r = bounded_request(self.http, "GET", url, self.timeout_s)
            return r.json() if r.headers.get("content-type", "").startswith("application/json") else None
        except (httpx.HTTPError, ValueError, PeerTimeoutError):
            return None

    def _get_all(self, urls: list[str]) -> list[Any]:
        """`_get` of every url at once: a snapshot costs one timeout however many roles hang."""
        return list(self._pool.map(self._get, urls))

    def _read_chain(self, done: threading.Event) -> None:
        chain: dict[str, Any] = {"up": False}
        try:
            if self.chain is None:
                self.chain = ChainWatch(self.layout, self.chain_timeout_s)
            self.chain.poll()
            chain = {"up": True, "events": dict(self.chain.counts), "recent": self.chain.recent[-20:],
                     "rewards_reserved": self.chain.pool.rewards_reserved(),
                     "policy_version": self.chain.pool.policy()[0]}
        except Exception as exc:  # noqa: BLE001 - the chain being down is something to show, not to crash on
            with self._chain_lock:  # the last values read stay on show beside the error
                chain = {**_without(self._chain_last, "up", "error"), "up": False,
                         "error": f"{type(exc).__name__}: {exc}"}
        with self._chain_lock:
            self._chain_last = chain
        done.set()

    def _chain_start(self) -> threading.Event:
        """A chain read in a daemon thread (so neither the next snapshot nor the process's exit waits for a
        hung endpoint); one at a time: while one is still running, its event."""
        with self._chain_lock:
            if self._chain_read is None or not self._chain_read[0].is_alive():
                done = threading.Event()
                thread = threading.Thread(target=self._read_chain, args=(done,), name="observer-chain", daemon=True)
                self._chain_read = (thread, done)
                thread.start()
            return self._chain_read[1]

    def _chain_result(self, done: threading.Event, deadline: float) -> dict[str, Any]:
        """The chain's part of a snapshot, waited on until `deadline` at most; past it the last values read
        are shown with `up` False."""
        answered = done.wait(max(0.0, deadline - time.monotonic()))
        with self._chain_lock:
            last = dict(self._chain_last)
        if answered:
            return last
        return {**_without(last, "up", "error"), "up": False,
                "error": f"no answer from the chain ({self.layout.rpc_url}) within {self.timeout_s:g} s"}

    def snapshot(self) -> dict[str, Any]:
        lay = self.layout
        deadline = time.monotonic() + self.timeout_s
        chain_read = self._chain_start()  # beside the HTTP reads: a snapshot costs one timeout in all
        metrics = read_metrics(Path(lay.trainer["metrics_file"]))
        trainer = {
            "steps": len(metrics), "max_steps": lay.trainer.get("max_steps"),
            "step": metrics[-1]["step"] if metrics else None,
            "reward": [{"step": m["step"], "reward_mean": m.get("reward_mean"), "samples": m.get("samples"),
                        "stale_samples": m.get("stale_samples"), "staleness_mean": m.get("staleness_mean")}
                       for m in metrics],
        }
        answers = self._get_all([n["url"] + "/health" for n in lay.nodes]
                                + [v["url"] + "/v1/audit?rows=false" for v in lay.validators])  # counts only
        nodes = []
        for n, h in zip(lay.nodes, answers, strict=False):
            nodes.append({"name": n["name"], "address": n["address"], "up": h is not None,
                          **({k: h.get(k) for k in ("state", "policy_version", "batches", "accepted", "rejected",
                                                     "pending", "records", "detail")} if isinstance(h, dict) else {})})
        validators = []
        verdicts: Counter[str] = Counter()
        for v, a in zip(lay.validators, answers[len(lay.nodes):], strict=True):
            counts = a.get("counts", {}) if isinstance(a, dict) else {}
            verdicts.update({k: int(c) for k, c in counts.items() if isinstance(c, int)})
            validators.append({"name": v["name"], "address": v["address"], "up": a is not None, "counts": counts})
        chain = self._chain_result(chain_read, deadline)
        _, entries = ProcessTable.read(Path(lay.state_dir))
        processes = [{"name": e.name, "role": e.role, "pid": e.pid, "port": e.port, "url": e.url,
                      "alive": e.alive(), "log": e.log, "exit_code": e.exit_code} for e in entries]
        return {"trainer": trainer, "nodes": nodes, "validators": validators, "verdicts": dict(verdicts),
                "chain": chain, "processes": processes, "dashboard": lay.dashboard}


def summary_line(s: dict[str, Any]) -> str:
    """One line for the terminal: step, reward, version per node, verdicts, chain events."""
    t = s["trainer"]
    rewards = t["reward"]
    reward = f"{rewards[-1]['reward_mean']:.3f}" if rewards and rewards[-1]["reward_mean"] is not None else "-"
    first = f" (step 0: {rewards[0]['reward_mean']:.3f})" if len(rewards) > 1 else ""
    versions = " ".join(f"{n['name'].removeprefix('node-')}:v{n.get('policy_version')}" if n["up"]
                        else f"{n['name'].removeprefix('node-')}:down" for n in s["nodes"])
    v = s["verdicts"]
    ev = s["chain"].get("events", {})
    return (f"step {t['step'] if t['step'] is not None else '-'}/{t['max_steps']} reward {reward}{first} | "
            f"nodes {versions} | verdicts acc {v.get('accepted', 0)} hard {v.get('rejected_hard', 0)} "
            f"soft {v.get('rejected_soft', 0)} pend {v.get('pending', 0)} | chain v{s['chain'].get('policy_version', '-')} "
            f"work {ev.get('WorkRecorded', 0)} slash {ev.get('StakeSlashed', 0)} "
            f"policies {ev.get('PolicyPublished', 0)}")
