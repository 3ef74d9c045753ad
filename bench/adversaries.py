"""Cheating peers, for the attack bench (`bench.attacks`) and the tests that check each cheat is caught: a node
built from the libraries that can submit honest work or cheat in one named way (`SimNode`), the cheats' own
building blocks (steered logprobs, skipped near-tie EOS, perturbed weights), and a relay that serves whatever
it is handed (`FakeRelay`).

Honest work is built by `prime-node`'s own `node.rollouts.build_submission`; the copy of its steps below
(generate with the seeded sampler, grade, prove, seal) exists only for the cheats, which are applied between
generation and sealing.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from bench.loopback import MANIFEST_V0, RUN, start_site
from environments import get as get_environment
from environments import render_prompt
from models.engine import Engine
from models.loading import LoadedModel
from models.sampling import SamplingParams
from node.engines import ModelsEngine
from node.rollouts import build_submission
from protocol.envelope import seal
from protocol.identity import Identity
from protocol.nonce import random_nonce
from protocol.rollout import Precision, RunSpec, SampleRollout, Submission, TaskRollouts, submission_venue
from protocol.seeds import sampling_seed, task_seed
from toploc.validation import prove

OTHER_SYSTEM_PROMPT = "You are a pirate. Answer in pirate speak."


@dataclass
class SimNode:
    """A node built from the libraries (see the module docstring)."""

    identity: Identity
    loaded: LoadedModel
    domain: str
    run: RunSpec = RUN
    manifest_hash: bytes = MANIFEST_V0
    ground_manifest: bytes | None = None
    """The manifest hash a `ground_tasks` cheat drew its tasks under (a guess, ground before the version)."""
    counter: int = 0
    sealed: list[bytes] = field(default_factory=list)

    def build(self, version: int = 1, counter: int | None = None, cheat: str | None = None,
              model: LoadedModel | None = None, precision: Precision | None = None) -> tuple[Submission, bytes]:
        """One assignment's submission and its sealed bytes; `cheat` names a way to cheat: `other_weights`
        (generate with `model`), `other_prompt` (another system prompt), `edit_token`, `cheap_tokens`
        (`model`'s tokens, proved and scored by an honest prefill), `other_seed`, `early_stop`,
        `inflate_reward`, `unassigned_task`, `steer_logprobs` (honest work whose claimed logprobs are moved
        inside the tolerance, see `steer_logprobs`) (`bench.attacks` runs each of them), `junk` (free: one
        made-up token per sample, no model run), `logprob_shift` (every claimed logprob 0.51 lower: just over
        the 0.5 tolerance), `skip_eos` (every EOS that wins the seeded draw by at most the sampling
        tolerance is replaced by the best other token and generation goes on; `narrow_eos_node` finds keys
        whose first assignment has one), `cached_repeat` (the assigned tasks answered with samples another
        assignment's seeds drew: what replaying a cache for a task drawn again gives), `ground_tasks` (the tasks
        drawn under `ground_manifest`, the hash a key was ground for in advance, sampled and sealed honestly
        under `manifest_hash`), `steer_near_ties` (at every near-tie within the sampling tolerance the token the
        node prefers, see `steer_near_ties`), `steer_one_near_tie` (honest work but for one token of the first sample:
        a near-tie losing the draw by `ONE_NEAR_TIE_MARGIN` to the sampling tolerance). `precision`: what a cheat's submission declares (None: nothing, as a
        node from before the field; honest work declares its engine's, as prime-node does)."""
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
        drawn_under = self.ground_manifest if cheat == "ground_tasks" and self.ground_manifest else self.manifest_hash
        tasks = env.sample(task_seed(self.identity.address, version, draw_counter, run_id=run.run_id,
                                     chain_id=chain_id, pool=pool, manifest_hash=drawn_under),
                           run.tasks_per_batch)
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
                                     chain_id=chain_id, pool=pool, counter=seed_counter,
                                     manifest_hash=self.manifest_hash)
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
                    hidden = prefill_hidden(self.loaded, prompts[0], tokens)  # a careful cheat re-proves
                if cheat == "cheap_tokens":  # another model's tokens, proved and scored by an honest prefill
                    prompt = prompts[t * run.samples_per_task + i]
                    hidden = prefill_hidden(self.loaded, prompt, tokens)
                    logprobs = _true_logprobs(self.loaded, prompt, tokens, hidden, seeds[t * run.samples_per_task + i],
                                              run.max_new_tokens, params)
                if cheat == "skip_eos":
                    prompt, seed = prompts[t * run.samples_per_task + i], seeds[t * run.samples_per_task + i]
                    tokens = skip_narrow_eos(gen_model, prompt, seed, params, run.max_new_tokens, EOS_SKIP_TOLERANCE)
                    hidden = prefill_hidden(self.loaded, prompt, tokens)
                    logprobs = _true_logprobs(self.loaded, prompt, tokens, hidden, seed, run.max_new_tokens, params)
                    finish = "eos" if tokens[-1] in self.loaded.eos_token_ids else "length"
                if cheat == "steer_near_ties":
                    prompt, seed = prompts[t * run.samples_per_task + i], seeds[t * run.samples_per_task + i]
                    tokens, _ = steer_near_ties(gen_model, prompt, seed, params, run.max_new_tokens,
                                                NEAR_TIE_TOLERANCE)
                    hidden = prefill_hidden(self.loaded, prompt, tokens)
                    logprobs = _true_logprobs(self.loaded, prompt, tokens, hidden, seed, run.max_new_tokens, params)
                    finish = "eos" if tokens[-1] in self.loaded.eos_token_ids else "length"
                if cheat == "steer_one_near_tie" and t == 0 and i == 0:
                    prompt, seed = prompts[0], seeds[0]
                    tokens, chose = steer_near_ties(gen_model, prompt, seed, params, run.max_new_tokens,
                                                    NEAR_TIE_TOLERANCE, budget=1, min_margin=ONE_NEAR_TIE_MARGIN)
                    if chose != 1:
                        raise ValueError("steer_one_near_tie: the first sample has no near-tie to steer")
                    hidden = prefill_hidden(self.loaded, prompt, tokens)
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
                         precision=precision, tasks=tuple(task_rollouts))
        data = self.seal(sub)
        return sub, data

    def _junk(self, version: int, counter: int) -> tuple[Submission, bytes]:
        run, env = self.run, get_environment(self.run.env, self.run.env_version)
        chain_id, pool = submission_venue(self.domain)
        tasks = env.sample(task_seed(self.identity.address, version, counter, run_id=run.run_id, chain_id=chain_id,
                                     pool=pool, manifest_hash=self.manifest_hash), run.tasks_per_batch)
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


