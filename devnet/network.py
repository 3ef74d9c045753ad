"""Bringing the devnet up: ports, keys, each role's TOML config, and the processes in dependency order.

    anvil -> deploy (job) -> origin -> relays -> trainer (publishes v0 through the origin and on chain: the
          model's own weights, or the `--init` checkpoint, which nodes and validators then pull like any version)
          -> validators -> nodes (stake, register, work)

Every role is started as a process from its own CLI with a config file written under
`<state_dir>/config/`; nothing here imports a role. `devnet.json` in the state directory says where
everything is (URLs, addresses, files); `processes.json` is the process table (devnet/processes.py).
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
import socket
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from devnet.accounts import DEPLOYER, TRAINER, Accounts, dev_address, dev_key_hex
from devnet.config import DevnetConfig
from devnet.hosts import HostPlan, plan_hosts, state_tag
from devnet.processes import Entry, ProcessTable, tail
from devnet.tomlfile import dumps, write_atomic

log = logging.getLogger(__name__)

LAYOUT = "devnet.json"
NETNS_PORTS = {"chain": 8545, "origin": 8600, "relay": 8601, "validator": 8700, "node": 8710, "trainer": 9100,
               "discovery": 4001}
"""With a host per role every role has its machine to itself: well-known ports, the same on every host."""
PY = sys.executable
STOP_ORDER_ROLES = ("node", "trainer", "validator", "relay", "origin", "chain")
"""Who stops first: producers before consumers' sources, the chain last."""

TINY = {"type": "tiny", "hidden_size": 128, "intermediate_size": 256, "seed": 0}
"""The tiny model: 128 wide so a TOPLOC chunk's top-k (128) fits one hidden state."""


class DevnetError(RuntimeError):
    """The devnet could not come up (the message names the role and its log)."""


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out on its own (outgoing connections, `bind(0)`)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


PORT_WINDOW = 12000
"""How many ports below the kernel's ephemeral range `free_port` draws from."""
PORT_CLAIM_S = 600.0
"""How long a port `free_port` handed out stays claimed for every process on the machine."""


def _claims_dir() -> Path:
    return Path(tempfile.gettempdir()) / "prime-port-claims"


