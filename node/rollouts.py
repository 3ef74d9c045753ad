"""One assignment, start to finish: tasks from `task_seed`, samples with `sampling_seed`, rewards, proofs.

`build_submission` is the whole of what a node does for its `counter`-th batch at a policy version,
short of signing: the validator recomputes each step (same seeds, same environment, one prefill) and
any difference is a hard rejection, so this code must follow `protocol/rollout.py` exactly.
"""

from __future__ import annotations

from environments import get as get_environment
from environments import render_prompt
from node.engines import InferenceEngine, Request
from protocol.rollout import RunSpec, SampleRollout, Submission, TaskRollouts
from protocol.seeds import sampling_seed, task_seed


def prompt_ids(tokenizer: object, task: object) -> list[int]:
    ids = render_prompt(tokenizer, task, tokenize=True)  # type: ignore[arg-type]
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    return [int(t) for t in ids]


def build_submission(engine: InferenceEngine, run: RunSpec, node: str, version: int, counter: int,
                     manifest_hash: bytes, *, chain_id: int, pool: str) -> Submission:
    """The unsigned `Submission` of assignment (`node`, `version`, `counter`) in `run`, in the pool contract
    `pool` on chain `chain_id`, at the version published with `manifest_hash` (all bound into the tasks and the
    sampling seeds)."""
    env = get_environment(run.env, run.env_version)
    tasks = env.sample(task_seed(node, version, counter, run_id=run.run_id, chain_id=chain_id, pool=pool,
                                 manifest_hash=manifest_hash),
                       run.tasks_per_batch)
    tok = engine.tokenizer
    requests = []
    for task in tasks:
        ids = prompt_ids(tok, task)
        requests += [Request(ids, sampling_seed(node, version, task.task_id, i, run_id=run.run_id, chain_id=chain_id,
                                                pool=pool, counter=counter,
                                                manifest_hash=manifest_hash))
                     for i in range(run.samples_per_task)]
    completions = engine.generate(requests, run)
    groups = []
    for t, task in enumerate(tasks):
        samples = []
        for c in completions[t * run.samples_per_task:(t + 1) * run.samples_per_task]:
            text = str(tok.decode(c.tokens, skip_special_tokens=True))
            reward = env.reward(task, text, completion_tokens=len(c.tokens))
            samples.append(SampleRollout(tokens=tuple(c.tokens), logprobs=tuple(c.logprobs),
                                         finish_reason=c.finish_reason, reward=reward, proofs=tuple(c.proofs)))
        groups.append(TaskRollouts(task_id=task.task_id, samples=tuple(samples)))
    return Submission(run_id=run.run_id, node=node, policy_version=version, manifest_hash=manifest_hash,
                      counter=counter, env=run.env, env_version=run.env_version, precision=engine.precision,
                      tasks=tuple(groups))
