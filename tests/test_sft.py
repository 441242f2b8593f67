"""SFT's objective: response NLL, and the optional prompt term (exact when every prompt token is drawn)."""

import pytest
import torch
import torch.nn.functional as F

from data.tldr import ShardedLoader, collate_sft
from model.gpt2 import GPT2LMHeadModel, GPTConfig
from sft import accumulate_gradients
from training.nll import prompt_targets, response_nll_sum, weighted_nll_sum

CFG = GPTConfig(vocab_size=300, n_layer=2, n_head=2, n_embd=32, n_positions=64)


def batch_and_model():
    torch.manual_seed(0)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [14, 15, 16, 17]]
    responses = [[20, 21, 198], [22, 198], [23, 24, 25, 26]]
    return collate_sft(prompts, responses, pad_id=0, example=[0, 1, 2]), GPT2LMHeadModel(CFG), prompts, responses


def test_logits_at_index_tensor_equal_slice():
    batch, model, _, _ = batch_and_model()
    args = (batch["input_ids"], batch["position_ids"], batch["attention_mask"])
    idx = torch.tensor([[0, 3, 5], [2, 2, 7], [8, 1, 4]])
    full = model(*args)
    assert torch.allclose(model(*args, logits_slice=idx), full.gather(1, idx[..., None].expand(-1, -1, full.shape[-1])))


def test_prompt_weight_zero_is_the_response_nll():
    batch, model, _, _ = batch_and_model()
    assert torch.equal(weighted_nll_sum(model, batch, 0.0, 4, None, "cpu"), response_nll_sum(model, batch, "cpu")[0])


def test_all_prompt_positions_drawn_gives_the_exact_weighted_lm_loss():
    batch, model, prompts, responses = batch_and_model()
    w = 0.3
    got = weighted_nll_sum(model, batch, w, 100, 0, "cpu")
    # independent: each row alone, unpadded, a plain next-token loss
    want = 0.0
    for p, r in zip(prompts, responses, strict=True):
        ids = torch.tensor([p + r])
        logits = model(ids, torch.arange(ids.shape[1])[None])[0, :-1]
        nll = F.cross_entropy(logits, ids[0, 1:], reduction="none")
        want += w * nll[: len(p) - 1].sum() + nll[len(p) - 1 :].sum()
    assert torch.allclose(got, want, atol=1e-4), (got, want)
    assert prompt_targets(batch).sum(1).tolist() == [len(p) - 1 for p in prompts]


def test_drawn_prompt_positions_are_unbiased():
    batch, model, _, _ = batch_and_model()
    exact = weighted_nll_sum(model, batch, 1.0, 100, 0, "cpu").detach()
    draws = torch.stack([weighted_nll_sum(model, batch, 1.0, 2, seed, "cpu").detach() for seed in range(200)])
    assert abs(draws.mean() - exact) < 4 * draws.std() / 200**0.5, (draws.mean(), exact)


@pytest.mark.parametrize("prompt_weight", [0.0, 0.5])
def test_a_step_grouped_by_length_has_the_ungrouped_steps_gradient(prompt_weight):
    # the step's rows dealt out by length over 2 ranks x 4 micro-batches (data.tldr.ShardedLoader with lengths):
    # less padding, and the gradient of the whole step (both ranks' micro-batches, global token count) is the
    # ungrouped one up to float summation order; with a prompt loss too, whose draws follow the rows
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 300, (int(n),), generator=g).tolist() for n in torch.randint(2, 40, (64,), generator=g)]
    responses = [
        torch.randint(0, 300, (int(n),), generator=g).tolist() + [198] for n in torch.randint(0, 9, (64,), generator=g)
    ]
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses, strict=True)]

    def collate(idx):
        return collate_sft([prompts[i] for i in idx], [responses[i] for i in idx], pad_id=0, example=idx)

    grads, computed = [], []
    for by_length in (None, lengths):
        micro = [b for r in range(2) for b in ShardedLoader(64, 4, r, 2, 3, collate, by_length).next_step(4)]
        computed.append(sum(b["input_ids"].numel() for b in micro))
        torch.manual_seed(0)
        model = GPT2LMHeadModel(CFG)
        accumulate_gradients(model, micro, 1, torch.device("cpu"), prompt_weight, 3, draw_seed=7)
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert computed[1] < 0.8 * computed[0]
    assert float((grads[1] - grads[0]).norm() / grads[0].norm()) < 1e-6
    assert not torch.equal(grads[1], grads[0])  # the rows did move between micro-batches
