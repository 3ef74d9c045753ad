"""SHARDCAST broadcast benchmark: origin -> 2 relays -> 8 clients on loopback.

Measures seconds from "publish" until every client holds a verified copy of a synthetic checkpoint,
for four systems, each run as separate processes on 127.0.0.1:

    ours         prime-relay: origin (publish = shard + hash + sign) -> 2 relays -> 8 clients
                 (clients pull from both relays; pipelined, verified per shard)
    reference    shardcast 0.3.2 from PyPI, in its own venv (bench/.venvs/shardcast-ref): origin ->
                 2 middle nodes -> 8 client nodes (clients use both middles; wget; whole-file blake3).
                 Its middle nodes poll every `--ref-check-interval` s (default 30, its own default;
                 pass 1 to see its transfer path without the polling delay).
    plain_http   one aiohttp static-file server serving the whole file to all 8 clients (no hashing)
    raw_copy     8 loopback TCP streams, sendfile -> recv_into + write, no protocol, no hashing

Every client writes its copy to disk. Client processes start (and import) before the clock starts and
wait for the version (long-poll / polling), so start-up cost is not measured, neither in seconds nor
in the CPU seconds reported (`cpu_s`: user + system of a system's processes after the clock started).
Just before each clock starts, all available memory but 2 GiB is written once and freed (see
`warm_memory`; `--cold` skips it): on a VM that hands freed memory back to its host, as this one
does, the first write to a page costs ten times a later one, and without the warm-up each system's
time depends on which system ran before it. `--rounds N` runs every system N times in rotated order
and reports medians. Prints a table and ratios; `--json PATH` writes them (keys ours_s, reference_s,
plain_http_s, raw_copy_s, ratios, rounds, cpu_s).

    python -m bench.shardcast --quick                  # 256 MiB (8 MiB shards), a few minutes
    python -m bench.shardcast --size-mib 1024 --rounds 3 --json bench/measured/shardcast.json
    python -m bench.shardcast --smoke --json out.json  # 8 MiB, 2 clients, no memory warm-up (seconds)

`--delta` measures sparse delta versions instead (`run_delta`): a bf16 checkpoint of `--size-mib` in which
`--delta-fraction` of the weights change between v1 and v2, published once whole and once as a delta (origin
-> relays -> clients that hold v1, in one process), and reports `delta_bytes_over_full` and
`full_time_over_delta_time` (from publish until every client holds v2, verified).

    python -m bench.shardcast --delta --smoke --json out.json

On loopback bytes cost almost nothing, so each client's work (applying the delta, hashing the full weights)
decides the time. `--link-mbit N` runs the bench again inside a network namespace of its own (`unshare -n`, as
root) whose loopback is shaped to N Mbit/s (`tc ... tbf`): every transfer of the tree (origin to relays, relays
to clients) then shares one link of N Mbit/s, a stricter bottleneck than a real tree of links, where each edge has
its own. The host's own network is not touched.

    sudo python -m bench.shardcast --delta --link-mbit 1000 --json out.json

`--delta --train-lrs 2e-5,...` measures real RL checkpoints instead of synthetic ones (`run_trained_delta`): for
each learning rate the trainer runs local-mode GRPO (SmolLM2-135M on reverse-text, `configs/trainer/
reverse-text-smollm2.toml` with warm-up off, `--train-steps` steps, a checkpoint every step); every step's weights go
through the trainer's own publisher (`ShardcastPublisher`, bf16, each version a delta against the one before, an
anchor only where a delta is not smaller), which reports the changed fraction and the bytes of every version; then
the last two versions of the first learning rate go through origin -> relays -> clients as full and as delta.

    python -m bench.shardcast --delta --train-lrs 2e-6,2e-5,6e-5 --json bench/measured/shardcast_delta_smollm2.json

`--smoke` runs every system once at the smallest size so a default-tier test keeps the bench from rotting;
it runs the reference (the anchor) only if its venv bench/.venvs/shardcast-ref already exists, says so
when it skips it, and exits 1 if a system that ran failed.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import venv
from pathlib import Path

from bench import harness
from bench.harness import ROOT
from devnet.network import free_port

REF_VERSION = "0.3.2"
REF_VENV = ROOT / "bench" / ".venvs" / "shardcast-ref"
CLIENTS = 8
RELAYS = 2
MiB = 1 << 20


# ---------------------------------------------------------------------------------------------------
# process plumbing


class Proc:
    """A role in a subprocess, talking line by line over stdin/stdout."""

    def __init__(self, argv: list[str], *, env: dict[str, str] | None = None, cwd: Path | None = None) -> None:
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env={**os.environ, **(env or {})}, cwd=cwd)
        self.lines: list[str] = []
        self.err: list[str] = []
        self._cv = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._read_err, daemon=True).start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            with self._cv:
                self.lines.append(line.strip())
                self._cv.notify_all()
        with self._cv:
            self._cv.notify_all()

    def _read_err(self) -> None:
        assert self.p.stderr is not None
        for line in self.p.stderr:
            self.err.append(line.rstrip())
            del self.err[:-40]

    def wait_line(self, prefix: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                for line in self.lines:
                    if line.startswith(prefix):
                        return line
                if self.p.poll() is not None and not any(x.startswith(prefix) for x in self.lines):
                    raise RuntimeError(f"{self.p.args!r} exited {self.p.returncode}: " + "\n".join(self.err[-15:]))
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no {prefix!r} from {self.p.args[:4]!r}; stderr: " + "\n".join(self.err[-10:]))
                self._cv.wait(min(left, 0.5))

    def send(self, text: str) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(text + "\n")
        self.p.stdin.flush()

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(5)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()


def cpu_seconds(pid: int, kind: str = "all") -> float:
    """user + system (or `kind` "user" only) CPU seconds of a live process (Linux /proc; 0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    ticks = int(fields[11]) + (int(fields[12]) if kind == "all" else 0)
    return ticks / os.sysconf("SC_CLK_TCK")


STARTUP_CPU: dict[str, float] = {}  # per system: CPU s its processes had used when the clock started


def ready_to_start(name: str, procs: list[Proc]) -> None:
    """Just before a system's clock starts: warm the memory (`warm_memory`), then record the CPU its
    processes spent starting (imports, connecting), to subtract from what the run used."""
    warm_memory()
    STARTUP_CPU[name] = sum(cpu_seconds(p.p.pid) for p in procs)


def wait_http(url: str, timeout: float = 30) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=2).read()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


