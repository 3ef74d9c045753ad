"""`bench.load --only hostile` (issue 35): honest work at a validator process while everything hostile at once.

A validator process with all its loops (`bench.validator_http.Served`) on anvil (`bench.validator.Chain`), honest
nodes submitting real work (the tiny model, `bench.load.build_honest`) with their upload headers as prime-node
does, one at a time each, waiting for each verdict (429/503/425: back after 1 s), each at most one submission every
`honest_every_s` (a node's batch cadence), so the honest work spans the whole attack. First a warm-up (one
submission per node, not measured), then alone (the baseline, as many submissions as the attack phase plans), then
beside, for `duration_s`:

- `slow_uploads` connections from no key, each sending a submission's headers and then one body byte every
  2 s (reconnecting when cut);
- `audits` threads asking `GET /v1/audit` (rows) in a loop;
- `appeals` slow 16 MiB appeal uploads under 8 registered attacker keys' upload headers (one byte every 2 s,
  reconnecting when cut or refused);
- `staked` registered keys as fast as the validator lets them (`bench.load`'s flood sender): half send junk work
  (cheap failures: an honest payload re-sealed under other counters; slashed at the first verdict, then refused),
  half work for a version outside the run's window (refused at intake: no row, no verdict, no slash, so they go on
  for the whole attack; JSON `attackers.staked_outside_window`).

The attackers run in a process of their own: as threads beside the honest senders they shared their GIL, so
every attack request the validator answered faster was a wait for the honest clients, not for the validator
(a faster `/v1/audit` measured a worse p99). On a machine of two or more CPUs the attackers are pinned to half of
them and the validator and the honest senders to the other half, baseline included (JSON `cpus`): a network's
attackers bring their own CPUs, and what is measured is the validator's answer to their traffic.

Reported (JSON keys): `honest_acceptance` (accepted / submitted during the attack; goal >= 0.99),
`p99_over_baseline` (honest post-to-verdict latency p99 under attack over the baseline's; goal <= 2), the
validator's RSS and ledger size before, at peak and after, and what the attackers got (statuses).
"""

from __future__ import annotations

import math
import multiprocessing
import os
import socket
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from bench import validator_http as vhttp


@dataclass
class HostileLoad:
    honest_nodes: int = 4
    warmup: int = 1
    """Honest submissions per node before the baseline, not measured (the validator's first checks of a version
    are slower: one of them was the baseline's p99 once it was its slowest sample)."""
    baseline: int | None = None
    """Honest submissions in the baseline (spread over `honest_nodes`); default: as many as the attack phase plans,
    so both p99s are read from as many samples (a baseline of 100 against 800 under attack compared its 100th
    of 100, the slowest, with the 792nd of 800)."""
    attack: int | None = None
    """Honest submissions under attack (at most; the phase ends at `duration_s`); default: enough for every honest
    node to submit every `honest_every_s` for `duration_s`."""
    duration_s: float = 600.0
    honest_every_s: float = 3.0
    """Each honest node starts a submission at most this often (the baseline's too)."""
    slow_uploads: int = 64
    audits: int = 200
    appeals: int = 100
    staked: int = 10
    threads: int = 1


def _p99(xs: list[float]) -> float | None:
    """The nearest-rank 99th percentile: the ceil(0.99 n)-th smallest (of 100 the 99th, not the slowest)."""
    if not xs:
        return None
    return sorted(xs)[math.ceil(0.99 * len(xs)) - 1]


