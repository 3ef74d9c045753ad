"""Load: a validator under 10,000 submissions from 100 senders, and a relay under 100 concurrent pulls.

Everything runs as real processes on 127.0.0.1:

(a) Validator. anvil with the pool deployed (`bench.validator`'s `Chain`: 100 node keys registered
    and staked by one operator, policy v1 published), a validator process with all its loops on
    (`python -m bench.validator_http --serve --loops`: intake, model worker, chain reporter, the configured
    per-node rate limit), and one thread per sender posting that sender's share of the traffic in
    order. Two senders are "greedy": they send a tenth of all requests, after their first honest
    submission on `--greedy-conns` connections at once, mostly ones their rate check counts, so the
    per-node limit has something to refuse (the validator's default 5/s is more than a 100th of what
    one validator process answers on 2 cores, so a sender on one connection never reaches it).

    The traffic mix (counts are printed and written to the JSON):
      honest        real work: `node.rollouts.build_submission` with the tiny model (what prime-node
                    builds), sealed by the sender; on 429 it waits `Retry-After` and resends, as
                    prime-node does; every one must end in the ledger with a verdict
      malformed     bytes that are not a canonical submission envelope (400)
      tampered      the sender's honest envelope with another counter in its body, signature kept (401)
      oversize      a Content-Length over the limit (413, refused from the header), and some chunked
                    bodies over the limit (413 while streaming)
      forged        the sender's honest envelope with one signature bit flipped (401)
      unregistered  the sender's honest body, signed by a key no operator registered (403, or 503
                    `chain_unavailable` within `CATCHUP_S` of the last catch-up)
      replay        the sender's honest envelope resent byte for byte (the same answer, no new row)
      reseal        the sender's honest payload sealed again with a fresh nonce (a retry: the same
                    answer after the rate check, or 429)
      nonce_reuse   the honest payload sealed again with the nonce already used (409 replay, or 429)
    The per-node limit is checked from the senders' side: for each sender, the requests that passed
    its rate check (a 2xx or 409 answer to a request it signed) must be at most
    `burst + rate * (last such answer - first such request)`; refusals must be 429 with Retry-After.

    Anchors in the same run: the validator's RSS after warm-up (memory), and the rate of the same
    cheap mix posted by one sender on one connection (`single_sender_per_s`).

(b) Relay. A real checkpoint (`models.checkpoint` of a tiny LLaMA-shaped model, `--ckpt-hidden` wide)
    published through a `prime-relay origin`, one `prime-relay relay` below it (default limits), and
    `--pulls` `shardcast.Client`s in one event loop pulling it from the relay at once, each verifying
    every shard against the signed manifest; then every installed file is compared (SHA-256) with the
    checkpoint. The relay's RSS is sampled. Anchor: one pull alone, same relay, same run.

(c) Flood (issue 23 item 3). A few registered keys send cheap failures (an honest payload re-sealed
    under other counters: wrong tasks, a hard verdict decided at intake, no model run) as fast as the
    validator lets them (on 429/503 back after Retry-After, at most 0.25 s), for a fixed time, against
    a validator process in two configurations, each on fresh keys:
      defaults   the shipped `flood` bounds: a key with a hard verdict pending is held (429) until its
                 slash lands (the systemic window is shortened to `slash_after_s` so it does in the run),
                 then refused as inactive (403);
      unheld     as if every slash were held back (a systemic window of `UNHELD_WINDOW_S`, longer than the
                 flood, the hold off) and each
                 key were many (per-node rate 100/s): what bounds the ledger is then the bytes per node
                 per window and the global backlog cap (both set small so the run reaches them).
    Sampled every 0.5 s: the validator's RSS and its ledger's size on disk (database + WAL) and row count.
    Bounded = the second half of the run adds (almost) nothing: rows, bytes and RSS growth in the second
    half are printed beside the first half's. Anchors in the same run: RSS and ledger size before the flood.

Bounded: a fixed number of requests and pulls, each phase with a deadline.

    python -m bench.load --json bench/measured/load.json            # 10,000 submissions, 100 pulls
    python -m bench.load --quick --json bench/measured/load_quick.json
    python -m bench.load --quick --only flood                        # the flood alone (~2 min)
    python -m bench.load --smoke --json out.json   # every part at the smallest size (checks the bench, seconds)
    python -m bench.load --only hostile --json bench/measured/load_hostile.json   # (d) below: 10 minutes alone, 10 under attack

(d) Hostile (issue 35, `bench/hostile.py`): honest nodes' work at a validator process alone (the baseline), then
    beside 64 slow uploads from no key, 200 concurrent audit requests, 100 slow 16 MiB appeal uploads and 10
    staked keys sending junk at their limits: `honest_acceptance`, `p99_over_baseline`, RSS and ledger growth.
    Runs only when named (`--only hostile`) and in `--smoke`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import harness, loopback
from bench import validator_http as vhttp  # the validator as a process, RSS from /proc, oversize senders
from bench.hostile import HostileLoad, hostile_load
from bench.hostile import report as report_hostile

MANIFEST = hashlib.sha256(b"load bench manifest v1").digest()
HONEST_RETRY_STATUSES = {425, 429, 503}
# an honest node resends these later too: a counter that arrived before the one the validator takes first
# (a greedy sender's honest submissions travel on several connections)
HONEST_RESEND_ERRORS = {"counter_out_of_order"}
# What each kind of request may be answered with (429 wherever the sender's rate check runs first).
EXPECTED: dict[str, set[int]] = {
    "honest": {200, 202},
    "malformed": {400},
    "tampered": {401},
    "oversize": {413},
    "oversize_chunked": {413},
    "forged": {401},
    "unregistered": {403, 503},  # 503 chain_unavailable: within CATCHUP_S of the last catch-up, "not known yet"
    "replay": {200, 202},
    "reseal": {200, 202, 429},
    "nonce_reuse": {409, 429},
}
GATED = {"honest", "reseal", "nonce_reuse"}  # signed by a registered sender: its rate check runs
MIX = {"malformed": 0.26, "tampered": 0.04, "forged": 0.16, "unregistered": 0.10, "oversize": 0.07, "oversize_chunked": 0.005,
       "replay": 0.12, "reseal": 0.15, "nonce_reuse": 0.095}
GREEDY_MIX = {"reseal": 0.6, "nonce_reuse": 0.15, "malformed": 0.1, "forged": 0.1, "replay": 0.05}


@dataclass
class ValidatorLoad:
    """Sizes and limits of the validator part."""

    senders: int = 100
    requests: int = 10_000
    honest: int = 300
    rate: float = 5.0
    """The validator's `rate_per_node` (its default)."""
    burst: int = 20
    """The validator's `rate_burst` (its default)."""
    greedy_senders: int = 2
    greedy_conns: int = 16
    greedy_share: float = 0.1
    """Fraction of all requests sent by the greedy senders."""
    threads: int = 1
    decide_timeout_s: float = 600.0
    traffic_timeout_s: float = 900.0
    anchor_requests: int = 300
    seed: int = 0


