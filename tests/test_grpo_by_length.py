"""grpo --group_by_length: micro-batches of prompts of similar length (rollouts.sampling.micro_batch_rows). The order
by hand; a GRPO step's gradient and the reward model's scores, row by row, equal the ungrouped ones up to float
summation order, with less padding computed."""

import pytest
import torch

from grpo import Config
from model.gpt2 import GPT2LMHeadModel, GPTConfig
from model.heads import RewardModel
from model.sampler import SampleOutput
from model.weights import freeze
from rollouts.models import Models
from rollouts.sampling import micro_batch_rows, score
from rollouts.step import train_step
from tests.helpers import prompts_and_rewards
from utils.optim import build_scheduler


def cuts(prompt_of_row, lengths, micro) -> list[list[int]]:
    return [c.tolist() for c in micro_batch_rows(torch.tensor(prompt_of_row), lengths, micro)]


def test_micro_batch_rows_puts_the_longest_prompts_first_and_keeps_each_prompts_rows_together():
    rows = [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]  # 5 prompts of 2 rows
    lengths = torch.tensor([3, 7, 3, 9, 7])
    # prompts by length: 3 (9), then 1 and 4 (7: in their order), then 0 and 2 (3): rows 6 7 | 2 3 | 8 9 | 0 1 | 4 5,
    # cut every 4 rows, each micro-batch's rows in their own order
    assert cuts(rows, lengths, 4) == [[2, 3, 6, 7], [0, 1, 8, 9], [4, 5]]
    assert cuts(rows, lengths, 3) == [[2, 6, 7], [3, 8, 9], [0, 1, 4], [5]]  # a group may straddle two micro-batches
    assert cuts(rows, None, 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]  # ungrouped: the rows in order
    # a prompt's rows together even when they are not adjacent; equal lengths in the order of their first rows
    assert cuts([1, 0, 1, 0], torch.tensor([5, 5]), 2) == [[0, 2], [1, 3]]
    assert cuts([1, 0, 1, 0], torch.tensor([6, 5]), 2) == [[1, 3], [0, 2]]  # prompt 0 (rows 1, 3) the longer


class GradientRecorder(torch.optim.SGD):
    """SGD at learning rate 0 that keeps the gradient of every parameter at each step (the step's whole gradient,
    after every micro-batch's backward)."""

    def __init__(self, params):
        super().__init__(params, lr=0.0)
        self.grads = []

    def step(self, closure=None):
        self.grads.append(torch.cat([p.grad.flatten() for g in self.param_groups for p in g["params"]]))
        return super().step(closure)


@pytest.mark.parametrize(
    "options",
    [{}, {"kl_in": "reward", "min_group_std": 0.05}],  # the KL of each row back at its place; dropped groups
    ids=["default", "kl_in_reward"],
)
def test_a_grpo_step_grouped_by_length_has_the_ungrouped_steps_gradient(options):
    # 6 prompts of 2, 3 and 4 tokens, 2 kept samples each, micro-batches of 4 rows (2 prompts): in loader order the
    # micro-batches pair prompts of different lengths, grouped they pair equal ones
    results = {}
    for by_length in (False, True):
        torch.manual_seed(0)
        policy = GPT2LMHeadModel(GPTConfig(n_layer=1, n_head=2, n_embd=16, n_positions=32))
        models = Models(policy, freeze(GPT2LMHeadModel(policy.cfg)), None)  # another random model: the KL is not 0
        cfg = Config(
            rewards="length",
            num_samples=4,
            num_kept=2,
            max_new_tokens=5,
            prompts_per_step=6,
            micro_batch_size=4,
            beta=0.1,
            grad_clip=0.0,
            group_by_length=by_length,
            **options,
        )
        optimizer = GradientRecorder(policy.parameters())
        prompts, spec = prompts_and_rewards(cfg)
        r = train_step(models, optimizer, build_scheduler(optimizer, 1, 10), prompts, spec, cfg, step=1)
        results[by_length] = (r, optimizer.grads[0])
    (plain, grad), (grouped, grad_grouped) = results[False], results[True]
    in_order = torch.cat([b.kept_index for b in plain.batches if not b.filler])
    assert torch.equal(in_order, torch.arange(in_order.shape[0]))  # ungrouped: the kept rows in their order
    assert [b.kept_index.tolist() for b in grouped.batches] != [b.kept_index.tolist() for b in plain.batches]
    computed = [sum(b.input_ids.numel() for b in r.batches) for r in (plain, grouped)]
    assert computed[1] < computed[0] if not options else computed[1] <= computed[0]  # dropped groups: 3 prompts
    assert torch.equal(grouped.rewards_BK, plain.rewards_BK) and grouped.keep_B.any()
    assert torch.allclose(grouped.advantages, plain.advantages, rtol=1e-6, atol=1e-7)
    assert torch.allclose(grouped.kl_penalty_BK, plain.kl_penalty_BK, rtol=1e-6, atol=1e-9)
    if options:
        assert plain.kl_penalty_BK.abs().max() > 0
    assert grad.norm() > 0 and float((grad_grouped - grad).norm() / grad.norm()) < 1e-6


@pytest.mark.parametrize("prefix_sharing", [True, False])
def test_grouped_scores_come_back_in_row_order(prefix_sharing):
    # 5 prompts of 3 to 40 tokens, 3 samples each, micro-batches of 4 rows: grouping changes which rows share a
    # micro-batch, and each row's score is its own (the rows scored one by one)
    g = torch.Generator().manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=32, n_positions=64, vocab_size=300)
    lengths = torch.tensor([3, 40, 12, 40, 7])
    P, G, R = int(lengths.max()), 3, 6
    prompt_mask = torch.arange(P)[None] >= P - lengths[:, None]  # (5, P) left-padded
    prompt_ids = torch.where(prompt_mask, torch.randint(0, 300, (5, P), generator=g), 0)
    response_lengths = torch.randint(1, R + 1, (5 * G,), generator=g)
    response_mask = torch.arange(R)[None] < response_lengths[:, None]  # (N, R)
    response_ids = torch.where(response_mask, torch.randint(0, 300, (5 * G, R), generator=g), 0)
    samples = SampleOutput(response_ids, response_mask, torch.zeros(5 * G, R), response_lengths < R)
    torch.manual_seed(0)
    reward_model = freeze(RewardModel(cfg, "last"))
    plain, grouped, alone = (
        score(reward_model, prompt_ids, prompt_mask, samples, G, micro, prefix_sharing, by_length)
        for micro, by_length in ((4, False), (4, True), (1, False))
    )
    prompt_of_row = torch.arange(5 * G) // G
    assert [c.tolist() for c in micro_batch_rows(prompt_of_row, lengths, 4)] != [
        c.tolist() for c in micro_batch_rows(prompt_of_row, None, 4)
    ]
    assert alone.std() > 0.1  # rows tell apart: a permutation would not pass
    torch.testing.assert_close(grouped, alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grouped, plain, rtol=1e-5, atol=1e-5)