WARM = True  # --cold turns the warm-up off


def available_memory() -> int:
    """MemAvailable in bytes (Linux); 0 where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def warm_memory() -> None:
    """Write all available memory but 2 GiB, then free it, just before a system's clock starts.

    On a VM with free-page reporting (this one has virtio-balloon with it on), memory the guest frees
    is handed back to the host, and the first write to such a page afterwards costs about ten times a
    normal one: 2.4-2.9 s of system time per GiB written into the page cache here, against 0.25 s
    when warm (measured with 1 GiB file writes). Every byte a client stores is such a write, so left
    alone a system's time depends on how much memory the system before it freed and how long ago:
    raw copy took 3.6 s right after another system and 12.7 s after a pause. The host takes freed
    pages back at ~150 MiB/s, also during a run, so warming only what a system will write still left
    ours (11 GiB written over ~12 s) paying for cold pages (44 % of all CPU samples in the page-cache
    copy, against 12 % after warming everything). Warming all available memory gives every system the
    same start, the state of a bare-metal or long-running machine. `--cold` skips it.
    """
    if not WARM:
        return
    nbytes = max(0, available_memory() - (2 << 30))
    if nbytes <= 0:
        return
    import mmap

    started = time.monotonic()
    block = bytes(64 * MiB)
    with mmap.mmap(-1, nbytes) as area:
        for offset in range(0, nbytes, len(block)):
            end = min(nbytes, offset + len(block))
            area[offset:end] = block[: end - offset]
    print(f"  warmed {nbytes / (1 << 30):.1f} GiB of memory in {time.monotonic() - started:.1f} s", flush=True)


def me(*role: str) -> list[str]:
    return [sys.executable, "-m", "bench.shardcast", "_role", *role]


def role(*args: str, env: dict[str, str] | None = None) -> Proc:
    """One of this program's own roles (`me`) in a subprocess that finds `bench` and our packages from any cwd."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return Proc(me(*args), env={"PYTHONPATH": path, **(env or {})})


def finish(procs: list[Proc], t0: float, timeout: float) -> float:
    """Seconds from t0 until the last client printed DONE."""
    ends = [float(p.wait_line("DONE", timeout).split()[1]) for p in procs]
    print("  clients done at " + " ".join(f"{e - t0:.2f}" for e in sorted(ends)), flush=True)
    for p in procs:
        extra = p.wait_line("DONE", 1).split(maxsplit=2)
        if len(extra) > 2:
            info = json.loads(extra[2])
            print(f"    seen {info['seen'] - t0:.2f} sources {info['sources']}", flush=True)
    return max(ends) - t0


# ---------------------------------------------------------------------------------------------------
# role bodies (run inside subprocesses)


def role_ours_origin(store: str, source: str, shard_mib: str) -> None:
    import asyncio
    import gc

    from protocol.identity import Identity
    from shardcast import Origin

    gc.collect()
    gc.freeze()  # as `prime-relay origin` does

    async def main() -> None:
        identity = Identity.from_key(os.environ["BENCH_TRAINER_KEY"])
        async with Origin(store, run_id="bench", identity=identity, shard_size=int(shard_mib) * MiB,
                          port=int(os.environ["BENCH_PORT"])) as origin:
            print("READY", flush=True)
            await asyncio.to_thread(sys.stdin.readline)
            t0 = time.time()
            version = origin.publish(source)
            print(f"T0 {t0}", flush=True)
            await origin.wait_published(version)
            print(f"PUBLISHED {time.time()}", flush=True)
            await asyncio.to_thread(sys.stdin.readline)
    asyncio.run(main())


def role_ours_client(out: str, trainer: str, *sources: str) -> None:
    import asyncio
    import gc

    from shardcast import Client

    gc.collect()
    gc.freeze()  # as `prime-relay pull` does (shardcast.cli._freeze_heap)

    async def main() -> None:
        client = Client(list(sources), trainer=trainer, out_dir=out, progress=False, concurrency=4)
        print("READY", flush=True)
        version = None
        while version is None:
            version = await client.wait_for_version(after=0, timeout=30)
        seen = time.time()
        result = await client.pull(version)
        print(f"DONE {time.time()} {json.dumps({'seen': seen, 'sources': result.sources})}", flush=True)
    asyncio.run(main())