@dataclass
class Item:
    kind: str
    payload: Any
    work_key: str | None = None
    """For kinds answered with a row (honest, replay, reseal): the work key the answer must name."""


@dataclass
class Sender:
    identity: Any
    greedy: bool
    first: Item
    items: list[Item] = field(default_factory=list)
    log: list[tuple[str, float, float, Any, str | None]] = field(default_factory=list)
    """(kind, sent, answered, status, error code) per request; honest retries are separate requests."""


# -- (a) the validator -------------------------------------------------------------------------------


def _run_and_model() -> tuple[Any, Any]:
    from protocol.model_spec import TinyModelSpec
    from protocol.rollout import RunSpec

    run = RunSpec(run_id="load", tasks_per_batch=2, samples_per_task=2, max_new_tokens=32, async_level=1)
    return run, TinyModelSpec(seed=0, hidden_size=128)  # 128 wide: a 1-token last chunk can be proved


def validator_config(state: Path, deployment: Path, rpc_url: str, spec: ValidatorLoad) -> Any:
    from validator.config import ValidatorConfig

    run, model = _run_and_model()
    return ValidatorConfig.model_validate({
        "state_dir": state, "run": run, "model": model, "threads": spec.threads,
        "chain": {"deployment": deployment, "rpc_url": rpc_url, "poll_s": 0.5},
        "key": {"key_env": vhttp.KEY_ENV}, "reporter": {"interval_s": 0.5, "max_backoff_s": loopback.REPORTER_MAX_BACKOFF_S},
        "max_age_s": 3600.0,  # honest work is built before the traffic starts
        # the systemic window plus the reporter's back-off must stay below the loopback pool's invalidation window
        # (the validator refuses to start otherwise); the default 300 s does not
        "systemic": {"window_s": 60.0},
        "rate_per_node": spec.rate, "rate_burst": spec.burst,
        # the global bounds are part (c)'s subject; here 100+ connections at once are the point
        "flood": {"max_concurrent": 1024, "rate": 100_000.0, "burst": 100_000},
        # a greedy sender's connections each get a slot: the per-node *rate* is this part's subject (the slots
        # per signer are the hostile part's)
        "gate": {"slots_per_node": max(2, spec.greedy_conns)},
    })


def build_honest(nodes: list[Any], n: int, domain: str) -> tuple[list[tuple[int, Any, int, bytes, str]], float]:
    """`n` honest submissions, round-robin over `nodes`: (sender index, Submission, nonce, bytes, work key)."""
    import torch

    from models.loading import load
    from node.engines import ModelsEngine
    from node.rollouts import build_submission
    from protocol.envelope import seal
    from protocol.nonce import random_nonce
    from protocol.rollout import submission_venue
    from protocol.seeds import work_key

    torch.set_num_threads(1)
    run, model = _run_and_model()
    engine = ModelsEngine(load(model))
    chain_id, pool = submission_venue(domain)
    out, t0 = [], time.perf_counter()
    for i in range(n):
        s, counter = i % len(nodes), i // len(nodes)
        sub = build_submission(engine, run, nodes[s].address, 1, counter, MANIFEST, chain_id=chain_id, pool=pool)
        nonce = random_nonce()
        data = seal(nodes[s], sub, domain=domain, nonce=nonce).to_bytes()
        out.append((s, sub, nonce, data, "0x" + work_key(run.run_id, sub.node, 1, counter, chain_id=chain_id,
                                                                    pool=pool).hex()))
    return out, time.perf_counter() - t0


def _malformed(good: bytes) -> list[bytes]:
    env = json.loads(good)
    return [b"", b"{", b"[1,2]", b"null", b"\xff\xfe\x00garbage", b'{"kind":"submission"}', b"[" * 50_000,
            b'{"a":' * 5_000, json.dumps(env).encode()]  # the last: valid JSON, not the canonical encoding


def _tampered(good: bytes, rng: random.Random) -> bytes:
    """The envelope with its body changed and its signature kept (canonical form)."""
    env = json.loads(good)
    body = {**env["body"], "counter": env["body"]["counter"] + 1 + rng.randrange(1000)}
    return json.dumps({**env, "body": body}, separators=(",", ":"), sort_keys=True).encode()


