from __future__ import annotations

import math

import pytest
import torch

from trainer.loss import LossConfig, group_advantages, grpo_token_loss, token_weights, zero_advantage_groups


def test_group_advantages_mean_centred_and_std() -> None:
    adv = group_advantages([1.0, 0.0, 0.0, 1.0, 2.0, 2.0], ["a", "a", "a", "a", "b", "b"])
    assert adv == pytest.approx([0.5, -0.5, -0.5, 0.5, 0.0, 0.0])
    adv = group_advantages([1.0, 0.0, 0.0, 1.0], ["a"] * 4, std_normalize=True)
    assert adv == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-5)  # std of {0,0,1,1} is 0.5


def test_filtering_drops_only_groups_without_signal() -> None:
    rewards = [1.0, 1.0, 0.0, 1.0, 0.3, 0.3]
    gids = ["same", "same", "mixed", "mixed", "flat", "flat"]
    adv = group_advantages(rewards, gids, std_normalize=True)
    assert zero_advantage_groups(adv, gids) == {"same", "flat"}


def test_loss_matches_hand_computed_example() -> None:
    # Four loss tokens, eps_low = 0.2, eps_high = 0.28, delta = 4.
    # ratios r = exp(lp - old): 1.5 (A=+1), 0.5 (A=-2), 1.1 (A=+1), 6.0 (A=-1)
    r = torch.tensor([1.5, 0.5, 1.1, 6.0], dtype=torch.float64)
    old = torch.tensor([-1.0, -2.0, -0.5, -3.0], dtype=torch.float64)
    lp = (old + r.log()).requires_grad_(True)
    adv = torch.tensor([1.0, -2.0, 1.0, -1.0], dtype=torch.float64)
    w = torch.full((4,), 0.25, dtype=torch.float64)
    cfg = LossConfig(epsilon_low=0.2, epsilon_high=0.28, delta=4.0)
    terms = grpo_token_loss(lp, old, adv, w, cfg)
    # token 1: -min(1.5*1, 1.28*1) = -1.28 (high clip)
    # token 2: -min(0.5*-2, 0.8*-2) = -min(-1.0, -1.6) = 1.6 (low clip)
    # token 3: -min(1.1, 1.1) = -1.1
    # token 4: -min(min(6,4)*-1, 1.28*-1) = -min(-4, -1.28) = 4 (delta cap; uncapped would be 6)
    expected = 0.25 * (-1.28 + 1.6 - 1.1 + 4.0)
    assert float(terms.loss.detach()) == pytest.approx(expected)
    assert terms.clipped_high_sum == pytest.approx(0.25)
    assert terms.clipped_low_sum == pytest.approx(0.25)
    assert terms.capped_sum == pytest.approx(0.25)
    terms.loss.backward()
    assert lp.grad is not None
    # Clipped and capped tokens carry no gradient; token 3's gradient is -w * A * r.
    assert lp.grad.tolist() == pytest.approx([0.0, 0.0, -0.25 * 1.1, 0.0])


@pytest.mark.parametrize("ratio,adv,clipped", [(1.5, 1.0, True), (1.2, 1.0, False), (0.7, -1.0, True),
                                               (0.9, -1.0, False), (0.7, 1.0, False), (1.5, -1.0, False)])
def test_clipping_on_both_sides(ratio: float, adv: float, clipped: bool) -> None:
    old = torch.tensor([-1.0], dtype=torch.float64)
    lp = (old + math.log(ratio)).requires_grad_(True)
    cfg = LossConfig(epsilon_low=0.2, epsilon_high=0.28, delta=4.0)
    terms = grpo_token_loss(lp, old, torch.tensor([adv], dtype=torch.float64), torch.ones(1, dtype=torch.float64), cfg)
    terms.loss.backward()
    assert lp.grad is not None
    assert (float(lp.grad[0]) == 0.0) == clipped
    assert (terms.clipped_high_sum + terms.clipped_low_sum > 0) == clipped


def test_kl_and_entropy_terms() -> None:
    lp = torch.tensor([-1.0, -2.0], dtype=torch.float64)
    ref = torch.tensor([-1.5, -1.0], dtype=torch.float64)
    ent = torch.tensor([2.0, 3.0], dtype=torch.float64)
    w = torch.tensor([0.5, 0.5], dtype=torch.float64)
    cfg = LossConfig(kl_coef=0.1, entropy_coef=0.01)
    terms = grpo_token_loss(lp, lp.clone(), torch.zeros(2, dtype=torch.float64), w, cfg, ref, ent)
    d = ref - lp
    kl = (d.exp() - d - 1).tolist()
    assert terms.kl_sum == pytest.approx(0.5 * sum(kl))
    assert float(terms.loss) == pytest.approx(0.1 * 0.5 * sum(kl) - 0.01 * 2.5)


def test_token_and_sequence_normalization() -> None:
    assert token_weights([2, 6], "token") == pytest.approx([1 / 8, 1 / 8])
    assert token_weights([2, 6], "sequence") == pytest.approx([1 / 4, 1 / 12])
    with pytest.raises(ValueError):
        token_weights([1], "bogus")
