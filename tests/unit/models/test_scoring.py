"""`models.scoring.Scorer`: a verifier's hidden states, each distinct prompt prefilled once."""

from __future__ import annotations

import torch

from models.engine import Engine
from models.loading import LoadedModel
from models.sampling import SamplingParams
from models.scoring import Scorer

PARAMS = SamplingParams(temperature=1.0)


def _batch(tiny: LoadedModel) -> tuple[list[list[int]], list[list[int]], list[int], list[torch.Tensor]]:
    prompts = [[1, 5, 6, 7, 40, 41], [1, 5, 6, 7, 90, 91, 92, 93, 94, 95, 96], [1, 9]]
    index = [0, 0, 1, 1, 1, 2]
    gens = Engine(tiny).generate([prompts[j] for j in index], PARAMS, [11, 12, 13, 14, 15, 16], 12)
    return prompts, [g.tokens for g in gens], index, [g.hidden_states for g in gens]


def test_shared_prompts_give_the_engines_states_on_both_paths(tiny: LoadedModel) -> None:
    prompts, completions, index, engine_states = _batch(tiny)
    fast = Scorer(tiny).hidden(prompts, completions, index)
    generic = Scorer(tiny, fast_path=False).hidden(prompts, completions, index)
    # a batch of one prompt at a time (every prompt split off) gives the same rows as the shared batch
    alone = Scorer(tiny).hidden(prompts, completions, index, batch_tokens=1)
    for f, g, a, e, c in zip(fast, generic, alone, engine_states, completions, strict=True):
        assert f.shape == (len(c), tiny.hidden_size)
        torch.testing.assert_close(f, e, atol=1e-5, rtol=1e-5)  # fp32: summation order only
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a, f, atol=1e-6, rtol=1e-6)


def test_a_scorer_is_rebuilt_after_an_in_place_weight_change(tiny: LoadedModel) -> None:
    import copy

    other = copy.copy(tiny)
    other.model = copy.deepcopy(tiny.model)
    first = Scorer.of(other)
    assert Scorer.of(other).fast is first.fast
    prompts, completions, index, _ = _batch(other)
    before = first.hidden(prompts, completions, index)
    with torch.no_grad():
        other.model.model.layers[0].mlp.up_proj.weight.mul_(1.5)  # the fused gate/up copy is stale now
    again = Scorer.of(other)
    assert again.fast is not first.fast
    after = again.hidden(prompts, completions, index)
    assert not torch.allclose(before[0], after[0])


def test_the_scorer_cache_lets_a_dropped_model_go(tiny: LoadedModel) -> None:
    import copy
    import gc
    import weakref

    other = copy.copy(tiny)
    other.model = copy.deepcopy(tiny.model)
    Scorer.of(other).hidden([[1, 2, 3]], [[4, 5]], [0])
    gone = weakref.ref(other.model)
    del other
    gc.collect()
    assert gone() is None  # a validator that drops an old policy version gets its memory back