def plan_traffic(nodes: list[Any], honest: list[tuple[int, Any, int, bytes, str]], domain: str,
                 spec: ValidatorLoad, max_bytes: int) -> list[Sender]:
    """Each sender's requests, in the order it sends them (its first honest submission first)."""
    from protocol.envelope import Envelope, seal
    from protocol.identity import Identity
    from protocol.nonce import random_nonce
    from protocol.rollout import Submission

    rng = random.Random(spec.seed)
    by_sender: dict[int, list[tuple[Any, int, bytes, str]]] = defaultdict(list)
    for s, sub, nonce, data, key in honest:
        by_sender[s].append((sub, nonce, data, key))
    if len(by_sender) < spec.senders:
        raise SystemExit(f"--honest {spec.honest} gives some of the {spec.senders} senders no honest work")
    strangers = [Identity.create() for _ in range(16)]
    n_greedy = spec.greedy_senders
    if not 0 < n_greedy < spec.senders:
        raise SystemExit("need at least one greedy sender and one other")
    greedy_total = round(spec.greedy_share * spec.requests)
    per_greedy, per_normal = greedy_total // n_greedy, (spec.requests - greedy_total) // (spec.senders - n_greedy)
    extra = spec.requests - per_greedy * n_greedy - per_normal * (spec.senders - n_greedy)
    senders = []
    for s, node in enumerate(nodes[: spec.senders]):
        mine = by_sender[s]
        sub0, nonce0, data0, key0 = mine[0]
        sender = Sender(node, greedy=s < n_greedy, first=Item("honest", data0, key0))
        mix = GREEDY_MIX if sender.greedy else MIX
        n_junk = (per_greedy if sender.greedy else per_normal) - len(mine) + (extra if s == n_greedy else 0)
        kinds = rng.choices(list(mix), weights=list(mix.values()), k=max(0, n_junk))
        malformed = _malformed(data0)
        for j, kind in enumerate(kinds):
            if kind == "malformed":
                sender.items.append(Item(kind, malformed[rng.randrange(len(malformed))]))
            elif kind == "tampered":
                sender.items.append(Item(kind, _tampered(data0, rng)))
            elif kind == "oversize":
                sender.items.append(Item(kind, max_bytes * 2))
            elif kind == "oversize_chunked":
                sender.items.append(Item(kind, max_bytes + (1 << 20)))
            elif kind == "forged":  # one bit of the signature's r flipped
                env = json.loads(data0)
                sig = bytearray(bytes.fromhex(env["signature"][2:]))
                sig[rng.randrange(32)] ^= 1 << rng.randrange(8)  # in r: s stays low, the form stays valid
                env["signature"] = "0x" + sig.hex()
                sender.items.append(Item(kind, Envelope.model_validate(env).to_bytes()))
            elif kind == "unregistered":
                stranger = strangers[j % len(strangers)]
                body = Submission.model_validate({**sub0.model_dump(), "node": stranger.address})
                sender.items.append(Item(kind, seal(stranger, body, domain=domain, nonce=random_nonce()).to_bytes()))
            elif kind == "replay":
                sender.items.append(Item(kind, data0, key0))
            elif kind == "reseal":
                sender.items.append(Item(kind, seal(node, sub0, domain=domain, nonce=random_nonce()).to_bytes(), key0))
            else:  # nonce_reuse: the first envelope's nonce, a later timestamp (ms, under the skew limit): other bytes
                data = seal(node, sub0, domain=domain, nonce=nonce0, now=time.time() + 0.001 * (1 + j % 500)).to_bytes()
                sender.items.append(Item(kind, data))
        at = 0
        for _, _, data, key in mine[1:]:  # the other honest ones, somewhere in the sequence, in counter order
            at = rng.randrange(at, len(sender.items) + 1)
            sender.items.insert(at, Item("honest", data, key))
            at += 1
        senders.append(sender)
    return senders


_VALIDATORS: dict[str, tuple[str, str]] = {}
"""base URL -> (validator address, envelope domain), read once from its /v1/info."""


def _signed(client: Any, identity: Any, data: bytes) -> dict[str, str]:
    """The sender's upload header for `data` (as prime-node sends it: the validator checks it before the body)."""
    from protocol.upload import upload_headers

    url = str(client.base_url)
    if url not in _VALIDATORS:
        info = client.get("/v1/info").json()
        _VALIDATORS[url] = (str(info["validator"]), str(info["domain"]))
    validator, domain = _VALIDATORS[url]
    return upload_headers(identity, data, domain=domain, validator=validator, path="/v1/submissions")


def _post(client: Any, host_port: tuple[str, int], item: Item,
          identity: Any = None) -> tuple[Any, str | None, dict[str, Any]]:
    """(status, error code, answer body) of one request, with `identity`'s upload header when given; a transport
    failure is `error:<Name>`."""
    import httpx

    try:
        if item.kind in ("oversize", "oversize_chunked"):
            kind = "oversize_declared" if item.kind == "oversize" else "oversize_chunked"
            return vhttp.send_junk(f"http://{host_port[0]}:{host_port[1]}")(client, (kind, item.payload)), \
                "oversize", {}
        headers = _signed(client, identity, item.payload) if identity is not None else None
        r = client.post("/v1/submissions", content=item.payload, headers=headers)
    except (httpx.HTTPError, OSError) as exc:
        return f"error:{type(exc).__name__}", None, {}
    try:
        body = r.json()
    except ValueError:
        body = {}
    if r.status_code == 429 and "retry-after" not in r.headers:
        return "429-without-retry-after", body.get("error"), body
    return r.status_code, body.get("error"), body


def _send(url: str, sender: Sender, items: list[Item], deadline: float, lock: threading.Lock) -> None:
    import httpx

    host, port = url.rsplit("/", 1)[-1].split(":")
    with httpx.Client(base_url=url, timeout=60.0) as client:
        for item in items:
            while time.monotonic() < deadline:
                t0 = time.monotonic()
                status, error, body = _post(client, (host, int(port)), item, sender.identity)
                t1 = time.monotonic()
                if item.work_key and status in (200, 202) and body.get("work_key") != item.work_key:
                    status = f"wrong-work-key:{status}"
                with lock:
                    sender.log.append((item.kind, t0, t1, status, error))
                if item.kind != "honest" or (status not in HONEST_RETRY_STATUSES and error not in HONEST_RESEND_ERRORS
                                             and not str(status).startswith("error")):
                    break
                time.sleep(1.0)  # the validator's Retry-After is whole seconds, at least 1


def run_traffic(url: str, senders: list[Sender], spec: ValidatorLoad) -> float:
    """Every sender posts its requests (greedy ones on several connections after their first); seconds."""
    deadline = time.monotonic() + spec.traffic_timeout_s
    lock = threading.Lock()

    def sender_main(sender: Sender) -> None:
        _send(url, sender, [sender.first], deadline, lock)
        conns = spec.greedy_conns if sender.greedy else 1
        parts = [sender.items[i::conns] for i in range(conns)]
        threads = [threading.Thread(target=_send, args=(url, sender, p, deadline, lock)) for p in parts[1:]]
        for t in threads:
            t.start()
        _send(url, sender, parts[0], deadline, lock)
        for t in threads:
            t.join()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=sender_main, args=(s,)) for s in senders]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def rate_check(senders: list[Sender], spec: ValidatorLoad) -> dict[str, Any]:
    """Per sender: requests that passed its rate check vs burst + rate * span (see the module docstring)."""
    worst, violations, refused, greedy_refused, passed_total = 0.0, [], 0, 0, 0
    for s in senders:
        gated = [(k, t0, t1, st) for k, t0, t1, st, _ in s.log if k in GATED]
        passed = [(t0, t1) for _, t0, t1, st in gated if st in (200, 202, 409)]
        n429 = sum(1 for *_, st in gated if st == 429)
        refused += n429
        greedy_refused += n429 if s.greedy else 0
        passed_total += len(passed)
        if not passed:
            continue
        span = max(t1 for _, t1 in passed) - min(t0 for _, t0, _, _ in gated)
        allowed = spec.burst + spec.rate * span
        worst = max(worst, len(passed) / allowed)
        if len(passed) > allowed + 1e-9:
            violations.append({"sender": s.identity.address, "passed": len(passed), "allowed": allowed})
    return {"rate_per_node": spec.rate, "burst": spec.burst, "gated_passed": passed_total,
            "refused_429": refused, "refused_429_greedy": greedy_refused, "violations": violations,
            "worst_passed_over_allowed": worst, "held": not violations}