def role_plain_server(path: str, port: str) -> None:
    from aiohttp import web

    async def handler(request: web.Request) -> web.FileResponse:
        return web.FileResponse(path, chunk_size=4 * MiB)
    app = web.Application()
    app.router.add_get("/file", handler)
    web.run_app(app, host="127.0.0.1", port=int(port), print=lambda *_: print("READY", flush=True), access_log=None)


def role_plain_client(url: str, out: str) -> None:
    import asyncio

    import aiohttp

    async def main() -> None:
        async with aiohttp.ClientSession(read_bufsize=4 * MiB) as session:
            print("READY", flush=True)
            await asyncio.to_thread(sys.stdin.readline)
            with open(out, "wb") as f:
                async with session.get(url) as response:
                    async for chunk in response.content.iter_any():
                        f.write(chunk)
        print(f"DONE {time.time()}", flush=True)
    asyncio.run(main())


def role_raw_sender(path: str, port: str, streams: str) -> None:
    server = socket.create_server(("127.0.0.1", int(port)), backlog=64)
    print("READY", flush=True)

    def push(conn: socket.socket) -> None:
        with conn, open(path, "rb") as f:
            conn.sendfile(f)

    threads = []
    for _ in range(int(streams)):
        conn, _ = server.accept()
        t = threading.Thread(target=push, args=(conn,))
        t.start()
        threads.append(t)
    for t in threads:
        t.join()


def role_raw_receiver(port: str, out: str) -> None:
    print("READY", flush=True)
    sys.stdin.readline()
    buf = bytearray(4 * MiB)
    view = memoryview(buf)
    with socket.create_connection(("127.0.0.1", int(port))) as s, open(out, "wb") as f:
        while n := s.recv_into(buf):
            f.write(view[:n])
    print(f"DONE {time.time()}", flush=True)


ROLES = {
    "ours-origin": role_ours_origin, "ours-client": role_ours_client, "plain-server": role_plain_server,
    "plain-client": role_plain_client, "raw-sender": role_raw_sender, "raw-receiver": role_raw_receiver,
}

# The reference roles run under the reference venv's python (its `shardcast` package).
REF_ORIGIN = r"""
import sys, time, os
import shardcast.server as srv
_orig = srv.ShardcastServer.__init__
def _loopback(self, addr, *a, **k):  # the reference binds 0.0.0.0; keep the benchmark on loopback
    _orig(self, ("127.0.0.1", addr[1]), *a, **k)
srv.ShardcastServer.__init__ = _loopback
from shardcast import OriginServer
data, port, source, shard = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
origin = OriginServer(data, port)
open(os.path.join(data, "data1.bin"), "wb").write(b"probe")  # the hand-made probe its clients need
print("READY", flush=True)
sys.stdin.readline()
t0 = time.time()
print(f"T0 {t0}", flush=True)
origin.broadcast(source, shard)
print(f"PUBLISHED {time.time()}", flush=True)
sys.stdin.readline()
"""

REF_MIDDLE = r"""
import sys, os, time
import shardcast.server as srv
_orig = srv.ShardcastServer.__init__
def _loopback(self, addr, *a, **k):
    _orig(self, ("127.0.0.1", addr[1]), *a, **k)
srv.ShardcastServer.__init__ = _loopback
from shardcast import MiddleNode
upstream, data, port, interval = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
os.makedirs(data, exist_ok=True)
open(os.path.join(data, "data1.bin"), "wb").write(b"probe")
node = MiddleNode([upstream], data, port, check_interval=interval)
print("READY", flush=True)
sys.stdin.readline()
"""

REF_CLIENT = r"""
import sys, time, os
import shardcast.client as sc_client
from shardcast import ClientNode
# Same-host artefact: every reference client writes the version list to ONE shared path inside
# site-packages; 8 clients on one machine would clobber each other's copy. Give each its own file.
def _dist(self):
    path = os.path.join(os.path.dirname(out), "temp_distribution.txt")
    if self.download_file("distribution.txt", path, update_metrics=False, log_error_on_failure=False):
        with open(path) as f:
            content = f.read()
        os.unlink(path)
        return content
    return None
sc_client.ShardDownloader.download_distribution_file = _dist
# Reference bug: download_version() lists versions twice; when the second listing fails (a busy
# single-threaded middle), it falls into "discovery mode" and retries non-existent shards forever.
# Reuse the last good listing so the reference can finish at all.
_list = ClientNode.list_available_versions
_last = {}
def _cached(self):
    got = _list(self)
    if got:
        _last.clear(); _last.update(got)
    return got or dict(_last)
ClientNode.list_available_versions = _cached
out, servers = sys.argv[1], sys.argv[2].split(",")
client = ClientNode(servers, os.path.dirname(out))
print("READY", flush=True)
while True:
    if "v1" in client.list_available_versions():
        if client.download_version("v1", out):
            break
    time.sleep(0.2)
print(f"DONE {time.time()}", flush=True)
"""


# ---------------------------------------------------------------------------------------------------
# the four systems


