"""The work loop: learn the policy version, build the next assignment, record it, sign, submit, follow verdicts.

Order matters for safety: the payload is recorded in the slashing-protection database *before* it
is signed, so a crash at any point either leaves nothing signed or leaves a record whose payload
a restart resubmits (same payload, fresh envelope: never a second, different payload). The next
counter always comes from that record, so a restart never reuses a counter.

Transient failures (connection refused or reset, timeouts, 5xx, 425 and 429, an unparseable answer)
are retried with exponential backoff and full jitter (tenacity); when the tries run out the work is
kept and resent later, and no new work is generated until it is out. Answers that say the node
itself is wrong (inactive on chain, bad signature, wrong domain, a hard verdict) stop the node with a
message for the operator.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
from tenacity import (
    RetryError,
    Retrying,
    retry_if_exception_type,
    stop_after_attempt,
    wait_random_exponential,
)

from node.config import NodeConfig
from node.engines import InferenceEngine
from node.errors import NodeStopped
from node.protection import SlashingProtection
from node.rollouts import build_submission
from protocol.canonical import to_hex
from protocol.envelope import seal
from protocol.errors import UngradableError
from protocol.identity import Identity, checksum
from protocol.nonce import random_nonce
from protocol.rollout import Outcome, Reason, RunSpec, Submission
from protocol.seeds import assigned_validator, work_key

logger = logging.getLogger(__name__)

_ZERO = b"\x00" * 32


class Transient(Exception):
    """A failure worth trying again (the validator or the network, not our work)."""

    def __init__(self, message: str, retry_after: float = 0.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class PolicySource:
    """Where the current policy version comes from; the chain's `policy()` by default."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool

    def current(self) -> tuple[int, bytes] | None:
        version, manifest = self.pool.policy()
        return None if manifest == _ZERO else (int(version), bytes(manifest))


@dataclass
class ValidatorDirectory:
    """Validator URLs from config, their addresses and the run's announced set, from `/v1/info`."""

    urls: list[str]
    http: httpx.Client
    by_address: dict[str, str] = field(default_factory=dict)
    announced: list[str] = field(default_factory=list)
    infos: dict[str, dict[str, Any]] = field(default_factory=dict)

    def refresh(self) -> None:
        for url in self.urls:
            try:
                r = self.http.get(url.rstrip("/") + "/v1/info")
                r.raise_for_status()
                info = r.json()
                address = checksum(str(info["validator"]))
                announced = [checksum(str(v)) for v in info.get("validators") or [address]]
            except Exception as exc:  # noqa: BLE001 - a down or garbled validator is logged, not fatal
                logger.warning("validator %s: /v1/info unavailable (%s)", url, _short(exc))
                continue
            self.by_address[address] = url.rstrip("/")
            self.infos[address] = info
            self.announced = sorted(set(self.announced) | set(announced))

    def url_of(self, address: str) -> str | None:
        return self.by_address.get(address)


@dataclass
class Tally:
    accepted: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    batches: int = 0
    tokens: int = 0


