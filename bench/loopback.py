"""The real parts the attack bench (`bench.attacks`) and the integration tests run on 127.0.0.1: a pool on a
dev chain with its role accounts and settings, validators served by uvicorn in this process, an ASGI app on a
free port, and checkpoints of random bytes. (The tests' pytest fixtures over these are in
`tests/unit/contracts/chainfixtures.py` and `tests/integration/conftest.py`; the cheating peers are in
`bench.adversaries`.) Heavy packages (torch, the validator) are imported where they are used, so a contracts
test that only wants the pool settings does not load them."""

from __future__ import annotations

import contextlib
import hashlib
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from contracts.deployment import Deployment, PoolSettings
from contracts.devchain import DevChain
from contracts.pool import PoolClient, TokenClient
from contracts.transactor import connect
from devnet.network import free_port as free_port  # the one free-port helper, for the bench and the tests
from protocol.identity import Identity
from protocol.model_spec import TinyModelSpec
from protocol.rollout import RunSpec

if TYPE_CHECKING:
    import uvicorn

    from models.loading import LoadedModel
    from validator.config import ValidatorConfig
    from validator.service import Service

# -- the pool -----------------------------------------------------------------------------------------

TOKEN = 10**18
SETTINGS = PoolSettings(
    min_stake=10 * TOKEN,
    unbonding_period=300,
    invalidation_window=100,
    reward_lock_period=200,
    reward_per_unit=10**15,
    slash_penalty=4 * TOKEN,
    appeal_window=150,
)
BUDGET = 1000 * TOKEN
REPORTER_MAX_BACKOFF_S = 20.0
"""`reporter.max_backoff_s` for validators of this pool: the default (300 s) would reach its 100 s invalidation
window, and a validator refuses that at start (`validator.service.check_reach`)."""

# PUBLIC anvil dev accounts by role (indices into the well-known test mnemonic).
ADMIN, VALIDATOR, TRAINER, OPERATOR, OPERATOR2, STRANGER, ATTACKER_EOA, VALIDATOR2, TREASURY = 0, 1, 2, 3, 4, 5, 6, 7, 9
# VALIDATOR2 holds no role at deploy time: a test that needs a second validator (appeals) grants it.


@dataclass
class Pools:
    """Fresh clients (fresh nonce caches) for each role of one deployment (in the tests: inside one test's snapshot)."""

    chain: DevChain
    deployment: Deployment
    admin: PoolClient
    validator: PoolClient
    trainer: PoolClient
    operator: PoolClient
    operator2: PoolClient
    stranger: PoolClient

    def client(self, index: int) -> PoolClient:
        return PoolClient(connect(self.chain.rpc_url), self.deployment.pool, self.chain.account(index))

    def token(self, index: int = ADMIN) -> TokenClient:
        return TokenClient(connect(self.chain.rpc_url), self.deployment.token, self.chain.account(index))

    def new_node(self, operator: PoolClient | None = None, stake: int = SETTINGS.min_stake) -> Identity:
        node = Identity.create()
        (operator or self.operator).register(node, stake)
        return node

    def work_key(self, run_id: str, node: str, version: int, counter: int) -> bytes:
        """`protocol.seeds.work_key` of an assignment in this deployment's pool and chain."""
        from protocol.seeds import work_key

        return work_key(run_id, node, version, counter, chain_id=self.deployment.chain_id, pool=self.deployment.pool)


# -- validators ---------------------------------------------------------------------------------------

MANIFEST_V0 = hashlib.sha256(b"manifest of v0").digest()
TINY = TinyModelSpec(seed=0, hidden_size=128)  # >= top-k values per token: a 1-token last chunk can be proved
RUN = RunSpec(run_id="test-run", tasks_per_batch=2, samples_per_task=2, max_new_tokens=40, async_level=1)