def _claim(port: int) -> bool:
    """Claim `port` for this machine's `free_port` callers (a file created exclusively; one older than
    `PORT_CLAIM_S` is taken over): False when another process holds a fresh claim on it."""
    path = _claims_dir() / str(port)
    try:
        path.parent.mkdir(exist_ok=True)
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        return True
    except FileExistsError:
        try:
            if time.time() - path.stat().st_mtime < PORT_CLAIM_S:
                return False
            os.utime(path)
            return True
        except OSError:
            return False
    except OSError:  # no writable temp directory: the bind test alone decides
        return True


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A loopback port that binds now, for a server started next. It is drawn at random from just below the
    kernel's ephemeral range: a port taken from `bind(0)` and freed again is an ephemeral port, which the next
    outgoing connection of any process on the box may take before our server binds it (on a busy box, a test's
    server then fails with "address in use"). Below the range only another explicit choice can take it, and
    those coordinate: each port handed out is claimed for `PORT_CLAIM_S` in a directory every process on the
    machine shares (a server that starts a minute after its port was drawn, while other suites draw theirs,
    found its port taken once)."""
    low = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(max(1024, low - PORT_WINDOW), low)
        if _bindable(port) and _claim(port):
            return port
    with socket.socket() as s:  # the range below is crowded: fall back to one the kernel picks
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Layout:
    """Where everything is: written to `<state_dir>/devnet.json` for `status`, `audit` and other tools."""

    state_dir: str
    model: str
    run: dict[str, Any]
    rpc_url: str
    deployment: str
    trainer: dict[str, Any]
    origin: str
    relays: list[str]
    validators: list[dict[str, str]]
    nodes: list[dict[str, str]]
    dashboard: str | None = None
    init: str | None = None
    """The checkpoint the run started from (`--init`; version 0), or None: version 0 is `model` itself."""
    hosts: str = "loopback"
    """loopback or netns (then `hosts.json` in the state directory names every namespace and address)."""
    started_at: float = field(default_factory=time.time)

    def save(self) -> None:
        write_atomic(Path(self.state_dir) / LAYOUT, json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, state_dir: Path) -> Layout:
        return cls(**json.loads((Path(state_dir) / LAYOUT).read_text()))


def model_defaults(cfg: DevnetConfig) -> tuple[dict[str, Any], str, int, float]:
    """(model spec, environment, max new tokens, learning rate) for `cfg.model`."""
    if cfg.model == "smollm2":
        spec: dict[str, Any] = {"type": "smollm2"}
        env, tokens, lr = "reverse-text", 32, 2e-6
    else:
        spec, env, tokens, lr = dict(TINY), "lowercase", 12, 0.005
    return (spec, cfg.run.env or env, cfg.run.max_new_tokens or tokens,
            cfg.trainer.lr if cfg.trainer.lr is not None else lr)


class Network:
    """The devnet's processes and files; `up()` starts everything, `stop()` stops everything."""

    def __init__(self, cfg: DevnetConfig) -> None:
        self.cfg = cfg
        self.state = cfg.state_dir.resolve()
        self.init = check_init(cfg, self.state)  # before anything is removed or started
        if cfg.fresh and self.state.exists():
            _refuse_if_running(self.state)
            _refuse_if_foreign(self.state)
            from devnet.hosts import HostsError, teardown

            try:
                teardown(self.state)  # a crashed run's namespaces, before their record goes
            except HostsError as exc:
                raise DevnetError(f"{exc}; the previous run's namespaces are still there") from None
            shutil.rmtree(self.state)
        self.state.mkdir(parents=True, exist_ok=True)
        self.hosts: HostPlan | None = None
        if cfg.hosts == "netns":
            names = (["chain", "origin"] + [f"relay-{i}" for i in range(cfg.relays)]
                     + [f"validator-{i}" for i in range(cfg.validators)] + ["trainer"]
                     + [f"node-{i}" for i in range(cfg.nodes + cfg.spare_nodes)])
            try:
                self.hosts = plan_hosts(names, tag=state_tag(self.state), subnet=cfg.subnet)
            except ValueError as exc:
                raise DevnetError(str(exc)) from None
        self.table = ProcessTable(self.state)
        self.accounts = Accounts(cfg.validators, cfg.nodes + cfg.spare_nodes)
        self.model, self.env, self.max_new_tokens, self.lr = model_defaults(cfg)
        self.groups_per_step = cfg.trainer.groups_per_step or cfg.nodes * cfg.run.tasks_per_batch
        per_step = math.ceil(self.groups_per_step / cfg.run.tasks_per_batch)
        self.run_spec = {
            "run_id": cfg.run.run_id, "env": self.env, "tasks_per_batch": cfg.run.tasks_per_batch,
            "samples_per_task": cfg.run.samples_per_task, "max_new_tokens": self.max_new_tokens,
            "temperature": cfg.run.temperature, "async_level": cfg.trainer.async_level,
            # a step's demand and no more (see RunSettings.batches_per_version)
            "max_batches_per_version": cfg.run.batches_per_version or math.ceil(per_step / cfg.nodes),
        }
        self.layout: Layout | None = None
        self._node_plan: dict[str, Any] = {}  # what every node config shares (set by `up`)

    # -- helpers ----------------------------------------------------------------------------------

    def _config(self, name: str, data: dict[str, Any]) -> Path:
        return write_atomic(self.state / "config" / f"{name}.toml",
                            "# written by prime-devnet (DEV ONLY keys come from the environment)\n" + dumps(data))

    def _wait(self, entry: Entry, check: Any, what: str) -> None:
        deadline = time.monotonic() + self.cfg.start_timeout_s
        while True:
            proc = self.table._popen.get(entry.name)
            if proc is not None and proc.poll() is not None:
                raise DevnetError(f"{entry.name} exited with {proc.returncode} before {what}; its log "
                                  f"({entry.log}) ends:\n{tail(Path(entry.log))}")
            try:
                if check():
                    return
            except (httpx.HTTPError, ValueError, OSError):
                pass
            if time.monotonic() > deadline:
                raise DevnetError(f"{entry.name}: no {what} within {self.cfg.start_timeout_s:.0f} s; its log "
                                  f"({entry.log}) ends:\n{tail(Path(entry.log))}")
            time.sleep(0.2)

    def address(self, name: str) -> str:
        """The address role `name` binds and is reached at: its host's own, or 127.0.0.1."""
        return self.hosts.host(name).address if self.hosts else "127.0.0.1"

    def port(self, role: str) -> int:
        return NETNS_PORTS[role] if self.hosts else free_port()

    def url(self, name: str, port: int) -> str:
        return f"http://{self.address(name)}:{port}"

    def listen(self, name: str) -> list[str]:
        """libp2p listen multiaddrs of role `name` (used when its discovery is switched on): its own address."""
        return [f"/ip4/{self.address(name)}/tcp/{NETNS_PORTS['discovery']}"] if self.hosts else []

    def command(self, name: str, command: list[str]) -> list[str]:
        """`command`, run inside role `name`'s namespace when there is one."""
        return self.hosts.exec_prefix(name) + command if self.hosts else command

    def create_hosts(self) -> None:
        """Make the namespaces, links and bridge of the plan (netns mode; nothing otherwise)."""
        if self.hosts is not None:
            from devnet.hosts import HostsError, create

            try:
                create(self.hosts, self.state)
            except HostsError as exc:
                raise DevnetError(f"--hosts netns: {exc}") from None

    @property
    def gateway(self) -> str | None:
        """The devnet's own address on the bridge (netns mode)."""
        return self.hosts.gateway if self.hosts else None

    @staticmethod
    def _http_ok(url: str) -> bool:
        return httpx.get(url, timeout=2.0).status_code == 200

    # -- up ---------------------------------------------------------------------------------------

    def up(self, dashboard_url: str | None = None) -> Layout:
        cfg, acc = self.cfg, self.accounts
        trainer_addr = dev_address(TRAINER)
        validator_addrs = [dev_address(acc.validator(i)) for i in range(cfg.validators)]
        node_addrs = [dev_address(acc.node(i)) for i in range(cfg.nodes)]

        # chain
        from contracts.devchain import DEV_CHAIN_ID, DEV_MNEMONIC, anvil_binary

        self.create_hosts()
        port = self.port("chain")
        rpc = self.url("chain", port)
        anvil = self.table.start("chain", "chain", self.command("chain", [
            str(anvil_binary()), "--host", self.address("chain"), "--port", str(port), "--chain-id",
            str(DEV_CHAIN_ID), "--accounts", str(acc.total), "--mnemonic", DEV_MNEMONIC, "--hardfork", "cancun",
            *(["--block-time", f"{cfg.chain.block_time:g}"] if cfg.chain.block_time else [])]),
            port=port, url=rpc)
        self._wait(anvil, lambda: httpx.post(rpc, json={"jsonrpc": "2.0", "id": 1, "method": "eth_chainId",
                                                        "params": []}, timeout=2.0).status_code == 200,
                   "JSON-RPC answer")
        deployment = self.state / "deployment.json"
        deploy = [PY, "-m", "contracts.deploy", "--rpc", rpc, "--dev-account", str(DEPLOYER), "--out",
                  str(deployment), "--trainer", trainer_addr, "--fund-rewards", str(10**27)]
        for a in validator_addrs:
            deploy += ["--validator", a]
        for a in node_addrs + [dev_address(acc.node(cfg.nodes + i)) for i in range(cfg.spare_nodes)]:
            deploy += ["--mint", f"{a}={10**20}"]  # spare nodes stake when they join
        self.table.run("deploy", deploy)
        dep = json.loads(deployment.read_text())

        # weights: the origin serves the store the trainer publishes into; relays below it
        origin_port = self.port("origin")
        origin_url = self.url("origin", origin_port)
        origin = self.table.start("origin", "origin", self.command("origin", [
            PY, "-m", "shardcast.cli", "--log-level", "WARNING", "origin", "--store", str(self.state / "origin"),
            "--run-id", cfg.run.run_id, "--host", self.address("origin"), "--port", str(origin_port),
            "--public-url", origin_url] + [a for m in self.listen("origin") for a in ("--discovery-listen", m)]),
            port=origin_port, url=origin_url)
        self._wait(origin, lambda: self._http_ok(origin_url + "/health"), "/health")
        relays = []
        for i in range(cfg.relays):
            name = f"relay-{i}"
            p = self.port("relay")
            url = self.url(name, p)
            relays.append(self.table.start(name, "relay", self.command(name, [
                PY, "-m", "shardcast.cli", "--log-level", "WARNING", "relay", "--store", str(self.state / name),
                "--host", self.address(name), "--port", str(p), "--public-url", url, "--upstream", origin_url,
                "--trainer", trainer_addr, "--run-id", cfg.run.run_id]
                + [a for m in self.listen(name) for a in ("--discovery-listen", m)]),
                port=p, url=url))
        for r in relays:
            self._wait(r, lambda r=r: self._http_ok(f"{r.url}/health"), "/health")
        relay_urls = [str(r.url) for r in relays]
        # v0 is the base model every role has, or (--init) a checkpoint pulled over the relays like any version
        weights = {"type": "shardcast", "relays": relay_urls, "trainer": trainer_addr,
                   "base_version": -1 if self.init else 0}

        # validators (ports first: each names the others as failover peers)
        v_ports = [self.port("validator") for _ in range(cfg.validators)]
        v_urls = [self.url(f"validator-{i}", p) for i, p in enumerate(v_ports)]
        validators = []
        for i in range(cfg.validators):
            path = self._config(f"validator-{i}", {
                "host": self.address(f"validator-{i}"), "port": v_ports[i], "public_url": v_urls[i], "state_dir": str(self.state / f"validator-{i}"),
                "validators": validator_addrs, "peers": [u for j, u in enumerate(v_urls) if j != i], "threads": 1,
                "run": self.run_spec, "model": self.model, "weights": weights,
                "chain": {"deployment": str(deployment), "rpc_url": rpc, "poll_s": 0.5},
                "key": {"key_env": "PRIME_DEVNET_VALIDATOR_KEY"},
                "reporter": {"interval_s": 1.0},
                # `prime-devnet audit` and the fault bench reconcile with fresh reads, as often as they like: on a local
                # network every reader is the operator
                "audit_cache_s": 0.0, "audit_rate_per_address": 1000.0, "audit_burst_per_address": 1000,
                "discovery": {"listen": self.listen(f"validator-{i}")} if self.hosts else None,
            })
            validators.append(self.table.start(
                f"validator-{i}", "validator",
                self.command(f"validator-{i}", [PY, "-m", "validator.cli", "--config", str(path)]),
                env={"PRIME_DEVNET_VALIDATOR_KEY": dev_key_hex(acc.validator(i)), "OMP_NUM_THREADS": "1"},
                port=v_ports[i], url=v_urls[i]))

        # trainer: publishes its starting weights (the model, or the --init checkpoint) as v0 (origin + chain), then
        # trains on the validators' feeds
        t_port = self.port("trainer")
        tdir = self.state / "trainer"
        path = self._config("trainer", {
            "model": {"type": "hf", "name_or_path": str(self.init)} if self.init else self.model,
            "max_steps": cfg.trainer.max_steps, "torch_threads": cfg.trainer.threads, "dtype": cfg.trainer.dtype,
            "progress": False, "metrics_file": str(tdir / "metrics.jsonl"), "metrics_port": t_port,
            "metrics_host": self.address("trainer"),
            "work_ledger": str(tdir / "work.jsonl"),
            "optim": self.trainer_optim(),
            "loss": self.trainer_loss(),
            **self._trainer_eval(),
            "batch": {"groups_per_step": self.groups_per_step, "seq_len": 256 if cfg.model == "tiny" else 512,
                      # SmolLM2 at 8 rows x 512 tokens held ~9 GB of activations for the backward pass: with 3
                      # nodes and 2 validators beside it the trainer was OOM-killed on a 24 GiB box
                      "micro_batch_rows": 8 if cfg.model == "tiny" else 2, "async_level": cfg.trainer.async_level,
                      "fill_timeout_s": cfg.trainer.fill_timeout_s,
                      "min_groups_per_step": min(self.groups_per_step,
                                                 cfg.trainer.min_groups_per_step or cfg.run.tasks_per_batch)},
            "data": {"type": "validators", "urls": v_urls, "addresses": validator_addrs,
                     "chain_id": int(dep["chain_id"]), "pool": dep["pool"], "run_id": cfg.run.run_id,
                     "poll_interval_s": 0.5, "wait_timeout_s": 86400.0,
                     # trains only on work the chain shows recorded by the validator that signed it
                     "chain": {"deployment": str(deployment), "rpc_url": rpc}},
            "checkpoint": {"dir": str(tdir / "checkpoints"), "interval": 1, "keep": 2},
            "publish": {"type": "shardcast", "store": str(self.state / "origin"), "run_id": cfg.run.run_id,
                        "key_env": "PRIME_DEVNET_TRAINER_KEY", "initial": True, "shard_mib": 8,
                        "dtype": cfg.publish_dtype(),
                        "retention": cfg.trainer.async_level + 3,
                        "chain": {"deployment": str(deployment), "rpc_url": rpc}},
        })
        trainer = self.table.start("trainer", "trainer",
                                   self.command("trainer", [PY, "-m", "trainer.cli", "--config", str(path)]),
                                   env={"PRIME_DEVNET_TRAINER_KEY": dev_key_hex(TRAINER), "OMP_NUM_THREADS": "1"},
                                   port=t_port, url=self.url("trainer", t_port))
        for v in validators:
            self._wait(v, lambda v=v: self._http_ok(f"{v.url}/health"), "/health")
        self._wait(trainer, lambda: self._http_ok(f"{trainer.url}/metrics"), "/metrics")

        # nodes
        self._node_plan = {"validators": v_urls, "deployment": str(deployment), "rpc_url": rpc, "weights": weights}
        nodes = [self._start_node(i) for i in range(cfg.nodes)]
        for n in nodes:
            self._wait(n, lambda n=n: self._http_ok(f"{n.url}/health"), "/health")

        self.layout = Layout(
            state_dir=str(self.state), model=cfg.model, run=self.run_spec, rpc_url=rpc, deployment=str(deployment),
            trainer={"address": trainer_addr, "metrics_url": trainer.url, "metrics_file": str(tdir / "metrics.jsonl"),
                     "work_ledger": str(tdir / "work.jsonl"), "max_steps": cfg.trainer.max_steps},
            origin=origin_url, relays=relay_urls,
            validators=[{"name": f"validator-{i}", "url": v_urls[i], "address": validator_addrs[i]}
                        for i in range(cfg.validators)],
            nodes=[{"name": f"node-{i}", "url": str(nodes[i].url), "address": node_addrs[i]} for i in range(cfg.nodes)],
            dashboard=dashboard_url, init=str(self.init) if self.init else None, hosts=cfg.hosts,
        )
        self.layout.save()
        return self.layout

    def trainer_optim(self) -> dict[str, Any]:
        """The trainer's `[optim]`: the learning rate (by model unless set) and warm-up."""
        return {"lr": self.lr, "warmup_steps": self.cfg.trainer.warmup_steps}

    def trainer_loss(self) -> dict[str, Any]:
        """The trainer's `[loss]`: the nodes' sampling temperature (the run's) and the advantage normalization."""
        return {"temperature": self.cfg.run.temperature, "std_normalize": self.cfg.trainer.std_normalize}

    def _trainer_eval(self) -> dict[str, Any]:
        """The trainer's `[eval]` section (`trainer.eval`; nothing when `every` is 0): the run's environment and,
        unless set, its generation limit."""
        ev = self.cfg.trainer.eval
        if not ev.every:
            return {}
        return {"eval": {"every": ev.every, "env": self.env, "seed_start": ev.seed_start, "num_tasks": ev.num_tasks,
                         "samples_per_task": ev.samples_per_task, "temperatures": list(ev.temperatures),
                         "max_new_tokens": ev.max_new_tokens or self.max_new_tokens, "seed": ev.seed}}

    def _start_node(self, i: int) -> Entry:
        cfg, plan, name = self.cfg, self._node_plan, f"node-{i}"
        p = self.port("node")
        path = self._config(name, {
            "state_dir": str(self.state / name), "validators": plan["validators"],
            "key": {"key_env": "PRIME_DEVNET_NODE_KEY"},
            "chain": {"deployment": plan["deployment"], "rpc_url": plan["rpc_url"], "poll_s": 1.0},
            "engine": {"type": cfg.node_engine, "threads": cfg.node_threads}, "weights": plan["weights"],
            "preflight": {"skip": True}, "monitor": {"host": self.address(name), "port": p},
            "submit": {"max_pending": 4, "backoff_s": 0.2, "max_backoff_s": 5.0},
        })
        return self.table.start(
            name, "node", self.command(name, [PY, "-m", "node.cli", "join", "--config", str(path)]),
            env={"PRIME_DEVNET_NODE_KEY": dev_key_hex(self.accounts.node(i)), "OMP_NUM_THREADS": "1"},
            port=p, url=self.url(name, p))

    def add_node(self) -> dict[str, str]:
        """Start the next spare node (`spare_nodes`) on the running devnet: it stakes, registers and works
        like the others; returns its layout entry (also saved to devnet.json)."""
        if self.layout is None:
            raise DevnetError("the devnet is not up")
        i = len(self.layout.nodes)
        if i >= self.cfg.nodes + self.cfg.spare_nodes:
            raise DevnetError(f"no spare node left ({self.cfg.spare_nodes} configured: --spare-nodes)")
        entry = self._start_node(i)
        self._wait(entry, lambda: self._http_ok(f"{entry.url}/health"), "/health")
        node = {"name": entry.name, "url": str(entry.url), "address": dev_address(self.accounts.node(i))}
        self.layout.nodes.append(node)
        self.layout.save()
        return node

    def stop(self, grace_s: float = 10.0) -> None:
        order = [e.name for role in STOP_ORDER_ROLES for e in self.table.entries.values() if e.role == role]
        self.table.stop_all(order, grace_s)
        if self.hosts is not None:
            from devnet.hosts import HostsError, teardown

            try:
                teardown(self.state)
            except HostsError as exc:
                log.error("%s", exc)