class Worker:
    """One node's loop (see the module docstring); `stop()` ends it after the batch in flight."""

    def __init__(self, cfg: NodeConfig, identity: Identity, run: RunSpec, domain: str, engine: InferenceEngine,
                 protection: SlashingProtection, policy: PolicySource, validators: ValidatorDirectory) -> None:
        self.cfg, self.identity, self.run, self.domain = cfg, identity, run, domain
        self.engine, self.protection, self.policy, self.validators = engine, protection, policy, validators
        self.node = identity.address
        self.tally = Tally()
        self._stop = threading.Event()

    def stop(self) -> None:
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    # -- the loop -------------------------------------------------------------------------------

    def run_loop(self) -> Tally:
        while not self.stopping and (self.cfg.max_batches is None or self.tally.batches < self.cfg.max_batches):
            self.poll_pending()
            if not self.resend_unsent():  # a validator is down: keep the work, make no more
                self._stop.wait(self.cfg.submit.max_backoff_s)
                continue
            if not self.validators.announced:
                self.validators.refresh()
            if not self.validators.announced:  # nobody to send work to: generate none
                logger.warning("no validator reachable (%s); waiting", ", ".join(self.validators.urls))
                self._stop.wait(self.cfg.submit.max_backoff_s)
                continue
            if len(self._submitted()) >= self.cfg.submit.max_pending:
                self._stop.wait(0.2)
                continue
            current = self.policy.current()
            if current is None:
                logger.info("no policy published on chain yet; waiting")
                self._stop.wait(self.cfg.chain.poll_s)
                continue
            version, manifest = current
            counter = self.protection.next_counter(self.run.run_id, self.node, version)
            if counter >= self.run.max_batches_per_version:
                logger.info("all %d assignments at v%d done; waiting for the next version", counter, version)
                self._stop.wait(self.cfg.chain.poll_s)
                continue
            started = time.monotonic()
            try:
                sub = build_submission(self.engine, self.run, self.node, version, counter, manifest)
            except UngradableError as exc:  # our grader failed: a guessed reward would be a slashable lie
                logger.warning("v%d #%d: could not grade locally (%s); nothing signed, retrying later", version,
                               counter, exc)
                self._stop.wait(self.cfg.chain.poll_s)
                continue
            elapsed = time.monotonic() - started
            self.tally.batches += 1
            self.tally.tokens += sub.n_tokens()
            answer = self.submit(sub)
            logger.info("v%d #%d: %d tokens in %.1f s (%.1f tok/s) -> %s; accepted %d, rejected %d, pending %d",
                        version, counter, sub.n_tokens(), elapsed, sub.n_tokens() / max(elapsed, 1e-9),
                        answer.get("outcome") or answer.get("state") or answer.get("error", "kept for resending"),
                        self.tally.accepted, sum(self.tally.rejected.values()), len(self._submitted()))
        self.wait_decided(self.cfg.submit.decide_timeout_s)
        return self.tally

    def wait_decided(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self._submitted() and time.monotonic() < deadline:
            self.poll_pending()
            if self._submitted():
                time.sleep(0.2)

    def _submitted(self) -> list[Any]:
        return [r for r in self.protection.unfinished(self.run.run_id, self.node) if r.state == "submitted"]

    def resend_unsent(self) -> bool:
        """Resubmit recorded-but-unsent work (after a crash or a validator outage); False if some is left."""
        for rec in self.protection.unfinished(self.run.run_id, self.node):
            sub = rec.submission()
            if rec.state == "signed" and sub is not None:
                self.submit(sub)
        return not any(r.state == "signed" for r in self.protection.unfinished(self.run.run_id, self.node))

    # -- submitting ----------------------------------------------------------------------------

    def submit(self, sub: Submission) -> dict[str, Any]:
        """Record, seal and POST one submission; the validator's answer ({} when it is kept for later)."""
        self.protection.check_and_record(sub)  # DoubleSignError before anything is signed
        address = self._validator_for(sub.policy_version)
        url = self.validators.url_of(address) if address else None
        if url is None:
            logger.warning("v%d #%d: the assigned validator %s has no known URL (configured: %s); kept for later",
                           sub.policy_version, sub.counter, address, ", ".join(self.validators.urls))
            self.validators.refresh()
            return {}
        data = seal(self.identity, sub, domain=self.domain, nonce=random_nonce()).to_bytes()
        try:
            status, body = self._post(url, data)
        except (Transient, RetryError) as exc:
            logger.warning("validator %s unreachable for v%d #%d after %d tries (%s); the work is kept and resent",
                           url, sub.policy_version, sub.counter, self.cfg.submit.attempts, _short(exc))
            return {}
        return self._handle(sub, address or "", status, body)

    def _validator_for(self, version: int) -> str | None:
        if not self.validators.announced:
            self.validators.refresh()
        if not self.validators.announced:
            return None
        return assigned_validator(self.run.run_id, self.node, version, self.validators.announced)

    def _post(self, url: str, data: bytes) -> tuple[int, dict[str, Any]]:
        s = self.cfg.submit
        retrying = Retrying(stop=stop_after_attempt(s.attempts), reraise=True,
                            wait=_wait(wait_random_exponential(multiplier=s.backoff_s, max=s.max_backoff_s)),
                            retry=retry_if_exception_type(Transient))
        for attempt in retrying:
            with attempt:
                return self._post_once(url, data)
        raise AssertionError("unreachable")  # pragma: no cover

    def _post_once(self, url: str, data: bytes) -> tuple[int, dict[str, Any]]:
        try:
            r = self.validators.http.post(url + "/v1/submissions", content=data,
                                          headers={"content-type": "application/octet-stream"},
                                          timeout=self.cfg.submit.timeout_s)
        except httpx.TransportError as exc:
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

    def _handle(self, sub: Submission, validator: str, status: int, body: dict[str, Any]) -> dict[str, Any]:
        where = f"v{sub.policy_version} #{sub.counter} at validator {validator}"
        if status in (200, 202):
            self.protection.mark(self.run.run_id, self.node, sub.policy_version, sub.counter, "submitted")
            if body.get("outcome"):
                self._verdict(sub.policy_version, sub.counter, body)
            return body
        error, detail = str(body.get("error", "")), str(body.get("detail", ""))
        if status == 421:  # the validator set changed under us: learn it again and resend later
            logger.warning("%s: not assigned there (%s); refreshing the validator set", where, detail)
            self.validators.announced = []
            self.validators.refresh()
            return body
        if status == 409 and error == "replay":  # our random nonce collided: seal again
            return self.submit(sub)
        if status == 409 and error == "duplicate_work":
            self._verdict(sub.policy_version, sub.counter, body)
            raise NodeStopped(f"{where}: the validator holds a different payload for this assignment "
                              f"(equivocation). Another machine is using this key, or the state dir was lost.")
        if status == 403:
            raise NodeStopped(f"{where}: the validator says this node is not active on chain ({detail}); "
                              f"stake and register with `prime-node join`")
        raise NodeStopped(f"{where}: refused with HTTP {status} {error}: {detail} (check the run, chain and "
                          f"clock settings against the validator's /v1/info)")

    # -- verdicts ------------------------------------------------------------------------------

    def poll_pending(self) -> None:
        for rec in self._submitted():
            address = self._validator_for(rec.policy_version)
            url = self.validators.url_of(address) if address else None
            if url is None:
                continue
            key = to_hex(work_key(self.run.run_id, self.node, rec.policy_version, rec.counter))
            try:
                r = self.validators.http.get(f"{url}/v1/submissions/{key}", timeout=self.cfg.submit.timeout_s)
                body = r.json() if r.status_code == 200 else None
            except (httpx.HTTPError, ValueError) as exc:
                logger.debug("polling %s: %s", key, exc)
                continue
            if isinstance(body, dict) and body.get("outcome"):
                self._verdict(rec.policy_version, rec.counter, body)

    def _verdict(self, version: int, counter: int, body: dict[str, Any]) -> None:
        outcome, reason, detail = body.get("outcome"), str(body.get("reason")), body.get("detail") or ""
        self.protection.mark(self.run.run_id, self.node, version, counter, "decided")
        if outcome == Outcome.ACCEPTED.value:
            self.tally.accepted += 1
            return
        self.tally.rejected[reason] += 1
        hard = outcome == Outcome.REJECTED_HARD.value
        if hard or (reason in Reason.__members__.values() and Reason(reason).hard):
            raise NodeStopped(
                f"v{version} #{counter} was rejected hard ({reason}: {detail}); the node stops so that no more "
                f"stake is slashed. This machine's output does not pass the validator's checks: run "
                f"`prime-node preflight`, check the model and engine settings, then restart")
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