def _by_minute(rows: list[dict[str, Any]]) -> list[float | None]:
    """The p99 latency of the submissions started in each minute of a phase, in order (where the tail comes from:
    all along, or as the ledger grows)."""
    if not rows:
        return []
    t0 = min(r["at"] for r in rows)
    minutes: dict[int, list[float]] = {}
    for r in rows:
        minutes.setdefault(int((r["at"] - t0) // 60), []).append(r["latency_s"])
    return [_p99(minutes.get(m, [])) for m in range(max(minutes) + 1)]


def _honest(url: str, node: Any, items: list[tuple[bytes, str]], deadline: float, out: list[dict[str, Any]],
            lock: threading.Lock, every_s: float = 0.0) -> None:
    import httpx

    from bench.load import _signed

    start = time.monotonic()
    with httpx.Client(base_url=url, timeout=60) as c:
        for i, (data, key) in enumerate(items):
            time.sleep(max(0.0, start + i * every_s - time.monotonic()))
            if time.monotonic() >= deadline:
                return
            t0, outcome = time.monotonic(), None
            status: Any = None
            while time.monotonic() < deadline + 120:
                try:
                    r = c.post("/v1/submissions", content=data, headers=_signed(c, node, data))
                    status = r.status_code
                except httpx.HTTPError as exc:
                    status = f"error:{type(exc).__name__}"
                if status in (200, 202):
                    break
                time.sleep(1.0)
            while status in (200, 202) and time.monotonic() < deadline + 120:
                row = c.get(f"/v1/submissions/{key}")
                if row.status_code == 200 and row.json()["state"] != "received":
                    outcome = row.json()["outcome"]
                    break
                time.sleep(0.1)
            with lock:
                out.append({"status": status, "outcome": outcome, "latency_s": time.monotonic() - t0, "at": t0})


ATTACKER_ADDRESSES = 32
"""Source addresses the attackers spread over (127.0.0.2 and up; the honest nodes use 127.0.0.1): the
validator caps connections per address, so one address alone would only ever hurt itself."""


def _source(i: int) -> str:
    return f"127.0.0.{2 + i % ATTACKER_ADDRESSES}"


def _trickle(url: str, first: bytes, source: str, stop: threading.Event, tally: Counter[str],
             lock: threading.Lock) -> None:
    """Send `first`, then a byte every 2 s; reconnect when the server cuts us (counting how)."""
    u = urlparse(url)
    while not stop.is_set():
        try:
            with socket.create_connection((u.hostname, u.port), timeout=5, source_address=(source, 0)) as s:
                s.sendall(first)
                while not stop.wait(2.0):
                    s.sendall(b" ")
        except OSError as exc:
            with lock:
                tally[type(exc).__name__] += 1
            stop.wait(0.2)


def _split_cpus() -> tuple[set[int], set[int]] | None:
    """(the validator's and honest senders' CPUs, the attackers'), or None on one CPU."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    half = len(cpus) // 2
    return set(cpus[:len(cpus) - half]), set(cpus[len(cpus) - half:])


def _pin(pid: int, cpus: set[int]) -> None:
    """Every thread of process `pid` onto `cpus` (threads it starts later inherit it from theirs)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:  # a thread that ended meanwhile
            pass


Plan = Callable[[threading.Event, "Counter[str]", threading.Lock], None]
"""One attacker thread's body, given (stop, its kind's tally, the lock)."""


def _staked(url: str, node: Any, sub: Any, domain: str, deadline: float, outside: int | None,
            stop: threading.Event, tally: Counter[str], lock: threading.Lock) -> None:
    """`bench.load`'s flood sender until `deadline`, its statuses counted into `tally`."""
    from bench.load import _flood_sender

    log: list[tuple[float, Any, int]] = []
    _flood_sender(url, node, sub, domain, deadline, log, lock, outside)
    with lock:
        tally.update(str(st) for _, st, _ in log)


def _attack_process(plans: list[tuple[str, Plan]], cpus: set[int] | None, stop: Any, results: Any) -> None:
    """The attackers' process (forked): every plan on a thread until `stop` is set, then the tallies to `results`."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    halt, lock = threading.Event(), threading.Lock()
    tally: dict[str, Counter[str]] = {kind: Counter() for kind, _ in plans}
    threads = [threading.Thread(target=plan, args=(halt, tally[kind], lock), daemon=True) for kind, plan in plans]
    for t in threads:
        t.start()
    stop.wait()
    halt.set()
    for t in threads:
        t.join(timeout=30)
    with lock:
        results.put({k: dict(v) for k, v in tally.items()})


def _audits(url: str, source: str, stop: threading.Event, tally: Counter[str], lock: threading.Lock) -> None:
    import httpx

    with httpx.Client(base_url=url, timeout=60, transport=httpx.HTTPTransport(local_address=source)) as c:
        while not stop.is_set():
            try:
                status: Any = c.get("/v1/audit").status_code
            except httpx.HTTPError as exc:
                status = f"error:{type(exc).__name__}"
            with lock:
                tally[str(status)] += 1


def hostile_load(spec: HostileLoad, tmp: Path) -> dict[str, Any]:
    import httpx

    from bench import validator as bench_validator
    from bench.load import MANIFEST, FloodLoad, _ledger_bytes, build_honest, flood_config
    from protocol.rollout import submission_domain
    from protocol.upload import upload_headers

    # appellants hold one appeal slot each: a few keys make the 100 uploads (the pool's operator funds ~100 nodes)
    n_keys = spec.honest_nodes + spec.staked + max(1, min(spec.appeals, 8))
    # a budget for every honest row of a 10-minute run (800+ accepted: 100 tokens ran short, and the reporter's
    # InsufficientRewardBudget retries were chain work the measurement did not ask for)
    chain = bench_validator.Chain(n_keys, MANIFEST, fund_rewards=100_000 * bench_validator.TOKEN)
    out: dict[str, Any] = {"spec": spec.__dict__, "attacker_addresses": ATTACKER_ADDRESSES}
    try:
        deployment = tmp / "deployment.json"
        chain.deployment.save(deployment)
        domain = submission_domain(chain.deployment.chain_id, chain.deployment.pool, "load")
        honest_ids = chain.nodes[:spec.honest_nodes]
        staked_ids = chain.nodes[spec.honest_nodes:spec.honest_nodes + spec.staked]
        appeal_ids = chain.nodes[spec.honest_nodes + spec.staked:]
        attack = spec.attack or math.ceil(spec.duration_s / spec.honest_every_s) * len(honest_ids)
        baseline = attack if spec.baseline is None else spec.baseline
        warm = spec.warmup * len(honest_ids)
        built, build_s = build_honest(honest_ids, warm + baseline + attack, domain)
        print(f"hostile: built {len(built)} honest submissions in {build_s:.0f} s", flush=True)
        out["honest_planned"] = attack
        junk, _ = build_honest(staked_ids, len(staked_ids), domain) if staked_ids else ([], 0.0)
        cfg = flood_config(tmp / "v", deployment, chain.rpc_url, FloodLoad(threads=spec.threads), unheld=False)
        served = vhttp.Served(cfg, spec.threads, loops=True, tmp=tmp / "served")
        try:
            time.sleep(1.0)  # the validator's chain view has read the registrations
            with httpx.Client(base_url=served.url, timeout=30) as c:
                me = str(c.get("/v1/info").json()["validator"])
            lock = threading.Lock()

            def phase(items: list[tuple[int, Any, int, bytes, str]], deadline: float) -> list[dict[str, Any]]:
                done: list[dict[str, Any]] = []
                per_node = [[(d, k) for s, _, _, d, k in items if s == i] for i in range(len(honest_ids))]
                threads = [threading.Thread(target=_honest, args=(served.url, honest_ids[i], per_node[i], deadline,
                                                                  done, lock, spec.honest_every_s), daemon=True)
                           for i in range(len(honest_ids))]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(timeout=deadline - time.monotonic() + 300)
                return done

            split = _split_cpus()
            if split is not None:  # the baseline runs pinned as the attack phase does
                _pin(os.getpid(), split[0])
                _pin(served.proc.pid, split[0])
            out["cpus"] = None if split is None else {"validator_and_honest": sorted(split[0]),
                                                      "attackers": sorted(split[1])}
            rss0, ledger0 = vhttp.rss_kib(served.proc.pid)["VmRSS"], _ledger_bytes(served.ledger)
            phase(built[:warm], time.monotonic() + 120.0)
            base = phase(built[warm:warm + baseline], time.monotonic() + max(60.0, spec.duration_s) + 60.0)
            url = served.url
            slow_first = b"POST /v1/submissions HTTP/1.1\r\nHost: x\r\nContent-Length: 4000000\r\n\r\n{"
            plans: list[tuple[str, Plan]] = []
            plans += [("slow", partial(_trickle, url, slow_first, _source(i))) for i in range(spec.slow_uploads)]
            plans += [("audit", partial(_audits, url, _source(i))) for i in range(spec.audits)]
            for i in range(spec.appeals):
                who = appeal_ids[i % len(appeal_ids)]
                headers = upload_headers(who, b"x" * (16 << 20), domain=domain, validator=me, path="/v1/appeals")
                first = (f"POST /v1/appeals HTTP/1.1\r\nHost: x\r\nContent-Length: {16 << 20}\r\n"
                         + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n").encode() + b"{"
                plans.append(("appeal", partial(_trickle, url, first, _source(i))))
            attack_deadline = time.monotonic() + spec.duration_s
            # half the staked keys send junk (slashed at the first verdict, then refused), half work for a version
            # outside the window (never a row, never a slash: they send for the whole attack)
            for i, (_, sub, _, _, _) in enumerate(junk):
                outside = sub.policy_version + 1000 if i % 2 else None
                plans.append(("staked" if outside is None else "staked_outside_window",
                              partial(_staked, url, staked_ids[i], sub, domain, attack_deadline, outside)))
            ctx = multiprocessing.get_context("fork")
            stop, results = ctx.Event(), ctx.Queue()
            attackers = ctx.Process(target=_attack_process, args=(plans, None if split is None else split[1], stop,
                                                                  results), daemon=True)
            attackers.start()
            samples: list[tuple[float, float]] = []
            sampler_stop = threading.Event()

            def sample() -> None:
                while not sampler_stop.wait(0.5):
                    samples.append((vhttp.rss_kib(served.proc.pid)["VmRSS"] / 1024,
                                    _ledger_bytes(served.ledger) / (1 << 20)))

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            time.sleep(min(2.0, spec.duration_s / 4))  # the attack is in place before the honest work starts
            hit = phase(built[warm + baseline:], attack_deadline)
            stop.set()
            sampler_stop.set()
            got = results.get(timeout=120)
            attackers.join(timeout=60)
            rss1, ledger1 = vhttp.rss_kib(served.proc.pid)["VmRSS"], _ledger_bytes(served.ledger)
        finally:
            served.stop()
    finally:
        chain.stop()
    tally = {kind: Counter(counts) for kind, counts in got.items()}
    accepted = [r for r in hit if r["outcome"] == "accepted"]
    base_p99 = _p99([r["latency_s"] for r in base if r["outcome"] == "accepted"])
    hit_p99 = _p99([r["latency_s"] for r in accepted])
    out.update({
        "honest_submitted_baseline": len(base), "honest_accepted_baseline": sum(r["outcome"] == "accepted" for r in base),
        "honest_submitted": len(hit), "honest_accepted": len(accepted),
        "honest_acceptance": len(accepted) / len(hit) if hit else None,
        "p99_baseline_s": base_p99, "p99_attack_s": hit_p99,
        "p99_over_baseline": hit_p99 / base_p99 if hit_p99 and base_p99 else None,
        "median_attack_s": statistics.median([r["latency_s"] for r in accepted]) if accepted else None,
        "p99_attack_by_minute_s": _by_minute(accepted),
        "p99_baseline_by_minute_s": _by_minute([r for r in base if r["outcome"] == "accepted"]),
        "honest_statuses": dict(Counter(str(r["status"]) for r in hit)),
        "rss_mib_before": rss0 / 1024, "rss_mib_peak": max([s[0] for s in samples], default=rss1 / 1024),
        "rss_mib_after": rss1 / 1024,
        "ledger_mib_before": ledger0 / (1 << 20), "ledger_mib_after": ledger1 / (1 << 20),
        "ledger_mib_growth": (ledger1 - ledger0) / (1 << 20),
        "attackers": {k: dict(v) for k, v in tally.items()},
    })
    return out


def report(h: dict[str, Any]) -> None:
    print(f"\nhostile: honest accepted {h['honest_accepted']}/{h['honest_submitted']} under attack "
          f"(honest_acceptance {h['honest_acceptance']}), baseline {h['honest_accepted_baseline']}/"
          f"{h['honest_submitted_baseline']}; p99 {h['p99_attack_s']} s vs {h['p99_baseline_s']} s "
          f"(p99_over_baseline {h['p99_over_baseline']})")
    def minutes(xs: list[float | None]) -> str:
        return " ".join(f"{x:.2f}" if x is not None else "-" for x in xs) + " s"

    print(f"p99 by minute under attack: {minutes(h['p99_attack_by_minute_s'])}; "
          f"baseline: {minutes(h['p99_baseline_by_minute_s'])}")
    print(f"validator RSS {h['rss_mib_before']:.0f} MiB before, peak {h['rss_mib_peak']:.0f}, after "
          f"{h['rss_mib_after']:.0f}; ledger {h['ledger_mib_before']:.2f} -> {h['ledger_mib_after']:.2f} MiB")
    print(f"attackers: {h['attackers']}")
