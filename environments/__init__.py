"""Task generation (deterministic from a seed) and reward functions, shared by node and validator.

    import environments
    env = environments.get("reverse-text")          # latest version; get(name, "1") pins one
    tasks = env.sample(seed, 8)                     # seed: an int the protocol derives
    prompt = environments.render_prompt(tokenizer, tasks[0])
    score = env.reward(tasks[0], completion_text)   # float in [0, 1], pure; UngradableError when
                                                    # grading itself failed (never record it as 0)

Multi-turn environments (`MultiTurnEnvironment`: calc-arith, alphabet-sort, wordle) play an episode
with `start`/`step`/`replay`; `ChatRenderer` turns their messages into token spans appended after the
model's own tokens. See environments/README.md for each environment, its grading rule and the
sandbox limits.
"""

from protocol.errors import UngradableError

from .base import Environment
from .chat import render_prompt
from .episode import EnvReply, Episode, EpisodeState, MultiTurnEnvironment, episode_rng
from .length import LengthReward
from .registry import get, names, register, versions
from .renderer import (
    ChatRenderer,
    RenderedEpisode,
    TemplateUnstableError,
    check_prefix_stable,
    reference_tokens,
    render_episode,
)
from .sandbox import SandboxLimits, SandboxResult, SandboxUnavailableError, run_sandboxed
from .task import HiddenTest, Message, Task, make_task, task_digest_ok

__all__ = [
    "ChatRenderer", "EnvReply", "Environment", "Episode", "EpisodeState", "HiddenTest", "LengthReward", "Message",
    "MultiTurnEnvironment", "RenderedEpisode", "SandboxLimits", "SandboxResult", "SandboxUnavailableError", "Task",
    "TemplateUnstableError", "UngradableError", "check_prefix_stable", "episode_rng", "get", "make_task", "names",
    "reference_tokens", "register", "render_episode", "render_prompt", "run_sandboxed", "task_digest_ok", "versions",
]
