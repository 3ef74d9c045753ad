"""The work loop: learn the policy version, build the next assignment, record it, sign, submit, follow verdicts.

Order matters for safety: the payload is recorded in the slashing-protection database *before* it
is signed, so a crash at any point either leaves nothing signed or leaves a record whose payload
a restart resubmits (same payload, fresh envelope: never a second, different payload). The next
counter always comes from that record, so a restart never reuses a counter.

Transient failures (connection refused or reset, 5xx, 425 and 429, an unparseable answer) are retried
with exponential backoff and full jitter (tenacity); when the tries run out the work is kept and resent
later, and no new work is generated until it is out. A validator that does not answer within its timeout
(it accepts connections and hangs, or trickles bytes: every request has a total deadline, not only a
per-read one) is not retried: it is marked down at once and the work goes to the next validator in the
ranking (issue 26 item 3), and its `/v1/info` and verdict reads are bounded by `submit.probe_timeout_s`.
Its back-off doubles each time in a row it hangs (up to `DOWN_MAX_S`) and starts over when it answers: after
failover, polls for the old verdicts it holds go to the others and rarely to it (issue 39 item 4).

Nothing a validator says is believed because it answered (issue 23, item 10):

- a URL counts as validator V only if its `/v1/info` is proved by V's signature over our fresh challenge
  (`protocol.info_proof`), V holds the validator role on chain (`is_validator`), and the first URL that
  claims V keeps it until it is caught lying (a second claimant is only a stand-by);
- a 200 or 202 counts as delivered only with V's signed `Receipt` for exactly the envelope bytes sent
  (`verified_receipt`; issue 35 item 8: a bare `202 {}` made a node wait forever); without one the URL is
  dropped for V and the work kept to resend, and work V took that has no verdict by
  `submit.verdict_deadline_s` is resent, the same bytes (`resend_overdue`);
- a verdict is acted on only as the `Verdict` envelope V signed, in this run's domain, about exactly
  the assignment and one of the envelopes this node sent (`verified_verdict`); an answer that claims
  an outcome without such a verdict is a lie: the URL is dropped for V and shunned for a while, the
  work goes back to "signed" (payload kept) and is resent to whoever holds V's role next;
- an unexpected status is logged and counted (`Tally.peer_errors`), the validator is backed off and
  the next one tried. The node stops only on what it can check itself: a verified, signed hard
  verdict (more work would only be slashed again) or the chain saying it is not active.

Counters are used strictly in order and never skipped (validators take them in order:
docs/protocol/assignment.md, "Counters"). When a validator takes an earlier counter first that this node
no longer holds (it went to another validator while this one was down, or the state dir was lost), that
assignment is marked `refused` (never resent or signed again) and the node waits for the next version.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx
from tenacity import (
    RetryError,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    wait_random_exponential,
)

from environments import MultiTurnEnvironment
from environments import get as get_environment
from node.config import NodeConfig
from node.episodes import build_episode_submission
from node.errors import NodeStopped
from node.protection import SlashingProtection
from node.rollouts import build_submission
from node.weights import PolicyWeights, Waiting
from protocol import deadline
from protocol.canonical import to_hex
from protocol.envelope import Envelope, open_envelope, seal
from protocol.episodes import AnySubmission
from protocol.errors import PrimeError, SignatureError, UngradableError
from protocol.identity import Identity, checksum
from protocol.info_proof import read_info
from protocol.nonce import random_nonce
from protocol.replay import RereadRecords
from protocol.rollout import (
    Outcome,
    Reason,
    Receipt,
    RunSpec,
    Verdict,
    submission_hash,
    submission_venue,
)
from protocol.seeds import validator_ranking, work_key
from protocol.upload import upload_headers

logger = logging.getLogger(__name__)
SignedT = TypeVar("SignedT", Receipt, Verdict)


class Transient(Exception):
    """A failure worth trying again (the validator or the network, not our work)."""

    def __init__(self, message: str, retry_after: float = 0.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Hung(Transient):
    """The validator did not answer within its deadline: down for now, tried again only after a backoff."""


def bounded_request(http: httpx.Client, method: str, url: str, timeout_s: float, **kw: Any) -> httpx.Response:
    """`protocol.deadline.bounded_request`, its timeout raised as `Hung`."""
    try:
        return deadline.bounded_request(http, method, url, timeout_s, **kw)
    except deadline.PeerTimeoutError as exc:
        raise Hung(str(exc)) from exc


MAX_VALIDATORS = 64
"""Validator URLs a node keeps (configured, learned and hinted together)."""
DOWN_MAX_S = 600.0
"""Longest back-off from a validator that keeps hanging (`Worker._mark_down`; from `submit.max_backoff_s`, doubling)."""
SHUN_S = 300.0
"""How long a URL caught lying (a verdict it could not have signed) is not asked again."""


@dataclass
class ValidatorDirectory:
    """Validator URLs (configured, or learned over discovery) and the on-chain validator each one serves.

    A URL's `/v1/info` names the address it claims to be, proved by that address's signature over a fresh
    challenge (`protocol.info_proof`: a URL copying another's info proves nothing); the claim counts only when
    that address holds the validator role on chain (`is_validator`, the pool's `hasRole`), and only for the first
    URL that makes it: a later claimant of an address already served is a stand-by, used once the first one stops
    answering or is dropped (`distrust`), which happens when it answers with a verdict that address did
    not sign. The
    run's validator set (`announced`, what rendezvous ranks) is the chain-checked addresses the
    validators name, so a peer cannot add a validator of its own making."""

    urls: list[str]
    http: httpx.Client
    is_validator: Callable[[str], bool]
    """Whether an address holds the validator role on chain (the only authority on who validates)."""
    learned: Callable[[], list[str]] | None = None
    """More validator URLs (announced over discovery); each counts once its own /v1/info names its address."""
    by_address: dict[str, str] = field(default_factory=dict)
    announced: list[str] = field(default_factory=list)
    infos: dict[str, dict[str, Any]] = field(default_factory=dict)
    shunned: dict[str, float] = field(default_factory=dict)
    """URL -> time.monotonic() until which it is not asked (caught lying)."""
    timeout_s: float = 5.0
    """Total deadline of one `/v1/info` read (a URL slower than this is not answering, this pass)."""
    refused: Counter[str] = field(default_factory=Counter)
    """Claims not believed, by kind (`unproven`: the answer carries no valid signature of the address it names over
    our fresh challenge; `no_role`: the address holds no validator role; `taken`: another URL that still answers
    holds it)."""
    domain: str = ""
    """The run's envelope domain: `/v1/info` proofs are signed in it (a `Worker` fills it in from its own)."""

    def _add_url(self, url: str) -> None:
        url = url.rstrip("/")
        if url not in self.urls and len(self.urls) < MAX_VALIDATORS:
            self.urls.append(url)

    def _role(self, address: str) -> bool:
        try:
            return bool(self.is_validator(address))
        except Exception as exc:  # noqa: BLE001 - the chain unreadable: believe no one now, ask again later
            logger.warning("cannot read the validator role of %s on chain (%s)", address, _short(exc))
            return False

    def refresh(self) -> None:
        if self.learned is not None:
            for url in self.learned():
                self._add_url(url)
        now = time.monotonic()
        answered: dict[str, list[str]] = {}  # address -> the URLs that claimed it in this pass, in order
        infos: dict[str, dict[str, Any]] = {}
        for url in self.urls:  # hints appended below are asked in this same pass (at most MAX_VALIDATORS)
            url = url.rstrip("/")
            if self.shunned.get(url, 0.0) > now:
                continue
            try:
                proven = read_info(self.http, url, domain=self.domain, timeout_s=self.timeout_s)
            except SignatureError as exc:  # answers, but cannot prove the address it names: speaks for no one
                self.refused["unproven"] += 1
                logger.warning("validator %s: /v1/info not proved by the address it names (%s): ignored", url,
                               _short(exc))
                continue
            except Exception as exc:  # noqa: BLE001 - a down or garbled validator is logged, not fatal
                logger.warning("validator %s: /v1/info unavailable (%s)", url, _short(exc))
                continue
            try:
                info, address = proven.info, proven.address
                claimed = info.get("validators") or [address]
                if not isinstance(claimed, list) or len(claimed) > MAX_VALIDATORS:
                    raise ValueError("'validators' is not a list of at most 64 addresses")
                named = [checksum(str(v)) for v in claimed]
            except Exception as exc:  # noqa: BLE001 - a down or garbled validator is logged, not fatal
                logger.warning("validator %s: /v1/info unavailable (%s)", url, _short(exc))
                continue
            if not self._role(address):
                self.refused["no_role"] += 1
                logger.warning("validator %s claims to be %s, which holds no validator role on chain: ignored",
                               url, address)
                continue
            answered.setdefault(address, []).append(url)
            infos[url] = info
            self.announced = sorted(set(self.announced) | {a for a in named if self._role(a)})
            hints = info.get("validator_urls")
            if isinstance(hints, dict):  # a hint: a URL counts once its own /v1/info names the address
                for hint in list(hints.values())[:MAX_VALIDATORS]:
                    if isinstance(hint, str) and hint.startswith(("http://", "https://")) and len(hint) < 256:
                        self._add_url(hint)
        for address, claimants in answered.items():  # the holder keeps the address while it answers
            holder = self.by_address.get(address)
            if holder not in claimants:
                holder = claimants[0]
                self.by_address[address] = holder
            self.infos[address] = infos[holder]
            for other in claimants:
                if other != holder:
                    self.refused["taken"] += 1
                    logger.info("validator %s also claims %s, served by %s: kept as a stand-by", other, address,
                                holder)

    def url_of(self, address: str) -> str | None:
        return self.by_address.get(address)

    def distrust(self, address: str, url: str, why: str) -> None:
        """`url` answered for `address` with something `address` did not sign: drop it and shun it a while."""
        logger.warning("validator URL %s does not speak for %s (%s): dropped for %.0f s", url, address, why, SHUN_S)
        if self.by_address.get(address) == url:
            del self.by_address[address]
        self.shunned[url] = time.monotonic() + SHUN_S


MAX_VERDICT_BYTES = 64 << 10
"""A verdict envelope is a few hundred bytes; anything bigger is not one."""
RECEIPT_AGE_S = 3600.0
"""A receipt is made for the answer it travels in; one this old (by the validator's clock) is not believed."""
VERDICT_AGE_S = 365 * 24 * 3600.0
"""A verdict is a record polled long after it was signed: its age is not the point (its work key is)."""

WAIT_REASONS = ("version", "validator", "verdicts", "assignments", "grader")
"""What the loop can wait for: a usable policy version (chain, relays, weights), a validator that takes its
work, verdicts on what it sent (`max_pending`), the next version once its assignments are done, its own grader."""
SAY_AGAIN_S = 60.0
"""A wait that lasts is logged again this often."""

VERSIONS_KEPT = 64
"""Versions whose start time the tally keeps (and /metrics exports)."""


@dataclass
class Tally:
    """What the loop has done (read by `/metrics`, `/health` and the status line)."""

    accepted: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    batches: int = 0
    tokens: int = 0
    generation_s: float = 0.0
    version: int | None = None
    """The policy version of the last batch."""
    state: str = "starting"
    """starting | working | waiting | stopped | failed"""
    reason: str = ""
    """What the loop waits for while `state` is waiting: one of `WAIT_REASONS`."""
    detail: str = ""
    """Why the loop waits or stopped, in words."""
    waiting_since: float | None = None
    """time.time() at which the current wait began."""
    last_batch_at: float | None = None
    """time.time() of the last batch generated."""
    submit_failures: int = 0
    resent: int = 0
    """Submissions sent again (the same envelope) because no verdict came by `submit.verdict_deadline_s`."""
    peer_errors: Counter[str] = field(default_factory=Counter)
    """Validator answers not believed or not understood, by kind (missing, forged or misdirected receipts, unsigned
    or forged verdicts, odd statuses)."""
    version_started_at: dict[int, float] = field(default_factory=dict)
    """time.time() at which the first batch of each policy version began (the newest VERSIONS_KEPT
    versions): when a version reached this node, for the operator's propagation view."""


class Worker:
    """One node's loop (see the module docstring); `stop()` ends it after the batch in flight."""

    def __init__(self, cfg: NodeConfig, identity: Identity, run: RunSpec, domain: str, weights: PolicyWeights,
                 protection: SlashingProtection, validators: ValidatorDirectory,
                 is_active: Callable[[], bool] | None = None) -> None:
        self.cfg, self.identity, self.run, self.domain = cfg, identity, run, domain
        self.multi_turn = isinstance(get_environment(run.env, run.env_version), MultiTurnEnvironment)
        """The run's environment answers between turns: assignments are episodes (`node.episodes`, v2)."""
        self.chain_id, self.pool = submission_venue(domain)  # bound into every work key and seed
        self.weights, self.protection, self.validators = weights, protection, validators
        if not validators.domain:
            validators.domain = domain
        self.is_active = is_active
        """The chain's word on whether this node is active (a validator's 403 is only checked against it)."""
        self.node = identity.address
        self.tally = Tally()
        self._stop = threading.Event()
        self._said_at = -float("inf")
        self._down_until: dict[str, float] = {}
        self._strikes: dict[str, int] = {}  # validator -> times in a row it hung or lied (its back-off doubles)
        self._probing: set[str] = set()  # validators being probed on the side (`_probe_aside`)
        self._down_url: dict[str, str | None] = {}  # validator -> the URL its marks were earned at
        self._closed: dict[int, str] = {}  # versions our validator takes no more of our work at: why

    def stop(self) -> None:
        self._stop.set()

    def _wait(self, reason: str, message: str, seconds: float) -> None:
        """Wait `seconds` for `reason` (one of `WAIT_REASONS`): said at once in one log line and in `/health`
        (`state` waiting, `reason`, `detail`), and again every `SAY_AGAIN_S` while the same wait lasts, never
        once per poll (an operator reads these at 3 a.m.)."""
        now = time.monotonic()
        t = self.tally
        if (t.state, t.reason, t.detail) != ("waiting", reason, message):
            t.waiting_since = time.time()
            self._said_at = -float("inf")
        if now - self._said_at >= SAY_AGAIN_S:  # said before /health shows it: who sees the wait finds its line
            since = time.time() - (t.waiting_since or time.time())
            logger.warning("waiting (%s%s): %s", reason, f", for {since:.0f} s" if since >= 1 else "", message)
            self._said_at = now
        t.state, t.reason, t.detail = "waiting", reason, message
        self._stop.wait(seconds)

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    # -- the loop -------------------------------------------------------------------------------

    def run_loop(self) -> Tally:
        polled = -float("inf")
        while not self.stopping and (self.cfg.max_batches is None or self.tally.batches < self.cfg.max_batches):
            if time.monotonic() - polled >= self.cfg.chain.poll_s:  # verdicts: not a round trip per batch
                self.poll_pending()
                self.resend_overdue()
                polled = time.monotonic()
            if not self.resend_unsent():  # a validator is down: keep the work, make no more
                unsent = sum(r.state == "signed" for r in self.protection.unfinished(self.run.run_id, self.node))
                self._wait("validator", f"{unsent} signed submissions wait for a validator to take them "
                           f"(tried: {', '.join(self.validators.urls)}); no new work until they are out",
                           self.cfg.submit.max_backoff_s)
                continue
            if not self.validators.announced:
                self.validators.refresh()
            if not self.validators.announced:  # nobody to send work to: generate none
                self._wait("validator", f"no validator reachable ({', '.join(self.validators.urls) or 'none known'})",
                           self.cfg.submit.max_backoff_s)
                continue
            pending = len(self.pending())
            if pending >= self.cfg.submit.max_pending:
                self._wait("verdicts", f"{pending} submissions await their verdicts (max_pending "
                           f"{self.cfg.submit.max_pending})", 0.2)
                continue
            try:
                policy = self.weights.select()
            except Waiting as exc:
                self._wait("version", str(exc), self.cfg.chain.poll_s)
                continue
            version, manifest = policy.version, policy.manifest_hash
            if version in self._closed:
                self._wait("version", f"v{version} takes no more of our work ({self._closed[version]}); waiting for "
                           f"the next version", self.cfg.chain.poll_s)
                continue
            counter = self.protection.next_counter(self.run.run_id, self.node, version)
            if counter >= self.run.max_batches_per_version:
                self._wait("assignments", f"all {counter} assignments at v{version} done "
                           f"(max_batches_per_version); waiting for the next version", self.cfg.chain.poll_s)
                continue
            started = time.monotonic()
            try:
                build = build_episode_submission if self.multi_turn else build_submission
                sub = build(policy.engine, self.run, self.node, version, counter, manifest, chain_id=self.chain_id,
                            pool=self.pool)
            except UngradableError as exc:  # our grader failed: a guessed reward would be a slashable lie
                self._wait("grader", f"v{version} #{counter}: could not grade locally ({exc}); nothing signed, "
                           f"retrying", self.cfg.chain.poll_s)
                continue
            elapsed = time.monotonic() - started
            self.tally.batches += 1
            self.tally.tokens += sub.n_tokens()
            self.tally.generation_s += elapsed
            self.tally.version, self.tally.last_batch_at = version, time.time()
            if version not in self.tally.version_started_at:
                self.tally.version_started_at[version] = self.tally.last_batch_at - elapsed
                for old in sorted(self.tally.version_started_at)[:-VERSIONS_KEPT]:
                    del self.tally.version_started_at[old]
            self.tally.state, self.tally.reason, self.tally.detail = "working", "", ""
            self.tally.waiting_since, self._said_at = None, -float("inf")
            answer = self.submit(sub)
            logger.info("v%d #%d: %d tokens in %.1f s (%.1f tok/s) -> %s; accepted %d, rejected %d, pending %d",
                        version, counter, sub.n_tokens(), elapsed, sub.n_tokens() / max(elapsed, 1e-9),
                        answer.get("outcome") or answer.get("state") or answer.get("error", "kept for resending"),
                        self.tally.accepted, sum(self.tally.rejected.values()), len(self.pending()))
        if not self.stopping:  # done with max_batches: wait for the verdicts (a signal does not wait)
            self.wait_decided(self.cfg.submit.decide_timeout_s)
        self.tally.state = "stopped"
        return self.tally

    def wait_decided(self, timeout_s: float) -> None:
        """Until `timeout_s`: poll the verdicts still owed, resend the overdue ones, and send the work kept for a
        validator to take, at most every `submit.max_backoff_s` (a node's last batch, kept because the backup had
        not yet seen the assigned validator down, went nowhere before: `test_work_fails_over_from_a_stopped_validator`
        once a submission's deadline became shorter than the backup's failover)."""
        deadline, tried = time.monotonic() + timeout_s, -float("inf")
        while time.monotonic() < deadline:
            unsent = any(r.state == "signed" for r in self.protection.unfinished(self.run.run_id, self.node))
            if not self.pending() and not unsent:
                return
            self.poll_pending()
            self.resend_overdue()
            if unsent and time.monotonic() - tried >= self.cfg.submit.max_backoff_s:
                tried = time.monotonic()
                self.resend_unsent()
            time.sleep(0.2)

    def pending(self) -> list[Any]:
        return [r for r in self.protection.unfinished(self.run.run_id, self.node) if r.state == "submitted"]

    def resend_overdue(self, now: float | None = None) -> int:
        """Send again, byte for byte, each submission a validator took (its receipt held) that has no verdict
        `submit.verdict_deadline_s` after it was last sent: its validator lost it or sits on it, and whoever holds
        the role now gets the same envelope (a validator holding it answers as before: no second row, no replay).
        Returns how many were resent."""
        now_s = time.time() if now is None else now
        resent = 0
        for rec in self.pending():
            last = self.protection.last_sent(self.run.run_id, self.node, rec.policy_version, rec.counter)
            sub = rec.submission()
            if last is None or sub is None or now_s - last[1] < self.cfg.submit.verdict_deadline_s:
                continue
            data, sent_at = last
            ranking = self._ranking(sub.policy_version)
            if not ranking:
                break
            logger.warning("v%d #%d: no verdict %.0f s after it was sent; sending the same envelope again",
                           sub.policy_version, sub.counter, now_s - sent_at)
            self.protection.resent(data)
            self.tally.resent += 1
            resent += 1
            self._deliver(sub, data, ranking, resealed=False)
        return resent

    def resend_unsent(self) -> bool:
        """Resubmit recorded-but-unsent work (after a crash or a validator outage); False if some is left."""
        for rec in self.protection.unfinished(self.run.run_id, self.node):
            sub = rec.submission()
            if rec.state == "signed" and sub is not None:
                self.submit(sub)
        return not any(r.state == "signed" for r in self.protection.unfinished(self.run.run_id, self.node))

    # -- submitting ----------------------------------------------------------------------------

    def submit(self, sub: AnySubmission, *, resealed: bool = False) -> dict[str, Any]:
        """Record, seal and POST one submission to the validator that takes it; its answer ({} when kept).

        Work sealed before and not decided (kept through a crash or an outage) goes out as the same envelope,
        byte for byte: a validator holding it answers as before, and `sent` does not grow by one envelope per
        retry. It is sealed afresh only when a validator refuses those bytes (`resealed`: a nonce replay, or
        too old for a validator new to it).

        The validators are tried in rendezvous order: the assigned one first, the next one when the
        assigned one is unreachable (it accepts only if it cannot reach the first either; otherwise it
        answers 421 and the work is kept and resent later). One that ran out of tries is skipped for
        `max_backoff_s`, so a dead validator does not cost every submission its full retry budget.
        """
        self.protection.check_and_record(sub)  # DoubleSignError before anything is signed
        ranking = self._ranking(sub.policy_version)
        if not ranking:
            logger.warning("v%d #%d: no validator known (configured: %s); kept for later", sub.policy_version,
                           sub.counter, ", ".join(self.validators.urls))
            return {}
        last = None if resealed else self.protection.last_sent(sub.run_id, self.node, sub.policy_version, sub.counter)
        if last is not None:  # sealed before (a crash, an outage): the same bytes again, not one more envelope
            data = last[0]
            self.protection.resent(data)
        else:
            data = seal(self.identity, sub, domain=self.domain, nonce=random_nonce()).to_bytes()
            self.protection.record_sent(sub, data)  # kept until its verdict: a hard one may be appealed with it
        return self._deliver(sub, data, ranking, resealed=resealed)

    def _deliver(self, sub: AnySubmission, data: bytes, ranking: list[str], *, resealed: bool) -> dict[str, Any]:
        """POST the sealed `data` of `sub` down `ranking` (see `submit`); the answer believed, or {} when kept."""
        for address in ranking:  # another URL speaks for it now (a stand-by): the marks were the old URL's
            url = self.validators.url_of(address)
            if url and address in self._down_url and self._down_url[address] != url:
                self._mark_up(address)
        now = time.monotonic()
        reachable = [a for a in ranking if self.validators.url_of(a) and self._down_until.get(a, 0.0) <= now]
        if not reachable:  # everyone is marked down: try them all again rather than wait for the marks
            reachable = [a for a in ranking if self.validators.url_of(a)]
        if not reachable:
            logger.warning("v%d #%d: no URL known for validators %s (configured: %s); kept for later",
                           sub.policy_version, sub.counter, ", ".join(ranking), ", ".join(self.validators.urls))
            self.validators.refresh()
            return {}
        for address in reachable:
            url = self.validators.url_of(address) or ""
            if self._strikes.get(address):  # it hung before and its back-off just ended: probed on the side
                self._probe_aside(address, url)
                continue
            try:
                status, body = self._post(url, address, data)
            except (Transient, RetryError) as exc:
                self.tally.submit_failures += 1
                self._mark_down(address, url)
                logger.warning("validator %s unreachable for v%d #%d after %d tries (%s)%s", url, sub.policy_version,
                               sub.counter, self.cfg.submit.attempts, _short(exc),
                               "; trying the next one" if address != reachable[-1] else "; the work is kept and resent")
                continue
            self._mark_up(address)
            answer = self._handle(sub, address, url, status, body, sent=submission_hash(data), resealed=resealed)
            if status == 421:  # it sees the validators ranked before it up: their back-off ends (probed first)
                for earlier in ranking[:ranking.index(address)]:
                    if self._down_until.get(earlier):
                        self._down_until[earlier] = 0.0
            if answer is not None:
                return answer
            # an answer not believed: back off from this validator, try the next; the work stays kept
            self._mark_down(address, url)
        return {}

    def submit_deadline(self, size: int) -> float:
        """The total deadline of a submission of `size` bytes (`submit.timeout_s`, `submit.min_rate_bytes_s`)."""
        s = self.cfg.submit
        return min(s.timeout_s, s.probe_timeout_s + size / s.min_rate_bytes_s)

    def _probe_aside(self, address: str, url: str) -> None:
        """A validator that hung before (its back-off just ended) gets no body until it answers `/health` within
        `probe_timeout_s`, asked from a thread while the work goes to the next one: a validator that stays hung costs
        nothing more (`bench.faults` hung_validator: every batch ranked to a stopped validator waited 30 s for it,
        then 5 s for each probe). Answered, its back-off starts over; not, it is marked down again (doubling)."""
        if address in self._probing:
            return
        self._probing.add(address)

        def probe() -> None:
            try:
                with deadline.deadline_client(self.cfg.submit.probe_timeout_s) as http:
                    r = bounded_request(http, "GET", url + "/health", self.cfg.submit.probe_timeout_s)
                if r.status_code < 500:
                    self._mark_up(address)
                    logger.info("validator %s answers again", url)
                    return
                why = f"HTTP {r.status_code}"
            except Exception as exc:  # noqa: BLE001 - any failure to answer is "still down"
                why = _short(exc)
            wait = self._mark_down(address, url)
            logger.warning("validator %s still does not answer (%s); it is asked again in %.0f s", url, why, wait)

        def run() -> None:
            try:
                probe()
            finally:
                self._probing.discard(address)

        threading.Thread(target=run, name="validator-probe", daemon=True).start()

    def _mark_down(self, address: str, url: str | None = None) -> float:
        """`address` hung (or answered what we cannot believe): ask it nothing until its back-off ends. The
        back-off doubles from `submit.max_backoff_s` each time in a row, up to `DOWN_MAX_S`: a validator that
        stays hung after failover is asked again rarely, not every `max_backoff_s` at the price of a timeout
        (verdict polls of old work at it halved a node's rate). Returns the back-off."""
        strikes = self._strikes[address] = self._strikes.get(address, 0) + 1
        base = self.cfg.submit.max_backoff_s
        wait = float(min(max(base, DOWN_MAX_S), base * 2 ** min(strikes - 1, 30)))
        self._down_until[address] = time.monotonic() + wait
        self._down_url[address] = url if url is not None else self.validators.url_of(address)
        return wait

    def _mark_up(self, address: str) -> None:
        """`address` answered: its back-off starts over."""
        self._down_until.pop(address, None)
        self._strikes.pop(address, None)
        self._down_url.pop(address, None)

    def _ranking(self, version: int) -> list[str]:
        if not self.validators.announced:
            self.validators.refresh()
        if not self.validators.announced:
            return []
        return validator_ranking(self.run.run_id, self.node, version, self.validators.announced)

    def _post(self, url: str, validator: str, data: bytes) -> tuple[int, dict[str, Any]]:
        s = self.cfg.submit
        retrying = Retrying(stop=stop_after_attempt(s.attempts), reraise=True,
                            wait=_wait(wait_random_exponential(multiplier=s.backoff_s, max=s.max_backoff_s)),
                            retry=retry_if_exception(lambda e: isinstance(e, Transient) and not isinstance(e, Hung)))
        for attempt in retrying:
            with attempt:
                return self._post_once(url, validator, data)
        raise AssertionError("unreachable")  # pragma: no cover

    def _post_once(self, url: str, validator: str, data: bytes) -> tuple[int, dict[str, Any]]:
        # the upload header, signed afresh each try: the validator checks our stake from it before our body
        # takes one of its slots (docs/protocol/wire-format.md, "Upload header")
        headers = upload_headers(self.identity, data, domain=self.domain, validator=validator, path="/v1/submissions")
        try:
            r = bounded_request(self.validators.http, "POST", url + "/v1/submissions", self.submit_deadline(len(data)),
                                content=data, headers={"content-type": "application/octet-stream", **headers})
        except httpx.HTTPError as exc:
            raise Transient(f"{type(exc).__name__}: {exc}") from exc
        if r.status_code >= 500 or r.status_code in (425, 429):
            raise Transient(f"HTTP {r.status_code}", _retry_after(r))
        try:
            body = r.json()
            if not isinstance(body, dict):
                raise ValueError("not an object")
        except ValueError as exc:
            raise Transient(f"HTTP {r.status_code} with an unparseable body: {r.text[:80]!r}") from exc
        return r.status_code, body

    def _handle(self, sub: AnySubmission, validator: str, url: str, status: int, body: dict[str, Any], *, sent: bytes,
                resealed: bool = False) -> dict[str, Any] | None:
        """Act on one validator's answer to the envelope hashing to `sent`; None when it is not believed (the caller
        backs off and fails over)."""
        where = f"v{sub.policy_version} #{sub.counter} at validator {validator} ({url})"
        if status in (200, 202):
            if not self.verified_receipt(sub, body, validator, url, sent):
                return None  # not delivered: kept as signed, resent to whoever holds the role next
            if body.get("outcome") or body.get("verdict"):  # a claimed verdict: believed only as signed
                verdict = self.verified_verdict(sub.policy_version, sub.counter, body, validator, url)
                if verdict is None:
                    return None
                self.protection.mark(self.run.run_id, self.node, sub.policy_version, sub.counter, "submitted")
                self._apply(verdict, str(body["verdict"]), str(body.get("detail") or ""))
                return body
            self.protection.mark(self.run.run_id, self.node, sub.policy_version, sub.counter, "submitted")
            return body
        error, detail = str(body.get("error", ""))[:64], str(body.get("detail", ""))[:300]
        if status == 421:  # the validator set changed under us: learn it again and resend later
            logger.warning("%s: not assigned there (%s); refreshing the validator set", where, detail)
            self.validators.announced = []
            self.validators.refresh()
            return body
        if status == 410 and error == Reason.STALE_VERSION.value:  # outside the async window for good: never resent
            logger.warning("%s: refused as stale (%s); dropped", where, detail)
            self.protection.mark(self.run.run_id, self.node, sub.policy_version, sub.counter, "refused")
            self.tally.peer_errors["stale_version"] += 1
            return body
        if status == 409 and error == "replay" and not resealed:  # our random nonce collided: seal again, once
            return self.submit(sub, resealed=True)
        if status == 400 and error == "expired" and not resealed:  # a resend too old for a validator new to it
            return self.submit(sub, resealed=True)  # the same payload, sealed afresh (never a second payload)
        if status == 409 and error == "counter_out_of_order":
            return self._out_of_order(sub, validator, where, body)
        if status == 409 and error == "duplicate_work":
            verdict = self.verified_verdict(sub.policy_version, sub.counter, body, validator, url)
            if verdict is None or verdict.outcome is not Outcome.REJECTED_HARD:
                return None
            self._apply(verdict, str(body["verdict"]), "the validator holds a different payload for this assignment: "
                        "another machine is using this key, or the state dir was lost")  # raises NodeStopped
            return body  # pragma: no cover - _apply raised
        if status == 403 and self.is_active is not None:
            try:
                active = self.is_active()
            except Exception as exc:  # noqa: BLE001 - the chain unreadable: the peer's word alone stops nothing
                logger.warning("%s: says this node is not active; the chain cannot be read to check (%s)", where,
                               _short(exc))
                active = True
            if not active:
                raise NodeStopped(f"{where}: this node is not active on chain ({detail}); stake and register "
                                  f"with `prime-node join`")
        self.tally.peer_errors[f"http_{status}"] += 1
        logger.warning("%s: unexpected answer HTTP %d %s: %s; backing off from it and trying the next validator "
                       "(check the run, chain and clock settings against its /v1/info)", where, status, error, detail)
        return None

    def _out_of_order(self, sub: AnySubmission, validator: str, where: str, body: dict[str, Any]) -> dict[str, Any]:
        """The validator takes another counter first. Ours are used strictly in order, so either that one is
        still here unsent (then this one is kept and resent after it), or the validator will never get it
        from us (it went to another validator while this one was down, or the state dir was lost): then
        this assignment is refused for good (never resent or signed again), and the node waits for the
        next version instead of signing assignments that validator will not take."""
        expected = body.get("expected_counter")
        if isinstance(expected, int) and not isinstance(expected, bool) and expected < sub.counter:
            earlier = self.protection.get(self.run.run_id, self.node, sub.policy_version, expected)
            if earlier is not None and earlier.state == "signed" and earlier.payload is not None:
                logger.info("%s: counter %d goes first; kept for resending after it", where, expected)
                return {}
        self.protection.mark(self.run.run_id, self.node, sub.policy_version, sub.counter, "refused")
        self.tally.rejected["counter_out_of_order"] += 1
        why = f"v{sub.policy_version}: validator {validator} takes counter {expected} first, which this " \
              f"node no longer holds"
        self._closed[sub.policy_version] = why
        logger.warning("%s refused (counter out of order, no slash): %s", where, body.get("detail"))
        return body

    # -- verdicts ------------------------------------------------------------------------------

    def poll_pending(self) -> None:
        """Ask for the verdicts still pending (at each validator in rendezvous order: one may have failed over)."""
        for rec in self.pending():
            key = to_hex(work_key(self.run.run_id, self.node, rec.policy_version, rec.counter, chain_id=self.chain_id,
                                  pool=self.pool))
            for address in self._ranking(rec.policy_version):
                url = self.validators.url_of(address)
                if url is None or self._down_until.get(address, 0.0) > time.monotonic():
                    continue
                try:
                    r = bounded_request(self.validators.http, "GET", f"{url}/v1/submissions/{key}",
                                        self.cfg.submit.probe_timeout_s)
                    body = r.json() if r.status_code == 200 else None
                except Hung as exc:  # hung: ask no more of it until its backoff ends (the next one may know)
                    wait = self._mark_down(address, url)
                    logger.warning("validator %s: verdict poll %s; asking the others, and it again in %.0f s", url,
                                   exc, wait)
                    continue
                except (httpx.HTTPError, ValueError) as exc:
                    logger.debug("polling %s at %s: %s", key, url, exc)
                    continue
                self._mark_up(address)
                if not isinstance(body, dict):
                    continue
                if body.get("outcome") or body.get("verdict"):
                    verdict = self.verified_verdict(rec.policy_version, rec.counter, body, address, url)
                    if verdict is None:  # a lie about our work: resend it to whoever holds this role next
                        self._mark_down(address, url)
                        self.protection.mark(self.run.run_id, self.node, rec.policy_version, rec.counter, "signed")
                        break
                    self._apply(verdict, str(body["verdict"]), str(body.get("detail") or ""))
                break

    def verified_receipt(self, sub: AnySubmission, body: dict[str, Any], validator: str, url: str, sent: bytes) -> bool:
        """Whether `body` carries `validator`'s signed `Receipt`, in this run's domain, for exactly the envelope this
        node just sent (`sent`, its SHA-256) for `sub`'s assignment. Else False, with the URL distrusted for
        `validator` and the answer counted in `Tally.peer_errors` (`unsigned_receipt`, `forged_receipt`,
        `misdirected_receipt`): a 200 or 202 without it is not a delivery (docs/protocol/wire-format.md,
        "Receipts")."""
        opened = self._open_signed(body.get("receipt"), validator, Receipt, RECEIPT_AGE_S)
        why, kind = "a 200/202 without a signed receipt", "unsigned_receipt"
        if isinstance(opened, PrimeError):
            why, kind = f"receipt refused: {opened}", "forged_receipt"
        elif isinstance(opened, Receipt):
            key = work_key(self.run.run_id, self.node, sub.policy_version, sub.counter, chain_id=self.chain_id,
                           pool=self.pool)
            if (opened.run_id, opened.node, opened.policy_version, opened.counter, bytes(opened.work_key),
                    bytes(opened.submission_hash)) == (self.run.run_id, self.node, sub.policy_version,
                                                       sub.counter, key, sent):
                return True
            why, kind = "a receipt for other bytes or other work", "misdirected_receipt"
        self.tally.peer_errors[kind] += 1
        self.validators.distrust(validator, url, why)
        return False

    def verified_verdict(self, version: int, counter: int, body: dict[str, Any], validator: str,
                         url: str) -> Verdict | None:
        """The `Verdict` in `body` if `validator` signed it, in this run's domain, about exactly assignment
        (version, counter) of this node and one of the envelopes this node sent for it; else None, with
        the URL distrusted for `validator` and the answer counted in `Tally.peer_errors`."""
        opened = self._open_signed(body.get("verdict"), validator, Verdict, VERDICT_AGE_S)
        why, kind = "no signed verdict", "unsigned_verdict"
        if isinstance(opened, PrimeError):
            why, kind = f"verdict refused: {opened}", "forged_verdict"
        elif isinstance(opened, Verdict):
            key = work_key(self.run.run_id, self.node, version, counter, chain_id=self.chain_id, pool=self.pool)
            sent = self.protection.sent_hashes(self.run.run_id, self.node, version, counter)
            if (opened.run_id, opened.node, opened.policy_version, opened.counter, bytes(opened.work_key)) != (
                    self.run.run_id, self.node, version, counter, key):
                why, kind = "a verdict about other work", "misdirected_verdict"
            elif to_hex(opened.submission_hash) not in sent and opened.reason is not Reason.EQUIVOCATION:
                # (an equivocation verdict judges the *other* envelope signed with this key, not ours)
                why, kind = "a verdict about an envelope this node never sent", "misdirected_verdict"
            else:
                return opened
        self.tally.peer_errors[kind] += 1
        self.validators.distrust(validator, url, why)
        return None

    def _open_signed(self, text: object, validator: str, body_type: type[SignedT],
                     max_age_s: float) -> SignedT | PrimeError | None:
        """`text` (a field of a validator's answer) opened as a `body_type` envelope that `validator` signed in this
        run's domain within `max_age_s`: the body, the `PrimeError` it was refused with, or None when the field
        is not a string (absent)."""
        if not isinstance(text, str):
            return None
        try:
            env = Envelope.from_bytes(text.encode(), max_bytes=MAX_VERDICT_BYTES)
            opened = open_envelope(env, domain=self.domain, replay_guard=RereadRecords(),
                                   expected_signer=validator, body_types=[body_type], max_age_s=max_age_s)
        except PrimeError as exc:
            return exc
        assert isinstance(opened, body_type)
        return opened

    def _apply(self, verdict: Verdict, text: str, detail: str) -> None:
        """Record a verified verdict; the payload is dropped only now. A hard one stops the node."""
        version, counter, reason = verdict.policy_version, verdict.counter, verdict.reason.value
        hard = verdict.outcome is Outcome.REJECTED_HARD
        self.protection.record_verdict(self.run.run_id, self.node, version, counter, hard=hard, verdict=text)
        if verdict.outcome is Outcome.ACCEPTED:
            self.tally.accepted += 1
            return
        self.tally.rejected[reason] += 1
        if hard:
            raise NodeStopped(
                f"v{version} #{counter} was rejected hard ({reason}: {detail}); the node stops so that no more "
                f"stake is slashed. This machine's output does not pass the validator's checks: run "
                f"`prime-node preflight`, check the model and engine settings, then restart. If the work was "
                f"honest, `prime-node appeal` asks another validator to re-check it (inside the pool's appeal window)")
        logger.warning("v%d #%d rejected (soft, no slash): %s %s", version, counter, reason, detail)


def _retry_after(r: httpx.Response) -> float:
    try:
        return min(float(r.headers.get("retry-after", "0")), 300.0)
    except ValueError:
        return 0.0


def _wait(jitter: Any) -> Any:
    """Full-jitter exponential backoff, but never shorter than the server's Retry-After."""

    def wait(state: Any) -> float:
        exc = state.outcome.exception() if state.outcome else None
        floor = exc.retry_after if isinstance(exc, Transient) else 0.0
        return max(float(jitter(state)), floor)

    return wait


def _short(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) < 160 else text[:157] + "..."