def _metric_lines(url: str, prefix: str) -> dict[str, float]:
    import httpx

    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(prefix):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def wait_decided(ledger: Path, keys: set[str], timeout: float,
                 other_honest: set[str] | None = None) -> tuple[dict[str, Any], float]:
    """Poll the ledger (read-only) until every honest work key has left `received` (`other_honest`: honest
    rows sent outside the traffic, the warm-up's)."""
    t0 = time.monotonic()
    rows: dict[str, tuple[str, str | None, str | None]] = {}
    while True:
        with sqlite3.connect(f"file:{ledger}?mode=ro", uri=True, timeout=30) as db:
            rows = {k: (st, out, reason) for k, st, out, reason in
                    db.execute("SELECT work_key, state, outcome, reason FROM submissions")}
        pending = [k for k in keys if k not in rows or rows[k][0] == "received"]
        if not pending or time.monotonic() - t0 > timeout:
            break
        time.sleep(0.5)
    honest = {k: rows.get(k) for k in keys}
    res = {
        "honest_submitted": len(keys),
        "in_ledger": sum(1 for v in honest.values() if v is not None),
        "decided": sum(1 for v in honest.values() if v is not None and v[0] != "received"),
        "outcomes": dict(Counter(f"{v[1]}:{v[2]}" for v in honest.values() if v is not None and v[1])),
        "missing": sorted(k for k, v in honest.items() if v is None),
        "ledger_rows_total": len(rows),
        "ledger_rows_not_honest": sum(1 for k in rows if k not in keys and k not in (other_honest or ())),
        "states": dict(Counter(v[0] for v in honest.values() if v is not None)),
    }
    res["lost"] = len(keys) - res["decided"]
    return res, time.monotonic() - t0


def single_sender_anchor(url: str, senders: list[Sender], n: int) -> dict[str, Any]:
    """The anchor: the same cheap kinds (no honest work) posted by one sender on one connection."""
    pool = [i for s in senders for i in s.items if i.kind in ("malformed", "tampered", "forged", "unregistered")]
    items = random.Random(1).sample(pool, min(n, len(pool)))
    probe = Sender(senders[0].identity, False, items[0])
    t0 = time.perf_counter()
    _send(url, probe, items, time.monotonic() + 300, threading.Lock())
    dt = time.perf_counter() - t0
    return {"requests": len(items), "seconds": dt, "per_s": len(items) / dt}