NEAR_TIE_TOLERANCE = 0.5
"""The sampling tolerance a `steer_near_ties` node chooses within (the validators' default)."""
ONE_NEAR_TIE_MARGIN = 0.1
"""The least margin of the one token `steer_one_near_tie` steers: inside bf16's tolerance (0.5), far beyond
fp32's (0.01)."""


def steer_near_ties(loaded: LoadedModel, prompt: list[int], seed: int, params: SamplingParams, max_tokens: int,
                    tolerance: float, *, budget: int | None = None, min_margin: float = 0.0) -> tuple[list[int], int]:
    """(tokens, how many were chosen): the seeded draw, token by token, except that wherever other tokens than
    the winner score within `tolerance` of it, the node takes the one it prefers (here the lowest id that is not
    an EOS: any fixed preference, as a node steering the trainer toward some text would have). An EOS that wins is
    kept (skipping one is `skip_eos`). Each chosen token loses the replay's draw by at most `tolerance`: a near-tie
    disagreement, which passes the sampling check one by one (`validator.near_tie_rule` judges the account).
    `budget`: choose at most this many tokens; `min_margin`: only tokens that lose the draw by at least this."""
    import torch

    from models.forward import prefill
    from models.loading import output_head
    from models.sampling import scores, seed_tensor

    eos = set(loaded.eos_token_ids)
    tokens: list[int] = []
    chose = 0
    with torch.inference_mode():
        while len(tokens) < max_tokens:
            ids = torch.tensor([prompt + tokens], dtype=torch.long)
            hidden = prefill(loaded, ids, torch.ones_like(ids), logits_last_only=True).hidden[0, -1:]
            row = scores(output_head(loaded.model)(hidden).float(), params, seed_tensor([seed]),
                         torch.tensor([len(tokens)]))[0].double()
            winner = pick = int(row.argmax())
            if winner not in eos and (budget is None or chose < budget):
                near = (row >= row[winner] - tolerance) & (row <= row[winner] - min_margin)
                pick = min((int(t) for t in torch.nonzero(near).flatten() if int(t) not in eos), default=winner)
            chose += pick != winner
            tokens.append(pick)
            if pick in eos:
                break
    return tokens, chose


def narrow_eos_node(loaded: LoadedModel, run: RunSpec, version: int, above: float, *, domain: str,
                    manifest_hash: bytes, tries: int = 512) -> Identity:
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
            for task in env.sample(task_seed(key.address, version, 0, manifest_hash=manifest_hash, **where),
                                   run.tasks_per_batch):
                ids = render_prompt(loaded.tokenizer, task, tokenize=True)
                ids = [int(t) for t in (ids["input_ids"] if hasattr(ids, "keys") else ids)]
                for i in range(run.samples_per_task):
                    prompts.append(ids)
                    seeds.append(sampling_seed(key.address, version, task.task_id, i, counter=0,
                                               manifest_hash=manifest_hash, **where))
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


def prefill_hidden(loaded: LoadedModel, prompt: list[int], tokens: list[int]) -> Any:
    """The final hidden states that produced `tokens` after `prompt` (what a node proves), by one prefill."""
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


class FakeRelay:
    """An HTTP server that answers like a relay but serves whatever a test hands it (malformed or
    forged manifests, oversized answers)."""

    def __init__(self, routes: dict[str, Callable[[web.Request], Awaitable[web.StreamResponse]]]) -> None:
        self.routes = routes
        self.hits: dict[str, int] = {}
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> FakeRelay:
        app = web.Application()
        for path, handler in self.routes.items():
            async def counted(request: web.Request, handler: Any = handler, path: str = path) -> web.StreamResponse:
                self.hits[path] = self.hits.get(path, 0) + 1
                return await handler(request)
            app.router.add_get(path, counted)
        self._runner, self.port = await start_site(app, shutdown_timeout=0.5)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._runner is not None
        await self._runner.cleanup()
