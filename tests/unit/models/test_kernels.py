"""The engine's matmul kernel paths: same model, same tokens, proofs that verify; the choice cache.

What is exact and what is not:

- float32 models: every path computes the same fp32 products in a different summation order, so
  every path generates the same tokens as the reference path (``linear``, what transformers
  runs) and hidden states within 1e-5.
- bfloat16 models: every path is a bf16-in / bf16-out product accumulated in fp32 and rounded
  once (the ``fp32_*`` paths upcast the bf16 weights exactly), so each output is within one bf16
  rounding of the exact product; summation order still differs, so generations are compared the
  way a validator compares them: hidden states within bf16 tolerance (3e-2) of a bf16 prefill,
  TOPLOC proofs and the seeded-sampling replay within the shipped thresholds. Tokens are not
  required to be identical across bf16 paths (a near-tie may break differently, as it does
  between two machines).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from models import LoadedModel, kernels, load
from models.engine import Engine
from models.forward import prefill
from models.kernels import PATHS, REFERENCE, Linear, choose
from models.sampling import SamplingParams, sample
from protocol.errors import ModelError
from protocol.model_spec import TinyModelSpec
from toploc import ToplocThresholds
from toploc.validation import Rollout, measure, prove

PROMPTS = [[1, 5, 6, 7, 8, 9, 10], [1, 40, 41], [1] + list(range(100, 130)), [1, 77]]
SEEDS = [3, 4, 5, 6]
# hidden 128: a one-token last proof chunk still holds topk=128 values.
WIDE = TinyModelSpec(seed=0, hidden_size=128, intermediate_size=256, num_layers=2, vocab_size=512)
CFG = ToplocThresholds()  # the validator's defaults (validator/config.py uses the same numbers)
SHAPES = [(32, 48), (32, 48), (48, 32), (32, 96)]


@pytest.fixture(autouse=True)
def _fresh_memo(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sees only the cache files it made (the in-process memo is per test)."""
    monkeypatch.setattr(kernels, "_MEMO", {})
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)


@pytest.fixture(scope="module")
def wide() -> LoadedModel:
    return load(WIDE)


@pytest.fixture(scope="module")
def wide_bf16() -> LoadedModel:
    return load(WIDE, dtype="bfloat16")


def _skip_unavailable(path: str, dtype: torch.dtype) -> None:
    if not kernels.available(path, dtype):
        pytest.skip(f"{path} does not run for {dtype} on this CPU")


def _linears(engine: Engine) -> list[Linear]:
    fast = engine._fast
    assert fast is not None
    return [fast.lm_head] + [lin for layer in fast.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]


