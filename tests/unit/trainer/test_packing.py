from __future__ import annotations

import pytest
import torch

from protocol.rollout_files import Sample
from tests.unit.trainer.conftest import tiny_llama
from trainer.packing import pack, plan_rows, token_logprobs


def _sample(tokens: list[int], prompt: int) -> Sample:
    n = len(tokens)
    return Sample(
        tokens=tuple(tokens),
        loss_mask=tuple(i >= prompt for i in range(n)),
        sampling_logprobs=tuple(-1.0 if i >= prompt else 0.0 for i in range(n)),
        reward=1.0,
        group_id="g",
        policy_version=0,
        task_id="t",
        env_name="e",
        env_version="1",
    )


def test_plan_rows_first_fit_decreasing() -> None:
    rows = plan_rows([5, 3, 4, 2, 6], 8)
    assert sorted(i for r in rows for i in r) == [0, 1, 2, 3, 4]
    assert rows == [[4, 3], [0, 1], [2]]
    with pytest.raises(ValueError):
        plan_rows([9], 8)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_logprobs_equal_unpacked(attn: str) -> None:
    model = tiny_llama()
    model.config._attn_implementation = attn
    g = torch.Generator().manual_seed(1)
    samples = [_sample(torch.randint(0, 64, (n,), generator=g).tolist(), 2) for n in (7, 5, 9, 3, 6)]
    packed = pack(samples, [1.0] * 5, [1.0] * 5, seq_len=16)
    assert packed.input_ids.shape[0] < len(samples)  # really packed
    with torch.no_grad():
        lp, ent = token_logprobs(model, packed.input_ids, packed.position_ids, packed.segment_ids, with_entropy=True)
        for i, s in enumerate(samples):
            ids = torch.tensor([s.tokens])
            logits = model(input_ids=ids).logits[0, :-1]
            ref = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
            # locate the sample in the packed rows
            found = False
            for r in range(packed.input_ids.shape[0]):
                for seg in packed.segment_ids[r].unique().tolist():
                    sel = packed.segment_ids[r] == seg
                    if seg >= 0 and packed.input_ids[r][sel].tolist() == list(s.tokens):
                        torch.testing.assert_close(lp[r][sel][1:], ref, atol=1e-5, rtol=1e-5)
                        assert ent is not None and bool((ent[r][sel][1:] > 0).all())
                        found = True
            assert found, i
