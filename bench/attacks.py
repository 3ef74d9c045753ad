"""Attack suite: a cheating node per attack against REAL validators, and hostile relays against real relays.

Everything runs on 127.0.0.1 with real parts: anvil with the pool deployed (`contracts.devchain`), two
validators served over HTTP by uvicorn (the run's validator set, so work is assigned by rendezvous
hashing and a node must post to the right one), a SHARDCAST origin with real relays, and the tiny
in-process transformer (or SmolLM2 with `--model smollm2`). The cheating nodes are
`bench.adversaries.SimNode` (honest work is `prime-node`'s own `node.rollouts.build_submission`); the
hostile relays are `bench.adversaries.FakeRelay` servers that proxy a real relay and alter what it serves.
The pool, the served validators and the other loopback parts are `bench.loopback`'s, as in the tests.

The `ep_*` rows attack multi-turn episodes (`submission` v2): a second pool on the same chain whose run is
`alphabet-sort` (`EPISODES`) and its own validator; each cheat is `bench.episode_adversaries.play` with one
named deviation in one episode, each expected to end in the verdict that names it, and `ep_honest` sends
`prime-node`'s own episode loop (1, 2 or 4 assignments a trial in smoke, quick and full runs: 320 honest
episodes in the full run), every one of which must be accepted.

Each attack runs `--trials` times, each trial with a fresh node key (so fresh tasks and sampling
seeds) and fresh perturbation seeds. A trial is *detected* when the work is not paid: a hard or
soft verdict, or a refusal (HTTP 4xx without a paid row); for relay attacks, when the client ends
with the genuine bytes (or refuses to install anything) and the lying relay was seen serving; for
work that is honest but lies inside a tolerance (steered logprobs), when it is accepted and what the
trainer reads from the validator's feed is the validator's own replay, not the node's claim. The
table shows the verdict classes and reason codes seen, the expected class, and for the proof-based
attacks the measurements next to the thresholds (the closest call over the trials).

The false-positive count comes from honest submissions (4 rollouts each) generated across batch sizes
(1, 4 or 8 assignments in one engine call), torch thread counts (1, 2) and the engine's fast and
generic (Hugging Face) decode paths; any honest submission not accepted is a false positive.

    python -m bench.attacks --json bench/measured/attacks.json       # tiny: 20 trials each, 1,000+ honest
    python -m bench.attacks --quick                                  # 3 trials each, 64 honest (a few minutes)
    python -m bench.attacks --smoke --json out.json                  # 1 trial each, 1 honest submission
    python -m bench.attacks --model smollm2 --only weight_noise      # the realistic model (slow)

Not a speed benchmark: the table is counts. The anchor is the honest run in the same process (its
margins against the thresholds); machine, threads, load and wall time are printed with it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import harness

VERSION = 3  # work is done at v3; v1 is outside the async window (stale), v9 is not on chain
GUARD = {"window_s": 1.0, "min_nodes": 3, "fraction": 0.5}
"""The validators' correlation guard (`systemic.*`): the defaults but for a short window."""
HANG_S = 600.0
"""How long a trial waits for state the validators reach (a registration seen, a submission decided) before it
calls it a hang: a bound, not a window (CI run 89: a smoke beside four other suites and two busy loops crashed a
row while waiting 30 s or 120 s for what came later)."""
KiB = 1024


def _episode_run() -> Any:
    from bench.loopback import RUN

    return RUN.model_copy(update={"run_id": "test-episodes", "env": "alphabet-sort", "env_version": "1",
                                  "max_new_tokens": 12})


EPISODES = _episode_run()
"""The multi-turn run of the episode rows: the harness's run on `alphabet-sort` (the tiny model never writes a
`<calc>` call), 12 tokens a turn."""


# -- results ------------------------------------------------------------------------------------------


@dataclass
class Trial:
    """What one attempt of an attack came to."""

    klass: str
    """accepted | hard | soft | refused | error (the attack's outcome as the attacker sees it)."""
    reason: str
    detected: bool
    margins: dict[str, float] = field(default_factory=dict)
    note: str = ""


@dataclass
class Attack:
    name: str
    label: str
    expect: str
    """The class this attack should get (hard, soft, refused, or accepted where the work itself is honest)."""
    run: Callable[[Any, int], Trial]
    tiny_only: bool = False


# -- the network: anvil, the pool, two validators -----------------------------------------------------


class Network:
    """anvil with the pool (the integration tests' settings), policy v1..v3 published, two validators."""

    def __init__(self, loaded: Any, spec: Any, tmp: Path) -> None:
        from bench import loopback
        from bench.loopback import (
            MANIFEST_V0,
            RUN,
            SETTINGS,
            TRAINER,
            VALIDATOR,
            Pools,
            serve,
            validator_config,
        )
        from contracts.deployment import deploy_pool
        from contracts.devchain import DevChain
        from contracts.pool import PoolClient
        from contracts.transactor import Transactor, connect
        from protocol.rollout import submission_domain

        self.loaded, self.tmp, self.run = loaded, tmp, RUN
        self.devchain = DevChain.start()
        c = self.devchain
        second = 7  # PUBLIC anvil dev account 7 holds the second validator role
        deployment = deploy_pool(
            Transactor(connect(c.rpc_url), c.account(loopback.ADMIN)),
            treasury=c.account(loopback.TREASURY).address, settings=SETTINGS,
            validators=[c.account(VALIDATOR).address, c.account(second).address],
            trainers=[c.account(TRAINER).address],
            mint={c.account(i).address: 100_000 * loopback.TOKEN for i in (loopback.ADMIN, loopback.OPERATOR)},
            fund_rewards=loopback.BUDGET)
        self.pools = Pools(c, deployment, *(PoolClient(connect(c.rpc_url), deployment.pool, c.account(i))
                                            for i in (loopback.ADMIN, VALIDATOR, TRAINER, loopback.OPERATOR,
                                                      loopback.OPERATOR2, loopback.STRANGER)))
        for v in range(1, VERSION + 1):
            self.pools.trainer.publish_policy(v, MANIFEST_V0)
        path = deployment.save(tmp / "deployment.json")
        self.validator_accounts = [c.account(VALIDATOR), c.account(second)]
        addresses = [a.address for a in self.validator_accounts]
        # The correlation guard is on, as deployed (a short window): every attack trial is a fresh node with no
        # accepted history, which weighs nothing in it; `sybil_shield` attacks the guard itself.
        self.validators = [serve(validator_config(tmp / f"v{i}", path, c.rpc_url, model=spec, validators=addresses,
                                                  systemic=GUARD), account)
                           for i, account in enumerate(self.validator_accounts)]
        self.domain = submission_domain(deployment.chain_id, deployment.pool, RUN.run_id)
        self.chain_id, self.pool = deployment.chain_id, deployment.pool
        self.max_bytes = self.validators[0].service.cfg.max_submission_bytes
        self.thresholds = self.validators[0].service.core.checker.thresholds
        self.hard_keys: list[tuple[Any, str]] = []
        self._second: tuple[Any, Any, str] | None = None
        self._episodes: tuple[Any, Any, str] | None = None
        self._split: Any = None
        self._renderer: Any = None

    def second_pool(self) -> tuple[Any, Any, str]:
        """(clients, validator, envelope domain) of a second pool on the same chain with the same run id and
        weights (v1..v3 published with the same manifest), deployed on first use."""
        if self._second is None:
            from bench import loopback
            from bench.loopback import (
                MANIFEST_V0,
                SETTINGS,
                TRAINER,
                VALIDATOR,
                Pools,
                serve,
                validator_config,
            )
            from contracts.deployment import deploy_pool
            from contracts.pool import PoolClient
            from contracts.transactor import Transactor, connect
            from protocol.rollout import submission_domain

            c = self.devchain
            deployment = deploy_pool(
                Transactor(connect(c.rpc_url), c.account(loopback.ADMIN)),
                treasury=c.account(loopback.TREASURY).address, settings=SETTINGS,
                validators=[c.account(VALIDATOR).address], trainers=[c.account(TRAINER).address],
                mint={c.account(loopback.OPERATOR).address: 100_000 * loopback.TOKEN},
                fund_rewards=loopback.BUDGET)
            pools = Pools(c, deployment, *(PoolClient(connect(c.rpc_url), deployment.pool, c.account(i))
                                           for i in (loopback.ADMIN, VALIDATOR, TRAINER, loopback.OPERATOR,
                                                     loopback.OPERATOR2, loopback.STRANGER)))
            for v in range(1, VERSION + 1):
                pools.trainer.publish_policy(v, MANIFEST_V0)
            served = serve(validator_config(self.tmp / "pool2", deployment.save(self.tmp / "pool2.json"), c.rpc_url,
                                            model=self.validators[0].service.cfg.model,
                                            systemic={"window_s": 0.5, "min_nodes": 1_000_000, "fraction": 1.0}),
                           c.account(VALIDATOR))
            self._second = (pools, served, submission_domain(deployment.chain_id, deployment.pool, self.run.run_id))
        return self._second

    def episode_pool(self) -> tuple[Any, Any, str]:
        """(clients, validator, envelope domain) of a pool on the same chain whose run is multi-turn (`EPISODES`:
        `alphabet-sort`, the run's other settings), v1..v3 published, one validator; deployed on first use."""
        if self._episodes is None:
            from bench import loopback
            from bench.loopback import (
                MANIFEST_V0,
                SETTINGS,
                TRAINER,
                Pools,
                serve,
                validator_config,
            )
            from contracts.deployment import deploy_pool
            from contracts.pool import PoolClient
            from contracts.transactor import Transactor, connect
            from protocol.rollout import submission_domain

            c = self.devchain
            v = 8  # PUBLIC anvil dev account 8, no other role: its reporter's nonces are its own
            deployment = deploy_pool(
                Transactor(connect(c.rpc_url), c.account(loopback.ADMIN)),
                treasury=c.account(loopback.TREASURY).address, settings=SETTINGS,
                validators=[c.account(v).address], trainers=[c.account(TRAINER).address],
                mint={c.account(loopback.OPERATOR).address: 1_000_000 * loopback.TOKEN},
                fund_rewards=loopback.BUDGET)
            pools = Pools(c, deployment, *(PoolClient(connect(c.rpc_url), deployment.pool, c.account(i))
                                           for i in (loopback.ADMIN, v, TRAINER, loopback.OPERATOR,
                                                     loopback.OPERATOR2, loopback.STRANGER)))
            for version in range(1, VERSION + 1):
                pools.trainer.publish_policy(version, MANIFEST_V0)
            served = serve(validator_config(self.tmp / "episodes", deployment.save(self.tmp / "episodes.json"),
                                            c.rpc_url, run=EPISODES, model=self.validators[0].service.cfg.model,
                                            systemic=GUARD), c.account(v))
            self._episodes = (pools, served, submission_domain(deployment.chain_id, deployment.pool, EPISODES.run_id))
        return self._episodes

    def split_pool(self) -> Any:
        """`SplitPool`: a pool on the same chain whose two validators are each other's peers, the second reaching the
        first through a TCP proxy that is closed (so the first is down to it, and to it alone); deployed on first use."""
        if self._split is None:
            self._split = SplitPool(self)
        return self._split

    def episode_node(self, search_eos: bool = False) -> tuple[Any, Any]:
        """(a node key registered in the episode pool, its assignment #0 at `VERSION`); with `search_eos`, a key
        whose honest first turns hold an EOS a `skip_eos` cheat replaces, and that episode (task, sample)."""
        from bench.episode_adversaries import narrow_first_eos
        from bench.loopback import SETTINGS
        from protocol.identity import Identity

        pools, served, _ = self.episode_pool()
        where = (0, 0)
        if search_eos:
            drift = served.service.cfg.checks.eos_tie_drift
            for _ in range(16):
                keys = {(k := Identity.create()).address: k for _ in range(32)}
                try:
                    at, where = narrow_first_eos(self.loaded, EPISODES, [self._assignment(a) for a in keys],
                                                 above=drift, batch=128)
                except LookupError:
                    continue
                identity = keys[at.node]
                break
            else:
                raise LookupError("no key among 512 has a narrow EOS in its first turns")
        else:
            identity = Identity.create()
        pools.operator.register(identity, SETTINGS.min_stake)
        deadline = time.monotonic() + 30
        while not served.service.chain.node_active(identity.address):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the episode validator did not see {identity.address} registered")
            time.sleep(0.02)
        return identity, (self._assignment(identity.address), where)

    def _assignment(self, node: str) -> Any:
        from bench.episode_adversaries import Assignment
        from bench.loopback import MANIFEST_V0
        from protocol.rollout import submission_venue

        chain_id, pool = submission_venue(self.episode_pool()[2])
        return Assignment(node, VERSION, 0, MANIFEST_V0, chain_id, pool)

    def stop(self) -> None:
        for v in self.validators:
            v.stop()
        if self._second is not None:
            self._second[1].stop()
        if self._episodes is not None:
            self._episodes[1].stop()
        if self._split is not None:
            self._split.stop()
        self.devchain.stop()

    def node(self, register: bool = True) -> Any:
        from bench.adversaries import SimNode
        from protocol.identity import Identity

        identity = self.pools.new_node() if register else Identity.create()
        if register:  # validators learn registrations from pool events (polled): wait until both have seen it
            self.wait_active(identity.address)
        return SimNode(identity, self.loaded, self.domain)

    def node_at(self, served: Any, version: int = VERSION) -> Any:
        """A registered node whose work at `version` goes to `served` (a key ground offline, as a Sybil would)."""
        from bench.adversaries import SimNode
        from bench.loopback import SETTINGS
        from protocol.identity import Identity

        while True:
            identity = Identity.create()
            node = SimNode(identity, self.loaded, self.domain)
            if self.assigned(node, version)[0] is served:
                self.pools.operator.register(identity, SETTINGS.min_stake)
                self.wait_active(identity.address)
                return node

    def wait_active(self, address: str, timeout: float = HANG_S) -> None:
        deadline = time.monotonic() + timeout
        while not all(v.service.chain.node_active(address) for v in self.validators):
            if time.monotonic() > deadline:
                raise TimeoutError(f"validators did not see {address} registered within {timeout} s")
            time.sleep(0.02)

    def assigned(self, node: Any, version: int = VERSION) -> tuple[Any, Any]:
        """(the validator that takes this node's work at `version`, the other one)."""
        from protocol.seeds import validator_ranking

        first = validator_ranking(self.run.run_id, node.identity.address, version,
                                  [a.address for a in self.validator_accounts])[0]
        a, b = self.validators
        return (a, b) if a.service.identity.address == first else (b, a)

    def post(self, served: Any, data: bytes, retries: int = 20) -> tuple[int, dict[str, Any]]:
        with served.client() as c:
            for _ in range(retries):
                r = c.post("/v1/submissions", content=data)
                # an honest node waits out its rate limit, and a validator's own trouble (503: its chain view or
                # backlog), as prime-node does
                if r.status_code not in (429, 503):
                    return r.status_code, dict(r.json())
                time.sleep(float(r.headers.get("Retry-After", "1")))
        return r.status_code, dict(r.json())

    def outcome(self, served: Any, status: int, body: dict[str, Any], expect_reasons: set[str] | None = None,
                timeout: float = HANG_S) -> Trial:
        """Post-answer to a Trial: decided rows become hard/soft/accepted, 4xx without a row `refused`."""
        if status in (200, 202):
            row = served.wait_decided(body["work_key"], timeout)
            klass = {"accepted": "accepted", "rejected_hard": "hard", "rejected_soft": "soft"}[row["outcome"]]
            if klass == "hard":
                self.hard_keys.append((served, row["work_key"]))
            ok = klass != "accepted" and (expect_reasons is None or row["reason"] in expect_reasons)
            return Trial(klass, row["reason"], ok, margins=_margins(row))
        return Trial("refused", str(body.get("error")), 400 <= status < 500, note=f"HTTP {status}")

    def submit(self, node: Any, data: bytes, version: int = VERSION, **kw: Any) -> Trial:
        served, _ = self.assigned(node, version)
        status, body = self.post(served, data)
        return self.outcome(served, status, body, **kw)

    def on_chain(self) -> tuple[int, int]:
        """(hard verdicts invalidated and slashed on chain, hard verdicts): waits for the reporters."""
        from contracts.pool import WorkStatus

        slashed = 0
        for served, key in self.hard_keys:
            if not self.reported(served, key):
                continue
            pools = self._episodes[0] if self._episodes is not None and served is self._episodes[1] else self.pools
            slashed += pools.admin.get_work(key).status == WorkStatus.HARD_INVALIDATED
        return slashed, len(self.hard_keys)

    @staticmethod
    def reported(served: Any, key: str) -> bool:
        """Whether the hard verdict on `key` left `served`'s outbox within 60 s."""
        try:
            served.wait_reported(key, timeout=60)
        except AssertionError:
            return False
        return True