# -- numerics -----------------------------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
def test_every_path_is_one_rounding_of_the_exact_bf16_product(path: str) -> None:
    _skip_unavailable(path, torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    w = torch.randn((96, 160), generator=gen).bfloat16()
    b = torch.randn(96, generator=gen).bfloat16()
    x = torch.randn((2, 5, 160), generator=gen).bfloat16()
    y = Linear(w, b, path)(x)
    assert y.dtype == torch.bfloat16 and y.shape == (2, 5, 96)
    exact = x.double() @ w.double().t() + b.double()
    magnitude = x.double().abs() @ w.double().abs().t() + b.double().abs()
    # one bf16 rounding (half an ulp: 2**-9 relative) plus fp32 accumulation error over 160 terms
    bound = exact.abs() * 2**-8 + magnitude * 160 * 2**-24
    assert bool(((y.double() - exact).abs() <= bound).all())


def test_fp32_paths_on_fp32_weights_are_the_plain_ones() -> None:
    w = torch.randn(8, 4)
    assert Linear(w, None, "fp32_mm_t").compute_dtype == torch.float32
    x = torch.randn(3, 4)
    torch.testing.assert_close(Linear(w, None, "fp32_linear")(x), Linear(w, None, "linear")(x), rtol=0, atol=0)
    assert not any(p.startswith("fp32_") for p in kernels.candidates(torch.float32))


def test_a_path_this_cpu_cannot_run_is_refused(tiny_bf16: LoadedModel) -> None:
    missing = [p for p in PATHS if not kernels.available(p, torch.bfloat16)]
    if not missing:
        pytest.skip("every kernel path runs in bf16 here")
    assert missing[0] not in kernels.candidates(torch.bfloat16)
    with pytest.raises(ModelError, match="not available"):
        Engine(tiny_bf16, kernel=missing[0])


@pytest.mark.parametrize("path", PATHS)
def test_fp32_every_path_generates_the_reference_tokens(tiny: LoadedModel, path: str) -> None:
    _skip_unavailable(path, torch.float32)
    params = SamplingParams(temperature=0.9, top_k=100)
    ref = Engine(tiny, kernel=REFERENCE).generate(PROMPTS, params, SEEDS, 24)
    engine = Engine(tiny, kernel=path)
    assert engine.kernels is not None and engine.kernels.source == "forced"
    assert {lin.path for lin in _linears(engine)} == {path}
    for g, r in zip(engine.generate(PROMPTS, params, SEEDS, 24), ref, strict=True):
        assert g.tokens == r.tokens and g.finish_reason == r.finish_reason
        torch.testing.assert_close(g.hidden_states, r.hidden_states, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(r.logprobs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", PATHS)
def test_bf16_every_path_matches_a_bf16_prefill(tiny_bf16: LoadedModel, path: str) -> None:
    _skip_unavailable(path, torch.bfloat16)
    params = SamplingParams(temperature=0.0)  # greedy: replayed from the prefill's own logits
    for g in Engine(tiny_bf16, kernel=path).generate(PROMPTS, params, SEEDS, 16):
        assert g.hidden_states.dtype == torch.bfloat16
        n, start = len(g.tokens), len(g.prompt_tokens) - 1
        out = prefill(tiny_bf16, torch.tensor([g.prompt_tokens + g.tokens]))
        hidden = out.hidden[0, start : start + n]
        torch.testing.assert_close(g.hidden_states.float(), hidden.float(), rtol=3e-2, atol=3e-2)
        tokens, _ = sample(out.logits[0, start : start + n], params, torch.full((n,), g.seed), torch.arange(n))
        assert tokens.tolist() == g.tokens


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("path", PATHS)
def test_proofs_from_every_path_verify_against_a_bf16_prefill(
    wide: LoadedModel, wide_bf16: LoadedModel, dtype: str, path: str
) -> None:
    """What a validator does (toploc.validation.measure, one bf16 prefill), with its default thresholds."""
    node_model = wide_bf16 if dtype == "bfloat16" else wide
    _skip_unavailable(path, node_model.dtype)
    params = SamplingParams(temperature=1.0)
    gens = Engine(node_model, kernel=path).generate(PROMPTS, params, SEEDS, 40)
    rollouts = [
        Rollout(prompt_tokens=g.prompt_tokens, tokens=g.tokens, proofs=prove(g.hidden_states, CFG), seed=g.seed,
                max_tokens=40)
        for g in gens
    ]
    for report in measure(wide_bf16, rollouts, params, CFG):
        assert report.error is None
        assert CFG.failing_chunks(report.proofs) == [], report.proofs
        if dtype == "bfloat16":  # the sampling replay is exact only within one dtype
            assert report.sampling is not None and report.termination is not None
            assert not CFG.sampling_failed(report.sampling), report.sampling.max_margin
            assert report.termination.violations == ()


# -- choosing and caching -----------------------------------------------------------------------


def test_choice_is_measured_written_then_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = choose(SHAPES, torch.bfloat16, kernel="auto", cache_dir=tmp_path)
    assert first.source == "measured" and set(first.paths) == set(SHAPES)
    assert set(first.paths.values()) <= set(PATHS)
    assert first.cache_file is not None and first.cache_file.parent == tmp_path
    saved = json.loads(first.cache_file.read_text())
    assert saved["key"]["dtype"] == "bfloat16" and saved["paths"] == {"32x48": first.paths[(32, 48)],
                                                                       "48x32": first.paths[(48, 32)],
                                                                       "32x96": first.paths[(32, 96)]}
    assert all(rate > 0 for r in saved["gflops"].values() for by_m in r.values() for rate in by_m.values())
    assert list(tmp_path.iterdir()) == [first.cache_file]  # no temporary file left behind

    def no_measuring(*args: object, **kwargs: object) -> None:
        raise AssertionError("measured again")

    assert choose(SHAPES, torch.bfloat16, cache_dir=tmp_path) is first  # in-process memo
    monkeypatch.setattr(kernels, "_MEMO", {})
    monkeypatch.setattr(kernels, "measure", no_measuring)
    again = choose(SHAPES, torch.bfloat16, cache_dir=tmp_path)  # a new process: read from the file
    assert again.source == "cache" and again.paths == first.paths and again.gflops == first.gflops


@pytest.mark.parametrize("damage", ["garbage", "truncated", "bad path", "missing shape", "other machine"])
def test_corrupt_or_foreign_cache_is_ignored_and_replaced(tmp_path: Path, damage: str) -> None:
    choice = choose(SHAPES, torch.float32, cache_dir=tmp_path)
    assert choice.cache_file is not None
    path, text = choice.cache_file, choice.cache_file.read_text()
    data = json.loads(text)
    if damage == "garbage":
        path.write_bytes(b"\x00\xffnot json")
    elif damage == "truncated":
        path.write_text(text[: len(text) // 2])
    elif damage == "bad path":
        data["paths"]["32x48"] = "os.system"
        path.write_text(json.dumps(data))
    elif damage == "missing shape":
        del data["paths"]["32x48"]
        path.write_text(json.dumps(data))
    else:  # a cache dir shared with (or copied from) another kind of machine
        data["key"]["cpu"], data["key"]["simd"] = "Other CPU", ["amx_bf16", "avx512f"]
        data["paths"] = dict.fromkeys(data["paths"], "linear")
        path.write_text(json.dumps(data))
    kernels._MEMO.clear()
    redone = choose(SHAPES, torch.float32, cache_dir=tmp_path)
    assert redone.source == "measured"
    assert json.loads(path.read_text())["key"] == choice.key  # rewritten for this machine


def test_another_machine_key_uses_another_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    here = choose(SHAPES, torch.float32, cache_dir=tmp_path)
    monkeypatch.setattr(kernels, "cpu_identity", lambda: {"cpu": "Other CPU", "arch": "x86_64", "simd": []})
    there = choose(SHAPES, torch.float32, cache_dir=tmp_path)
    assert there.source == "measured" and there.cache_file != here.cache_file
    torch.set_num_threads(2)
    try:
        threads = choose(SHAPES, torch.float32, cache_dir=tmp_path)  # the thread count is part of the key
    finally:
        torch.set_num_threads(1)
    assert threads.source == "measured" and threads.key["threads"] == 2
    assert len(list(tmp_path.iterdir())) == 3


def test_unwritable_cache_still_chooses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    choice = choose(SHAPES, torch.float32, cache_dir=blocker / "kernels")
    assert choice.source == "measured" and set(choice.paths) == set(SHAPES)

    def read_only_home() -> Path:
        raise PermissionError("read-only file system")

    monkeypatch.setattr(kernels, "default_cache_dir", read_only_home)
    choice = choose(SHAPES, torch.float32)
    assert choice.source == "measured" and choice.cache_file is None
    assert choose(SHAPES, torch.float32) is choice  # remembered in memory


def test_fp32_candidates_skipped_when_their_copies_would_not_fit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kernels, "_available_bytes", lambda: 1000)
    choice = choose(SHAPES, torch.bfloat16, cache_dir=tmp_path)
    assert not any(p.startswith("fp32_") for p in choice.paths.values())
    assert choice.key["candidates"] == [p for p in kernels.candidates(torch.bfloat16) if not p.startswith("fp32_")]


def test_forced_path_argument_and_environment(
    tiny: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(kernels.ENV_VAR, "fp32_linear")
    engine = Engine(tiny, kernel_cache=tmp_path)
    assert engine.kernels is not None and engine.kernels.source == "forced"
    assert {lin.path for lin in _linears(engine)} == {"fp32_linear"}
    engine = Engine(tiny, kernel="mm_t", kernel_cache=tmp_path)  # the argument wins
    assert {lin.path for lin in _linears(engine)} == {"mm_t"}
    assert list(tmp_path.iterdir()) == []  # forcing measures nothing
    monkeypatch.setenv(kernels.ENV_VAR, "auto")
    auto = Engine(tiny, kernel_cache=tmp_path)
    assert auto.kernels is not None and auto.kernels.source == "measured"
    assert [lin.path for lin in _linears(auto)] == [
        auto.kernels.path((lin.in_features, lin.out_features)) for lin in _linears(auto)
    ]
    with pytest.raises(ModelError, match="unknown kernel path"):
        Engine(tiny, kernel="fast")
    monkeypatch.setenv(kernels.ENV_VAR, "turbo")
    with pytest.raises(ModelError, match="unknown kernel path"):
        Engine(tiny)


def test_generic_path_and_other_devices_do_not_measure(tiny: LoadedModel, tmp_path: Path) -> None:
    assert Engine(tiny, fast_path=False, kernel_cache=tmp_path).kernels is None
    choice = choose(SHAPES, torch.bfloat16, "meta", cache_dir=tmp_path)
    assert choice.source == "device" and set(choice.paths.values()) == {REFERENCE}
    assert list(tmp_path.iterdir()) == []
