"""SFT's objective: response NLL, and the optional prompt term (exact when every prompt token is drawn)."""

import torch
import torch.nn.functional as F

from data.tldr import collate_sft
from model.gpt2 import GPT2LMHeadModel, GPTConfig
from sft import prompt_targets, response_nll_sum, weighted_nll_sum

CFG = GPTConfig(vocab_size=300, n_layer=2, n_head=2, n_embd=32, n_positions=64)


def batch_and_model():
    torch.manual_seed(0)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [14, 15, 16, 17]]
    responses = [[20, 21, 198], [22, 198], [23, 24, 25, 26]]
    return collate_sft(prompts, responses, pad_id=0), GPT2LMHeadModel(CFG), prompts, responses


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
    got = weighted_nll_sum(model, batch, w, 100, torch.Generator().manual_seed(0), "cpu")
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
    exact = weighted_nll_sum(model, batch, 1.0, 100, None, "cpu").detach()
    g = torch.Generator().manual_seed(1)
    draws = torch.stack([weighted_nll_sum(model, batch, 1.0, 2, g, "cpu").detach() for _ in range(200)])
    assert abs(draws.mean() - exact) < 4 * draws.std() / 200**0.5, (draws.mean(), exact)