def run_ours(work: Path, source: Path, shard_mib: int, timeout: float) -> float:
    from protocol.identity import Identity

    trainer = Identity.create()  # a throwaway key made for this run only
    key = "0x" + bytes(trainer.account.key).hex()
    procs: list[Proc] = []
    try:
        oport = free_port()
        origin = role("ours-origin", str(work / "origin"), str(source), str(shard_mib),
                      env={"BENCH_TRAINER_KEY": key, "BENCH_PORT": str(oport)})
        procs.append(origin)
        origin.wait_line("READY", 60)
        relay_urls = []
        for i in range(RELAYS):
            port = free_port()
            procs.append(Proc([sys.executable, "-m", "shardcast.cli", "--log-level", "INFO", "relay", "--upstream",
                               f"http://127.0.0.1:{oport}", "--trainer", trainer.address, "--store",
                               str(work / f"relay{i}"), "--port", str(port)], cwd=ROOT,
                              env={"PYTHONPATH": str(ROOT)}))
            relay_urls.append(f"http://127.0.0.1:{port}")
        for url in relay_urls:
            wait_http(url + "/health")
        clients = [role("ours-client", str(work / f"client{i}"), trainer.address, *relay_urls) for i in range(CLIENTS)]
        procs += clients
        for c in clients:
            c.wait_line("READY", 60)
        ready_to_start("ours", procs)
        time.sleep(0.5)  # let every long-poll reach its server
        origin.send("go")
        t0 = float(origin.wait_line("T0", 30).split()[1])
        seconds = finish(clients, t0, timeout)
        published = float(origin.wait_line("PUBLISHED", 5).split()[1]) - t0
        print(f"  ours: publish (shard+hash+sign) took {published:.2f} s of it", flush=True)
        for relay in procs[1:1 + RELAYS]:
            print("  relay: " + " | ".join(line[11:23] + line[line.index(": ") + 1:] for line in relay.err
                                          if "complete" in line or "following" in line), flush=True)
        print(f"  t0 at {time.strftime('%H:%M:%S', time.localtime(t0))}.{int(t0 * 1000) % 1000:03d}", flush=True)
        print("  CPU s (start-up included): " + ", ".join(
            f"{name} {cpu_seconds(p.p.pid):.1f} ({cpu_seconds(p.p.pid, 'user'):.1f} user)" for name, p in
            [("origin", origin), *((f"relay{i}", procs[1 + i]) for i in range(RELAYS)),
             *((f"client{i}", c) for i, c in enumerate(clients))]), flush=True)
        for i in range(CLIENTS):
            got = next((work / f"client{i}" / "current").iterdir())
            assert got.stat().st_size == source.stat().st_size
        return seconds
    finally:
        for p in procs:
            p.stop()


def ensure_reference_venv() -> Path:
    py = REF_VENV / "bin" / "python"
    probe = [str(py), "-c", f"import importlib.metadata as m; assert m.version('shardcast') == '{REF_VERSION}'"]
    if py.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return py
    REF_VENV.parent.mkdir(parents=True, exist_ok=True)
    venv.EnvBuilder(with_pip=True, clear=True).create(REF_VENV)
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", f"shardcast=={REF_VERSION}"],
                   check=True)
    return py


def run_reference(work: Path, source: Path, shard_mib: int, timeout: float, interval: int) -> float:
    if shutil.which("wget") is None:
        raise RuntimeError("the reference client shells out to wget, which is not installed (apt-get install wget)")
    py = str(ensure_reference_venv())
    cwd = work  # never the repo: its `shardcast/` would shadow the reference package
    procs: list[Proc] = []
    try:
        oport = free_port()
        origin = Proc([py, "-c", REF_ORIGIN, str(work / "origin"), str(oport), str(source), str(shard_mib * MiB)], cwd=cwd)
        procs.append(origin)
        origin.wait_line("READY", 60)
        wait_http(f"http://127.0.0.1:{oport}/data1.bin")
        middles = []
        for i in range(RELAYS):
            port = free_port()
            middles.append(f"http://127.0.0.1:{port}")
            procs.append(Proc([py, "-c", REF_MIDDLE, f"http://127.0.0.1:{oport}", str(work / f"middle{i}"), str(port),
                               str(interval)], cwd=cwd))
            procs[-1].wait_line("READY", 60)
        for url in middles:
            wait_http(url + "/data1.bin")
        clients = []
        for i in range(CLIENTS):  # one at a time: each probes servers via the same /tmp/dummy.bin
            (work / f"client{i}").mkdir()
            clients.append(Proc([py, "-c", REF_CLIENT, str(work / f"client{i}" / "out.bin"), ",".join(middles)], cwd=cwd))
            procs.append(clients[-1])
            clients[-1].wait_line("READY", 60)
        ready_to_start("reference", procs)
        origin.send("go")
        t0 = float(origin.wait_line("T0", 30).split()[1])
        seconds = finish(clients, t0, timeout)
        for i in range(CLIENTS):
            assert (work / f"client{i}" / "out.bin").stat().st_size == source.stat().st_size
        return seconds
    finally:
        for p in procs:
            p.stop()


def run_plain(work: Path, source: Path, timeout: float) -> float:
    procs: list[Proc] = []
    try:
        port = free_port()
        procs.append(role("plain-server", str(source), str(port)))
        procs[0].wait_line("READY", 60)
        clients = [role("plain-client", f"http://127.0.0.1:{port}/file", str(work / f"plain{i}.bin"))
                   for i in range(CLIENTS)]
        procs += clients
        for c in clients:
            c.wait_line("READY", 60)
        ready_to_start("plain_http", procs)
        t0 = time.time()
        for c in clients:
            c.send("go")
        seconds = finish(clients, t0, timeout)
        for i in range(CLIENTS):
            assert (work / f"plain{i}.bin").stat().st_size == source.stat().st_size
        return seconds
    finally:
        for p in procs:
            p.stop()