def check_init(cfg: DevnetConfig, state: Path) -> Path | None:
    """The `--init` checkpoint, resolved, once it is known to be a checkpoint of `cfg.model`'s architecture and
    vocabulary (`models.checkpoint.check_compatible`); DevnetError otherwise. None without `--init`."""
    if cfg.init is None:
        return None
    init = cfg.init.expanduser().resolve()
    if cfg.fresh and init.is_relative_to(state):
        raise DevnetError(f"--init {init} lies inside the state directory {state}, which a fresh start removes: "
                          f"copy it elsewhere first")
    from models.checkpoint import check_compatible
    from protocol.errors import ModelError
    from protocol.model_spec import parse_model_spec

    try:
        check_compatible(init, parse_model_spec(model_defaults(cfg)[0]))
    except ModelError as exc:
        raise DevnetError(f"--init {cfg.init} cannot start a {cfg.model} run: {exc}") from None
    return init


def _refuse_if_foreign(state: Path) -> None:
    """`fresh` removes the state directory: only one a devnet made (or an empty one), never another folder."""
    if any(state.iterdir()) and not ((state / "processes.json").exists() or (state / LAYOUT).exists()):
        raise DevnetError(f"{state} is not empty and holds no devnet (no processes.json): not removing it; "
                          f"give another --state-dir")


def _refuse_if_running(state: Path) -> None:
    header, entries = ProcessTable.read(state)
    if any(e.alive() for e in entries):
        raise DevnetError(f"a devnet is running in {state} (pids {[e.pid for e in entries if e.alive()]}): "
                          f"`prime-devnet down --state-dir {state}` first")
