"""A validator on 127.0.0.1 against a real anvil pool, and a node built from the libraries that can
submit honest work or cheat in one named way.

Honest work is built by `prime-node`'s own `node.rollouts.build_submission`; the copy of its steps
below (generate with the seeded sampler, grade, prove, seal) exists only for the cheats, which are
applied between generation and sealing.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from environments import get as get_environment
from environments import render_prompt
from models.engine import Engine
from models.loading import LoadedModel, load
from models.sampling import SamplingParams
from node.engines import ModelsEngine
from node.rollouts import build_submission
from protocol.envelope import seal
from protocol.identity import Identity
from protocol.model_spec import TinyModelSpec
from protocol.nonce import random_nonce
from protocol.rollout import RunSpec, SampleRollout, Submission, TaskRollouts, submission_venue
from protocol.seeds import sampling_seed, task_seed
from toploc.validation import prove
from validator.app import build_app
from validator.config import ValidatorConfig
from validator.service import Service

MANIFEST_V0 = hashlib.sha256(b"manifest of v0").digest()
TINY = TinyModelSpec(seed=0, hidden_size=128)  # >= top-k values per token: a 1-token last chunk can be proved
OTHER_SYSTEM_PROMPT = "You are a pirate. Answer in pirate speak."
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
    service = Service(cfg, identity)
    service.start()
    server = uvicorn.Server(uvicorn.Config(build_app(service), host="127.0.0.1", port=port, log_level="warning"))
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
    values: dict[str, Any] = {
        "state_dir": state_dir, "run": RUN, "model": TINY,
        "chain": {"deployment": deployment_path, "rpc_url": rpc_url, "poll_s": 0.2},
        "systemic": {"window_s": 0.5, "min_nodes": 3, "fraction": 0.5},
        "reporter": {"interval_s": 0.2},
        # the tiny model in fp32 everywhere: honest replay margins are 0.0, so a skipped near-tie EOS is a cheat
        "checks": {"eos_tie_drift": FP32_EOS_TIE_DRIFT},
    }
    values.update(overrides)
    return ValidatorConfig.model_validate(values)


@dataclass
class SimNode:
    """A node built from the libraries (see the module docstring)."""

    identity: Identity
    loaded: LoadedModel
    domain: str
    run: RunSpec = RUN
    manifest_hash: bytes = MANIFEST_V0
    counter: int = 0
    sealed: list[bytes] = field(default_factory=list)

    def build(self, version: int = 1, counter: int | None = None, cheat: str | None = None,
              model: LoadedModel | None = None) -> tuple[Submission, bytes]:
        """One assignment's submission and its sealed bytes; `cheat` names a way to cheat: `other_weights`
        (generate with `model`), `other_prompt` (another system prompt), `edit_token`, `cheap_tokens`
        (`model`'s tokens, proved and scored by an honest prefill), `other_seed`, `early_stop`,
        `inflate_reward`, `unassigned_task`, `steer_logprobs` (honest work whose claimed logprobs are moved
        inside the tolerance, see `steer_logprobs`) (bench/attacks.py runs each of them), `junk` (free: one
        made-up token per sample, no model run), `logprob_shift` (every claimed logprob 0.51 lower: just over
        the 0.5 tolerance), `skip_eos` (every EOS that wins the seeded draw by at most the sampling
        tolerance is replaced by the best other token and generation goes on; `narrow_eos_node` finds keys
        whose first assignment has one), `cached_repeat` (the assigned tasks answered with samples another
        assignment's seeds drew: what replaying a cache for a task drawn again gives)."""
        if counter is None:
            counter, self.counter = self.counter, self.counter + 1
        chain_id, pool = submission_venue(self.domain)
        if cheat in (None, "steer_logprobs"):  # honest work is exactly what prime-node builds
            sub = build_submission(ModelsEngine(model or self.loaded), self.run, self.identity.address, version,
                                   counter, self.manifest_hash, chain_id=chain_id, pool=pool)
            if cheat == "steer_logprobs":
                sub = steer_logprobs(sub)
            return sub, self.seal(sub)
        run, env = self.run, get_environment(self.run.env, self.run.env_version)
        if cheat == "junk":
            return self._junk(version, counter)
        gen_model = model or self.loaded
        draw_counter = counter + 1000 if cheat == "unassigned_task" else counter
        tasks = env.sample(task_seed(self.identity.address, version, draw_counter, run_id=run.run_id,
                                     chain_id=chain_id, pool=pool), run.tasks_per_batch)
        tok = self.loaded.tokenizer
        prompts, seeds = [], []
        for task in tasks:
            if cheat == "other_prompt":  # the assigned task under another system prompt
                messages = [m for m in task.as_messages() if m["role"] != "system"]
                ids = tok.apply_chat_template([{"role": "system", "content": OTHER_SYSTEM_PROMPT}, *messages],
                                              add_generation_prompt=True, tokenize=True)
            else:
                ids = render_prompt(tok, task, tokenize=True)
            ids = [int(t) for t in (ids["input_ids"] if hasattr(ids, "keys") else ids)]
            for i in range(run.samples_per_task):
                prompts.append(ids)
                seed_counter = (0 if counter else 1) if cheat == "cached_repeat" else counter
                seed = sampling_seed(self.identity.address, version, task.task_id, i, run_id=run.run_id,
                                     chain_id=chain_id, pool=pool, counter=seed_counter)
                seeds.append(seed + 1 if cheat == "other_seed" else seed)
        params = SamplingParams(temperature=run.temperature, top_k=run.top_k, top_p=run.top_p)
        gens = Engine(gen_model).generate(prompts, params, seeds, run.max_new_tokens)
        task_rollouts = []
        cut = cheat == "early_stop"  # the first sample long enough is cut (a random node may draw short ones)
        for t, task in enumerate(tasks):
            samples = []
            for i in range(run.samples_per_task):
                g = gens[t * run.samples_per_task + i]
                tokens, logprobs, hidden = list(g.tokens), list(g.logprobs), g.hidden_states
                finish = g.finish_reason
                if cheat == "edit_token" and t == 0 and i == 0:  # the token the seeded draw ranks last
                    pos = len(tokens) // 2
                    tokens[pos] = _last_ranked(self.loaded, hidden[pos], params, seeds[0], pos)
                    hidden = _prefill_hidden(self.loaded, prompts[0], tokens)  # a careful cheat re-proves
                if cheat == "cheap_tokens":  # another model's tokens, proved and scored by an honest prefill
                    prompt = prompts[t * run.samples_per_task + i]
                    hidden = _prefill_hidden(self.loaded, prompt, tokens)
                    logprobs = _true_logprobs(self.loaded, prompt, tokens, hidden, seeds[t * run.samples_per_task + i],
                                              run.max_new_tokens, params)
                if cheat == "skip_eos":
                    prompt, seed = prompts[t * run.samples_per_task + i], seeds[t * run.samples_per_task + i]
                    tokens = skip_narrow_eos(gen_model, prompt, seed, params, run.max_new_tokens, EOS_SKIP_TOLERANCE)
                    hidden = _prefill_hidden(self.loaded, prompt, tokens)
                    logprobs = _true_logprobs(self.loaded, prompt, tokens, hidden, seed, run.max_new_tokens, params)
                    finish = "eos" if tokens[-1] in self.loaded.eos_token_ids else "length"
                if cheat == "logprob_shift":
                    logprobs = [x - 0.51 for x in logprobs]
                if cut and len(tokens) > 4:  # stop 3 tokens early, claim an EOS ending
                    tokens, logprobs, hidden, finish = tokens[:-3], logprobs[:-3], hidden[:-3], "eos"
                    cut = False
                text = str(tok.decode(tokens, skip_special_tokens=True))
                reward = env.reward(task, text, completion_tokens=len(tokens))
                if cheat == "inflate_reward":  # a lie whatever the true reward was
                    reward = reward + 0.5 if reward <= 0.5 else reward - 0.5
                samples.append(SampleRollout(tokens=tuple(tokens), logprobs=tuple(logprobs), finish_reason=finish,
                                             reward=reward, proofs=tuple(prove(hidden))))
            task_rollouts.append(TaskRollouts(task_id=task.task_id, samples=tuple(samples)))
        sub = Submission(run_id=run.run_id, node=self.identity.address, policy_version=version,
                         manifest_hash=self.manifest_hash, counter=counter, env=run.env, env_version=run.env_version,
                         tasks=tuple(task_rollouts))
        data = self.seal(sub)
        return sub, data

    def _junk(self, version: int, counter: int) -> tuple[Submission, bytes]:
        run, env = self.run, get_environment(self.run.env, self.run.env_version)
        chain_id, pool = submission_venue(self.domain)
        tasks = env.sample(task_seed(self.identity.address, version, counter, run_id=run.run_id, chain_id=chain_id,
                                     pool=pool), run.tasks_per_batch)
        junk = SampleRollout(tokens=(5,), logprobs=(-1.0,), finish_reason="length", reward=0.0,
                             proofs=(bytes(258),))
        sub = Submission(run_id=run.run_id, node=self.identity.address, policy_version=version,
                         manifest_hash=self.manifest_hash, counter=counter, env=run.env, env_version=run.env_version,
                         tasks=tuple(TaskRollouts(task_id=t.task_id, samples=(junk,) * run.samples_per_task)
                                     for t in tasks))
        return sub, self.seal(sub)

    def seal(self, sub: Submission) -> bytes:
        data = seal(self.identity, sub, domain=self.domain, nonce=random_nonce()).to_bytes()
        self.sealed.append(data)
        return data


STEER = 0.49
"""How far `steer_logprobs` moves a claimed logprob: just inside the validator's 0.5-nat tolerance."""


def steer_logprobs(sub: Submission, shift: float = STEER) -> Submission:
    """`sub` with each sample's claimed logprobs moved by -shift x sign(its advantage in its group) (-shift
    where the advantage is 0): the importance ratios of positive-advantage tokens land above 1 + eps_high and
    those of negative ones below 1 - eps_low, so a trainer using the claims gives the work zero gradient."""
    tasks = []
    for tr in sub.tasks:
        mean = sum(s.reward for s in tr.samples) / len(tr.samples)
        samples = []
        for s in tr.samples:
            d = shift if s.reward < mean else -shift
            samples.append(s.model_copy(update={"logprobs": tuple(min(0.0, x + d) for x in s.logprobs)}))
        tasks.append(tr.model_copy(update={"samples": tuple(samples)}))
    return sub.model_copy(update={"tasks": tuple(tasks)})


EOS_SKIP_TOLERANCE = 0.5
"""The validators' default sampling margin tolerance: the EOS wins a `skip_eos` node replaces."""


def _eos_gap(loaded: LoadedModel, prompt: list[int], tokens: list[int], seed: int, params: SamplingParams
             ) -> tuple[float, int, int]:
    """At the step after `tokens`: (by how much the seeded draw's best EOS beats the best other token, that
    other token, that EOS)."""
    import torch

    from models.forward import prefill
    from models.loading import output_head
    from models.sampling import scores, seed_tensor

    ids = torch.tensor([prompt + tokens], dtype=torch.long)
    with torch.inference_mode():
        hidden = prefill(loaded, ids, torch.ones_like(ids), logits_last_only=True).hidden[0, -1:]
        row = scores(output_head(loaded.model)(hidden).float(), params, seed_tensor([seed]),
                     torch.tensor([len(tokens)]))[0]
    eos = sorted(loaded.eos_token_ids)
    best_eos = eos[int(row[eos].argmax())]
    others = row.clone()
    others[eos] = float("-inf")
    best_other = int(others.argmax())
    return float(row[best_eos] - row[best_other]), best_other, best_eos


def skip_narrow_eos(loaded: LoadedModel, prompt: list[int], seed: int, params: SamplingParams, max_tokens: int,
                    tolerance: float) -> list[int]:
    """The seeded draw, token by token, except that an EOS winning by at most `tolerance` is replaced by the best
    other token (a node that keeps generating where the validator's replay says stop, within the margin)."""
    tokens: list[int] = []
    while len(tokens) < max_tokens:
        gap, other, eos = _eos_gap(loaded, prompt, tokens, seed, params)
        if gap > tolerance:  # EOS won clearly: stop there
            tokens.append(eos)
            break
        tokens.append(other)  # the winner, or the best other token where EOS won narrowly
    return tokens


def narrow_eos_node(loaded: LoadedModel, run: RunSpec, version: int, above: float, *, domain: str,
                    tries: int = 512) -> Identity:
    """A fresh key whose assignment #0 at `version` in `domain`'s pool, generated honestly, ends a sample at an
    EOS before its last allowed token that won the seeded draw by more than `above` and at most
    `EOS_SKIP_TOLERANCE` (the EOS a `skip_eos` node replaces)."""
    env = get_environment(run.env, run.env_version)
    where = {"run_id": run.run_id, "chain_id": submission_venue(domain)[0], "pool": submission_venue(domain)[1]}
    params = SamplingParams(temperature=run.temperature, top_k=run.top_k, top_p=run.top_p)
    eos = set(loaded.eos_token_ids)
    for _ in range(0, tries, 32):
        keys = [Identity.create() for _ in range(32)]
        prompts, seeds, owners = [], [], []
        for key in keys:
            for task in env.sample(task_seed(key.address, version, 0, **where), run.tasks_per_batch):
                ids = render_prompt(loaded.tokenizer, task, tokenize=True)
                ids = [int(t) for t in (ids["input_ids"] if hasattr(ids, "keys") else ids)]
                for i in range(run.samples_per_task):
                    prompts.append(ids)
                    seeds.append(sampling_seed(key.address, version, task.task_id, i, counter=0, **where))
                    owners.append(key)
        for g, prompt, seed, key in zip(Engine(loaded).generate(prompts, params, seeds, run.max_new_tokens), prompts,
                                        seeds, owners, strict=True):
            # An EOS at the last allowed position would be replaced by one token and no more: the skip would
            # change nothing a test can see, so the EOS must leave room to generate on.
            if g.tokens[-1] in eos and len(g.tokens) < run.max_new_tokens \
                    and above < _eos_gap(loaded, prompt, g.tokens[:-1], seed, params)[0] <= EOS_SKIP_TOLERANCE:
                return key
    raise AssertionError(f"no key among {tries} has a narrow EOS win in its first assignment")


def _last_ranked(loaded: LoadedModel, hidden: Any, params: SamplingParams, seed: int, step: int) -> int:
    import torch

    from models.loading import output_head
    from models.sampling import scores, seed_tensor

    with torch.inference_mode():
        logits = output_head(loaded.model)(hidden.unsqueeze(0)).float()
        row = scores(logits, params, seed_tensor([seed]), torch.tensor([step]))
    return int(row.argmin())


def _true_logprobs(loaded: LoadedModel, prompt: list[int], tokens: list[int], hidden: Any, seed: int,
                   max_tokens: int, params: SamplingParams) -> list[float]:
    """The sampling logprobs the claimed model gives `tokens` (what a validator recomputes)."""
    from toploc.validation import Rollout, measure

    report = measure(loaded, [Rollout(prompt, tokens, prove(hidden), seed, max_tokens)], params)[0]
    return list(report.logprobs)


def _prefill_hidden(loaded: LoadedModel, prompt: list[int], tokens: list[int]) -> Any:
    import torch

    from models.forward import prefill

    ids = torch.tensor([prompt + tokens[:-1]], dtype=torch.long)
    out = prefill(loaded, ids, torch.ones_like(ids), logits_last_only=True)
    return out.hidden[0, len(prompt) - 1 :]


def perturbed(loaded: LoadedModel, scale: float, seed: int) -> LoadedModel:
    """A copy of `loaded` with every weight multiplied by (1 + scale * N(0, 1))."""
    import copy

    import torch

    other = copy.copy(loaded)
    other.model = copy.deepcopy(loaded.model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.model.parameters():
            p.mul_(1 + scale * torch.randn(p.shape, generator=gen))
    return other


def tiny(seed: int = 0) -> LoadedModel:
    return load(TINY.model_copy(update={"seed": seed}))