@dataclass
class Served:
    """A running validator: its service, its URL, and a way to stop it."""

    service: Service
    url: str
    server: uvicorn.Server
    thread: threading.Thread

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=30.0)

    def post_work(self, data: bytes) -> str:
        """Post the submission `data`; its work key once taken (200 or 202), else AssertionError with the answer."""
        with self.client() as c:
            r = c.post("/v1/submissions", content=data)
        if r.status_code not in (200, 202):
            raise AssertionError(f"HTTP {r.status_code}: {r.text}")
        return str(r.json()["work_key"])

    def stop(self) -> None:
        if self.server.should_exit:  # stopped already (a test took it down early)
            return
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.service.stop()

    def wait_decided(self, work_key: str, timeout: float = 60.0,
                     alive: Callable[[], bool] | None = None) -> dict[str, Any]:
        """The row once decided; AssertionError after `timeout`, or at once when `alive()` (the sender, e.g. a
        node's loop in a thread) says the sender has ended without it being decided."""
        with self.client() as c:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                ended = alive is not None and not alive()
                r = c.get(f"/v1/submissions/{work_key}")
                if r.status_code == 200 and r.json()["state"] != "received":
                    return dict(r.json())
                if ended and r.status_code != 200:
                    raise AssertionError(f"{work_key}: the sender ended and the validator has no row "
                                         f"(HTTP {r.status_code})")
                time.sleep(0.1)
        raise AssertionError(f"{work_key} not decided within {timeout} s")

    def wait_reported(self, work_key: str, timeout: float = 60.0) -> dict[str, Any]:
        with self.client() as c:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                r = c.get(f"/v1/submissions/{work_key}")
                if r.status_code == 200 and r.json()["state"] == "reported":
                    return dict(r.json())
                time.sleep(0.1)
        raise AssertionError(f"{work_key} not reported within {timeout} s")


def serve(cfg: ValidatorConfig, identity: Identity, port: int = 0) -> Served:
    """Build the service and serve it with uvicorn on a loopback port (default: any free one)."""
    import uvicorn

    from validator.app import build_app
    from validator.server import uvicorn_config
    from validator.service import Service

    service = Service(cfg, identity)
    service.start()
    server = uvicorn.Server(uvicorn_config(build_app(service), cfg.gate, host="127.0.0.1", port=port,
                                           stats=service.core.stats))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise AssertionError("validator did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    return Served(service, f"http://127.0.0.1:{port}", server, thread)


FP32_EOS_TIE_DRIFT = 0.01
"""`checks.eos_tie_drift` for a run whose nodes all generate in fp32 (the harness's validators)."""


def validator_config(state_dir: Path, deployment_path: Path, rpc_url: str, **overrides: Any) -> ValidatorConfig:
    from validator.config import ValidatorConfig

    values: dict[str, Any] = {
        "state_dir": state_dir, "run": RUN, "model": TINY,
        "chain": {"deployment": deployment_path, "rpc_url": rpc_url, "poll_s": 0.2},
        "systemic": {"window_s": 0.5, "min_nodes": 3, "fraction": 0.5},
        "reporter": {"interval_s": 0.2, "max_backoff_s": REPORTER_MAX_BACKOFF_S},
        # the tests read the audit right after the rows they check, as often as they poll (a test sets these to test
        # them)
        "audit_cache_s": 0.0, "audit_rate_per_address": 1000.0, "audit_burst_per_address": 1000,
        # the tiny model in fp32 everywhere: honest replay margins are 0.0, so a skipped near-tie EOS is a cheat
        "checks": {"eos_tie_drift": FP32_EOS_TIE_DRIFT},
    }
    values.update(overrides)
    return ValidatorConfig.model_validate(values)


def tiny(seed: int = 0) -> LoadedModel:
    """The tiny model the loopback validators run (`seed` != 0: another model of the same shape)."""
    from models.loading import load

    return load(TINY.model_copy(update={"seed": seed}))


# -- servers and files --------------------------------------------------------------------------------


def wait_http(url: str, timeout: float = 60.0, alive: object = None) -> httpx.Response:
    """GET `url` until it answers 200; AssertionError after `timeout` seconds, or at once when `alive`
    (a `subprocess.Popen`) has exited."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        poll = getattr(alive, "poll", None)
        if poll is not None and poll() is not None:
            raise AssertionError(f"process exited with {poll()} before {url} answered")
        try:
            r = httpx.get(url, timeout=2.0)
            if r.status_code == 200:
                return r
            last = r.status_code
        except httpx.HTTPError as exc:
            last = exc
        time.sleep(0.1)
    raise AssertionError(f"{url} did not answer 200 within {timeout} s (last: {last!r})")


@contextlib.contextmanager
def serve_asgi(app: Any, timeout: float = 30.0) -> Iterator[str]:
    """Serve an ASGI `app` (e.g. a hostile peer a test writes with FastAPI) with uvicorn on a free loopback
    port in a thread; yields its base URL and stops it on exit."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise AssertionError("the ASGI server did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=timeout)


