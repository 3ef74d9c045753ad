"""The validator as a process, for `bench.validator`: served by uvicorn, posted to over HTTP, flooded with junk.

`python -m bench.validator_http --serve CONFIG.json --port-file PATH [--loops]` builds the `Service`
from a `ValidatorConfig` (key from the environment variable `BENCH_VALIDATOR_KEY`), serves it on a
free loopback port and writes the port; with `--loops` every background loop runs, as in
`prime-validator`. SIGTERM stops it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench import harness

VALIDATOR = 1  # PUBLIC anvil dev account of the validator role, as in the tests
KEY_ENV = "BENCH_VALIDATOR_KEY"
MIB = 1 << 20


def rss_kib(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            out[line.split(":")[0]] = int(line.split()[1])
    return out


# -- the validator as a process -------------------------------------------------------------------


def serve_main(config: Path, port_file: Path, loops: bool) -> int:
    """Build the Service from a config JSON, serve it on a free port, write the port (see the docstring)."""
    import logging

    import uvicorn

    from validator.app import build_app
    from validator.config import ValidatorConfig
    from validator.server import settle_heap, uvicorn_config
    from validator.service import Service

    logging.basicConfig(level=logging.WARNING)
    cfg = ValidatorConfig.model_validate_json(config.read_text())
    import torch

    torch.set_num_threads(cfg.threads)
    service = Service(cfg)
    if loops:
        service.start()
    server = uvicorn.Server(uvicorn_config(build_app(service), cfg.gate, host="127.0.0.1", port=0,
                                           stats=service.core.stats))
    settle_heap()  # as prime-validator does
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            return 1
        time.sleep(0.02)
    port_file.write_text(str(server.servers[0].sockets[0].getsockname()[1]))
    stop.wait()
    server.should_exit = True
    thread.join(timeout=30)
    service.stop()
    return 0


class Served:
    """`serve_main` in a subprocess (the validator's own process, so its RSS is its own)."""

    def __init__(self, cfg: Any, threads: int, loops: bool, tmp: Path) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        (tmp / "config.json").write_text(cfg.model_dump_json())
        port_file = tmp / "port"
        from contracts.devchain import dev_key

        env = {**os.environ, KEY_ENV: "0x" + dev_key(VALIDATOR).hex(), "OMP_NUM_THREADS": str(threads)}
        cmd = [sys.executable, "-m", "bench.validator_http", "--serve", str(tmp.resolve() / "config.json"),
               "--port-file", str(port_file.resolve())] + (["--loops"] if loops else [])
        self.proc = subprocess.Popen(cmd, env=env, cwd=harness.ROOT)
        deadline = time.monotonic() + 120
        while not port_file.exists() or not port_file.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                self.proc.wait()
                raise RuntimeError("the validator process did not start")
            time.sleep(0.05)
        self.port = int(port_file.read_text())
        self.url = f"http://127.0.0.1:{self.port}"
        self.ledger = cfg.state_dir / "ledger.sqlite"

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def post_all(url: str, items: list[Any], send: Callable[[Any, Any], int | str],
             connections: int) -> tuple[float, Counter]:
    """POST every item over `connections` keep-alive clients; returns (seconds, status counts), where a
    transport error counts as `error:<ExceptionName>`."""
    import httpx

    local = threading.local()
    clients: list[Any] = []

    def one(item: Any) -> int | str:
        if not hasattr(local, "c"):
            local.c = httpx.Client(base_url=url, timeout=60.0)
            clients.append(local.c)
        try:
            return send(local.c, item)
        except httpx.HTTPError as exc:
            return f"error:{type(exc).__name__}"

    t0 = time.perf_counter()
    with ThreadPoolExecutor(connections) as pool:
        statuses = list(pool.map(one, items))
    dt = time.perf_counter() - t0
    for c in clients:
        c.close()
    return dt, Counter(statuses)


def http_intake(cfg: Any, datas: list[bytes], threads: int, connections: int, tmp: Path) -> dict[str, Any]:
    served = Served(cfg, threads, loops=False, tmp=tmp)

    def post(c: Any, d: bytes) -> int:
        return int(c.post("/v1/submissions", content=d).status_code)

    try:  # warm-up: first-use imports and caches of the intake path (one honest submission, some junk)
        warm, timed = datas[:1], datas[1:]
        post_all(served.url, warm + [b"{", b"[1]"] * 4, post, connections)
        dt, statuses = post_all(served.url, timed, post, connections)
    finally:
        served.stop()
    if statuses != Counter({202: len(timed)}):
        raise RuntimeError(f"honest submissions over HTTP: {dict(statuses)}")
    return {"submissions": len(timed), "connections": connections, "seconds": dt, "per_s": len(timed) / dt}


# -- the junk flood ---------------------------------------------------------------------------------


def junk_items(n: int, datas: list[bytes], domain: str, max_bytes: int) -> list[tuple[str, Any]]:
    """A shuffled mix of junk: (kind, payload)."""
    from protocol.envelope import Envelope, seal
    from protocol.identity import Identity
    from protocol.nonce import random_nonce
    from protocol.rollout import Submission

    rng = random.Random(0)
    good = json.loads(datas[0])
    spaced = json.dumps(good).encode()  # valid JSON, not the canonical encoding
    malformed = [b"", b"{", b"[1,2]", b'{"kind":"submission"}', b"[" * 100_000, b'{"a":' * 5_000, spaced,
                 b"\xff\xfe\x00garbage", b"null", b'{"kind":"submission","version":1,"domain":"x","signer":"0x0"}']
    weights = {"malformed": 0.35, "forged_signature": 0.25, "unknown_node": 0.25, "oversize_declared": 0.13,
               "oversize_chunked": 0.02}
    kinds = [k for k, w in weights.items() for _ in range(round(w * n))][:n]
    kinds += ["malformed"] * (n - len(kinds))
    rng.shuffle(kinds)
    body = Envelope.model_validate_json(datas[0]).body
    items: list[tuple[str, Any]] = []
    for i, kind in enumerate(kinds):
        if kind == "malformed":
            items.append((kind, malformed[i % len(malformed)]))
        elif kind == "forged_signature":  # a real submission with one bit of the signature's r flipped
            env = json.loads(datas[i % len(datas)])
            sig = bytearray(bytes.fromhex(env["signature"][2:]))
            sig[i % 32] ^= 1 << (i // 32 % 8)
            env["signature"] = "0x" + sig.hex()
            items.append((kind, Envelope.model_validate(env).to_bytes()))
        elif kind == "unknown_node":  # full-size, correctly signed, by a key no operator registered
            stranger = Identity.create()
            sub = Submission.model_validate({**body, "node": stranger.address})
            items.append((kind, seal(stranger, sub, domain=domain, nonce=random_nonce()).to_bytes()))
        elif kind == "oversize_declared":
            items.append((kind, max_bytes * 2))
        else:
            items.append((kind, max_bytes + MIB))
    return items


def send_junk(url: str) -> Callable[[Any, tuple[str, Any]], int]:
    host, port = url.rsplit("/", 1)[-1].split(":")

    def send(client: Any, item: tuple[str, Any]) -> int:
        kind, payload = item
        if kind == "oversize_declared":  # a lying Content-Length, a few bytes sent: refused from the header
            with socket.create_connection((host, int(port)), timeout=30) as s:
                s.sendall(f"POST /v1/submissions HTTP/1.1\r\nHost: {host}\r\nContent-Length: {payload}\r\n"
                          f"Content-Type: application/octet-stream\r\n\r\n".encode() + b"x" * 4096)
                head = s.recv(64)
            return int(head.split()[1])
        if kind == "oversize_chunked":  # real bytes, no length: the server reads up to its limit
            def chunks(total: int = payload) -> Iterator[bytes]:
                block = b"x" * (256 << 10)
                for _ in range(-(-total // len(block))):
                    yield block
            return int(client.post("/v1/submissions", content=chunks()).status_code)
        return int(client.post("/v1/submissions", content=payload).status_code)

    return send


def junk_flood(cfg: Any, datas: list[bytes], n: int, threads: int, connections: int, tmp: Path) -> dict[str, Any]:
    from contracts.deployment import Deployment
    from protocol.rollout import submission_domain

    deployment = Deployment.load(cfg.chain.deployment)
    domain = submission_domain(deployment.chain_id, deployment.pool, cfg.run.run_id)
    t0 = time.perf_counter()
    items = junk_items(n, datas, domain, cfg.max_submission_bytes)
    build_s = time.perf_counter() - t0
    warm = junk_items(min(200, n), datas, domain, cfg.max_submission_bytes)
    served = Served(cfg, threads, loops=True, tmp=tmp)
    send = send_junk(served.url)
    samples: list[tuple[float, int]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append((time.perf_counter(), rss_kib(served.proc.pid)["VmRSS"]))
            stop.wait(0.02)

    try:
        post_all(served.url, warm, send, connections)  # lazy imports and first-use caches
        time.sleep(0.5)
        before = rss_kib(served.proc.pid)
        db_before = sum(p.stat().st_size for p in served.ledger.parent.glob("ledger.sqlite*"))
        sampler = threading.Thread(target=sample, daemon=True)
        t_start = time.perf_counter()
        sampler.start()
        results: dict[str, Counter] = defaultdict(Counter)
        lock = threading.Lock()

        def tagged(client: Any, item: tuple[str, Any]) -> int | str:
            try:
                status: int | str = send(client, item)
            except Exception as exc:  # noqa: BLE001 - a refused connection is a result here, counted by kind
                status = f"error:{type(exc).__name__}"
            with lock:
                results[item[0]][status] += 1
            return status

        dt, _ = post_all(served.url, items, tagged, connections)
        stop.set()
        sampler.join()
        time.sleep(0.5)
        after = rss_kib(served.proc.pid)
        db_after = sum(p.stat().st_size for p in served.ledger.parent.glob("ledger.sqlite*"))
    finally:
        stop.set()
        served.stop()
    import sqlite3

    with sqlite3.connect(f"file:{served.ledger}?mode=ro", uri=True) as db:
        refusal_rows, refusals = db.execute("SELECT COUNT(*), COALESCE(SUM(count), 0) FROM refusals").fetchone()
        submission_rows = db.execute("SELECT COUNT(*) FROM submissions").fetchone()[0]
    rss = [kib for _, kib in samples]
    tenth = [kib for t, kib in samples if t - t_start >= dt * 0.1]
    base10 = tenth[0] if tenth else before["VmRSS"]
    peak = max(rss + [after["VmRSS"]])
    growth_after_10pct = (after["VmRSS"] - base10) / 1024
    return {
        "requests": n, "connections": connections, "seconds": dt, "per_s": n / dt, "build_s": build_s,
        "mix": {k: sum(results[k].values()) for k in results},
        "statuses": {k: {str(s): c for s, c in sorted(v.items(), key=str)} for k, v in sorted(results.items())},
        "rss_before_mib": before["VmRSS"] / 1024, "rss_after_mib": after["VmRSS"] / 1024,
        "rss_peak_sampled_mib": peak / 1024, "vmhwm_before_mib": before["VmHWM"] / 1024,
        "vmhwm_after_mib": after["VmHWM"] / 1024, "rss_samples": len(rss),
        "rss_growth_mib": (after["VmRSS"] - before["VmRSS"]) / 1024,
        "rss_growth_after_first_10pct_mib": growth_after_10pct,
        "peak_over_before_mib": (peak - before["VmRSS"]) / 1024,
        "ledger_bytes_before": db_before, "ledger_bytes_after": db_after, "ledger_refusal_rows": refusal_rows,
        "ledger_refusals_counted": refusals, "ledger_submission_rows": submission_rows,
        "rss_timeline_s_mib": [(round(t - t_start, 2), round(kib / 1024, 1))
                               for t, kib in samples[:: max(1, len(samples) // 100)]],
        "flat_rule": "RSS after the flood within 8 MiB of the RSS 10% into it, and peak within 64 MiB of before",
        "flat": growth_after_10pct <= 8 and (peak - before["VmRSS"]) / 1024 <= 64,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--serve", type=Path, required=True, help="ValidatorConfig as JSON")
    ap.add_argument("--port-file", type=Path, required=True, help="the chosen port is written here")
    ap.add_argument("--loops", action="store_true", help="start the service's background loops")
    args = ap.parse_args()
    return serve_main(args.serve, args.port_file, args.loops)


if __name__ == "__main__":
    sys.exit(main())