class SplitPool:
    """Issue 35 item 7's stage: validators A and B of one pool, each the other's peer. A's reporter runs only when
    a trial says (`report`), so A's acceptance is off chain while the node moves on, as in the round after A took
    it; B reaches A through a proxy, closed at once, so A is down to B (B covers A's work) and up to everyone else.
    Their keys are fresh, funded on the dev chain (no other pool's transactions share their nonces)."""

    def __init__(self, net: Network) -> None:
        from urllib.parse import urlparse

        from bench import loopback
        from bench.loopback import (
            MANIFEST_V0,
            REPORTER_MAX_BACKOFF_S,
            SETTINGS,
            TRAINER,
            Pools,
            ProxyProcess,
            serve,
            validator_config,
        )
        from contracts.deployment import deploy_pool
        from contracts.pool import PoolClient
        from contracts.transactor import Transactor, connect
        from protocol.identity import Identity
        from protocol.rollout import submission_domain

        c = net.devchain
        keys = [Identity.create(), Identity.create()]
        for k in keys:
            c.rpc("anvil_setBalance", [k.address, hex(10**21)])
        deployment = deploy_pool(
            Transactor(connect(c.rpc_url), c.account(loopback.ADMIN)),
            treasury=c.account(loopback.TREASURY).address, settings=SETTINGS,
            validators=[k.address for k in keys], trainers=[c.account(TRAINER).address],
            mint={c.account(loopback.OPERATOR).address: 1_000_000 * loopback.TOKEN}, fund_rewards=loopback.BUDGET)
        self.pools = Pools(c, deployment, *(PoolClient(connect(c.rpc_url), deployment.pool, c.account(i))
                                            for i in (loopback.ADMIN, loopback.VALIDATOR, TRAINER, loopback.OPERATOR,
                                                      loopback.OPERATOR2, loopback.STRANGER)))
        for version in range(1, VERSION + 1):
            self.pools.trainer.publish_policy(version, MANIFEST_V0)
        path = deployment.save(net.tmp / "split.json")
        self.domain = submission_domain(deployment.chain_id, deployment.pool, net.run.run_id)
        self.addresses = [k.address for k in keys]
        model = net.validators[0].service.cfg.model
        # B reaches A only through a proxy, listening from the start (B's peer list names it), forwarding once A
        # listens: B identifies A through it, then
        self.proxy = ProxyProcess(None)
        self.b = serve(validator_config(net.tmp / "split-b", path, c.rpc_url, model=model, validators=self.addresses,
                                        peers=[self.proxy.url], failover_after_s=0.5, systemic=GUARD), keys[1])
        self.a = serve(validator_config(net.tmp / "split-a", path, c.rpc_url, model=model, validators=self.addresses,
                                        peers=[self.b.url], systemic=GUARD, pool_notes={"crosscheck_s": 0.2},
                                        reporter={"interval_s": 3600.0, "max_backoff_s": REPORTER_MAX_BACKOFF_S}),
                       keys[0])
        self.proxy.forward_to(int(urlparse(self.a.url).port or 0))
        self._until(lambda: self.addresses[0] in self.b.service.peers.urls(), "B never identified A")
        self.proxy.close()  # it is gone, and A is down to B alone
        self._until(lambda: self.b.service.peers.down(self.addresses[0]), "B never saw A down")
        self._until(lambda: self.addresses[1] in self.a.service.peers.urls(), "A never identified B")

    @staticmethod
    def _until(done: Callable[[], object], what: str, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                raise TimeoutError(what)
            time.sleep(0.05)

    def node(self, net: Network) -> Any:
        """A registered node whose work at `VERSION` is A's (a key ground offline)."""
        from bench.adversaries import SimNode
        from bench.loopback import SETTINGS
        from protocol.identity import Identity
        from protocol.seeds import validator_ranking

        while True:
            identity = Identity.create()
            if validator_ranking(net.run.run_id, identity.address, VERSION, self.addresses)[0] == self.addresses[0]:
                break
        self.pools.operator.register(identity, SETTINGS.min_stake)
        self._until(lambda: all(v.service.chain.node_active(identity.address) for v in (self.a, self.b)),
                    f"the split pool's validators did not see {identity.address} registered")
        return SimNode(identity, net.loaded, self.domain)

    def report(self, key: str, status: Any) -> None:
        """A's reporter rounds (its hard verdicts are held `systemic.window_s` first; an RPC that fails pauses it) until
        the chain shows `status` for `key`."""
        self._until(lambda: self.a.service.reporter.drain() >= 0 and self.pools.admin.get_work(key).status == status,
                    f"A's report of {key} never showed {status.name} on chain")

    def stop(self) -> None:
        self.a.stop()
        self.b.stop()
        self.proxy.close()


def split_assignment(resend_same: bool) -> Callable[[Any, int], Trial]:
    """Issue 35 item 7: the node's assignment #0 to its validator A (accepted, not on chain yet), then to B, which
    covers for A while A is down to it: another payload (logprobs steered inside the tolerance, which B accepts and
    records) or, as an honest node that failed over, the same payload sealed again. Detected: the split is slashed
    on chain (A's cross-check finds B's record and B's envelope: `equivocation`); the resend costs nothing (both
    rows stay accepted, nothing invalidated)."""
    def run(net: Any, trial: int) -> Trial:
        from bench.adversaries import steer_logprobs
        from contracts.pool import NodeStatus, WorkStatus

        split = net.split_pool()
        node = split.node(net)
        sub, data = node.build(version=VERSION, counter=0)
        _, first = net.post(split.a, data)
        key = first["work_key"]
        if split.a.wait_decided(key, 180)["outcome"] != "accepted":
            return Trial("error", "A did not accept the honest payload", False)
        again = node.seal(sub if resend_same else steer_logprobs(sub))
        status, body = net.post(split.b, again)
        if status not in (200, 202) or split.b.wait_decided(key, 180)["outcome"] != "accepted":
            return Trial("refused", str(body.get("error")), False, note=f"B answered {status}")
        pool = split.pools.admin
        split._until(lambda: pool.get_work(key).status == WorkStatus.ACCEPTED, "B never recorded the work")
        # per key: a count read after B's record could already include A's comparison (it runs every 0.2 s), and
        # would then wait for one that never comes (the project's CI of a754c60)
        split._until(lambda: split.a.service.crosscheck.judged(key), "A never compared its payload with B's")
        row = split.a.service.ledger.get(key)
        if resend_same:
            split.report(key, WorkStatus.ACCEPTED)  # A's own record is skipped: B's stands
            after = split.a.service.ledger.get(key)
            kept = row.outcome == "accepted" and after is not None and after.outcome == "accepted"
            return Trial("accepted", row.reason or "the same payload resent", kept,
                         note="an honest resend to the covering validator: no verdict, nothing invalidated")
        split.report(key, WorkStatus.HARD_INVALIDATED)
        ejected = pool.get_node(node.identity.address).status == NodeStatus.EJECTED
        return Trial("hard", str(row.reason), row.reason == "equivocation" and ejected,
                     note="split between A and B (covering): slashed once A saw B's record")
    return run


def _margins(row: dict[str, Any]) -> dict[str, float]:
    samples = (row.get("measurements") or {}).get("samples") or []
    chunks = [ch for s in samples for ch in s.get("toploc") or []]
    if not chunks:
        return {}
    return {"exp": max(ch[0] for ch in chunks), "mean": max(ch[1] for ch in chunks),
            "median": max(ch[2] for ch in chunks),
            "sampling_mismatches": max(len(s.get("sampling_mismatches") or []) for s in samples),
            "sampling_max_margin": max(float(s.get("sampling_max_margin") or 0.0) for s in samples),
            "logprob_max_error": max(float(s.get("logprob_max_error") or 0.0) for s in samples)}


# -- models a cheater runs instead ------------------------------------------------------------------


def perturbed(loaded: Any, scale: float, seed: int) -> Any:
    """A copy of `loaded` with every weight multiplied by (1 + scale * N(0, 1))."""
    from bench.adversaries import perturbed as noised

    return noised(loaded, scale, seed)


def lower_precision(loaded: Any, dtype: str) -> Any:
    """A copy of `loaded` whose weights were rounded to `dtype` (computed in the claimed dtype)."""
    import copy

    import torch

    other = copy.copy(loaded)
    other.model = copy.deepcopy(loaded.model)
    with torch.no_grad():
        for p in other.model.parameters():
            p.copy_(p.to(getattr(torch, dtype)).to(p.dtype))
    return other


def other_model(net: Any, trial: int) -> Any:
    """A different model with the same tokenizer: another seed of the tiny model, or a 10%-noised copy."""
    if net.spec_type == "tiny":
        from bench.loopback import tiny

        return tiny(1000 + trial)
    return perturbed(net.loaded, 0.10, 9000 + trial)


# -- attacks on the validator ---------------------------------------------------------------------


def cheat(name: str, model: Callable[[Any, int], Any] | None = None, expect: set[str] | None = None
          ) -> Callable[[Any, int], Trial]:
    def run(net: Any, trial: int) -> Trial:
        node = net.node()
        _, data = node.build(version=VERSION, cheat=name, model=model(net, trial) if model else None)
        return net.submit(node, data, expect_reasons=expect)
    return run


def stale(net: Any, trial: int) -> Trial:
    """Stale work is refused at intake (410), no row, no transaction (issue 35 item 3; it used to be a soft row)."""
    node = net.node()
    _, data = node.build(version=1)
    t = net.submit(node, data, version=1)
    t.detected = t.klass == "refused" and t.reason == "stale_version"
    return t


def stale_junk_flood(net: Any, trial: int) -> Trial:
    """Issue 35 item 3: one staked key sends 24 stale submissions (a row and an `invalidateSoft` each, before) and
    then junk at the current version as fast as it is answered. Detected when the key cost the validator at most
    one ledger row (its first junk, slashed) and no transaction for its stale work, and an honest node sent
    alongside is accepted."""
    from contracts.pool import WorkStatus

    attacker, honest = net.node(), net.node()
    served, _ = net.assigned(attacker, 1)
    stale_keys, statuses = [], Counter[str]()
    # every payload is built before its connection opens: building one takes seconds on a loaded box, and a
    # connection idle past the validator's keep-alive (5 s) is closed under the next request (CI runs 68, 69)
    stale = [attacker.build(version=1, counter=k, cheat="junk" if k % 2 else None)[1] for k in range(24)]
    with served.client() as c:
        for k, data in enumerate(stale):
            stale_keys.append("0x" + net.pools.work_key(net.run.run_id, attacker.identity.address, 1, k).hex())
            r = c.post("/v1/submissions", content=data)
            statuses[f"{r.status_code} {r.json().get('error') or r.json().get('reason')}"] += 1
    mine, _ = net.assigned(attacker)
    junk = [attacker.build(version=VERSION, counter=k, cheat="junk")[1] for k in range(8)]
    with mine.client() as c:
        for data in junk:  # junk at v3: the first is a hard verdict, the rest wait behind it (429) or are refused
            r = c.post("/v1/submissions", content=data)
            statuses[f"{r.status_code} {r.json().get('error') or r.json().get('reason')}"] += 1
            if r.status_code in (200, 202) and r.json().get("outcome") == "rejected_hard":
                net.hard_keys.append((mine, r.json()["work_key"]))
    honest_t = net.submit(honest, honest.build(version=VERSION)[1])
    rows = sum(sum(n.values()) for v in net.validators
               for n in v.service.ledger.node_summary(attacker.identity.address)["verdicts"].values())
    untouched = all(net.pools.admin.get_work(k).status == WorkStatus.NONE for k in stale_keys)
    ok = rows <= 1 and untouched and honest_t.klass == "accepted"
    return Trial("refused" if ok else "error", "stale_version", ok,
                 note=f"rows {rows}, stale keys untouched on chain {untouched}, honest {honest_t.klass}; "
                      + ", ".join(f"{k} x{n}" for k, n in sorted(statuses.items())))


def dup_same_payload(net: Any, trial: int) -> Trial:
    """The same payload sealed again (fresh nonce) to the same validator: the same answer, one row."""
    node = net.node()
    sub, data = node.build(version=VERSION)
    served, _ = net.assigned(node)
    status, first = net.post(served, data)
    served.wait_decided(first["work_key"])
    status2, second = net.post(served, node.seal(sub))
    detected = status2 == 200 and second.get("submission_hash") == first["submission_hash"]
    return Trial("refused", "same_answer" if detected else f"HTTP {status2}", detected,
                 note="resealed payload answered with the first row")


def dup_diff_payload(net: Any, trial: int) -> Trial:
    """A second, different payload for an assignment to the same validator: equivocation (hard)."""
    node = net.node()
    _, data = node.build(version=VERSION, counter=0)
    served, _ = net.assigned(node)
    _, first = net.post(served, data)
    served.wait_decided(first["work_key"])
    _, other = node.build(version=VERSION, counter=0, cheat="other_seed" if trial % 2 else "inflate_reward")
    status, body = net.post(served, other)
    if status != 409:
        return Trial("accepted" if status in (200, 202) else "refused", str(body.get("error")), False)
    row = served.wait_decided(first["work_key"])
    if row["outcome"] == "rejected_hard":
        net.hard_keys.append((served, row["work_key"]))
    return Trial("hard" if row["outcome"] == "rejected_hard" else row["outcome"], row["reason"],
                 row["outcome"] == "rejected_hard" and row["reason"] == "equivocation", note="409 duplicate_work")


def resigned_recorded(net: Any, trial: int) -> Trial:
    """A node re-signs a different payload for its own old work, already recorded on chain and past its
    invalidation window, so the equivocation verdict's `invalidateHard` reverts forever; it must not stop the
    validator reporting: detected = that verdict leaves the outbox as `unreportable` (with the revert), and work
    submitted afterwards still lands (an honest node's recorded, a cheater's slashed)."""
    from bench.loopback import SETTINGS
    from contracts.pool import WorkStatus

    node = net.node()
    sub, data = node.build(version=VERSION)
    served, _ = net.assigned(node)
    _, first = net.post(served, data)
    key = first["work_key"]
    if served.wait_reported(key)["outcome"] != "accepted":
        return Trial("error", "honest work not accepted", False)
    for at, hard in net.hard_keys:  # the earlier rows' hard verdicts land first: the clock jump would close
        net.reported(at, hard)     # their windows too, and `on_chain` would count them as never slashed
    net.devchain.rpc("evm_increaseTime", [SETTINGS.invalidation_window + 10])  # its window closes
    net.devchain.rpc("evm_mine")
    s0 = sub.tasks[0].samples[0]
    other = sub.model_copy(update={"tasks": (sub.tasks[0].model_copy(update={"samples": (
        s0.model_copy(update={"reward": s0.reward + 1.0}), *sub.tasks[0].samples[1:])}), *sub.tasks[1:])})
    status, _ = net.post(served, node.seal(other))
    honest, cheater = net.node(), net.node()
    h_served, _ = net.assigned(honest)
    c_served, _ = net.assigned(cheater)
    _, h = net.post(h_served, honest.build(version=VERSION)[1])
    _, b = net.post(c_served, cheater.build(version=VERSION, cheat="other_seed")[1])
    try:
        h_served.wait_reported(h["work_key"], timeout=60)
        c_served.wait_reported(b["work_key"], timeout=60)
    except AssertionError:
        return Trial("hard", "reporting blocked", False, note=f"re-sign HTTP {status}")
    deadline = time.monotonic() + 60
    while (row := served.service.ledger.get(key)) is not None and row.state == "decided" \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    landed = net.pools.admin.get_work(h["work_key"]).status == WorkStatus.ACCEPTED \
        and net.pools.admin.get_work(b["work_key"]).status == WorkStatus.HARD_INVALIDATED
    stuck = row is not None and row.state == "unreportable" and "InvalidationWindowClosed" in (row.report_error or "")
    return Trial("hard", f"{row.reason if row else '-'}: {row.state if row else '-'}", status == 409 and landed and stuck,
                 note="other work still lands")


def dup_two_validators(different: bool) -> Callable[[Any, int], Trial]:
    """The assignment to its validator and again (same or another payload) to the other validator."""
    def run(net: Any, trial: int) -> Trial:
        node = net.node()
        sub, data = node.build(version=VERSION, counter=0)
        mine, other = net.assigned(node)
        _, first = net.post(mine, data)
        mine.wait_decided(first["work_key"])
        if different:
            _, again = node.build(version=VERSION, counter=0, cheat="inflate_reward")
        else:
            again = node.seal(sub)
        status, body = net.post(other, again)
        rows = other.service.ledger.get(first["work_key"])
        return Trial("refused" if status >= 400 else "accepted", str(body.get("error")),
                     status == 421 and rows is None, note="second validator refuses, keeps no row")
    return run


def replayed_envelope(net: Any, trial: int) -> Trial:
    """Exactly the same bytes again: to the same validator (the same answer) or to the other (421)."""
    node = net.node()
    _, data = node.build(version=VERSION)
    mine, other = net.assigned(node)
    _, first = net.post(mine, data)
    mine.wait_decided(first["work_key"])
    if trial % 2 == 0:
        status, body = net.post(mine, data)
        ok = status == 200 and body.get("submission_hash") == first["submission_hash"] \
            and mine.service.ledger.get(first["work_key"]) is not None
        return Trial("refused", "same_answer" if ok else str(body.get("error")), ok)
    status, body = net.post(other, data)
    return Trial("refused", str(body.get("error")), status == 421)


def forged_signature(net: Any, trial: int) -> Trial:
    """Another key's signature on a victim's submission, or a signed body altered afterwards."""
    from protocol.canonical import canonical_bytes
    from protocol.envelope import Envelope, seal
    from protocol.identity import Identity
    from protocol.nonce import random_nonce

    victim = net.node()
    sub, data = victim.build(version=VERSION)
    env = json.loads(data)
    attacker = Identity.create()
    variant = trial % 3
    if variant == 0:  # the victim's header, the attacker's signature
        signed = Envelope.model_validate_json(data)
        env["signature"] = "0x" + attacker.sign_message(signed.signing_bytes()).hex()
    elif variant == 1:  # the signed body altered after signing (a higher reward)
        env["body"]["tasks"][0]["samples"][0]["reward"] = 1.0 if env["body"]["tasks"][0]["samples"][0]["reward"] != 1.0 \
            else 0.0
    else:  # a registered attacker seals the victim's work as its own envelope
        thief = net.pools.new_node()
        net.wait_active(thief.address)
        env = json.loads(seal(thief, sub, domain=net.domain, nonce=random_nonce()).to_bytes())
    served, _ = net.assigned(victim)
    status, body = net.post(served, canonical_bytes(env))
    return net.outcome(served, status, body)


def steered_logprobs(net: Any, trial: int) -> Trial:
    """Honest work whose claimed sampling logprobs are moved 0.49 nats (inside the 0.5 tolerance) against
    the sign of each sample's advantage, so that a trainer using them would clip every token away. The work
    is honest, so it is accepted and paid; detected = what the trainer reads from the validator's signed
    feed (the same `open_envelope` + `feed_groups` path as trainer/validator_feed.py) are the logprobs of
    the validator's own replay (`Checker.measure`), not the node's claims."""
    from bench.adversaries import STEER
    from protocol.envelope import Envelope, open_envelope
    from protocol.rollout import FeedItem
    from protocol.rollout_files import feed_groups

    node = net.node()
    sub, data = node.build(version=VERSION, cheat="steer_logprobs")
    served, _ = net.assigned(node)
    status, body = net.post(served, data)
    t = net.outcome(served, status, body)
    if t.klass != "accepted":
        return Trial(t.klass, t.reason, False, t.margins, note="honest tokens not accepted")
    key = body["work_key"]
    with served.client() as c:
        listed = [i for i in c.get("/v1/feed", params={"after": 0, "limit": 1024}).json()["items"]
                  if i["work_key"] == key]
    if not listed:
        return Trial("accepted", "not in the feed", False)
    svc = served.service
    item = open_envelope(Envelope.from_bytes(listed[0]["envelope"].encode(), max_bytes=net.max_bytes), domain=svc.domain,
                         replay_guard=_AnyNonce(), expected_signer=svc.identity.address, body_types=[FeedItem])
    assert isinstance(item, FeedItem)
    fed = [tuple(lp for lp, m in zip(s.sampling_logprobs, s.loss_mask, strict=True) if m)
           for g in feed_groups(item) for s in g]
    loaded = svc.weights.get(VERSION)
    tasks = svc.core.assignment.tasks(sub.node, sub.policy_version, sub.counter)
    (reports,) = svc.core.checker.measure(loaded, [(sub, tasks)])
    claimed = [s.logprobs for tr in sub.tasks for s in tr.samples]
    to_replay = max(abs(a - b) for f, r in zip(fed, reports, strict=True) for a, b in zip(f, r.logprobs, strict=True))
    to_claim = max(abs(a - b) for f, c in zip(fed, claimed, strict=True) for a, b in zip(f, c, strict=True))
    detected = to_replay < 1e-5 and to_claim > STEER - 0.01
    return Trial("accepted", "trainer gets the replay" if detected else "trainer gets the claim", detected,
                 t.margins, note=f"fed vs replay {to_replay:.1e}, fed vs claim {to_claim:.2f}")


class _AnyNonce:
    """The trainer's replay guard for feed items (it de-duplicates by work key instead)."""

    def check_and_record(self, *args: Any, **kw: Any) -> None:
        return None


def _with_proofs(sub: Any, change: Callable[[int, list[bytes], random.Random], list[bytes]], rng: random.Random) -> Any:
    tasks, j = [], 0
    for tr in sub.tasks:
        samples = []
        for s in tr.samples:
            samples.append(s.model_copy(update={"proofs": tuple(change(j, list(s.proofs), rng))}))
            j += 1
        tasks.append(tr.model_copy(update={"samples": tuple(samples)}))
    return sub.model_copy(update={"tasks": tuple(tasks)})


MALFORMED: list[tuple[str, Callable[[int, list[bytes], random.Random], list[bytes]]]] = [
    ("random bytes", lambda j, p, rng: [rng.randbytes(258) if j == 0 and k == 0 else x for k, x in enumerate(p)]),
    ("all 0xff", lambda j, p, rng: [b"\xff" * 258 if j == 0 else x for x in p]),
    ("all zero", lambda j, p, rng: [bytes(258) if j == 1 else x for x in p]),
    ("truncated", lambda j, p, rng: [x[:100] if j == 0 else x for x in p]),
    ("one missing", lambda j, p, rng: p[:-1] if j == 0 else p),
    ("one extra", lambda j, p, rng: p + [p[0]] if j == 0 else p),
    ("coefficient bit flipped", lambda j, p, rng: [_flip_coefficient(x, rng) if j == 0 and k == 0 else x
                                                  for k, x in enumerate(p)]),
]


def _flip_coefficient(proof: bytes, rng: random.Random) -> bytes:
    """One bit of one coefficient flipped (bytes 2..257; bytes 0-1 are the index modulus, which any value
    above every index makes equivalent: flipping a bit there proves the same thing)."""
    at = rng.randrange(2, len(proof))
    return proof[:at] + bytes([proof[at] ^ (1 << rng.randrange(8))]) + proof[at + 1:]


def malformed_proofs(net: Any, trial: int) -> Trial:
    name, change = MALFORMED[trial % len(MALFORMED)]
    node = net.node()
    sub, _ = node.build(version=VERSION)
    data = node.seal(_with_proofs(sub, change, random.Random(trial)))
    t = net.submit(node, data)
    t.note = name
    t.detected = t.detected and t.klass == "hard"
    return t


def oversized(net: Any, trial: int) -> Trial:
    """A body one byte over the limit: with Content-Length, or streamed chunked with no length."""
    import httpx

    node = net.node()
    served, _ = net.assigned(node)
    body = b'{"kind":"' + b"x" * (net.max_bytes + 1) + b'"}'
    with httpx.Client(base_url=served.url, timeout=60) as c:
        if trial % 2 == 0:
            r = c.post("/v1/submissions", content=body)
        else:
            r = c.post("/v1/submissions", content=iter([body[i:i + 65536] for i in range(0, len(body), 65536)]))
    try:
        error = str(r.json().get("error"))
    except ValueError:
        error = r.text[:40]
    return Trial("refused", error, r.status_code == 413, note="chunked" if trial % 2 else "content-length")


def slow_uploads(net: Any, trial: int) -> Trial:
    """Issue 35 item 1: 16 slow uploads from no key (headers and one body byte, then nothing; from four source
    addresses), 8 connections that never finish their headers and a fresh key's signed header, all held open at
    the validator a staked node's work goes to, while that node submits honest work with its upload header (as
    prime-node does). Detected when the honest work is accepted during the attack (16 slow uploads once held
    every intake slot and the node got 503 on every try)."""
    import socket
    from urllib.parse import urlparse

    from protocol.identity import Identity
    from protocol.upload import upload_headers

    node = net.node()
    served, _ = net.assigned(node)
    u = urlparse(served.url)
    me = served.service.identity.address

    def connect(first: bytes, source: str = "127.0.0.1") -> socket.socket:
        s = socket.create_connection((u.hostname, u.port), timeout=60, source_address=(source, 0))
        s.sendall(first)
        return s

    post = b"POST /v1/submissions HTTP/1.1\r\nHost: x\r\nContent-Length: 2000\r\n"
    stranger = upload_headers(Identity.create(), b"{" + b" " * 1999, domain=net.domain, validator=me,
                              path="/v1/submissions")
    held = [connect(post + b"\r\n{", f"127.0.0.{2 + (trial + i) % 4}") for i in range(16)]
    held += [connect(b"POST /v1/sub") for _ in range(8)]
    held.append(connect(post + "".join(f"{k}: {v}\r\n" for k, v in stranger.items()).encode() + b"\r\n{"))
    try:
        _, data = node.build(version=VERSION)
        with served.client() as c:
            r = c.post("/v1/submissions", content=data, headers=upload_headers(
                node.identity, data, domain=net.domain, validator=me, path="/v1/submissions"))
        status, body = r.status_code, dict(r.json())
    finally:
        for s in held:
            s.close()
    if status not in (200, 202):
        return Trial("refused", str(body.get("error")), False, note=f"HTTP {status} during the attack")
    row = served.wait_decided(body["work_key"])
    accepted = row["outcome"] == "accepted"
    return Trial("accepted" if accepted else row["outcome"], row["reason"] or "honest work accepted", accepted,
                 note="honest work accepted during 16 slow no-key uploads" if accepted else "")


def sybil_shield(net: Any, trial: int) -> Trial:
    """Issue 23 item 1: 4 established honest nodes at one validator; 4 Sybil keys ground onto it send free junk
    (counters out of range, one-token samples) while a fifth proves a noised copy of the weights (TOPLOC just
    over the limits, the drift band). Detected when the noised work and every junk submission are hard."""
    from bench.adversaries import perturbed

    served = net.validators[trial % 2]
    honest = [net.node_at(served) for _ in range(4)]
    keys = [net.post(served, n.build(version=VERSION)[1])[1]["work_key"] for n in honest]
    for k in keys:
        served.wait_decided(k)
    time.sleep(GUARD["window_s"] + 0.2)  # their history now lies before the guard's window
    sybils = [net.node_at(served) for _ in range(5)]
    junk = [s.build(version=VERSION, counter=10**6 if i % 2 else None, cheat="junk")[1]
            for i, s in enumerate(sybils[:4])]
    _, noised = sybils[4].build(version=VERSION, cheat="other_weights",
                                model=perturbed(net.loaded, 0.07 if net.spec_type == "tiny" else 0.02, 500 + trial))
    for n in honest:
        net.post(served, n.build(version=VERSION)[1])
    junk_trials = [net.outcome(served, *net.post(served, data)) for data in junk]
    t = net.outcome(served, *net.post(served, noised), expect_reasons=PROOF)
    t.detected = t.detected and t.klass == "hard" and all(j.klass == "hard" for j in junk_trials)
    t.note = f"junk: {','.join(sorted({j.reason for j in junk_trials}))}"
    return t


def fresh_version_cheats(net: Any, trial: int) -> Trial:
    """Issue 35 item 6: three keys with one accepted submission each (at v3) cheat first at v2, a version no
    validator here holds accepted work of: a noised copy of the weights (TOPLOC just over the limits, the drift
    band). The guard's trigger fires, its self-test has nothing known-good to re-check, and it fails closed (it
    used to fail open: all three softened). Detected when all three are hard."""
    from bench.adversaries import SimNode, perturbed
    from bench.loopback import SETTINGS
    from protocol.identity import Identity

    fresh = 2
    served = net.validators[trial % 2]
    keys: list[Any] = []
    while len(keys) < 3:  # keys ground offline onto one validator at both versions, as Sybils would
        node = SimNode(Identity.create(), net.loaded, net.domain)
        if net.assigned(node, VERSION)[0] is served and net.assigned(node, fresh)[0] is served:
            net.pools.operator.register(node.identity, SETTINGS.min_stake)
            keys.append(node)
    for n in keys:
        net.wait_active(n.identity.address)
    accepted = [net.post(served, n.build(version=VERSION, counter=0)[1])[1]["work_key"] for n in keys]
    if not all(served.wait_decided(k)["outcome"] == "accepted" for k in accepted):
        return Trial("error", "their honest history was not accepted", False)
    time.sleep(GUARD["window_s"] + 0.2)  # that history now lies before the guard's window: they weigh
    model = perturbed(net.loaded, 0.07 if net.spec_type == "tiny" else 0.02, 700 + trial)
    trials = [net.outcome(served, *net.post(served, n.build(version=fresh, counter=0, cheat="other_weights",
                                                              model=model)[1]), expect_reasons=PROOF)
              for n in keys]
    hard = all(t.klass == "hard" for t in trials)
    worst = max(trials, key=lambda t: t.klass != "hard")
    return Trial(worst.klass, worst.reason, hard and all(t.detected for t in trials), margins=worst.margins,
                 note="classes " + ",".join(t.klass for t in trials))


def appeal_band(net: Any, trial: int) -> Trial:
    """Issue 23 item 8: logprobs 0.51 off (just past the 0.5 intake tolerance), slashed, appealed on chain and to
    the other validator. Detected when the appeal is upheld (the stake stays slashed)."""
    from protocol.appeal import Appeal
    from protocol.envelope import seal
    from protocol.nonce import random_nonce
    from protocol.upload import upload_headers

    node = net.node()
    _, data = node.build(version=VERSION, cheat="logprob_shift")
    mine, other = net.assigned(node)
    t = net.outcome(mine, *net.post(mine, data), expect_reasons={"logprob_mismatch"})
    if t.klass != "hard":
        return t
    key = net.hard_keys[-1][1]
    row = mine.wait_reported(key)
    net.pools.operator.appeal(key)
    body = Appeal(run_id=net.run.run_id, node=node.identity.address, work_key=bytes.fromhex(key[2:]),
                  verdict=row["verdict"], submission=data.decode())
    appeal = seal(node.identity, body, domain=net.domain, nonce=random_nonce()).to_bytes()
    with other.client() as c:
        r = c.post("/v1/appeals", content=appeal, headers=upload_headers(
            node.identity, appeal, domain=net.domain, validator=other.service.identity.address, path="/v1/appeals"))
    answer = r.json()
    upheld = r.status_code == 200 and answer.get("outcome") == "upheld"
    return Trial("hard" if upheld else "accepted" if answer.get("outcome") == "overturned" else "error",
                 str(answer.get("reason") or answer.get("error")), upheld, note="appeal upheld" if upheld else "")


def eos_skip(net: Any, trial: int) -> Trial:
    """Issue 23 item 9: a node replaces every EOS that won the seeded draw by at most the sampling margin and keeps
    generating (a key whose first assignment has such an EOS, found offline)."""
    from bench.adversaries import SimNode, narrow_eos_node
    from bench.loopback import MANIFEST_V0, SETTINGS

    drift = net.validators[0].service.cfg.checks.eos_tie_drift
    identity = narrow_eos_node(net.loaded, net.run, VERSION, above=drift, domain=net.domain, manifest_hash=MANIFEST_V0)
    net.pools.operator.register(identity, SETTINGS.min_stake)
    net.wait_active(identity.address)
    node = SimNode(identity, net.loaded, net.domain)
    _, data = node.build(version=VERSION, cheat="skip_eos")
    return net.submit(node, data, expect_reasons={"termination"})


# -- multi-turn episodes (bench.episode_adversaries) ---------------------------------------------------------


def episode_cheat(name: str) -> Callable[[Any, int], Trial]:
    """A fresh key in the episode pool plays its assignment #0 with `name`'s cheat in one episode and sends it."""
    def run(net: Any, trial: int) -> Trial:
        from bench.episode_adversaries import CHEATS, Cheat, play
        from environments import ChatRenderer
        from protocol.envelope import seal
        from protocol.nonce import random_nonce

        _, served, domain = net.episode_pool()
        if net._renderer is None:
            net._renderer = ChatRenderer(net.loaded.tokenizer)
        other = other_model(net, trial) if name == "two_policies" else None
        for _ in range(8):  # `env_seed`: a key with a task whose environment depends on its seed
            identity, (at, where) = net.episode_node(search_eos=name == "skip_eos")
            try:
                sub = play(net.loaded, net._renderer, EPISODES, at, Cheat(name, at=where, other=other))
                break
            except LookupError:
                continue
        else:
            raise LookupError("no key among 8 has a task whose environment depends on its seed")
        data = seal(identity, sub, domain=domain, nonce=random_nonce()).to_bytes()
        expect = PROOF if name == "two_policies" else {CHEATS[name]}
        return net.outcome(served, *net.post(served, data), expect_reasons=expect)
    return run


def honest_episodes(net: Any, trial: int) -> Trial:
    """`prime-node`'s own episode loop (`node.episodes.build_episode_submission`), `net.episode_submissions`
    assignments of a fresh key: detected = every one accepted (a false positive otherwise)."""
    from node.engines import ModelsEngine
    from node.episodes import build_episode_submission
    from protocol.envelope import seal
    from protocol.nonce import random_nonce

    _, served, domain = net.episode_pool()
    identity, (at, _) = net.episode_node()
    outcomes = Counter[str]()
    worst: dict[str, float] = {}
    n = getattr(net, "episode_submissions", 1)
    for counter in range(n):
        sub = build_episode_submission(ModelsEngine(net.loaded), EPISODES, identity.address, VERSION, counter,
                                       at.manifest_hash, chain_id=at.chain_id, pool=at.pool)
        t = net.outcome(served, *net.post(served, seal(identity, sub, domain=domain, nonce=random_nonce()).to_bytes()))
        outcomes[t.klass if t.klass == "accepted" else f"{t.klass} {t.reason}"] += 1
        worst = {k: max(worst.get(k, 0.0), v) for k, v in t.margins.items()} or worst
    episodes = n * EPISODES.tasks_per_batch * EPISODES.samples_per_task
    ok = outcomes["accepted"] == n
    return Trial("accepted" if ok else "hard", "accepted" if ok else ", ".join(sorted(outcomes)), ok, margins=worst,
                 note=f"{episodes} episodes a trial")


def near_tie_steering(net: Any, trial: int) -> Trial:
    """Issue 35 item 5: one key takes its preferred token at every near-tie (`steer_near_ties`) in submission after
    submission; each passes the per-token checks, and the validator's account of the key's near-ties crosses the
    honest tail (`validator.near_tie_rule`) within a few. The trial is the first submission not accepted (or the
    last sent, accepted, when none crossed: missed)."""
    node = net.node()
    result = None
    for _ in range(8):
        _, data = node.build(version=VERSION, cheat="steer_near_ties")
        result = net.submit(node, data, expect_reasons={"near_tie_steering"})
        if result.klass != "accepted":
            break
    assert result is not None
    return result


def fp32_near_ties(net: Any, trial: int) -> Trial:
    """Issue 35 item 5: a node that declares fp32 (as the harness's engines compute) and takes its preferred token at
    every near-tie within bf16's 0.5: fp32's row allows 0.01 (honest fp32 margins are 0.0), so its first submission
    is a hard `sampling_mismatch`, with no account to build up."""
    from protocol.rollout import Precision

    node = net.node()
    _, data = node.build(version=VERSION, cheat="steer_near_ties", precision=Precision.FP32)
    return net.submit(node, data, expect_reasons={"sampling_mismatch"})


# -- relay attacks ---------------------------------------------------------------------------------------


async def _relay_trial(tmp: Path, trial: int, kind: str) -> Trial:
    """Origin + two real relays; a hostile proxy in front of one; a client pulls. The hostile relay lies as `kind` says."""
    import aiohttp
    from aiohttp import web

    from bench.adversaries import FakeRelay
    from bench.loopback import make_checkpoint, same_tree
    from protocol.errors import PrimeError
    from protocol.identity import Identity
    from shardcast import Client, Origin, Relay

    trainer, forger = Identity.create(), Identity.create()
    rng = random.Random(trial)
    sizes = {"model.safetensors": rng.randint(40, 120) * KiB, "config.json": rng.randint(1, 4) * KiB}
    ckpt1 = make_checkpoint(tmp / "ckpt1", sizes, seed=trial)
    ckpt2 = make_checkpoint(tmp / "ckpt2", sizes, seed=trial + 10_000)
    rollback = kind == "rolled_back_manifest"
    variant = trial % 2
    hide = rollback and trial % 3 == 2
    async with Origin(tmp / "origin", run_id="attacks", identity=trainer, shard_size=16 * KiB) as origin:
        await origin.wait_published(origin.publish(ckpt1))
        if rollback:
            await origin.wait_published(origin.publish(ckpt2))
        newest = 2 if rollback else 1
        async with Relay([origin.url], trainer=trainer.address, store_root=tmp / "r1", poll_wait_s=1.0) as honest, \
                Relay([origin.url], trainer=trainer.address, store_root=tmp / "r2", poll_wait_s=1.0) as upstream:
            deadline = time.monotonic() + 30
            while honest.store.latest != newest or upstream.store.latest != newest:
                if time.monotonic() > deadline:
                    return Trial("error", "relays did not sync", False)
                await asyncio.sleep(0.05)
            forged_origin = None
            if kind == "forged_manifest" and variant == 1:  # a manifest signed by another key, its own shards
                forged_origin = Origin(tmp / "forger", run_id="attacks", identity=forger, shard_size=16 * KiB)
                await forged_origin.start()
                await forged_origin.wait_published(forged_origin.publish(make_checkpoint(tmp / "evil", sizes, seed=-trial)))
            session = aiohttp.ClientSession()
            lies = Counter[str]()

            async def fetch(path: str, base: str | None = None) -> bytes:
                async with session.get((base or upstream.url) + path) as r:
                    return await r.read()

            async def versions(request: web.Request) -> web.Response:
                index = await fetch("/versions")
                if hide:  # an index that hides the newest version (a relay holding clients back)
                    lies["index"] += 1
                    doc = json.loads(index)
                    doc["latest"] = 1
                    doc["versions"] = [{**doc["versions"][0], "version": 1}]
                    index = json.dumps(doc).encode()
                return web.Response(body=index, content_type="application/json")

            async def manifest(request: web.Request) -> web.Response:
                v = int(request.match_info["v"])
                raw = await fetch(f"/v/{v}/manifest")
                if kind == "forged_manifest":
                    lies["manifest"] += 1
                    if forged_origin is not None:
                        raw = await fetch(f"/v/{v}/manifest", forged_origin.url)
                    else:
                        doc = json.loads(raw)
                        doc["manifest"]["shards"][rng.randrange(len(doc["manifest"]["shards"]))]["hash"] = \
                            hashlib.sha256(b"other bytes").hexdigest()
                        raw = json.dumps(doc).encode()
                elif rollback and v == 2:  # the trainer's genuine v1 manifest served as v2
                    lies["manifest"] += 1
                    raw = await fetch("/v/1/manifest", origin.url)
                elif rollback and v == 1:
                    raw = await fetch("/v/1/manifest", origin.url)
                return web.Response(body=raw, content_type="application/json")

            async def shard(request: web.Request) -> web.Response:
                v, i = int(request.match_info["v"]), int(request.match_info["i"])
                base = forged_origin.url if forged_origin else origin.url if rollback and v == 1 else None
                data = await fetch(f"/v/{v}/shards/{i}", base)
                if kind == "relay_flip" and data:
                    lies["shard"] += 1
                    at = rng.randrange(len(data))
                    data = data[:at] + bytes([data[at] ^ (1 << rng.randrange(8))]) + data[at + 1:]
                return web.Response(body=data)

            routes = {"/versions": versions, "/v/{v}/manifest": manifest, "/v/{v}/shards/{i}": shard}
            try:
                async with FakeRelay(routes) as hostile:  # type: ignore[arg-type]
                    # Every third (forged: fourth) trial the hostile relay is the client's only source.
                    alone = trial % (4 if kind == "forged_manifest" else 3) == 0
                    sources = [hostile.url] if alone else [hostile.url, honest.url]
                    client = Client(sources, trainer=trainer.address, out_dir=tmp / "out", progress=False,
                                    concurrency=2, stall_s=2.0)
                    try:
                        result = await asyncio.wait_for(client.pull(), 60)
                    except (PrimeError, TimeoutError) as exc:
                        installed = client.installed_version()
                        ok = installed is None and sum(lies.values()) > 0
                        return Trial("refused", type(exc).__name__, ok, note="hostile relay only: nothing installed")
                    want = ckpt2 if result.version == 2 else ckpt1
                    genuine = result.version == newest and same_tree(tmp / "out" / "current", want)
                    banned = bool(result.sources.get(hostile.url, {}).get("banned"))
                    if hide:  # hiding a version is not provably a lie (a relay may lag): the point is v2 installed
                        return Trial("refused", "newest installed", genuine and lies["index"] > 0,
                                     note="index hiding v2: v2 installed from the honest relay")
                    return Trial("refused", "banned" if banned else "not banned",
                                 genuine and banned and sum(lies.values()) > 0,
                                 note=f"installed v{result.version} from the honest relay")
            finally:
                await session.close()
                if forged_origin is not None:
                    await forged_origin.stop()


def relay_attack(kind: str) -> Callable[[Any, int], Trial]:
    def run(net: Any, trial: int) -> Trial:
        with tempfile.TemporaryDirectory(dir=net.tmp) as d:
            return asyncio.run(_relay_trial(Path(d), trial, kind))
    return run


def forged_verdict(net: Any, trial: int) -> Trial:
    """Issue 23 item 10 and issue 35 item 8, turned round: a server standing in for the assigned validator (a proxy
    of its `/v1/info`, the challenge's proof included, so it holds the address) answers a real node work loop
    (`node.worker.Worker`) with an unsigned "accepted", a verdict signed by another key, an unsigned slash, a bare
    `202 {}`, a receipt signed by another key, or an odd status; or it copies the validator's `/v1/info` without
    the proof. One kind per trial in turn. Detected when the node believes none of it: the payload is kept to
    resend, the lie is counted (or the copied info refused as unproven), and the loop does not stop."""
    import json as json_

    import httpx
    from fastapi import FastAPI, Request, Response

    from bench.loopback import forward_info, serve_asgi
    from node.commands import validator_role
    from node.config import NodeConfig
    from node.errors import NodeStopped
    from node.protection import SlashingProtection
    from node.worker import ValidatorDirectory, Worker
    from protocol.envelope import Envelope, seal
    from protocol.identity import Identity
    from protocol.nonce import random_nonce
    from protocol.rollout import Outcome, Reason, Receipt, Submission, Verdict, submission_hash
    from protocol.seeds import work_key

    kind = ["unsigned_accept", "forged_accept", "unsigned_slash", "http_418", "bare_202", "forged_receipt",
            "copied_info"][trial % 7]
    node = net.node()
    served, _ = net.assigned(node)
    app = FastAPI()

    async def info(request: Request) -> Response:
        body, headers = forward_info(served.url, "" if kind == "copied_info" else request.url.query)
        return Response(body, media_type="application/json", headers=headers)

    async def submissions(request: Request) -> Response:
        data = await request.body()
        sub = Submission.model_validate(Envelope.model_validate_json(data).body)
        body: dict[str, Any] = {"state": "decided", "outcome": "accepted", "reason": "accepted", "verdict": None}
        status = 200
        if kind == "forged_accept":
            v = Verdict(run_id=sub.run_id, work_key=work_key(sub.run_id, sub.node, sub.policy_version, sub.counter,
                                                             chain_id=net.chain_id, pool=net.pool),
                        node=sub.node, policy_version=sub.policy_version, counter=sub.counter,
                        submission_hash=submission_hash(data), outcome=Outcome.ACCEPTED, reason=Reason.ACCEPTED)
            body["verdict"] = seal(Identity.create(), v, domain=net.domain, nonce=random_nonce()).to_bytes().decode()
        elif kind == "unsigned_slash":
            body.update(outcome="rejected_hard", reason="proof_mismatch")
        elif kind == "http_418":
            status, body = 418, {"error": "teapot"}
        elif kind in ("bare_202", "copied_info"):
            status, body = 202, {}
        elif kind == "forged_receipt":
            r = Receipt(run_id=sub.run_id, work_key=work_key(sub.run_id, sub.node, sub.policy_version, sub.counter,
                                                             chain_id=net.chain_id, pool=net.pool),
                        node=sub.node, policy_version=sub.policy_version, counter=sub.counter,
                        submission_hash=submission_hash(data), state="received")
            status, body = 202, {"state": "received", "receipt": seal(Identity.create(), r, domain=net.domain,
                                                                      nonce=random_nonce()).to_bytes().decode()}
        return Response(json_.dumps(body), status_code=status, media_type="application/json")

    # plain Starlette routes: the handlers are local, so FastAPI could not resolve their (string) annotations
    app.add_route("/v1/info", info, methods=["GET"])
    app.add_route("/v1/submissions", submissions, methods=["POST"])
    sub, _ = node.build(version=VERSION)
    with tempfile.TemporaryDirectory(dir=net.tmp) as d, serve_asgi(app) as url, httpx.Client(timeout=30) as http, \
            SlashingProtection(Path(d) / "protection.sqlite") as db:
        cfg = NodeConfig.model_validate({"state_dir": d, "validators": [url], "run": net.run,
                                         "submit": {"attempts": 1, "backoff_s": 0.01, "max_backoff_s": 0.05}})
        worker = Worker(cfg, node.identity, net.run, net.domain, None, db,  # type: ignore[arg-type]
                        ValidatorDirectory([url], http, validator_role(net.pools.admin)))
        try:
            worker.submit(sub)
        except NodeStopped as exc:
            return Trial("accepted", kind, False, note=f"the node stopped: {exc}"[:120])
        rec = db.get(net.run.run_id, node.identity.address, sub.policy_version, sub.counter)
        kept = rec is not None and rec.state == "signed" and rec.payload is not None
        counted = sum(worker.tally.peer_errors.values()) + worker.validators.refused["unproven"]
        believed = worker.tally.accepted + sum(worker.tally.rejected.values())
        detected = kept and counted > 0 and believed == 0
        return Trial("refused" if detected else "accepted", kind, detected,
                     note="" if detected else f"state {rec.state if rec else None}, counted {counted}")


def relay_claims(net: Any, trial: int) -> Trial:
    """Issue 35 item 8: eight staked keys announce relays holding version 2**63-1 (signed, admitted: they hold stake
    on chain), after one honest relay that served the chain's newest version to this node. Detected when the node's
    polled set (`node.gossip.polled_relays`: verified versions first, claims cut to the chain's version, random
    slots drawn per trial) still holds the honest relay. What the node records as served is `note_install`'s (a
    pull's hash-checked shards of a version whose manifest hash the chain has; test_node_relay_ranking); the trial
    stands for it with the honest relay's entry."""
    from discovery.admission import Admission, Trust
    from discovery.board import AnnouncementBoard
    from discovery.messages import RelayAnnounced, Topic
    from node.config import RelaySettings
    from node.gossip import polled_relays
    from protocol.envelope import seal
    from protocol.nonce import random_nonce

    admission = Admission(domain=net.domain, trust=Trust(relay_signer=lambda a: bool(net.pools.admin.is_active(a))))
    board = AnnouncementBoard()
    honest = f"http://10.0.0.{trial % 250}:8600"

    def announce(url: str, versions: tuple[int, ...]) -> None:
        wire = seal(net.pools.new_node(), RelayAnnounced(peer_id=RELAY_PEER, http_url=url, versions=versions),
                    domain=net.domain, nonce=random_nonce()).to_bytes()
        board.offer(admission.admit(wire, topic=Topic.RELAYS))

    announce(honest, (VERSION,))
    for i in range(8):
        announce(f"http://10.6.6.{i}:8600", (2**63 - 1,))
    if len(board.relays()) != 9:
        return Trial("error", f"{len(board.relays())} announcements admitted, 9 sent", False)
    s = RelaySettings()
    polled = polled_relays(board.relays(), s.polled, verified={honest: VERSION}, chain_version=VERSION,
                           random_slots=s.random_slots, rng=random.Random(trial))
    kept = honest in polled
    return Trial("refused" if kept else "accepted", "honest relay polled" if kept else "displaced", kept,
                 note=f"{len(polled)} polled, {sum(u.startswith('http://10.6.6.') for u in polled)} of them claimers")


RELAY_PEER = "12D3KooWJeBihrd6fXLo9Z5ShnedY1ahcqVjAikAJZ1qQGpD4ohP"


def cached_repeat(net: Any, trial: int) -> Trial:
    """Issue 23 item 5: a task a node draws again within a version answered from its cache (samples another
    assignment's seeds drew); the first assignment is honest and paid, the cached one must not be."""
    node = net.node()
    served, _ = net.assigned(node)
    _, data = node.build(version=VERSION, counter=0)
    status, first = net.post(served, data)
    if status not in (200, 202) or served.wait_decided(first["work_key"])["outcome"] != "accepted":
        return Trial("error", f"the honest first assignment was not accepted: {first}", False)
    _, cached = node.build(version=VERSION, counter=1, cheat="cached_repeat")
    status, body = net.post(served, cached)
    return net.outcome(served, status, body, expect_reasons={"sampling_mismatch"})


def counter_grind(net: Any, trial: int) -> Trial:
    """Issue 23 item 6: the node hashes counters offline (no model) for the tasks it likes (the shortest text)
    and sends that one first (even trials), or sends counter 0, holds back counter 1 (scored badly) and
    goes on past it (odd trials): refused, nothing recorded for it; the skipped counter is counted later."""
    node = net.node()
    served, _ = net.assigned(node)
    address = node.identity.address
    if trial % 2 == 0:
        easiest = min(range(2, 2000), key=lambda k: len(
            served.service.core.assignment.tasks(address, VERSION, k)[0].messages[-1].content))
        _, data = node.build(version=VERSION, counter=easiest)
    else:
        for counter in (0, 2):  # 1 held back; 2 is inside the gap of 1
            status, body = net.post(served, node.build(version=VERSION, counter=counter)[1])
            if status not in (200, 202):
                return Trial("error", f"counter {counter} in order was refused: {body}", False)
        _, data = node.build(version=VERSION, counter=3)
    status, body = net.post(served, data)
    return Trial("refused" if status >= 400 else "accepted", str(body.get("error")),
                 status == 409 and body.get("error") == "counter_out_of_order",
                 note=f"expected counter {body.get('expected_counter')}")


GRIND_KEYS = 256
"""Keys an attacker grinds offline per trial (the issue's 1,416 took 0.2 s; each here costs a task draw)."""


def grind_before_publish(net: Any, trial: int) -> Trial:
    """Issue 35 item 4: before a version is published, the attacker grinds keys offline for the tasks it likes
    (the least text to reverse at assignment #0) under the manifest hash it expects, registers the best one, and
    once the chain records the real hash (which it could not know) sends the tasks it ground for, honestly
    generated, as that assignment. The tasks mix the published manifest hash, so they are not the key's:
    `wrong_task` (hard), and the key's real tasks share nothing with the ones it ground for (it gained nothing).
    Before, the seed bound only what is known in advance: the ground tasks were the key's, accepted and paid."""
    from bench.adversaries import SimNode
    from bench.loopback import MANIFEST_V0, SETTINGS
    from environments import get as get_environment
    from protocol.identity import Identity
    from protocol.seeds import task_seed

    env, run = get_environment(net.run.env, net.run.env_version), net.run
    guess = hashlib.sha256(f"the manifest an attacker expects, trial {trial}".encode()).digest()

    def tasks(address: str, manifest: bytes) -> list[Any]:
        return env.sample(task_seed(address, VERSION, 0, run_id=run.run_id, chain_id=net.chain_id, pool=net.pool,
                                    manifest_hash=manifest), run.tasks_per_batch)

    def liked(drawn: list[Any]) -> int:  # what the attacker minimises: text to reverse
        return sum(len(t.messages[-1].content) for t in drawn)

    best = min((Identity.create() for _ in range(GRIND_KEYS)), key=lambda k: liked(tasks(k.address, guess)))
    ground, drawn = tasks(best.address, guess), tasks(best.address, MANIFEST_V0)
    net.pools.operator.register(best, SETTINGS.min_stake)  # registered after the grind, before the version
    net.wait_active(best.address)
    node = SimNode(best, net.loaded, net.domain, ground_manifest=guess)
    _, data = node.build(version=VERSION, counter=0, cheat="ground_tasks")  # sampled with the published hash
    t = net.submit(node, data, expect_reasons={"wrong_task"})
    shared = {x.task_id for x in ground} & {x.task_id for x in drawn}
    t.detected = t.detected and not shared
    t.note = f"best of {GRIND_KEYS} keys: {liked(ground)} chars ground, {liked(drawn)} drawn; {len(shared)} shared"
    return t


def second_pool(net: Any, trial: int) -> Trial:
    """Issue 23 item 7: rollouts accepted in one pool, resealed for a second pool with the same run id and
    weights (the node is registered in both): another assignment there, refused (never paid twice)."""
    from protocol.envelope import seal
    from protocol.nonce import random_nonce

    pools2, served2, domain2 = net.second_pool()
    node = net.node()
    pools2.operator.register(node.identity, pools2.operator.params().min_stake)
    deadline = time.monotonic() + 30
    while not served2.service.chain.node_active(node.identity.address):
        if time.monotonic() > deadline:
            return Trial("error", "the second pool's validator never saw the node", False)
        time.sleep(0.02)
    sub, data = node.build(version=VERSION)
    served, _ = net.assigned(node)
    status, first = net.post(served, data)
    if status not in (200, 202) or served.wait_decided(first["work_key"])["outcome"] != "accepted":
        return Trial("error", f"the honest work was not accepted in the first pool: {first}", False)
    resealed = seal(node.identity, sub, domain=domain2, nonce=random_nonce()).to_bytes()
    status, body = net.post(served2, resealed)
    kept = len(net.hard_keys)
    trial_result = net.outcome(served2, status, body, expect_reasons={"wrong_task"})
    del net.hard_keys[kept:]  # slashed in the second pool: `on_chain` reads the first one
    return trial_result


# -- the list -----------------------------------------------------------------------------------------------

PROOF = {"proof_mismatch", "sampling_mismatch", "logprob_mismatch", "termination"}

ATTACKS = [
    Attack("model_swap", "model swap (other weights)", "hard", cheat("other_weights", other_model, PROOF)),
    Attack("weight_noise", "3% weight noise", "hard",
           cheat("other_weights", lambda net, t: perturbed(net.loaded, 0.03, 100 + t), PROOF)),
    Attack("bf16_weights", "lower precision: bf16-rounded weights", "hard",
           cheat("other_weights", lambda net, t: lower_precision(net.loaded, "bfloat16"), PROOF)),
    Attack("fp8_weights", "lower precision: fp8 (e4m3)-rounded weights", "hard",
           cheat("other_weights", lambda net, t: lower_precision(net.loaded, "float8_e4m3fn"), PROOF)),
    Attack("other_prompt", "another system prompt", "hard", cheat("other_prompt", expect=PROOF)),
    Attack("edit_token", "one token edited (re-proved)", "hard", cheat("edit_token", expect=PROOF)),
    Attack("cheap_tokens", "cheaper model's tokens + honest prefill", "hard",
           cheat("cheap_tokens", other_model, PROOF)),
    Attack("other_seed", "another sampling seed", "hard", cheat("other_seed", expect=PROOF)),
    Attack("early_stop", "early stop (claims EOS)", "hard", cheat("early_stop", expect={"termination"})),
    Attack("inflate_reward", "inflated reward", "hard", cheat("inflate_reward", expect={"reward_mismatch"})),
    Attack("cherry_pick", "cherry-picked task (not assigned)", "hard", cheat("unassigned_task", expect={"wrong_task"})),
    Attack("dup_same_one", "same assignment twice, same payload, one validator", "refused", dup_same_payload),
    Attack("dup_diff_one", "same assignment twice, other payload, one validator", "hard", dup_diff_payload),
    Attack("resigned_recorded", "re-signed old recorded work (slash reverts forever)", "hard", resigned_recorded),
    Attack("dup_same_two", "same assignment twice, same payload, two validators", "refused",
           dup_two_validators(False)),
    Attack("dup_diff_two", "same assignment twice, other payload, two validators", "refused",
           dup_two_validators(True)),
    Attack("split_covered", "split: another payload to the covering validator", "hard",
           split_assignment(False)),
    Attack("failover_resend", "honest resend to the covering validator", "accepted",
           split_assignment(True)),
    Attack("replay", "replayed envelope (same bytes)", "refused", replayed_envelope),
    Attack("forged_signature", "forged signature / altered signed body", "refused", forged_signature),
    Attack("stale_version", "stale policy version", "refused", stale),
    Attack("stale_junk_flood", "one staked key: stale + junk flood (rows, txs bounded)", "refused", stale_junk_flood),
    Attack("steered_logprobs", "logprobs steered 0.49 by advantage (trainer input)", "accepted", steered_logprobs),
    Attack("cached_repeat", "cached work paid twice (a repeated task's samples replayed)", "hard", cached_repeat),
    Attack("counter_grind", "counter grinding (liked tasks first / bad batch held back)", "refused", counter_grind),
    Attack("grind_keys", "keys ground before the version for liked tasks", "hard", grind_before_publish),
    Attack("second_pool", "second-pool replay (same run id and weights)", "hard", second_pool),
    Attack("malformed_proofs", "malformed or crashing proofs", "hard", malformed_proofs),
    Attack("oversized", "oversized payload", "refused", oversized),
    Attack("slow_uploads", "16 slow uploads from no key (honest work accepted)", "accepted", slow_uploads),
    Attack("sybil_shield", "Sybils (junk + noised prover) vs the correlation guard", "hard", sybil_shield),
    Attack("fresh_version", "3 keys with history cheat first at a fresh version (guard)", "hard",
           fresh_version_cheats),
    Attack("appeal_band", "appeal of logprobs 0.51 off (intake tolerance 0.5)", "hard", appeal_band),
    Attack("eos_skip", "skips every EOS that won within the margin", "hard", eos_skip, tiny_only=True),
    Attack("ep_fake_env", "episode: faked environment reply (tool output)", "hard", episode_cheat("fake_env")),
    Attack("ep_hint", "episode: hint injected into a user span", "hard", episode_cheat("hint")),
    Attack("ep_redraw", "episode: a turn re-drawn from another seed", "hard", episode_cheat("redraw")),
    Attack("ep_early_stop", "episode: stopped before the environment ended it", "hard", episode_cheat("early_stop")),
    Attack("ep_after_done", "episode: a turn after the environment said done", "hard", episode_cheat("after_done")),
    Attack("ep_skip_eos", "episode: a mid-episode EOS skipped beyond the drift", "hard", episode_cheat("skip_eos"),
           tiny_only=True),
    Attack("ep_inflate_reward", "episode: inflated reward", "hard", episode_cheat("inflate_reward")),
    Attack("ep_env_seed", "episode: environment played from the node's own seed", "hard", episode_cheat("env_seed")),
    Attack("ep_two_policies", "episode: turn 2 by other weights (two policy versions)", "hard",
           episode_cheat("two_policies")),
    Attack("ep_oversize", "episode: a turn over the per-turn token limit", "hard", episode_cheat("oversize")),
    Attack("ep_honest", "episode: honest (prime-node's loop), all accepted", "accepted", honest_episodes),
    Attack("near_tie_steering", "chooses its token at every near-tie within the sampling margin", "hard",
           near_tie_steering, tiny_only=True),
    Attack("fp32_near_ties", "declares fp32, chooses its token at near-ties within bf16's 0.5", "hard",
           fp32_near_ties, tiny_only=True),
    Attack("relay_flip", "relay flips bytes in a shard", "refused", relay_attack("relay_flip")),
    Attack("forged_manifest", "forged manifest (edited / other key)", "refused", relay_attack("forged_manifest")),
    Attack("rolled_back_manifest", "rolled-back manifest (v1's as v2 / v2 hidden)", "refused",
           relay_attack("rolled_back_manifest")),
    Attack("forged_verdict", "validator look-alike: unsigned/forged verdicts and receipts, copied info, to a node",
           "refused", forged_verdict),
    Attack("relay_claims", "8 staked keys announce relays holding v2**63-1 (an honest relay served)", "refused",
           relay_claims),
]


# -- honest work -------------------------------------------------------------------------------------------


class _Collected(Exception):
    pass


def honest_run(net: Any, target_rollouts: int) -> dict[str, Any]:
    """Honest submissions across batch sizes, thread counts and decode paths; returns the counts."""
    import torch

    from node.engines import Completion, InferenceEngine, ModelsEngine, Request
    from node.rollouts import build_submission
    from protocol.rollout import Precision

    class Recorder(InferenceEngine):
        def __init__(self, tokenizer: Any) -> None:
            self._tok, self.requests = tokenizer, list[Request]()

        precision = Precision.FP32  # never generates: it raises once it has the requests

        @property
        def tokenizer(self) -> Any:
            return self._tok

        def generate(self, requests: list[Request], run: Any) -> list[Completion]:
            self.requests += requests
            raise _Collected

    class Replay(InferenceEngine):
        def __init__(self, tokenizer: Any, done: dict[tuple[tuple[int, ...], int], Completion],
                     precision: Precision) -> None:
            self._tok, self.done, self._precision = tokenizer, done, precision

        @property
        def precision(self) -> Precision:
            return self._precision  # the engine's that generated `done`

        @property
        def tokenizer(self) -> Any:
            return self._tok

        def generate(self, requests: list[Request], run: Any) -> list[Completion]:
            return [self.done[(tuple(r.prompt), r.seed)] for r in requests]

    configs = [(k, threads, fast) for k in (1, 4, 8) for threads in (1, 2) for fast in (True, False)]
    tok = net.loaded.tokenizer
    per_sub = net.run.tasks_per_batch * net.run.samples_per_task
    rollouts, submitted, fp, by_config = 0, [], [], Counter[str]()
    worst: dict[str, float] = {}
    i = 0
    while rollouts < target_rollouts:
        k, threads, fast = configs[i % len(configs)]
        i += 1
        node = net.node()
        recorder = Recorder(tok)
        for counter in range(k):
            try:
                build_submission(recorder, net.run, node.identity.address, VERSION, counter, node.manifest_hash,
                                 chain_id=net.chain_id, pool=net.pool)
            except _Collected:
                pass
        engine = ModelsEngine(net.loaded, fast_path=fast)  # the decode path under test (fast or generic HF)
        torch.set_num_threads(threads)
        try:
            completions = engine.generate(recorder.requests, net.run)
        finally:
            torch.set_num_threads(1)
        done = {(tuple(r.prompt), r.seed): c for r, c in zip(recorder.requests, completions, strict=True)}
        served, _ = net.assigned(node)
        for counter in range(k):
            sub = build_submission(Replay(tok, done, engine.precision), net.run, node.identity.address, VERSION, counter,
                                   node.manifest_hash, chain_id=net.chain_id, pool=net.pool)
            status, body = net.post(served, node.seal(sub))
            submitted.append((served, status, body, f"batch {k * per_sub} threads {threads} "
                              f"{'fast' if fast else 'hf'} path"))
            rollouts += per_sub
    for served, status, body, config in submitted:
        by_config[config] += per_sub
        if status not in (200, 202):
            fp.append({"config": config, "status": status, "error": body.get("error")})
            continue
        row = served.wait_decided(body["work_key"], 300)
        for name, value in _margins(row).items():
            worst[name] = max(worst.get(name, 0.0), value)
        if row["outcome"] != "accepted":
            fp.append({"config": config, "outcome": row["outcome"], "reason": row["reason"], "detail": row["detail"]})
    return {"honest_rollouts": rollouts, "honest_submissions": len(submitted), "false_positives": len(fp),
            "false_positive_rows": fp, "by_config": dict(by_config), "honest_margins": worst}


# -- main ----------------------------------------------------------------------------------------------------


def summarize(attack: Attack, trials: list[Trial]) -> dict[str, Any]:
    margins = [t.margins for t in trials if t.margins]
    closest: dict[str, float] = {}
    if margins:  # the trial nearest to passing: the smallest of each worst-chunk measurement
        for name in ("exp", "mean", "median", "sampling_mismatches", "logprob_max_error"):
            closest[name] = min(m[name] for m in margins)
    return {
        "attack": attack.name, "label": attack.label, "trials": len(trials),
        "detected": sum(t.detected for t in trials), "expected_class": attack.expect,
        "classes": dict(Counter(t.klass for t in trials)), "reasons": dict(Counter(t.reason for t in trials)),
        "notes": sorted({t.note for t in trials if t.note}), "closest_margins": closest,
    }


def print_table(res: dict[str, Any]) -> None:
    print(f"\nmachine: {harness.describe(res['machine'])}; model {res['model']}; wall {res['wall_s']:.0f} s")
    th = res["thresholds"]
    print(f"thresholds: a chunk fails if exp_mismatches > {th['max_exp_mismatches']}, mant_err_mean > "
          f"{th['max_mant_err_mean']}, median > {th['max_mant_err_median']}; sampling fails with > "
          f"{th['max_sampling_mismatches']} positions off by > {th['sampling_margin_tolerance']}")
    h = res["honest_margins"]
    if h:
        print(f"honest work (worst over all chunks): exp {h.get('exp', 0):.0f}, mean {h.get('mean', 0):.3f}, "
              f"median {h.get('median', 0):.3f}, sampling mismatches {h.get('sampling_mismatches', 0):.0f} "
              f"(max margin {h.get('sampling_max_margin', 0):.3g}), logprob error {h.get('logprob_max_error', 0):.2g}")
    print(f"\n{'attack':<54} {'trials':>6} {'detected':>8} {'class':<16} reasons (closest call: exp/mean/median)")
    for r in res["attacks"]:
        classes = ",".join(f"{k}:{v}" for k, v in sorted(r["classes"].items()))
        reasons = ",".join(f"{k}:{v}" for k, v in sorted(r["reasons"].items()))
        c = r["closest_margins"]
        close = f" ({c['exp']:.0f}/{c['mean']:.2f}/{c['median']:.2f})" if c else ""
        flag = "" if r["detected"] == r["trials"] else "  <-- by design (see margins)" \
            if r["attack"] in UNDETECTABLE.get(res["model"], set()) else "  <-- NOT ALL DETECTED"
        print(f"{r['label']:<54} {r['trials']:>6} {r['detected']:>8} {classes:<16} {reasons}{close}{flag}")
    print(f"\nhonest rollouts: {res['honest_rollouts']} in {res['honest_submissions']} submissions; "
          f"false positives: {res['false_positives']}")
    if "on_chain" in res:
        print(f"hard verdicts invalidated and slashed on chain: {res['on_chain']['slashed']} of "
              f"{res['on_chain']['hard']}")


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser(__doc__, smoke="1 trial each, one honest submission (checks the bench; a single trial of "
                            "an attack the tiny model cannot catch by design may pass)",
                            quick="3 trials each, 64 honest rollouts")
    parser.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    parser.add_argument("--trials", type=int, help="trials per attack (default 20, quick 3)")
    parser.add_argument("--honest", type=int, help="honest rollouts at least (default 1000, quick 64)")
    parser.add_argument("--only", help="comma-separated attack names (default: all)")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import logging

    import torch

    logging.basicConfig(level=logging.WARNING)
    for noisy in ("validator", "shardcast"):  # a verdict or ban line per attack trial would bury the table
        logging.getLogger(noisy).setLevel(logging.ERROR)
    torch.set_num_threads(1)
    trials = args.trials or (1 if args.smoke else 3 if args.quick else 20)
    honest = args.honest if args.honest is not None else (4 if args.smoke else 64 if args.quick else 1000)
    wanted = set(args.only.split(",")) if args.only else None
    attacks = [a for a in ATTACKS if (wanted is None or a.name in wanted) and not (a.tiny_only and args.model != "tiny")]
    if wanted and len(attacks) != len(wanted):
        parser.error(f"unknown attacks: {sorted(wanted - {a.name for a in ATTACKS})}")
    from bench.loopback import TINY
    from models.loading import load
    from protocol.model_spec import SmolLM2Spec

    spec: Any = TINY if args.model == "tiny" else SmolLM2Spec()
    t0 = time.monotonic()
    loaded = load(spec)
    rows = []
    with tempfile.TemporaryDirectory(prefix="attacks-") as d:
        net = Network(loaded, spec, Path(d))
        net.spec_type = args.model  # type: ignore[attr-defined]
        # honest episode submissions per `ep_honest` trial: 20 x 4 x 4 = 320 episodes in the full run
        net.episode_submissions = 1 if args.smoke else 2 if args.quick else 4  # type: ignore[attr-defined]
        try:
            for attack in attacks:
                a0 = time.monotonic()
                results = []
                for trial in range(trials):
                    try:
                        results.append(attack.run(net, trial))
                    except Exception as exc:  # noqa: BLE001 - a crash in a trial is a result to report, not a stop
                        results.append(Trial("error", f"{type(exc).__name__}: {exc}"[:200], False))
                row = summarize(attack, results)
                row["seconds"] = round(time.monotonic() - a0, 1)
                row["not_caught_by_design"] = attack.name in UNDETECTABLE.get(args.model, set())
                rows.append(row)
                print(f"{attack.name:<22} {row['detected']}/{row['trials']} {row['classes']} {row['reasons']} "
                      f"({row['seconds']} s)", flush=True)
            h = honest_run(net, honest) if honest else {"honest_rollouts": 0, "honest_submissions": 0,
                                                         "false_positives": 0, "false_positive_rows": [],
                                                         "by_config": {}, "honest_margins": {}}
            slashed, hard = net.on_chain()
            th = net.thresholds
        finally:
            net.stop()
    res = {"bench": "attacks", "model": args.model, "quick": args.quick, "smoke": args.smoke, "threads": 1, "machine": harness.machine(1),
           "thresholds": {"max_exp_mismatches": th.max_exp_mismatches, "max_mant_err_mean": th.max_mant_err_mean,
                          "max_mant_err_median": th.max_mant_err_median,
                          "max_sampling_mismatches": th.max_sampling_mismatches,
                          "sampling_margin_tolerance": th.sampling_margin_tolerance},
           "attacks": rows, **h, "on_chain": {"slashed": slashed, "hard": hard},
           "wall_s": round(time.monotonic() - t0, 1)}
    print_table(res)
    harness.write_json(args.json, res)
    missed = [r["attack"] for r in rows if r["detected"] < r["trials"]]
    return 1 if missed and not set(missed) <= UNDETECTABLE.get(args.model, set()) or h["false_positives"] else 0


UNDETECTABLE: dict[str, set[str]] = {"tiny": {"weight_noise", "bf16_weights", "fp8_weights", "cheap_tokens"},
                                     "smollm2": {"bf16_weights"}}
"""Attacks not caught (in every trial) by design on a model (measured; bench/README.md's attack table shows
the margins). On the tiny random model, 3% weight noise and weights rounded to bf16 or fp8 leave the
TOPLOC measurements (worst chunk: exp mismatches <= ~20, mantissa mean <= ~7) inside the thresholds
(38 / 10 / 8), which must leave room for honest nodes on other hardware and dtypes; and its near-flat
logits let another model sampling with the same seeded Gumbel noise pick the same tokens, or tokens
within the sampling check's 0.5 tolerance (a cheaper model's tokens passed in ~1 trial of 20). On
SmolLM2, 3% noise, fp8 weights and a cheaper model's tokens are caught; bf16-rounded weights (a
relative change <= 2**-9) stay inside the drift an honest bf16 node makes."""


if __name__ == "__main__":
    sys.exit(main())