def forward_info(real_url: str, query: str = "") -> tuple[bytes, dict[str, str]]:
    """What a proxy in front of the validator at `real_url` answers to `GET /v1/info?<query>`: the real body and,
    when the caller sent a challenge, the real validator's signed proof header (`protocol.info_proof`). Look-alike
    validators in tests and attacks stand between a node and a real validator with it."""
    from protocol.info_proof import HEADER

    r = httpx.get(real_url.rstrip("/") + "/v1/info" + (f"?{query}" if query else ""), timeout=30.0)
    proof = r.headers.get(HEADER)
    return r.content, {} if proof is None else {HEADER: proof}


def make_checkpoint(directory: Path, sizes: dict[str, int], seed: int = 0) -> Path:
    """A checkpoint directory with files of random bytes (deterministic from `seed`)."""
    rng = random.Random(seed)
    for name, size in sizes.items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rng.randbytes(size))
    return directory


def same_tree(a: Path, b: Path) -> bool:
    files_a = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    files_b = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    return files_a == files_b and all((a / f).read_bytes() == (b / f).read_bytes() for f in files_a)


async def start_site(app: Any, **runner: Any) -> tuple[Any, int]:
    """`app` (an aiohttp `web.Application`) served on 127.0.0.1 at a port the system picks: (its `AppRunner`, to
    clean up, and the port). The one way the bench's and the tests' stand-in servers start."""
    from aiohttp import web

    r = web.AppRunner(app, **runner)
    await r.setup()
    await web.TCPSite(r, "127.0.0.1", 0).start()
    return r, int(r.addresses[0][1])


_PROXY = """
import asyncio, sys
target = None
async def pipe(r, w):
    try:
        while data := await r.read(65536):
            w.write(data)
            await w.drain()
    finally:
        w.close()
async def handle(r, w):
    ur, uw = await asyncio.open_connection("127.0.0.1", await asyncio.shield(target))
    await asyncio.gather(pipe(r, uw), pipe(ur, w), return_exceptions=True)
async def main():
    global target
    target = asyncio.get_running_loop().create_future()
    if sys.argv[2] != "-":
        target.set_result(int(sys.argv[2]))
    server = await asyncio.start_server(handle, "127.0.0.1", int(sys.argv[1]))
    print("ready", server.sockets[0].getsockname()[1], flush=True)
    if not target.done():  # the port to forward to comes on stdin, once that server listens
        line = await asyncio.to_thread(sys.stdin.readline)
        target.set_result(int(line))
    await server.serve_forever()
asyncio.run(main())
"""


class ProxyProcess:
    """A TCP forwarder to 127.0.0.1:`target_port` in its own process, so a test (or an attack) can `SIGSTOP` it: the peer
    behind it then accepts connections (the kernel's backlog) and never answers, exactly as a stopped role
    does, while the role itself keeps running in the test's process."""

    def __init__(self, target_port: int | None, port: int | None = None) -> None:
        """`port`: listen there (a proxy started again where a killed one listened), else on a port the system
        picks as the proxy binds it (no window in which another process could take it). `target_port` None: the
        proxy listens at once and forwards once `forward_to` names the port (a server that must know the proxy's
        URL before the one behind it starts); connections made before wait for it."""
        import subprocess
        import sys

        self.proc = subprocess.Popen(
            [sys.executable, "-c", _PROXY, str(port or 0), "-" if target_port is None else str(target_port)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        ready = self.proc.stdout.readline().split()
        if ready[:1] != ["ready"]:
            self.proc.wait(timeout=30)
            raise RuntimeError(f"the proxy to port {target_port} did not start on port {port or 'any'} (exit "
                               f"{self.proc.returncode})")
        self.port = int(ready[1])
        self.url = f"http://127.0.0.1:{self.port}"

    def forward_to(self, target_port: int) -> None:
        """Name the port a proxy started with `target_port` None forwards to (once)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{target_port}\n")
        self.proc.stdin.flush()

    def signal(self, signum: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signum)

    def close(self) -> None:
        import signal

        self.signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
