"""The check pipeline, cheapest first, and the verdicts it records.

`intake(bytes)` runs in the HTTP handler and does everything that needs no model: size, identity
(the same bytes again return the same answer), envelope (domain, age, signature, canonical body),
the sender's chain status and rate limit (both *before* its nonce is consumed), then the run,
assignment (validator, version window, manifest, counter, tasks), and schema and limits. A failure
there is decided at once; a pass is a `received` ledger row.

`check_pending()` runs in the model worker: it leases received rows, recomputes rewards, runs one
batched prefill per weights version (`toploc.validation.measure`: TOPLOC, sampling replay,
termination, logprobs) and decides. A failure on our side (weights not here, the model failing, a
grader that could not grade) is retried or soft, never hard.

Every hard verdict carries evidence (the submission's hash, what was measured, the thresholds, this
software's version) whose SHA-256 goes on chain; the submission itself is stored once, in its ledger row,
and served by its hash (`GET /v1/envelopes/{submission_hash}`), so a flood of failures is not stored twice.
A hard verdict whose measurements lie in the band honest drift produces may be softened to
`suspected_systemic` by the correlation guard, only after the validator's own self-test fails
(`validator.guard`); every other hard verdict stands.

Timing hook (for `bench/validator.py`): give the pipeline a `protocol.timing.StageTimer` (`timer=` or the
`timer` attribute) and it fills exclusive seconds per stage: intake `intake.lookup` (submission hash, ledger
lookups), `intake.parse` (envelope bytes), `intake.open` (body validation, canonical body, signature
recovery), `intake.gate` (sender's chain status, rate, replay guard), `intake.assignment`,
`intake.cheap_checks` (run, version, manifest, tasks, schema), `intake.insert` (ledger row); checks
`check.ledger` (claim, decide), `check.parse` (stored envelopes), `check.tasks`, `check.rewards` (decode,
grade), `check.measure` (prompts, batching, padding; the model stages are `toploc.validation.measure`'s
`measure.*`), `check.verdict` (judging, evidence, feed item), `verdict.seal` (signing verdicts and feed items).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from environments import Environment, render_prompt
from environments import get as get_environment
from protocol.canonical import canonical_bytes
from protocol.envelope import Envelope, NonceGuard, open_envelope, seal
from protocol.errors import (
    ModelError,
    OversizeError,
    PrimeError,
    ProtocolError,
    ReplayError,
    SignatureError,
    UngradableError,
)
from protocol.identity import Identity
from protocol.nonce import NonceCounter
from protocol.rollout import (
    FeedGroup,
    FeedItem,
    FeedSample,
    Outcome,
    Reason,
    RunSpec,
    Submission,
    Verdict,
    submission_hash,
    submission_venue,
)
from protocol.seeds import sampling_seed, task_seed, validator_ranking, work_key
from protocol.timing import StageTimer, stage
from validator.chainview import CATCHUP_S, ChainView
from validator.guard import SystemicGuard, drift_band
from validator.ledger import Decision, Ledger, Row
from validator.peers import PeerWatch
from validator.weights import WeightStore, WeightsUnavailable

if TYPE_CHECKING:
    from environments import Task
    from models.loading import LoadedModel
    from toploc.thresholds import ToplocThresholds
    from validator.config import ValidatorConfig

log = logging.getLogger(__name__)

SOFTWARE = "prime-validator/0.1"
PROOF_BYTES = 258


class NodeInactiveError(ProtocolError):
    """The signer is not a registered, active, staked node of this pool."""

    code = "node_inactive"


class CounterOutOfOrderError(ProtocolError):
    """The counter is not the one this validator expects next for (node, version) (nor within the gap).

    Soft and without a ledger row, so the assignment stays free: a node resends its work in counter
    order. Never a slash: that a counter was skipped rests on what this validator did *not* receive,
    which it cannot prove to anyone (DESIGN.md "Assignment"; skipped counters are counted instead)."""

    code = "counter_out_of_order"

    def __init__(self, message: str, expected: int) -> None:
        super().__init__(message)
        self.expected = expected


class RateLimitedError(ProtocolError):
    """The signer sent more than its share; retry after `retry_after` seconds."""

    code = "rate_limited"

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class NodeQuotaError(RateLimitedError):
    """The signer stored its share of bytes for this window, or has a hard verdict here not yet on chain."""

    code = "node_quota"


class OverloadedError(ProtocolError):
    """This validator takes no more work now (backlog full or global rate reached); retry after `retry_after`."""

    code = "overloaded"

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass
class Answer:
    """What the HTTP layer returns for one POST."""

    status: int
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)


class _Bucket:
    __slots__ = ("tokens", "at")

    def __init__(self, tokens: float, at: float) -> None:
        self.tokens, self.at = tokens, at


def _take(b: _Bucket, rate: float, burst: int, now: float) -> float:
    """Take one token from `b`; 0 when taken, else the seconds until one is there."""
    b.tokens = min(float(burst), b.tokens + (now - b.at) * rate)
    b.at = now
    if b.tokens < 1.0:
        return (1.0 - b.tokens) / rate
    b.tokens -= 1.0
    return 0.0


class _SenderGate:
    """A replay guard that first checks the (already authenticated) sender, cheapest first: active on chain,
    within its rate, within the global rate, within its bytes for the window, no hard verdict of it pending
    here, room in the backlog. Raising here keeps the nonce unconsumed, so a refused node can resend the same
    envelope. `sized(n)` is the guard for one request of `n` bytes."""

    def __init__(self, inner: NonceGuard, chain: ChainView, ledger: Ledger, cfg: ValidatorConfig) -> None:
        self.inner, self.chain, self.ledger = inner, chain, ledger
        self.rate, self.burst, self.flood = cfg.rate_per_node, cfg.rate_burst, cfg.flood
        self.retry_hold_s = cfg.systemic.window_s
        self.read_back_s = 2 * cfg.chain.poll_s + 1.0  # a landed slash is in the chain view by then
        self._buckets: dict[str, _Bucket] = {}
        self._global = _Bucket(float(cfg.flood.burst), time.monotonic())
        self._bytes: dict[str, tuple[int, int]] = {}
        """node -> (window number, bytes admitted in it); only the current window's nodes are kept."""
        self._lock = threading.Lock()
        self.timer: StageTimer | None = None

    def sized(self, size: int) -> _SizedGate:
        return _SizedGate(self, size)

    def check(self, domain: str, signer: str, nonce: int, *, size: int, sent_at: float, expires_at: float) -> None:
        with stage(self.timer, "intake.gate"):
            self._check(domain, signer, nonce, size=size, sent_at=sent_at, expires_at=expires_at)

    def _check(self, domain: str, signer: str, nonce: int, *, size: int, sent_at: float, expires_at: float) -> None:
        if not self.chain.node_active_fresh(signer, CATCHUP_S):
            raise NodeInactiveError(f"{signer} is not an active, staked node of this pool")
        mono, f = time.monotonic(), self.flood
        window = int(time.time() // f.window_s)
        with self._lock:
            b = self._buckets.get(signer)
            if b is None:
                b = self._buckets[signer] = _Bucket(float(self.burst), mono)
            wait = _take(b, self.rate, self.burst, mono)
            if wait:
                raise RateLimitedError(f"{signer} is over {self.rate}/s", wait)
            wait = _take(self._global, f.rate, f.burst, mono)
            if wait:
                raise OverloadedError(f"this validator takes at most {f.rate} submissions/s", wait)
            at, used = self._bytes.get(signer, (window, 0))
            used = used if at == window else 0
            if used + size > f.node_bytes_per_window:
                raise NodeQuotaError(f"{signer} stored {used} bytes here in this {f.window_s:.0f} s window (limit "
                                     f"{f.node_bytes_per_window})", (window + 1) * f.window_s - time.time())
        if f.hold_slashable and self.ledger.hard_pending(signer, reported_since=time.time() - self.read_back_s):
            raise NodeQuotaError(f"{signer} has a hard verdict here that is not on chain yet", self.retry_hold_s)
        backlog = self.ledger.backlog()
        if backlog >= f.max_backlog:
            raise OverloadedError(f"{backlog} submissions wait to be checked or reported (limit {f.max_backlog})",
                                  min(f.window_s, 10.0))
        # wall-clock time: the guard prunes nonces whose (wall-clock) expiry has passed
        self.inner.check_and_record(domain, signer, nonce, sent_at=sent_at, expires_at=expires_at)
        with self._lock:
            if len(self._bytes) > 4 * len(self._buckets) + 64:  # forget nodes of past windows
                self._bytes = {k: v for k, v in self._bytes.items() if v[0] == window}
            at, used = self._bytes.get(signer, (window, 0))
            self._bytes[signer] = (window, (used if at == window else 0) + size)

    def check_and_record(
        self, domain: str, signer: str, nonce: int, *, sent_at: float, expires_at: float, now: float | None = None
    ) -> None:
        self.check(domain, signer, nonce, size=0, sent_at=sent_at, expires_at=expires_at)


class _SizedGate:
    """`_SenderGate` for one request of `size` bytes (what `open_envelope` calls as its replay guard)."""

    def __init__(self, gate: _SenderGate, size: int) -> None:
        self.gate, self.size = gate, size

    def check_and_record(
        self, domain: str, signer: str, nonce: int, *, sent_at: float, expires_at: float, now: float | None = None
    ) -> None:
        self.gate.check(domain, signer, nonce, size=self.size, sent_at=sent_at, expires_at=expires_at)


def _hex(data: bytes) -> str:
    return "0x" + data.hex()


class Pipeline:
    """Intake, checks and verdicts of one validator (HTTP-free; `validator.app` serves it)."""

    def __init__(
        self, cfg: ValidatorConfig, identity: Identity, ledger: Ledger, chain: ChainView, weights: WeightStore,
        *, domain: str, replay_guard: NonceGuard, nonces: NonceCounter, peers: PeerWatch | None = None,
        timer: StageTimer | None = None,
    ) -> None:
        from toploc.thresholds import ToplocThresholds

        self.cfg = cfg
        self.run: RunSpec = cfg.run
        self.identity = identity
        self.ledger = ledger
        self.chain = chain
        self.weights = weights
        self.peers = peers
        self.domain = domain
        self.chain_id, self.pool = submission_venue(domain)  # bound into every work key and seed
        self.nonces = nonces
        self.gate = _SenderGate(replay_guard, chain, ledger, cfg)
        self.env: Environment = get_environment(self.run.env, self.run.env_version)
        c = cfg.checks
        self.thresholds = ToplocThresholds(
            max_exp_mismatches=c.max_exp_mismatches, max_mant_err_mean=c.max_mant_err_mean,
            max_mant_err_median=c.max_mant_err_median, sampling_margin_tolerance=c.sampling_margin_tolerance,
            max_sampling_mismatches=c.max_sampling_mismatches)
        self.thresholds_hash = _hex(hashlib.sha256(canonical_bytes({
            "checks": c.model_dump(mode="json"), "run": self.run.model_dump(mode="json")})).digest())
        self.stats: dict[str, int] = {}
        self._stats_lock = threading.Lock()
        self.guard = SystemicGuard(self)
        self._holes_below = 0  # versions below this have had their skipped counters counted
        self._timer: StageTimer | None = None
        self.timer = timer

    @property
    def timer(self) -> StageTimer | None:
        """The stage timer (`protocol.timing`) intake and checks fill, or None (the default: no timing)."""
        return self._timer

    @timer.setter
    def timer(self, timer: StageTimer | None) -> None:
        self._timer = self.gate.timer = timer

    # -- small helpers -------------------------------------------------------------------------

    def count(self, name: str, n: int = 1) -> None:
        with self._stats_lock:
            self.stats[name] = self.stats.get(name, 0) + n

    def tasks(self, node: str, version: int, counter: int) -> list[Task]:
        seed = task_seed(node, version, counter, run_id=self.run.run_id, chain_id=self.chain_id, pool=self.pool)
        return self.env.sample(seed, self.run.tasks_per_batch)

    def work_key(self, node: str, version: int, counter: int) -> bytes:
        """`protocol.seeds.work_key` of an assignment in this validator's run, pool and chain."""
        return work_key(self.run.run_id, node, version, counter, chain_id=self.chain_id, pool=self.pool)

    def validators(self) -> list[str]:
        return self.cfg.validators or [self.identity.address]

    def taker(self, node: str, version: int) -> str:
        """The validator that takes `node`'s work at `version`: the first in rendezvous order that is not
        down as seen from here (see `validator.peers`)."""
        for address in validator_ranking(self.run.run_id, node, version, self.validators()):
            if address == self.identity.address or self.peers is None or not self.peers.down(address):
                return address
        return self.identity.address  # pragma: no cover - the loop returns at our own address at the latest

    def _sign_verdict(self, sub: Submission, key: bytes, sub_hash: bytes, outcome: Outcome, reason: Reason,
                      evidence_hash: str | None) -> bytes:
        verdict = Verdict(
            run_id=self.run.run_id, work_key=key, node=sub.node, policy_version=sub.policy_version,
            counter=sub.counter, submission_hash=sub_hash, outcome=outcome, reason=reason,
            evidence_hash=bytes.fromhex(evidence_hash[2:]) if evidence_hash else None)
        with stage(self._timer, "verdict.seal"):
            env = seal(self.identity, verdict, domain=self.domain, nonce=self.nonces.next(self.domain))
            return env.to_bytes()

    def _decision(self, sub: Submission, envelope_bytes: bytes, outcome: Outcome, reason: Reason, detail: str,
                  measurements: dict[str, Any] | None = None, feed: FeedItem | None = None,
                  extra_evidence: dict[str, Any] | None = None) -> Decision:
        key = self.work_key(sub.node, sub.policy_version, sub.counter)
        sub_hash = submission_hash(envelope_bytes)
        evidence = evidence_hash = None
        if outcome is Outcome.REJECTED_HARD:
            evidence = canonical_bytes({
                "software": SOFTWARE, "work_key": _hex(key), "reason": reason.value, "detail": detail,
                # the envelope is stored once, in its ledger row (served at /v1/envelopes/{hash}): the
                # evidence names it by hash, which the hash of the evidence on chain then commits to
                "submission_hash": _hex(sub_hash), "measurements": measurements or {},
                "thresholds": self.cfg.checks.model_dump(mode="json"), "run": self.run.model_dump(mode="json"),
                **(extra_evidence or {})})
            evidence_hash = _hex(hashlib.sha256(evidence).digest())
        feed_bytes = None
        if feed is not None:
            with stage(self._timer, "verdict.seal"):
                feed_bytes = seal(self.identity, feed, domain=self.domain,
                                  nonce=self.nonces.next(self.domain)).to_bytes()
        self.count(f"verdict_{outcome.value}")
        log.info("verdict %s %s node %s v%d #%d: %s%s", outcome.value, reason.value, sub.node, sub.policy_version,
                 sub.counter, detail, f" evidence {evidence_hash}" if evidence_hash else "")
        return Decision(
            outcome=outcome.value, reason=reason.value, detail=detail, measurements=measurements,
            evidence=evidence, evidence_hash=evidence_hash,
            verdict=self._sign_verdict(sub, key, sub_hash, outcome, reason, evidence_hash), feed_item=feed_bytes)

    def _reject(self, sub: Submission, envelope_bytes: bytes, reason: Reason, detail: str,
                measurements: dict[str, Any] | None = None, **kw: Any) -> Decision:
        outcome = Outcome.REJECTED_HARD if reason.hard else Outcome.REJECTED_SOFT
        if outcome is Outcome.REJECTED_HARD and measurements is not None and "samples" in measurements:
            c = self.cfg.checks
            measurements = {**measurements, "drift_band": drift_band(
                reason, measurements, self.thresholds, c.logprob_tolerance, self.cfg.systemic.drift_band_factor)}
            if self.guard.softens(sub, reason, measurements):
                detail = f"{reason.value} ({detail}) and our self-test of v{sub.policy_version} failed: suspecting " \
                         "ourselves"
                reason, outcome = Reason.SUSPECTED_SYSTEMIC, Outcome.REJECTED_SOFT
                measurements["drift_band"] = False  # a softened row never counts as a failure again
        return self._decision(sub, envelope_bytes, outcome, reason, detail, measurements, **kw)

    def soften_unreported(self, version: int) -> None:
        """This version's drift-band hard verdicts not yet on chain become `suspected_systemic` (the reporter
        holds hard verdicts for `systemic.window_s`, so the early ones of a wave are still here)."""
        for row in self.ledger.unreported_hard(version):  # a page at a time, never every envelope at once
            if row.outcome != Outcome.REJECTED_HARD.value or not json.loads(row.measurements or "{}").get("drift_band"):
                continue
            decision = self._decision(_parse_stored(row), row.envelope, Outcome.REJECTED_SOFT,
                                      Reason.SUSPECTED_SYSTEMIC, f"was {row.reason}: {row.detail}")
            self.ledger.redecide(row.work_key, decision)

    def recheck(self, version: int, rows: list[Row]) -> list[tuple[Reason, str] | None]:
        """Stored submissions of `version` judged again with the current weights and thresholds (the guard's
        self-test); `WeightsUnavailable`, `ModelError` or the model's own errors when that cannot run."""
        loaded = self.weights.get(version)
        subs = [_parse_stored(r) for r in rows]
        reports = self.measure(loaded, [(sub, self.tasks(sub.node, sub.policy_version, sub.counter)) for sub in subs])
        return [self.judge(sub, rep, self.thresholds, self.cfg.checks.logprob_tolerance)[0]
                for sub, rep in zip(subs, reports, strict=True)]

    # -- intake (cheap checks) ----------------------------------------------------------------

    def intake(self, data: bytes) -> Answer:
        """Cheap checks of one posted envelope; see the module docstring."""
        self.count("submissions_received")
        if len(data) > self.cfg.max_submission_bytes:
            self.count("refused_oversize")
            return Answer(413, {"error": "oversize", "detail": f"{len(data)} bytes, limit "
                                f"{self.cfg.max_submission_bytes}"})
        timer = self._timer
        with stage(timer, "intake.lookup"):
            sub_hash = submission_hash(data)
            known = self.ledger.by_hash(_hex(sub_hash))
        if known is not None:  # the same bytes again: the same answer, never a second row
            return Answer(200 if known.state != "received" else 202, self.row_status(known))
        envelope: Envelope | None = None
        try:
            with stage(timer, "intake.parse"):
                envelope = Envelope.from_bytes(data, max_bytes=self.cfg.max_submission_bytes)
            with stage(timer, "intake.open"):
                body = open_envelope(envelope, domain=self.domain, replay_guard=self.gate.sized(len(data)),
                                     body_types=[Submission], max_age_s=self.cfg.max_age_s)
        except OversizeError as exc:
            return self._refuse(413, exc, None)
        except SignatureError as exc:
            return self._refuse(401, exc, None)
        except NodeInactiveError as exc:
            return self._refuse(403, exc, envelope.signer if envelope else None)
        except (RateLimitedError, OverloadedError) as exc:
            answer = self._refuse(429 if isinstance(exc, RateLimitedError) else 503, exc,
                                  envelope.signer if envelope else None)
            answer.headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after)))
            return answer
        except ReplayError as exc:
            return self._refuse(409, exc, envelope.signer if envelope else None)
        except ProtocolError as exc:  # malformed, expired, wrong domain, unknown version, body invalid
            return self._refuse(400, exc, None)
        assert isinstance(body, Submission)
        if body.node != envelope.signer:
            return self._refuse(400, ProtocolError(f"submission names node {body.node}, signed by {envelope.signer}"),
                                envelope.signer)
        key = _hex(self.work_key(body.node, body.policy_version, body.counter))
        with stage(timer, "intake.lookup"):
            existing = self.ledger.get(key)
        if existing is None:
            with stage(timer, "intake.assignment"):
                early = self._not_ours_yet(body)
            if early is not None:
                return early
            with stage(timer, "intake.cheap_checks"):
                decision = self._cheap_checks(body, data)
                out_of_order = self.counter_problem(body) if decision is None else None
            if out_of_order is not None:
                answer = self._refuse(409, out_of_order, body.node)
                answer.body.update(outcome=Outcome.REJECTED_SOFT.value, expected_counter=out_of_order.expected)
                return answer
            with stage(timer, "intake.insert"):
                inserted = self.ledger.insert(work_key=key, submission_hash=_hex(sub_hash), node=body.node,
                                              policy_version=body.policy_version, counter=body.counter,
                                              envelope=data, decision=decision)
            if inserted:
                row = self.ledger.get(key)
                assert row is not None
                return Answer(202 if decision is None else 200, self.row_status(row))
            existing = self.ledger.get(key)  # a concurrent request took the work key first
            assert existing is not None
        if _parse_stored(existing) == body:  # the same payload sealed again (a retry): the same answer
            return Answer(200 if existing.state != "received" else 202, self.row_status(existing))
        return self._equivocation(existing, body, data)

    def _refuse(self, status: int, exc: PrimeError, sender: str | None) -> Answer:
        self.count(f"refused_{exc.code}")
        # An authenticated member of the pool: counted against it in the ledger. Keys that never registered
        # cost nothing to make, so they are only counted in the metrics (a row each would fill the disk).
        if sender is not None and self.chain.known(sender):
            self.ledger.count_refusal(sender, exc.code)
        return Answer(status, {"error": exc.code, "detail": str(exc)})

    def _equivocation(self, existing: Row, body: Submission, data: bytes) -> Answer:
        """A second, different payload signed for an assignment that already has a row."""
        if existing.outcome != Outcome.REJECTED_HARD.value:
            decision = self._reject(body, data, Reason.EQUIVOCATION,
                                    f"a second, different payload for assignment #{body.counter} at "
                                    f"v{body.policy_version}", extra_evidence={
                                        # both signed payloads, so the evidence alone proves it (an appeal
                                        # re-checks it from this document; the second is stored nowhere else)
                                        "submission": data.decode(), "first": existing.envelope.decode(),
                                        "first_submission_hash": existing.submission_hash})
            if not self.ledger.decide(existing.work_key, decision):  # the checker decided it first
                self.ledger.redecide(existing.work_key, decision)
        row = self.ledger.get(existing.work_key)
        assert row is not None
        return Answer(409, {"error": "duplicate_work", "detail": "this assignment was already submitted",
                            **self.row_status(row)})

    def _not_ours_yet(self, sub: Submission) -> Answer | None:
        """Work another validator must check, or of a version our chain view has not seen yet: refused
        without a ledger row (soft, counted), so the assignment stays free for the right place and time."""
        mine = self.taker(sub.node, sub.policy_version)
        if mine != self.identity.address:
            self.ledger.count_refusal(sub.node, Reason.NOT_ASSIGNED_HERE.value)
            self.count(f"refused_{Reason.NOT_ASSIGNED_HERE.value}")
            return Answer(421, {"error": Reason.NOT_ASSIGNED_HERE.value, "detail": f"assigned to {mine}",
                                "outcome": Outcome.REJECTED_SOFT.value, "assigned_validator": mine})
        current = self.chain.current_version()
        if current is None or sub.policy_version > current:
            self.ledger.count_refusal(sub.node, Reason.FUTURE_VERSION.value)
            self.count(f"refused_{Reason.FUTURE_VERSION.value}")
            return Answer(425, {"error": Reason.FUTURE_VERSION.value, "outcome": Outcome.REJECTED_SOFT.value,
                                "detail": f"v{sub.policy_version} is not on chain yet (newest: {current})"},
                          {"Retry-After": "2"})
        return None

    def counter_problem(self, sub: Submission) -> CounterOutOfOrderError | None:
        """Counters in order, with a small bounded gap (DESIGN.md "Assignment"): for (node, version) let m be
        the smallest counter this validator holds no row for, counting from 0 where it is the assigned
        (rendezvous-first) validator; `sub.counter` must be in [m, m + checks.counter_gap]. A validator
        that took the node over (the first one down) starts at the first counter it is sent, and is in
        order from there. So a node cannot search counters for tasks it likes (the next one is fixed)
        nor hold back a batch that scored badly: until that counter arrives, nothing beyond the gap is
        taken at that version, and `count_holes` counts it against the node once the version is stale."""
        first = validator_ranking(self.run.run_id, sub.node, sub.policy_version, self.validators())[0]
        base = 0 if first == self.identity.address else None
        expected = self.ledger.next_counter(sub.node, sub.policy_version, base=base)
        gap = self.cfg.checks.counter_gap
        if expected is None or expected <= sub.counter <= expected + gap:
            return None
        if sub.counter < expected and self.ledger.get(_hex(self.work_key(sub.node, sub.policy_version,
                                                                         sub.counter))) is not None:
            return None  # a concurrent request took this assignment first: a retry or equivocation, not order
        return CounterOutOfOrderError(
            f"counter {sub.counter} at v{sub.policy_version}: this validator takes counter {expected} next (at most "
            f"{gap} ahead); send the assignments in counter order", expected)

    def count_holes(self) -> int:
        """Count, once per (node, version) that left the async window, the counters the node skipped here
        (between the first counter it had to send and the last one it sent; DESIGN.md "Assignment");
        returns how many (node, version)s were counted. Holes cost reputation, not stake: they are in the
        ledger (`/v1/audit` `counter_holes`, `/v1/nodes/<node>`) and the metrics (`counter_holes`), and
        at the version itself they already cost the node every assignment after the gap."""
        current = self.chain.current_version()
        if current is None:
            return 0
        below = current - self.run.async_level
        if below <= self._holes_below:
            return 0
        counted = 0
        for node, version, lo, hi, n in self.ledger.uncounted_assignments(below, self._holes_below):
            first = validator_ranking(self.run.run_id, node, version, self.validators())[0]
            base = 0 if first == self.identity.address else lo
            holes = max(0, hi - base + 1 - n)
            if self.ledger.record_holes(node, version, base, hi, holes):
                counted += 1
                if holes:
                    self.count("counter_holes", holes)
                    log.warning("node %s skipped %d of counters %d..%d at v%d (never sent here)", node, holes, base,
                                hi, version)
        self._holes_below = below
        return counted

    def _cheap_checks(self, sub: Submission, data: bytes) -> Decision | None:
        problem = self.cheap_problem(sub, version_window=True)
        return None if problem is None else self._reject(sub, data, *problem)

    def cheap_problem(self, sub: Submission, *, version_window: bool) -> tuple[Reason, str] | None:
        """The first cheap check `sub` fails (no side effects). `version_window=False` skips the async window
        (an appeal re-checks work that was inside it when it was submitted)."""
        run = self.run
        if sub.run_id != run.run_id:
            return Reason.WRONG_RUN, f"run {sub.run_id!r}, this is {run.run_id!r}"
        current = self.chain.current_version() or 0
        if version_window and sub.policy_version < current - run.async_level:
            return Reason.STALE_VERSION, f"v{sub.policy_version} is older than {current} - {run.async_level}"
        if self.chain.manifest_hash(sub.policy_version) != sub.manifest_hash:
            return Reason.WRONG_MANIFEST, f"manifest {_hex(sub.manifest_hash)} is not the one published for " \
                                          f"v{sub.policy_version}"
        if sub.counter >= run.max_batches_per_version:
            return Reason.COUNTER_OUT_OF_RANGE, f"counter {sub.counter} >= {run.max_batches_per_version}"
        if (sub.env, sub.env_version) != (run.env, run.env_version):
            return Reason.WRONG_TASK, f"environment {sub.env}@{sub.env_version}, run uses {run.env}@{run.env_version}"
        assigned = [t.task_id for t in self.tasks(sub.node, sub.policy_version, sub.counter)]
        claimed = [t.task_id for t in sub.tasks]
        if claimed != assigned:
            return Reason.WRONG_TASK, f"tasks {claimed} are not the assigned {assigned}"
        problem = self._schema_problem(sub)
        if problem is not None:
            return Reason.SCHEMA, problem
        return None

    def _schema_problem(self, sub: Submission) -> str | None:
        run, block = self.run, self.thresholds.decode_batching_size
        for t, task in enumerate(sub.tasks):
            if len(task.samples) != run.samples_per_task:
                return f"task {t} has {len(task.samples)} samples, the run asks {run.samples_per_task}"
            for i, s in enumerate(task.samples):
                where = f"task {t} sample {i}"
                if len(s.tokens) > run.max_new_tokens:
                    return f"{where}: {len(s.tokens)} tokens > max_new_tokens {run.max_new_tokens}"
                if s.finish_reason == "length" and len(s.tokens) != run.max_new_tokens:
                    return f"{where}: finish_reason length with {len(s.tokens)} of {run.max_new_tokens} tokens"
                if len(s.proofs) != -(-len(s.tokens) // block) or any(len(p) != PROOF_BYTES for p in s.proofs):
                    return f"{where}: {len(s.proofs)} proofs for {len(s.tokens)} tokens (one {PROOF_BYTES}-byte " \
                           f"proof per {block})"
                if not all(math.isfinite(x) and x <= 0.0 for x in s.logprobs) or not math.isfinite(s.reward):
                    return f"{where}: logprobs must be finite and <= 0, reward finite"
        return None

    # -- model stage ----------------------------------------------------------------------------

    def check_pending(self, limit: int | None = None) -> int:
        """Check a batch of received rows; returns how many were decided."""
        with stage(self._timer, "check.ledger"):
            rows = self.ledger.claim(limit or self.cfg.checks.batch_submissions)
        by_version: dict[int, list[Row]] = {}
        for row in rows:
            by_version.setdefault(row.policy_version, []).append(row)
        decided = 0
        for version, group in sorted(by_version.items()):
            decided += self._check_version(version, group)
        return decided

    def _ours_failed(self, row: Row, why: str, reason: Reason = Reason.VALIDATOR_ERROR) -> int:
        """Our failure: retry the row, or after `retries` attempts decide it soft. Never hard."""
        attempts = self.ledger.release(row.work_key, why)
        self.count("own_failures")
        if attempts <= self.cfg.checks.retries:
            log.warning("could not check %s (attempt %d, will retry): %s", row.work_key, attempts, why)
            return 0
        self.ledger.decide(row.work_key, self._reject(_parse_stored(row), row.envelope, reason, why))
        return 1

    def _check_version(self, version: int, rows: list[Row]) -> int:
        try:
            loaded = self.weights.get(version)
        except WeightsUnavailable as exc:
            current = self.chain.current_version() or 0
            decided = 0
            for row in rows:
                if version < current - self.run.async_level:  # it will never come: soft, not the node's fault
                    self.ledger.decide(row.work_key, self._reject(_parse_stored(row), row.envelope,
                                                                  Reason.WEIGHTS_UNAVAILABLE, str(exc)))
                    decided += 1
                else:
                    self.ledger.release(row.work_key, str(exc))
            return decided
        timer = self._timer
        with stage(timer, "check.parse"):
            subs = [(row, _parse_stored(row)) for row in rows]
        prepared: list[tuple[Row, Submission, list[Task], list[list[float]]]] = []
        decided = 0
        for row, sub in subs:
            with stage(timer, "check.tasks"):
                tasks = self.tasks(sub.node, sub.policy_version, sub.counter)
            try:
                with stage(timer, "check.rewards"):
                    rewards = self.rewards(loaded, sub, tasks)
            except UngradableError as exc:
                decided += self._ours_failed(row, f"grader: {exc}", Reason.UNGRADABLE)
                continue
            except Exception as exc:  # noqa: BLE001 - whatever our grader raises is our failure, never theirs
                decided += self._ours_failed(row, f"grader failed: {type(exc).__name__}: {exc}", Reason.UNGRADABLE)
                continue
            bad = self.reward_mismatch(sub, rewards)
            if bad is not None:
                self.ledger.decide(row.work_key, self._reject(sub, row.envelope, Reason.REWARD_MISMATCH, bad,
                                                              {"rewards": rewards}))
                decided += 1
                continue
            prepared.append((row, sub, tasks, rewards))
        if not prepared:
            return decided
        try:
            with stage(timer, "check.measure"):
                reports = self.measure(loaded, [(sub, tasks) for _, sub, tasks, _ in prepared])
        except (ModelError, RuntimeError, MemoryError) as exc:  # the model failing is ours, whatever it raised
            return decided + sum(self._ours_failed(row, f"model stage: {exc}") for row, *_ in prepared)
        for (row, sub, tasks, rewards), sub_reports in zip(prepared, reports, strict=True):
            try:
                with stage(timer, "check.verdict"):
                    decision = self._verdict(loaded, row, sub, tasks, rewards, sub_reports)
            except UngradableError as exc:  # grading a sample cut at the replay's EOS (feed_item) failed: ours
                decided += self._ours_failed(row, f"grader: {exc}", Reason.UNGRADABLE)
                continue
            with stage(timer, "check.ledger"):
                self.ledger.decide(row.work_key, decision)
            decided += 1
        return decided

    def rewards(self, loaded: LoadedModel, sub: Submission, tasks: list[Task]) -> list[list[float]]:
        return [[self.grade(loaded, task, s.tokens) for s in tr.samples] for task, tr in zip(tasks, sub.tasks, strict=True)]

    def grade(self, loaded: LoadedModel, task: Task, tokens: tuple[int, ...]) -> float:
        """The environment's reward for a completion's tokens (special tokens dropped from the text)."""
        text = str(loaded.tokenizer.decode(list(tokens), skip_special_tokens=True))
        return float(self.env.reward(task, text, completion_tokens=len(tokens)))

    def reward_mismatch(self, sub: Submission, rewards: list[list[float]]) -> str | None:
        tol = self.cfg.checks.reward_tolerance
        for t, (tr, rs) in enumerate(zip(sub.tasks, rewards, strict=True)):
            for i, (s, r) in enumerate(zip(tr.samples, rs, strict=True)):
                if abs(s.reward - r) > tol:
                    return f"task {t} sample {i}: claimed reward {s.reward}, recomputed {r}"
        return None

    def measure(self, loaded: LoadedModel, subs: list[tuple[Submission, list[Task]]],
                 thresholds: ToplocThresholds | None = None) -> list[list[Any]]:
        from models.sampling import SamplingParams
        from toploc.validation import Rollout, measure

        params = SamplingParams(temperature=self.run.temperature, top_k=self.run.top_k, top_p=self.run.top_p)
        rollouts: list[Rollout] = []
        shape: list[int] = []
        for sub, tasks in subs:
            n = 0
            for task, tr in zip(tasks, sub.tasks, strict=True):
                prompt = prompt_tokens(loaded, task)
                for i, s in enumerate(tr.samples):
                    seed = sampling_seed(sub.node, sub.policy_version, task.task_id, i, run_id=self.run.run_id,
                                         chain_id=self.chain_id, pool=self.pool, counter=sub.counter)
                    rollouts.append(Rollout(prompt, list(s.tokens), list(s.proofs), seed, self.run.max_new_tokens))
                    n += 1
            shape.append(n)
        reports = measure(loaded, rollouts, params, thresholds or self.thresholds,
                          batch_tokens=self.cfg.checks.batch_tokens, timer=self._timer)
        out, at = [], 0
        for n in shape:
            out.append(reports[at : at + n])
            at += n
        return out

    def _verdict(self, loaded: LoadedModel, row: Row, sub: Submission, tasks: list[Task],
                 rewards: list[list[float]], reports: list[Any]) -> Decision:
        failure, per_sample = self.judge(sub, reports, self.thresholds, self.cfg.checks.logprob_tolerance)
        near = sum(int(m.get("near_ties", 0)) for m in per_sample)
        near_eos = sum(len(m.get("eos_near_ties", ())) for m in per_sample)
        measurements = {"samples": per_sample, "rewards": rewards, "thresholds_hash": self.thresholds_hash,
                        "units": self.units(sub, paid_tokens(per_sample)), "near_ties": near, "eos_near_ties": near_eos}
        self.count("near_tie_disagreements", near)
        self.count("eos_near_ties", near_eos)
        if failure is not None:
            return self._reject(sub, row.envelope, *failure, measurements)
        return self._decision(sub, row.envelope, Outcome.ACCEPTED, Reason.ACCEPTED,
                              f"{sub.n_samples()} samples, {sub.n_tokens()} tokens", measurements,
                              feed=self.feed_item(loaded, bytes.fromhex(row.work_key[2:]), sub, tasks, rewards, reports))

    def feed_item(self, loaded: LoadedModel, key: bytes, sub: Submission, tasks: list[Task],
                  rewards: list[list[float]], reports: list[Any]) -> FeedItem:
        """What the trainer learns from accepted (or restored) work: the node's tokens (replayed exactly),
        the rewards we recomputed and the sampling logprobs of *our* replay (`reports`, one per sample in
        order). The node's claimed logprobs passed `logprob_tolerance` and are never used: a node could
        move them anywhere inside it to steer the trainer's importance ratios. A sample that went on past an
        EOS our replay draws is fed as the replay drew it (`fed_sample`). Raises `UngradableError` when our
        grader fails on such a cut sample."""
        replayed = iter(reports)
        return FeedItem(
            run_id=self.run.run_id, work_key=key, node=sub.node,
            policy_version=sub.policy_version, env=sub.env, env_version=sub.env_version,
            groups=tuple(FeedGroup(task_id=task.task_id, prompt_tokens=tuple(prompt_tokens(loaded, task)), samples=tuple(
                self.fed_sample(loaded, task, s.tokens, r, next(replayed))
                for s, r in zip(tr.samples, rs, strict=True)))
                for task, tr, rs in zip(tasks, sub.tasks, rewards, strict=True)))

    def fed_sample(self, loaded: LoadedModel, task: Task, tokens: tuple[int, ...], reward: float,
                   report: Any) -> FeedSample:
        """One sample for the trainer. Where our replay draws an EOS and the node's token there is not one (a
        near-tie EOS inside `checks.eos_tie_drift`, flipped by the node's float drift or skipped on purpose; a
        skip beyond it never gets here), the policy's sample ends at that EOS: the trainer gets the tokens before
        it, the EOS with our replay's logprob of it, and our grader's reward for that shorter completion. The
        tail the node generated after it is no draw of the policy (and is never paid, `paid_tokens`); fed as it
        was, a node could lengthen its completions toward whatever the reward favours."""
        term, sampling = report.termination, report.sampling
        end = term.replay_end if term is not None else None
        eos = set(loaded.eos_token_ids)
        if end is None or sampling is None or sampling.winners[end - 1] not in eos or tokens[end - 1] in eos:
            return FeedSample(tokens=tokens, logprobs=tuple(report.logprobs), reward=reward)
        p = end - 1
        cut = (*tokens[:p], int(sampling.winners[p]))
        try:
            cut_reward = self.grade(loaded, task, cut)
        except UngradableError:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever our grader raises is our failure, never theirs
            raise UngradableError(f"grader failed on a sample cut at the replay's EOS: {type(exc).__name__}: "
                                  f"{exc}") from exc
        self.count("feed_samples_cut_at_replay_eos")
        return FeedSample(tokens=cut, logprobs=(*report.logprobs[:p], report.winner_logprobs[p]), reward=cut_reward)

    def judge(self, sub: Submission, reports: list[Any], th: ToplocThresholds, tol: float
              ) -> tuple[tuple[Reason, str] | None, list[dict[str, Any]]]:
        """(the first failure of the measured samples, in order of precedence, or None; per-sample measurements)
        under thresholds `th` and logprob tolerance `tol`."""
        samples = [s for tr in sub.tasks for s in tr.samples]
        per_sample: list[dict[str, Any]] = []
        failures: dict[Reason, str] = {}
        for j, (s, rep) in enumerate(zip(samples, reports, strict=True)):
            m: dict[str, Any] = {"error": rep.error}
            if rep.error is None:
                chunks = th.failing_chunks(rep.proofs)
                m["toploc"] = [[p.exp_mismatches, round(p.mant_err_mean, 3), round(p.mant_err_median, 3)]
                               for p in rep.proofs]
                m["failing_chunks"] = chunks
                m["sampling_max_margin"] = rep.sampling.max_margin
                m["sampling_mismatches"] = list(rep.sampling.mismatch_positions)
                m["termination"] = list(rep.termination.violations)
                m["near_ties"] = len(rep.sampling.near_ties)
                eos_ties = [(i, rep.sampling.margins[i]) for i in rep.termination.eos_near_ties]
                m["eos_near_ties"] = [[i, margin] for i, margin in eos_ties]
                skipped = [i for i, margin in eos_ties if margin > self.cfg.checks.eos_tie_drift]
                m["eos_skips"] = skipped
                m["paid_tokens"] = rep.termination.replay_end
                lp_err = max((abs(a - b) for a, b in zip(s.logprobs, rep.logprobs, strict=True)), default=0.0)
                m["logprob_max_error"] = lp_err
                if chunks:
                    failures.setdefault(Reason.PROOF_MISMATCH, f"sample {j}: chunks {chunks} over the TOPLOC limits")
                if th.sampling_failed(rep.sampling):
                    failures.setdefault(Reason.SAMPLING_MISMATCH, f"sample {j}: tokens at "
                                        f"{list(rep.sampling.mismatch_positions)[:8]} were not the seeded draw")
                if rep.termination.violations or (s.finish_reason == "eos") != rep.termination.ends_with_eos:
                    failures.setdefault(Reason.TERMINATION, f"sample {j}: {list(rep.termination.violations)} "
                                        f"(finish_reason {s.finish_reason})")
                if skipped:
                    failures.setdefault(Reason.TERMINATION, f"sample {j}: an EOS the replay ranks first was replaced "
                                        f"at {skipped[:8]} by margins beyond the measured honest drift "
                                        f"{self.cfg.checks.eos_tie_drift}")
                if lp_err > tol:
                    failures.setdefault(Reason.LOGPROB_MISMATCH, f"sample {j}: logprob off by {lp_err:.3f}")
            else:
                failures.setdefault(Reason.SCHEMA, f"sample {j}: {rep.error}")
            per_sample.append(m)
        for reason in (Reason.SCHEMA, Reason.PROOF_MISMATCH, Reason.SAMPLING_MISMATCH, Reason.TERMINATION,
                       Reason.LOGPROB_MISMATCH):
            if reason in failures:
                return (reason, failures[reason]), per_sample
        return None, per_sample

    def units(self, sub: Submission, paid: int | None = None) -> int:
        """Work units for `sub`: `paid` tokens (counted from the replay, see `paid_tokens`) or all its tokens."""
        return max(1, math.ceil((sub.n_tokens() if paid is None else paid) * self.cfg.reporter.units_per_token))

    # -- views ------------------------------------------------------------------------------------

    def row_status(self, row: Row) -> dict[str, Any]:
        return {
            "work_key": row.work_key, "submission_hash": row.submission_hash, "node": row.node,
            "policy_version": row.policy_version, "counter": row.counter, "state": row.state,
            "outcome": row.outcome, "reason": row.reason, "detail": row.detail,
            "measurements": json.loads(row.measurements) if row.measurements else None,
            "evidence_hash": row.evidence_hash, "chain_tx": row.chain_tx, "report_error": row.report_error,
            "verdict": row.verdict.decode() if row.verdict else None,
        }


def prompt_tokens(loaded: LoadedModel, task: Task) -> list[int]:
    ids = render_prompt(loaded.tokenizer, task, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    return [int(t) for t in ids]


def paid_tokens(per_sample: list[dict[str, Any]]) -> int | None:
    """Tokens a node is paid for, from the replay: each sample up to the replay's first EOS (tokens a node
    generated after an EOS it skipped are never paid). None when a sample could not be measured."""
    if not per_sample or any(m.get("paid_tokens") is None for m in per_sample):
        return None
    return sum(int(m["paid_tokens"]) for m in per_sample)


def _parse_stored(row: Row) -> Submission:
    """A stored envelope's body (it passed every envelope check when it arrived)."""
    envelope = Envelope.model_validate_json(row.envelope)
    return Submission.model_validate(envelope.body)