def validator_load(spec: ValidatorLoad, tmp: Path) -> dict[str, Any]:
    from bench import validator as bench_validator
    from protocol.rollout import submission_domain
    t0 = time.perf_counter()
    chain = bench_validator.Chain(spec.senders, MANIFEST)
    setup_s = time.perf_counter() - t0
    served = None
    try:
        deployment = tmp / "deployment.json"
        chain.deployment.save(deployment)
        domain = submission_domain(chain.deployment.chain_id, chain.deployment.pool, "load")
        cfg = validator_config(tmp / "validator", deployment, chain.rpc_url, spec)
        honest, honest_build_s = build_honest(chain.nodes[: spec.senders], spec.honest + 1, domain)
        warm_honest = honest.pop()  # checked before the baseline RSS: the model stage's memory is in it
        senders = plan_traffic(chain.nodes, honest, domain, spec, cfg.max_submission_bytes)
        mix = Counter(i.kind for s in senders for i in [s.first, *s.items])
        served = vhttp.Served(cfg, spec.threads, loops=True, tmp=tmp / "served")
        pid = served.proc.pid
        # warm-up: first-use imports and caches of every refusal path (on a key outside the run's senders)
        warm = Sender(chain.nodes[0], False, senders[0].items[0])
        _send(served.url, warm, [i for s in senders[:3] for i in s.items if i.kind in
                                 ("malformed", "forged", "unregistered", "oversize")][:40],
              time.monotonic() + 120, threading.Lock())
        _send(served.url, warm, [Item("honest", warm_honest[3], warm_honest[4])], time.monotonic() + 120,
              threading.Lock())
        warm_decided, _ = wait_decided(served.ledger, {warm_honest[4]}, 120)
        if warm_decided["lost"]:
            raise RuntimeError(f"the warm-up submission was not decided: {warm_decided}")
        time.sleep(0.5)
        anchor = single_sender_anchor(served.url, senders, spec.anchor_requests)
        time.sleep(0.5)
        rss_before = vhttp.rss_kib(pid)
        samples: list[tuple[float, int]] = []
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                try:
                    samples.append((time.perf_counter(), vhttp.rss_kib(pid)["VmRSS"]))
                except (OSError, KeyError):
                    return
                stop.wait(0.1)

        sampler = threading.Thread(target=sample, daemon=True)
        t_start, t_mono = time.perf_counter(), time.monotonic()
        sampler.start()
        traffic_s = run_traffic(served.url, senders, spec)
        keys = {i.work_key for s in senders for i in [s.first, *s.items] if i.kind == "honest" and i.work_key}
        decided, decide_wait_s = wait_decided(served.ledger, keys, spec.decide_timeout_s, {warm_honest[4]})
        stop.set()
        sampler.join()
        rss_after = vhttp.rss_kib(pid)
        metrics = _metric_lines(served.url, "prime_validator")
    finally:
        if served is not None:
            served.stop()
        chain.stop()
    statuses: dict[str, Counter] = defaultdict(Counter)
    errors: dict[str, Counter] = defaultdict(Counter)
    unexpected: Counter = Counter()
    honest_attempts = Counter()
    for s in senders:
        for kind, _, _, status, error in s.log:
            statuses[kind][status] += 1
            if error:
                errors[kind][error] += 1
            if kind == "honest":
                honest_attempts[status] += 1
                continue
            if status not in EXPECTED[kind]:
                unexpected[f"{kind}:{status}"] += 1
    honest_final = Counter(st for s in senders for k, _, _, st, e in s.log if k == "honest"
                           and st not in HONEST_RETRY_STATUSES and e not in HONEST_RESEND_ERRORS)
    for st, c in honest_final.items():
        if st not in EXPECTED["honest"]:
            unexpected[f"honest:{st}"] += c
    requests = sum(len(s.log) for s in senders)
    answered = sorted(t1 - t_mono for s in senders for _, _, t1, _, _ in s.log)
    latency: dict[str, list[float]] = defaultdict(list)
    for s in senders:
        for kind, t0, t1, _, _ in s.log:
            latency[kind].append(t1 - t0)
    rss = [kib for _, kib in samples]
    tenth = [kib for t, kib in samples if t - t_start >= traffic_s * 0.1]
    peak = max(rss + [rss_after["VmRSS"]])
    quarter = max(1, len(rss) // 4)
    return {
        "senders": spec.senders, "greedy_senders": sum(s.greedy for s in senders), "greedy_conns": spec.greedy_conns,
        "planned_requests": sum(mix.values()), "mix": dict(sorted(mix.items())),
        "requests_sent": requests, "honest_retries": requests - sum(mix.values()),
        "traffic_s": traffic_s, "per_s": requests / traffic_s, "anchor_single_sender": anchor,
        "answered_by_s": {q: round(answered[min(len(answered) - 1, int(q / 100 * len(answered)))], 2)
                          for q in (50, 90, 99)} if answered else {},
        "latency_s": {k: {"median": round(statistics.median(v), 3), "max": round(max(v), 3)}
                      for k, v in sorted(latency.items())},
        "per_s_over_single_sender": requests / traffic_s / anchor["per_s"],
        "statuses": {k: {str(s): c for s, c in sorted(v.items(), key=str)} for k, v in sorted(statuses.items())},
        "error_codes": {k: dict(v) for k, v in sorted(errors.items())},
        "unexpected_answers": dict(unexpected),
        "rate_limit": rate_check(senders, spec),
        "honest": {**decided, "decide_wait_after_traffic_s": decide_wait_s, "build_s": honest_build_s,
                   "attempt_statuses": {str(k): v for k, v in honest_attempts.items()}},
        "rss_before_mib": rss_before["VmRSS"] / 1024, "rss_after_mib": rss_after["VmRSS"] / 1024,
        "rss_peak_sampled_mib": peak / 1024, "rss_samples": len(rss),
        "rss_growth_after_first_10pct_mib": (rss_after["VmRSS"] - (tenth[0] if tenth else rss_before["VmRSS"])) / 1024,
        "peak_over_before_mib": (peak - rss_before["VmRSS"]) / 1024,
        "rss_median_first_quarter_mib": statistics.median(rss[:quarter]) / 1024 if rss else None,
        "rss_median_last_quarter_mib": statistics.median(rss[-quarter:]) / 1024 if rss else None,
        "rss_timeline_s_mib": [(round(t - t_start, 1), round(kib / 1024, 1))
                               for t, kib in samples[:: max(1, len(samples) // 60)]],
        "validator_metrics": {k: v for k, v in metrics.items() if "refused" in k or "verdict" in k
                              or "submissions" in k},
        "chain_setup_s": setup_s,
    }


# -- (c) the flood -----------------------------------------------------------------------------------


@dataclass
class FloodLoad:
    """Sizes of the flood part."""

    keys: int = 3
    duration_s: float = 60.0
    """Flood time per configuration."""
    slash_after_s: float = 10.0
    """The systemic window (the reporter's hold on hard verdicts) in the `defaults` configuration."""
    node_bytes_per_window: int = 4 << 20
    """`flood.node_bytes_per_window` in the `unheld` configuration."""
    max_backlog: int = 2_000
    """`flood.max_backlog` in the `unheld` configuration."""
    threads: int = 1


UNHELD_WINDOW_S = 75.0
"""The `unheld` configuration's systemic window: past the default flood (60 s; a longer `--flood-s` sees slashes land), and with the reporter's back-off
below the loopback pool's invalidation window (100 s), as the validator requires to start."""


def flood_config(state: Path, deployment: Path, rpc_url: str, spec: FloodLoad, unheld: bool) -> Any:
    from validator.config import ValidatorConfig

    run, model = _run_and_model()
    values: dict[str, Any] = {
        "state_dir": state, "run": run, "model": model, "threads": spec.threads,
        "chain": {"deployment": deployment, "rpc_url": rpc_url, "poll_s": 0.5},
        "key": {"key_env": vhttp.KEY_ENV}, "reporter": {"interval_s": 0.5, "max_backoff_s": loopback.REPORTER_MAX_BACKOFF_S}, "max_age_s": 3600.0,
        "systemic": {"window_s": spec.slash_after_s, "min_nodes": 1_000_000, "fraction": 1.0},
    }
    if unheld:
        values.update(rate_per_node=100.0, rate_burst=100, systemic={"window_s": UNHELD_WINDOW_S, "min_nodes": 1_000_000,
                                                                      "fraction": 1.0},
                      flood={"hold_slashable": False, "node_bytes_per_window": spec.node_bytes_per_window,
                             "max_backlog": spec.max_backlog})
    return ValidatorConfig.model_validate(values)


def _flood_sender(url: str, node: Any, sub: Any, domain: str, deadline: float, log: list[tuple[float, Any, int]],
                  lock: threading.Lock, policy_version: int | None = None) -> None:
    """Junk work from a staked key as fast as the validator lets it: an honest payload re-sealed under other
    counters (the assigned tasks differ: cheap, hard), or with `policy_version`, work for a version outside the
    run's window (refused at intake with no row and no verdict: the key is never slashed and goes on)."""
    import httpx

    from protocol.envelope import seal
    from protocol.nonce import random_nonce

    with httpx.Client(base_url=url, timeout=30) as c:
        i = 0
        while time.monotonic() < deadline:
            i += 1
            update: dict[str, Any] = {"counter": i}
            if policy_version is not None:
                update["policy_version"] = policy_version
            data = seal(node, sub.model_copy(update=update), domain=domain, nonce=random_nonce()).to_bytes()
            try:
                r = c.post("/v1/submissions", content=data, headers=_signed(c, node, data))
                status: Any = r.status_code
            except httpx.HTTPError as exc:
                status, r = f"error:{type(exc).__name__}", None
            with lock:
                log.append((time.monotonic(), status, len(data)))
            if status == 403:  # slashed: out of the pool
                return
            if status in (429, 503) and r is not None:
                time.sleep(min(0.25, float(r.headers.get("Retry-After", "1"))))


def _ledger_bytes(ledger: Path) -> int:
    return sum(p.stat().st_size for p in (ledger, Path(f"{ledger}-wal")) if p.exists())


def flood_load(spec: FloodLoad, tmp: Path) -> dict[str, Any]:
    import httpx

    from bench import validator as bench_validator
    from protocol.rollout import submission_domain
    chain = bench_validator.Chain(2 * spec.keys, MANIFEST)
    out: dict[str, Any] = {"keys": spec.keys, "duration_s": spec.duration_s}
    try:
        deployment = tmp / "deployment.json"
        chain.deployment.save(deployment)
        domain = submission_domain(chain.deployment.chain_id, chain.deployment.pool, "load")
        honest, _ = build_honest(chain.nodes, 2 * spec.keys, domain)  # one payload per key, re-sealed below
        for j, name in enumerate(("defaults", "unheld")):
            cfg = flood_config(tmp / name, deployment, chain.rpc_url, spec, unheld=name == "unheld")
            served = vhttp.Served(cfg, spec.threads, loops=True, tmp=tmp / f"{name}-served")
            try:
                keys = [(chain.nodes[s], sub) for s, sub, _, _, _ in honest[j * spec.keys:(j + 1) * spec.keys]]
                time.sleep(1.0)  # the validator's chain view has read the registrations
                rss0, bytes0 = vhttp.rss_kib(served.proc.pid)["VmRSS"], _ledger_bytes(served.ledger)
                log: list[tuple[float, Any, int]] = []
                lock = threading.Lock()
                t0 = time.monotonic()
                deadline = t0 + spec.duration_s
                threads = [threading.Thread(target=_flood_sender, args=(served.url, node, sub, domain, deadline, log,
                                                                        lock), daemon=True) for node, sub in keys]
                for t in threads:
                    t.start()
                samples: list[tuple[float, float, float, int]] = []
                with httpx.Client(base_url=served.url, timeout=30) as c:
                    while time.monotonic() < deadline + 0.5:
                        rows = int(c.get("/v1/audit", params={"rows": "false"}).json()["counts"]["received"])
                        samples.append((time.monotonic() - t0, vhttp.rss_kib(served.proc.pid)["VmRSS"] / 1024,
                                        _ledger_bytes(served.ledger) / (1 << 20), rows))
                        time.sleep(0.5)
                    for t in threads:
                        t.join(timeout=60)
                    counts = c.get("/v1/audit", params={"rows": "false"}).json()["counts"]
                    metrics = _metric_lines(served.url, "prime_validator_events")
            finally:
                served.stop()
            half = [s for s in samples if s[0] >= spec.duration_s / 2]
            first = [s for s in samples if s[0] < spec.duration_s / 2]

            def growth(part: list[tuple[float, float, float, int]], k: int) -> float:
                return float(part[-1][k] - part[0][k]) if len(part) > 1 else 0.0

            statuses = Counter(str(st) for _, st, _ in log)
            size = max((n for _, _, n in log), default=0)
            out[name] = {
                "requests": len(log), "per_s": len(log) / spec.duration_s, "statuses": dict(statuses),
                "submission_bytes": size, "rows": counts["received"], "counts": counts,
                "ledger_mib_before": bytes0 / (1 << 20), "ledger_mib_after": samples[-1][2] if samples else None,
                "rss_mib_before": rss0 / 1024, "rss_mib_peak": max(s[1] for s in samples) if samples else None,
                "growth_first_half": {"rows": growth(first, 3), "ledger_mib": growth(first, 2), "rss_mib": growth(first, 1)},
                "growth_second_half": {"rows": growth(half, 3), "ledger_mib": growth(half, 2), "rss_mib": growth(half, 1)},
                "timeline_s_rss_mib_ledger_mib_rows": [(round(t, 1), round(r, 1), round(m, 2), n)
                                                       for t, r, m, n in samples[:: max(1, len(samples) // 30)]],
                "refusals": {k.split('"')[1]: v for k, v in metrics.items() if "refused" in k},
                "bounds": {k: v for k, v in cfg.flood.model_dump().items()},
                "systemic_window_s": cfg.systemic.window_s,
            }
    finally:
        chain.stop()
    return out


# -- (b) the relay -----------------------------------------------------------------------------------


@dataclass
class RelayLoad:
    pulls: int = 100
    ckpt_vocab: int = 4096
    ckpt_hidden: int = 512
    ckpt_layers: int = 4
    shard_mib: int = 8
    concurrency: int = 1
    """Shards each client fetches at once (100 clients share 127.0.0.1, which the relay caps at 128
    connections per peer address by default; one each keeps the relay's defaults)."""
    timeout_s: float = 600.0


def _relay_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "shardcast.cli", *args]


def _tree_hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def relay_load(spec: RelayLoad, tmp: Path) -> dict[str, Any]:
    import httpx

    from bench.loopback import free_port, wait_http
    from models.checkpoint import main as write_checkpoint
    from protocol.identity import Identity
    from shardcast import Client

    ckpt = tmp / "ckpt"
    model = {"type": "tiny", "seed": 3, "vocab_size": spec.ckpt_vocab, "hidden_size": spec.ckpt_hidden,
             "intermediate_size": spec.ckpt_hidden * 3, "num_layers": spec.ckpt_layers}
    if write_checkpoint([str(ckpt), "--model", json.dumps(model)]) != 0:
        raise RuntimeError("could not write the checkpoint")
    want = _tree_hashes(ckpt)
    ckpt_bytes = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())
    trainer = Identity.create()  # a throwaway key made for this run
    env = {**os.environ, "LOAD_TRAINER_KEY": "0x" + bytes(trainer.account.key).hex(), "OMP_NUM_THREADS": "1"}
    o_port, r_port = free_port(), free_port()
    logs = tmp / "logs"
    logs.mkdir()
    procs: list[subprocess.Popen[bytes]] = []

    def start(name: str, *args: str) -> subprocess.Popen[bytes]:
        with open(logs / f"{name}.log", "wb") as log:
            p = subprocess.Popen(_relay_cmd(*args), env=env, stdout=log, stderr=subprocess.STDOUT)
        procs.append(p)
        return p

    try:
        origin = start("origin", "origin", "--store", str(tmp / "origin"), "--run-id", "load", "--port", str(o_port))
        wait_http(f"http://127.0.0.1:{o_port}/health", 60, origin)
        pub = subprocess.run(_relay_cmd("publish", str(ckpt), "--store", str(tmp / "origin"), "--run-id", "load",
                                        "--version", "1", "--shard-mib", str(spec.shard_mib), "--key-env",
                                        "LOAD_TRAINER_KEY"), env=env, capture_output=True, timeout=300)
        if pub.returncode != 0:
            raise RuntimeError(f"publish failed: {pub.stderr.decode()[-2000:]}")
        relay = start("relay", "relay", "--upstream", f"http://127.0.0.1:{o_port}", "--trainer", trainer.address,
                      "--store", str(tmp / "relay"), "--port", str(r_port))
        url = f"http://127.0.0.1:{r_port}"
        wait_http(f"{url}/health", 60, relay)
        deadline = time.monotonic() + 120
        while True:
            index = httpx.get(f"{url}/versions", params={"after": 0, "wait": 5}, timeout=30).json()
            if any(v["version"] == 1 and v["complete"] for v in index["versions"]):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the relay did not complete v1: {index}")
        shards = next(v["shards"] for v in index["versions"] if v["version"] == 1)

        async def one(i: int) -> dict[str, Any]:
            out = tmp / "pulls" / str(i)
            client = Client([url], trainer=trainer.address, out_dir=out, run_id="load",
                            concurrency=spec.concurrency, progress=False, ban_s=0)
            t0 = time.perf_counter()
            result = await client.pull(1)
            seconds = time.perf_counter() - t0
            same = await asyncio.to_thread(_tree_hashes, result.path) == want
            shutil.rmtree(out, ignore_errors=True)
            return {"seconds": seconds, "verified_same": same, "hash_failures": result.hash_failures,
                    "bytes": result.bytes_fetched}

        async def many(n: int) -> tuple[list[Any], float]:
            t0 = time.perf_counter()
            res = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True),
                                         spec.timeout_s)
            return res, time.perf_counter() - t0

        alone, alone_s = asyncio.run(many(1))
        if isinstance(alone[0], BaseException):
            raise RuntimeError(f"the anchor pull failed: {alone[0]!r}")
        rss_before = vhttp.rss_kib(relay.pid)
        samples: list[int] = []
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                try:
                    samples.append(vhttp.rss_kib(relay.pid)["VmRSS"])
                except (OSError, KeyError):
                    return
                stop.wait(0.05)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        results, wall_s = asyncio.run(many(spec.pulls))
        stop.set()
        sampler.join()
        rss_after = vhttp.rss_kib(relay.pid)
        metrics = {k: v for k, v in _metric_lines(url, "shardcast_").items()
                   if "bytes_served" in k or "requests_total" in k or "refused" in k or "slow_readers" in k}
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    ok = [r for r in results if isinstance(r, dict)]
    failed = [repr(r) for r in results if not isinstance(r, dict)]
    secs = sorted(r["seconds"] for r in ok)
    total = ckpt_bytes * len(ok)
    return {
        "checkpoint": {"model": model, "bytes": ckpt_bytes, "files": len(want), "shards": shards,
                       "shard_mib": spec.shard_mib},
        "pulls": spec.pulls, "completed": len(ok), "verified_same": sum(r["verified_same"] for r in ok),
        "failed": failed[:10], "hash_failures": sum(r["hash_failures"] for r in ok),
        "client_concurrency": spec.concurrency,
        "wall_s": wall_s, "throughput_mib_s": total / wall_s / (1 << 20),
        "pull_s": {"min": secs[0] if secs else None, "median": secs[len(secs) // 2] if secs else None,
                   "max": secs[-1] if secs else None},
        "anchor_one_pull_s": alone_s, "anchor_throughput_mib_s": ckpt_bytes / alone_s / (1 << 20),
        "throughput_over_one_pull": (total / wall_s) / (ckpt_bytes / alone_s),
        "relay_rss_before_mib": rss_before["VmRSS"] / 1024, "relay_rss_after_mib": rss_after["VmRSS"] / 1024,
        "relay_rss_peak_sampled_mib": max(samples + [rss_after["VmRSS"]]) / 1024,
        "relay_vmhwm_mib": rss_after["VmHWM"] / 1024, "relay_rss_samples": len(samples),
        "relay_metrics": metrics,
    }


# -- report ------------------------------------------------------------------------------------------


def report(res: dict[str, Any]) -> None:
    v, r, f = res.get("validator"), res.get("relay"), res.get("flood")
    if f:
        print(f"\nflood: {f['keys']} keys sending cheap failures for {f['duration_s']:.0f} s per configuration")
        for name in ("defaults", "unheld"):
            x = f.get(name)
            if not x:
                continue
            g1, g2 = x["growth_first_half"], x["growth_second_half"]
            print(f"  {name:<9} {x['requests']} requests ({x['per_s']:.0f}/s) {x['statuses']}; rows {x['rows']}; "
                  f"ledger {x['ledger_mib_before']:.2f} -> {x['ledger_mib_after']:.2f} MiB; RSS {x['rss_mib_before']:.0f} "
                  f"MiB before, peak {x['rss_mib_peak']:.0f}")
            print(f"  {'':<9} growth 1st half: {g1['rows']:.0f} rows, {g1['ledger_mib']:+.2f} MiB ledger, "
                  f"{g1['rss_mib']:+.1f} MiB RSS; 2nd half: {g2['rows']:.0f} rows, {g2['ledger_mib']:+.2f} MiB ledger, "
                  f"{g2['rss_mib']:+.1f} MiB RSS; refusals {x['refusals']}")
    if v:
        print(f"\nvalidator: {v['requests_sent']} requests from {v['senders']} senders "
              f"({v['greedy_senders']} greedy on {v['greedy_conns']} connections) in {v['traffic_s']:.1f} s")
        print(f"{'kind':<18}{'planned':>8}  answers")
        for kind, n in v["mix"].items():
            print(f"{kind:<18}{n:>8}  {v['statuses'].get(kind, {})}")
        print(f"answers in by (s): {v['answered_by_s']} (50/90/99% of them); latency median/max by kind: "
              + ", ".join(f"{k} {x['median']}/{x['max']}" for k, x in v["latency_s"].items()))
        print(f"rate: {v['per_s']:.0f} requests/s; one sender alone {v['anchor_single_sender']['per_s']:.0f}/s "
              f"(ratio {v['per_s_over_single_sender']:.2f})")
        h = v["honest"]
        print(f"honest: {h['honest_submitted']} submitted, {h['decided']} decided {h['outcomes']}, lost {h['lost']}; "
              f"ledger rows {h['ledger_rows_total']} ({h['ledger_rows_not_honest']} not honest)")
        rl = v["rate_limit"]
        print(f"rate limit {rl['rate_per_node']}/s burst {rl['burst']}: held={rl['held']} "
              f"(worst sender at {rl['worst_passed_over_allowed']:.2f} of its allowance), {rl['refused_429']} x 429")
        print(f"RSS: {v['rss_before_mib']:.0f} MiB before, peak {v['rss_peak_sampled_mib']:.0f}, "
              f"after {v['rss_after_mib']:.0f} (growth after the first 10%: "
              f"{v['rss_growth_after_first_10pct_mib']:+.1f} MiB; median of the first quarter "
              f"{v['rss_median_first_quarter_mib']:.0f}, of the last {v['rss_median_last_quarter_mib']:.0f})")
        print(f"unexpected answers: {v['unexpected_answers']}")
    if res.get("hostile"):
        report_hostile(res["hostile"])
    if r:
        print(f"\nrelay: {r['completed']}/{r['pulls']} pulls of {r['checkpoint']['bytes'] / (1 << 20):.1f} MiB "
              f"({r['checkpoint']['shards']} shards) complete, {r['verified_same']} byte-identical, in {r['wall_s']:.1f} s")
        print(f"throughput {r['throughput_mib_s']:.0f} MiB/s; one pull alone {r['anchor_throughput_mib_s']:.0f} MiB/s "
              f"(ratio {r['throughput_over_one_pull']:.2f}); pull s min/median/max "
              f"{r['pull_s']['min']:.2f}/{r['pull_s']['median']:.2f}/{r['pull_s']['max']:.2f}")
        print(f"relay RSS: {r['relay_rss_before_mib']:.0f} MiB before, peak {r['relay_rss_peak_sampled_mib']:.0f}, "
              f"after {r['relay_rss_after_mib']:.0f}")


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser(__doc__, smoke="every part at the smallest size: 4 senders, 120 requests, 4 honest, 6 pulls "
                        "of a 1-layer checkpoint, 2 flooding keys for 3 s (checks the bench)",
                        quick="2,000 requests, 100 honest, 20 pulls of a smaller checkpoint")
    ap.add_argument("--senders", type=int, default=100)
    ap.add_argument("--requests", type=int, help="total requests (default 10,000; quick 2,000)")
    ap.add_argument("--honest", type=int, help="honest submissions (default 300; quick 100); at least --senders")
    ap.add_argument("--pulls", type=int, help="concurrent pulls (default 100; quick 20)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (validator and honest generation)")
    ap.add_argument("--only", choices=["validator", "relay", "flood", "hostile"],
                    help="run one part (hostile runs only when named, or in --smoke: `bench/hostile.py`)")
    ap.add_argument("--hostile-s", type=float, help="attack time of the hostile part (default 600; quick 60)")
    ap.add_argument("--flood-s", type=float, help="flood time per configuration (default 60; quick 20)")
    args = ap.parse_args(argv)
    vspec = ValidatorLoad(senders=args.senders, threads=args.threads,
                          requests=args.requests or (2_000 if args.quick else 10_000),
                          honest=args.honest or (100 if args.quick else 300))
    rspec = RelayLoad(pulls=args.pulls or (20 if args.quick else 100))
    fspec = FloodLoad(threads=args.threads, duration_s=args.flood_s or (20.0 if args.quick else 60.0))
    if args.quick:
        fspec.slash_after_s, fspec.node_bytes_per_window, fspec.max_backlog = 5.0, 256 << 10, 2_000
    if args.quick:
        rspec.ckpt_hidden, rspec.ckpt_layers, rspec.shard_mib = 256, 2, 4
    if args.smoke:  # the sizes of tests/integration/test_load_bench.py (the flood shorter)
        vspec = ValidatorLoad(senders=4, requests=120, honest=4, rate=0.5, burst=2, greedy_senders=1, greedy_conns=4,
                              greedy_share=0.25, anchor_requests=20, decide_timeout_s=60, traffic_timeout_s=60,
                              threads=args.threads)
        rspec = RelayLoad(pulls=6, ckpt_vocab=512, ckpt_hidden=64, ckpt_layers=1, shard_mib=1, timeout_s=60)
        fspec = FloodLoad(keys=2, duration_s=args.flood_s or 3.0, slash_after_s=1.0, node_bytes_per_window=48 << 10,
                          max_backlog=2000, threads=args.threads)
    hspec = HostileLoad(threads=args.threads, duration_s=args.hostile_s or (60.0 if args.quick else 600.0))
    if args.quick:
        hspec.attack = 60  # and as many in the baseline
    if args.smoke:
        hspec = HostileLoad(honest_nodes=2, warmup=0, baseline=2, attack=2, duration_s=args.hostile_s or 3.0,
                            slow_uploads=8,
                            audits=10, appeals=4, staked=2, threads=args.threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    res: dict[str, Any] = {"info": harness.machine(args.threads), "quick": args.quick, "smoke": args.smoke,
                           "command": harness.command("load", argv)}
    with tempfile.TemporaryDirectory(prefix="load-") as tmp:
        if args.only in (None, "validator"):
            res["validator"] = validator_load(vspec, Path(tmp) / "v")
        if args.only in (None, "relay"):
            res["relay"] = relay_load(rspec, Path(tmp) / "r")
        if args.only in (None, "flood"):
            res["flood"] = flood_load(fspec, Path(tmp) / "f")
        if args.only == "hostile" or (args.only is None and args.smoke):
            res["hostile"] = hostile_load(hspec, Path(tmp) / "h")
    res["info"]["load_average_end"] = list(os.getloadavg())
    report(res)
    harness.write_json(args.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