def run_raw(work: Path, source: Path, timeout: float) -> float:
    procs: list[Proc] = []
    try:
        port = free_port()
        sender = role("raw-sender", str(source), str(port), str(CLIENTS))
        procs.append(sender)
        sender.wait_line("READY", 60)
        receivers = [role("raw-receiver", str(port), str(work / f"raw{i}.bin")) for i in range(CLIENTS)]
        procs += receivers
        for r in receivers:
            r.wait_line("READY", 60)
        ready_to_start("raw_copy", procs)
        t0 = time.time()
        for r in receivers:
            r.send("go")
        seconds = finish(receivers, t0, timeout)
        for i in range(CLIENTS):
            assert (work / f"raw{i}.bin").stat().st_size == source.stat().st_size
        return seconds
    finally:
        for p in procs:
            p.stop()


# ---------------------------------------------------------------------------------------------------


_ON_LINK = "PRIME_BENCH_LINK_MBIT"
"""Set in the namespace `on_a_shaped_link` runs the bench in (its link's rate)."""


def on_a_shaped_link(mbit: float) -> int:
    """This bench's command again, in a network namespace of its own whose loopback carries at most `mbit` Mbit/s
    (a token bucket of 10 ms worth of bytes, at least 64 KiB); its exit status."""
    if not mbit > 0:
        raise SystemExit(f"--link-mbit must be positive, not {mbit}")
    burst = max(64 * 1024, int(mbit * 1e6 / 8 / 100))
    shape = (f"ip link set lo up && tc qdisc add dev lo root tbf rate {mbit}mbit burst {burst} latency 200ms "
             '&& exec "$0" "$@"')
    cmd = ["unshare", "--net", "sh", "-c", shape, sys.executable, "-m", "bench.shardcast", *sys.argv[1:]]
    try:
        return subprocess.run(cmd, cwd=ROOT, env={**os.environ, _ON_LINK: repr(mbit)}).returncode
    except FileNotFoundError as exc:
        raise SystemExit(f"--link-mbit needs unshare, ip and tc (util-linux, iproute2): {exc}") from exc


def _link() -> float | None:
    """The shaped link's Mbit/s when this process runs on one (`--link-mbit`), else None (loopback, unshaped)."""
    value = os.environ.get(_ON_LINK)
    return float(value) if value else None


