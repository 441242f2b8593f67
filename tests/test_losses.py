"""Preference losses against values worked by hand: Bradley-Terry, DPO (with cDPO label smoothing) and IPO."""

import math

import pytest
import torch

from rlhf.losses import bradley_terry_loss, dpo_logits, dpo_loss, ipo_loss

LOG2 = math.log(2.0)


def test_bradley_terry_at_zero_margin_is_log2_and_per_pair():
    r = torch.tensor([-3.0, 0.0, 7.5])
    assert torch.allclose(bradley_terry_loss(r, r), torch.full((3,), LOG2))
    # margin log 3: sigmoid = 3/4, loss log(4/3); margin -log 3: loss log 4
    chosen = torch.tensor([math.log(3.0), 0.0])
    rejected = torch.tensor([0.0, math.log(3.0)])
    assert torch.allclose(bradley_terry_loss(chosen, rejected), torch.tensor([math.log(4 / 3), math.log(4.0)]))


def test_bradley_terry_gradient_at_zero_margin_is_minus_half():
    chosen = torch.zeros(2, requires_grad=True)
    rejected = torch.zeros(2, requires_grad=True)
    bradley_terry_loss(chosen, rejected).sum().backward()
    # d/dm -log sigmoid(m) = -(1 - sigmoid(m)) = -1/2 at m = 0
    assert torch.allclose(chosen.grad, torch.full((2,), -0.5))
    assert torch.allclose(rejected.grad, torch.full((2,), 0.5))


def test_dpo_logits_are_the_difference_of_log_ratios():
    # chosen: log-ratio -10 - (-11) = 1; rejected: -12 - (-11) = -1; h = 2
    h = dpo_logits(torch.tensor([-10.0]), torch.tensor([-12.0]), torch.tensor([-11.0]), torch.tensor([-11.0]))
    assert torch.allclose(h, torch.tensor([2.0]))


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1, 0.3])
def test_dpo_at_zero_margin_is_log2_for_any_label_smoothing(label_smoothing):
    # policy == reference pair by pair (h = 0) with different absolute log-probs
    pc, pr = torch.tensor([-5.0, -40.0]), torch.tensor([-6.0, -2.0])
    loss = dpo_loss(pc, pr, pc, pr, beta=0.1, label_smoothing=label_smoothing)
    assert torch.allclose(loss, torch.full((2,), LOG2))


def test_dpo_at_known_margin():
    pc, pr, rc, rr = torch.tensor([-10.0]), torch.tensor([-12.0]), torch.tensor([-11.0]), torch.tensor([-11.0])
    # h = 2, beta = 0.5: beta h = 1; loss = -log sigmoid(1) = log(1 + e^-1)
    plain = math.log1p(math.exp(-1.0))
    assert dpo_loss(pc, pr, rc, rr, beta=0.5).item() == pytest.approx(plain, abs=1e-6)
    # cDPO, eps = 0.25: 0.75 log(1 + e^-1) + 0.25 log(1 + e) = log(1 + e^-1) + 0.25, as log(1 + e) = 1 + log(1 + e^-1)
    assert dpo_loss(pc, pr, rc, rr, beta=0.5, label_smoothing=0.25).item() == pytest.approx(plain + 0.25, abs=1e-6)
    # the rejected side winning by the same margin: -log sigmoid(-1) = log(1 + e)
    assert dpo_loss(pr, pc, rr, rc, beta=0.5).item() == pytest.approx(math.log1p(math.e), abs=1e-6)


def test_dpo_gradient_at_zero_margin_is_minus_beta_over_two():
    pc = torch.tensor([-3.0], requires_grad=True)
    pr = torch.tensor([-4.0], requires_grad=True)
    dpo_loss(pc, pr, pc.detach(), pr.detach(), beta=0.1).sum().backward()
    assert pc.grad.item() == pytest.approx(-0.05)
    assert pr.grad.item() == pytest.approx(0.05)


def test_label_smoothing_out_of_range_is_refused():
    z = torch.zeros(1)
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(z, z, z, z, label_smoothing=0.5)


def test_ipo_at_known_margins():
    pc, pr, rc, rr = torch.tensor([-10.0]), torch.tensor([-12.0]), torch.tensor([-11.0]), torch.tensor([-11.0])
    # h = 2; target 1/(2 beta)
    assert ipo_loss(pc, pr, rc, rr, beta=0.5).item() == pytest.approx(1.0)  # (2 - 1)^2
    assert ipo_loss(pc, pr, rc, rr, beta=0.1).item() == pytest.approx(9.0)  # (2 - 5)^2
    assert ipo_loss(pc, pr, rc, rr, beta=0.25).item() == pytest.approx(0.0)  # h on target
    z = torch.zeros(3)
    assert torch.allclose(ipo_loss(z, z, z, z, beta=0.1), torch.full((3,), 25.0))  # (0 - 5)^2 at h = 0