def main() -> int:
    global CLIENTS, WARM
    if len(sys.argv) > 2 and sys.argv[1] == "_role":
        ROLES[sys.argv[2]](*sys.argv[3:])
        return 0
    parser = harness.parser(__doc__, smoke="8 MiB, 2 clients, no memory warm-up, the reference only if its venv "
                            "exists (seconds; checks the bench, measures nothing)", quick="a short run (256 MiB)")
    parser.add_argument("--size-mib", type=int, default=None, help="checkpoint size (default 1024; --quick: 256)")
    parser.add_argument("--shard-mib", type=int, default=None,
                        help="shard size for ours and the reference (default: size/32, within 4..32 MiB)")
    parser.add_argument("--systems", default="ours,reference,plain_http,raw_copy", help="comma-separated subset")
    parser.add_argument("--ref-check-interval", type=int, default=30,
                        help="reference middle nodes' poll interval in s (30 = its default; 1 = a generous setting)")
    parser.add_argument("--clients", type=int, default=CLIENTS, help="number of pulling clients (default 8)")
    parser.add_argument("--timeout", type=float, default=None, help="per-system limit in seconds")
    parser.add_argument("--workdir", default=None, help="scratch directory (default: a temp dir, removed)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every system this many times, in rotated order; report medians (default 1)")
    parser.add_argument("--cold", action="store_true",
                        help="skip the memory warm-up before each system (see warm_memory: on a VM with free-page "
                             "reporting each system then pays for whatever memory the one before it gave back)")
    parser.add_argument("--delta", action="store_true", help="measure delta versions against full ones (run_delta)")
    parser.add_argument("--delta-fraction", type=float, default=0.02,
                        help="--delta: share of the weights that change between versions (default 0.02)")
    parser.add_argument("--train-lrs", default=None,
                        help="--delta: measure real RL checkpoints trained at these learning rates (comma-separated; "
                             "run_trained_delta) instead of synthetic weights")
    parser.add_argument("--train-steps", type=int, default=None,
                        help="--train-lrs: trainer steps per learning rate (default 4; --smoke: 3 on the tiny model)")
    parser.add_argument("--link-mbit", type=float, default=None,
                        help="run inside a network namespace whose loopback is shaped to this many Mbit/s (as root)")
    args = parser.parse_args()
    if args.link_mbit is not None and os.environ.get(_ON_LINK) != repr(args.link_mbit):
        return on_a_shaped_link(args.link_mbit)
    if args.smoke:
        args.clients, args.cold, args.rounds = 2, True, 1
    if args.delta and args.train_lrs:
        return run_trained_delta(args)
    if args.delta:
        return run_delta(args)
    CLIENTS = args.clients
    WARM = not args.cold
    size_mib = args.size_mib or (8 if args.smoke else 256 if args.quick else 1024)
    timeout = args.timeout or max(120.0, size_mib * 0.6)
    args.shard_mib = args.shard_mib or (2 if args.smoke else max(4, min(32, size_mib // 32)))
    systems = args.systems.split(",")
    skipped: dict[str, str] = {}
    if args.smoke and "reference" in systems and not (REF_VENV / "bin" / "python").exists():
        systems.remove("reference")
        skipped["reference"] = f"smoke: its venv {REF_VENV.relative_to(ROOT)} does not exist (a full run makes it)"
        print(f"smoke: skipped the anchor (the reference shardcast): {skipped['reference']}; the others run", flush=True)

    scratch = Path(args.workdir or tempfile.mkdtemp(prefix="shardcast-bench-"))
    scratch.mkdir(parents=True, exist_ok=True)
    source = scratch / "checkpoint.bin"
    with open(source, "wb") as f:  # incompressible, written once, reused by every system
        for _ in range(size_mib):
            f.write(os.urandom(MiB))
    load = os.getloadavg()
    print(f"checkpoint {size_mib} MiB, shards {args.shard_mib} MiB, {RELAYS} relays, {CLIENTS} clients, "
          f"{os.cpu_count()} CPUs, load {load[0]:.2f}", flush=True)
    runs: dict[str, list[float]] = {name: [] for name in systems}
    cpu_runs: dict[str, list[float]] = {name: [] for name in systems}  # user+sys s, start-up excluded
    notes: dict[str, str] = {}
    runners = {
        "ours": lambda w: run_ours(w, source, args.shard_mib, timeout),
        "reference": lambda w: run_reference(w, source, args.shard_mib, timeout, args.ref_check_interval),
        "plain_http": lambda w: run_plain(w, source, timeout),
        "raw_copy": lambda w: run_raw(w, source, timeout),
    }
    try:
        for round_ in range(args.rounds):
            order = systems[round_ % len(systems):] + systems[: round_ % len(systems)]
            for name in order:
                work = scratch / f"{name}-{round_}"
                work.mkdir()
                print(f"running {name} (round {round_ + 1}/{args.rounds}) ...", flush=True)
                before = resource.getrusage(resource.RUSAGE_CHILDREN)
                try:
                    seconds = runners[name](work)
                    after = resource.getrusage(resource.RUSAGE_CHILDREN)
                    used = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
                    used = round(used - STARTUP_CPU.pop(name, 0.0), 2)
                    runs[name].append(round(seconds, 3))
                    cpu_runs[name].append(used)
                    print(f"  {name}: {seconds:.2f} s (CPU of its processes after start-up: {used:.1f} s)", flush=True)
                except (RuntimeError, TimeoutError, AssertionError, subprocess.CalledProcessError) as exc:
                    notes[name] = f"{exc.__class__.__name__}: {str(exc)[-800:]}"
                    print(f"  {name}: FAILED: {notes[name]}", flush=True)
                finally:
                    shutil.rmtree(work, ignore_errors=True)
    finally:
        if args.workdir is None:
            shutil.rmtree(scratch, ignore_errors=True)

    results: dict[str, float | None] = {n: (statistics.median(v) if v else None) for n, v in runs.items()}
    cpu = {n: statistics.median(v) for n, v in cpu_runs.items() if v}

    def ratio(a: str, b: str) -> float | None:
        x, y = results.get(a), results.get(b)
        return round(x / y, 2) if x and y else None

    report = {
        "ours_s": results.get("ours"), "reference_s": results.get("reference"),
        "plain_http_s": results.get("plain_http"), "raw_copy_s": results.get("raw_copy"),
        "ratios": {
            "reference_over_ours": ratio("reference", "ours"),  # goal >= 2
            "ours_over_raw_copy": ratio("ours", "raw_copy"),    # goal <= 3
            "ours_over_plain_http": ratio("ours", "plain_http"),
            "ours_over_raw_copy_cpu": round(cpu["ours"] / cpu["raw_copy"], 2) if "ours" in cpu and "raw_copy" in cpu
            else None,
        },
        "rounds": runs, "memory_warmed": WARM,
        "size_mib": size_mib, "shard_mib": args.shard_mib, "relays": RELAYS, "clients": CLIENTS,
        "ref_check_interval_s": args.ref_check_interval, "reference_version": REF_VERSION,
        "machine": {**harness.machine(), "loadavg_at_start": [round(x, 2) for x in load]},
        "cpu_s": cpu,
        "notes": notes, "skipped": skipped, "smoke": args.smoke,
    }
    print()
    print(f"{'system':<12}{'seconds':>10}{'GiB/s (all copies)':>22}")
    for name in ("ours", "reference", "plain_http", "raw_copy"):
        s = results.get(name)
        rate = f"{CLIENTS * size_mib / 1024 / s:.2f}" if s else "-"
        print(f"{name:<12}{(f'{s:.2f}' if s else '-'):>10}{rate:>22}")
    print("ratios:", json.dumps(report["ratios"]))
    harness.write_json(args.json, report)
    return 1 if args.smoke and notes else 0  # a smoke run is a check: a system that failed fails it


def _bf16_weights(path: Path, elements: int, seed: int, base: Path | None = None, fraction: float = 0.0) -> None:
    """A safetensors file of bf16 bit patterns; with `base`, that file with `fraction` of its elements changed."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    rng = np.random.default_rng(seed)
    if base is None:
        tensors = {f"layer{i}": rng.integers(0x3C00, 0x3D00, size=elements // 4, dtype=np.uint16) for i in range(4)}
    else:
        tensors = load_file(str(base))
        for tensor in tensors.values():
            idx = rng.choice(tensor.size, size=int(tensor.size * fraction), replace=False)
            tensor[idx] = tensor[idx] + 1
    save_file(tensors, str(path))


def relay_tree_full_and_delta(v1: Path, v2: Path, scratch: Path, *, shard: int,
                              clients: int) -> tuple[dict[str, float], dict[str, tuple[int, int]]]:
    """Seconds from publishing v2 until every client (holding v1) holds it verified, once as full weights and once
    as a delta against v1, through origin -> relays -> clients in one process; and the bytes that travelled and the
    full bytes of each. `v1` and `v2` are directories of weights already in the published dtype (bf16)."""
    import asyncio

    from protocol.identity import Identity
    from shardcast import Client, Origin, Relay
    from shardcast.manifest import SignedManifest
    from shardcast.publisher import DeltaBase, publish_blocking

    trainer = Identity.create()
    results: dict[str, float] = {}
    sizes: dict[str, tuple[int, int]] = {}

    async def one(mode: str) -> float:
        store = scratch / f"origin-{mode}"
        first = publish_blocking(v1, store, identity=trainer, run_id="bench", version=1, shard_size=shard,
                                 dtype="bfloat16")
        async with Origin(store, run_id="bench", shard_size=shard, watch_interval_s=0.05) as origin:
            relays = [Relay([origin.url], trainer=trainer.address, store_root=scratch / f"relay-{mode}-{i}",
                            poll_wait_s=5) for i in range(RELAYS)]
            for relay in relays:
                await relay.start()
            try:
                pulls = [Client([r.url for r in relays], trainer=trainer.address, out_dir=scratch / f"c-{mode}-{i}",
                                progress=False, wait_s=60) for i in range(clients)]
                await asyncio.gather(*(c.pull(1) for c in pulls))  # everyone holds v1 before the clock
                t0 = time.monotonic()
                signed = await asyncio.to_thread(
                    publish_blocking, v2, store, identity=trainer, run_id="bench", version=2, shard_size=shard,
                    dtype="bfloat16", base=DeltaBase(v1, first.manifest) if mode == "delta" else None)
                await asyncio.gather(*(c.pull(2) for c in pulls))
                seconds = time.monotonic() - t0
            finally:
                for relay in relays:
                    await relay.stop()
        sizes[mode] = (signed.manifest.total_bytes, signed.manifest.full_bytes)
        for i in range(clients):
            got = SignedManifest.parse((scratch / f"c-{mode}-{i}" / "manifests" / "2.json").read_bytes()).manifest
            assert got.weights_hash() == signed.manifest.weights_hash()
            for f in v2.iterdir():
                assert (scratch / f"c-{mode}-{i}" / "v2" / f.name).read_bytes() == f.read_bytes(), f.name
        return seconds

    for mode in ("full", "delta"):
        results[mode] = asyncio.run(asyncio.wait_for(one(mode), 600))
        print(f"  {mode}: {results[mode]:.2f} s, {sizes[mode][0]} bytes travel per version", flush=True)
    return results, sizes


def run_delta(args: argparse.Namespace) -> int:
    """Full against delta for the same v2, through origin -> relays -> clients holding v1, in one process."""
    size_mib = args.size_mib or (4 if args.smoke else 64 if args.quick else 256)
    shard = (args.shard_mib or (1 if args.smoke else 4)) * MiB
    clients = args.clients
    scratch = Path(args.workdir or tempfile.mkdtemp(prefix="shardcast-delta-"))
    try:
        v1, v2 = scratch / "v1", scratch / "v2"
        for d in (v1, v2):
            d.mkdir(parents=True, exist_ok=True)
            (d / "config.json").write_text("{}")
        _bf16_weights(v1 / "model.safetensors", size_mib * MiB // 2, seed=1)
        _bf16_weights(v2 / "model.safetensors", 0, seed=2, base=v1 / "model.safetensors", fraction=args.delta_fraction)
        results, sizes = relay_tree_full_and_delta(v1, v2, scratch, shard=shard, clients=clients)
    finally:
        if args.workdir is None:
            shutil.rmtree(scratch, ignore_errors=True)
    report = {
        "delta_bytes_over_full": round(sizes["delta"][0] / sizes["full"][0], 4),
        "full_time_over_delta_time": round(results["full"] / results["delta"], 2),
        "full_s": round(results["full"], 3), "delta_s": round(results["delta"], 3),
        "changed_fraction": args.delta_fraction, "size_mib": size_mib, "shard_bytes": shard, "relays": RELAYS,
        "clients": clients, "weights": "synthetic bf16 (not SmolLM2 RL checkpoints)", "link_mbit": _link(),
        "machine": harness.machine(), "smoke": args.smoke,
    }
    print("delta:", json.dumps({k: report[k] for k in ("delta_bytes_over_full", "full_time_over_delta_time")}))
    harness.write_json(args.json, report)
    return 0


def train_checkpoints(out: Path, lr: float, steps: int, *, smoke: bool) -> Path:
    """Local-mode GRPO at `lr` for `steps` steps (SmolLM2 on reverse-text; `smoke`: the tiny model), a checkpoint
    every step, each published as plain files into `out/published/step-<n>/`; returns that folder."""
    config = "reverse-text-tiny.toml" if smoke else "reverse-text-smollm2.toml"
    cmd = [sys.executable, "-m", "trainer.cli", "--config", str(ROOT / "configs" / "trainer" / config),
           "--max-steps", str(steps), "--optim.lr", repr(lr), "--optim.warmup-steps", "0",
           "--torch-threads", str(min(2, os.cpu_count() or 1)), "--metrics-file", str(out / "metrics.jsonl"),
           "--checkpoint.dir", str(out / "checkpoints"), "--checkpoint.interval", "1", "--checkpoint.keep", "1",
           "--publish.type", "local", "--publish.path", str(out / "published")]
    if smoke:  # seconds: a few tiny groups
        cmd += ["--batch.groups-per-step", "4", "--data.group-size", "4", "--data.max-new-tokens", "16"]
    t0 = time.monotonic()
    done = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the trainer at lr {lr:g} exited {done.returncode}: {done.stderr[-2000:]}")
    print(f"  trained {steps} steps at lr {lr:g} in {time.monotonic() - t0:.0f} s", flush=True)
    return out / "published"


def changed_fraction(a: Path, b: Path, dtype: str = "bfloat16") -> float:
    """The share of floating-point elements whose `dtype` bit pattern differs between two safetensors files."""
    import torch
    from safetensors import safe_open

    target = getattr(torch, dtype)
    changed = total = 0
    with safe_open(str(a), framework="pt") as fa, safe_open(str(b), framework="pt") as fb:
        for name in fa.keys():  # noqa: SIM118 (safe_open has no __iter__)
            x = fa.get_tensor(name)
            if not x.is_floating_point():
                continue
            bits = torch.int16 if target.itemsize == 2 else torch.int32
            y = fb.get_tensor(name).to(target).view(bits)
            changed += int((x.to(target).view(bits) != y).sum())
            total += x.numel()
    return changed / total


def run_trained_delta(args: argparse.Namespace) -> int:
    """Real RL checkpoints through the trainer's own publisher, then the relay tree on the last pair."""
    from protocol.identity import Identity
    from trainer.config import ShardcastPublish
    from trainer.publish import ShardcastPublisher, stage_public

    lrs = [float(x) for x in args.train_lrs.split(",")]
    steps = args.train_steps or (3 if args.smoke else 4)
    if steps < 2:
        raise SystemExit("--train-steps must be at least 2 (a delta needs the version before)")
    shard = (args.shard_mib or (1 if args.smoke else 4)) * MiB
    scratch = Path(args.workdir or tempfile.mkdtemp(prefix="shardcast-trained-delta-"))
    per_lr: list[dict[str, object]] = []
    timed: tuple[dict[str, float], dict[str, tuple[int, int]]] | None = None
    try:
        for lr in lrs:
            published = train_checkpoints(scratch / f"lr-{lr:g}", lr, steps, smoke=args.smoke)
            versions = sorted(int(p.name.removeprefix("step-")) for p in published.glob("step-*"))
            publisher = ShardcastPublisher(
                ShardcastPublish(store=scratch / f"store-{lr:g}", dtype="bfloat16", anchor_every=steps + 1,
                                 shard_mib=shard // MiB), identity=Identity.create())
            rows = []
            for i, v in enumerate(versions):
                publisher.publish(v, published / f"step-{v}")
                travel, full = publisher.sent_bytes[v]
                row = {"version": v, "bytes": travel, "full_bytes": full, "over_full": round(travel / full, 4)}
                if i:
                    row["changed_fraction"] = round(changed_fraction(published / f"step-{versions[i - 1]}" /
                                                                     "model.safetensors",
                                                                     published / f"step-{v}" / "model.safetensors"), 5)
                rows.append(row)
                print(f"  lr {lr:g} v{v}: {travel} of {full} bytes ({travel / full:.1%})"
                      + (f", {row['changed_fraction']:.2%} of the bf16 weights changed" if i else " (anchor)"),
                      flush=True)
            publisher.close()
            deltas = rows[1:]
            per_lr.append({
                "lr": lr, "versions": rows,
                "changed_fraction_mean": round(statistics.mean(float(r["changed_fraction"]) for r in deltas), 5),
                "delta_bytes_over_full_mean": round(statistics.mean(float(r["over_full"]) for r in deltas), 4),
            })
            if timed is None:  # the first learning rate's last pair through the relay tree
                pair = []
                for v in versions[-2:]:
                    d = scratch / f"tree-v{v}"
                    d.mkdir()
                    stage_public(published / f"step-{v}", d, "bfloat16")
                    pair.append(d)
                timed = relay_tree_full_and_delta(pair[0], pair[1], scratch / "tree", shard=shard,
                                                  clients=args.clients)
    finally:
        if args.workdir is None:
            shutil.rmtree(scratch, ignore_errors=True)
    assert timed is not None
    results, sizes = timed
    report = {
        "delta_bytes_over_full": round(sizes["delta"][0] / sizes["full"][0], 4),
        "full_time_over_delta_time": round(results["full"] / results["delta"], 2),
        "full_s": round(results["full"], 3), "delta_s": round(results["delta"], 3),
        "timed_lr": lrs[0], "per_lr": per_lr, "steps": steps, "shard_bytes": shard, "relays": RELAYS,
        "clients": args.clients,
        "weights": ("tiny model (smoke)" if args.smoke else "SmolLM2-135M") + ": local-mode GRPO on reverse-text, "
                   "warm-up off, published in bf16 by the trainer's ShardcastPublisher",
        "command": harness.command("shardcast"), "machine": harness.machine(), "smoke": args.smoke,
        "link_mbit": _link(),
    }
    print("delta:", json.dumps({k: report[k] for k in ("delta_bytes_over_full", "full_time_over_delta_time")}))
    for entry in per_lr:
        print(f"  lr {entry['lr']:g}: {float(entry['changed_fraction_mean']):.2%} of the weights changed per step, "
              f"deltas {float(entry['delta_bytes_over_full_mean']):.1%} of the full bytes")
    harness.write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
