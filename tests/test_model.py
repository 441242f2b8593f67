"""Our GPT-2 against transformers' on the same random weights; KV cache; export; reward head."""

import pytest
import torch
import transformers

from model.gpt2 import GPT2LMHeadModel, KVCache
from model.heads import RewardModel, last_real_index
from model.weights import ModelLoadError, build_policy, build_reward_model, save_hf


def left_padded_batch(B=3, T=12, vocab=50257, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, :4] = False  # row 0: 4 pads on the left
    mask[1, :1] = False
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    return ids, mask, pos


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=32, n_positions=64, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0
    )
    hf = transformers.GPT2LMHeadModel(cfg)
    with torch.no_grad():  # transformers zero-inits some biases; randomise everything so the test can fail
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    folder = tmp_path_factory.mktemp("hf") / "tiny"
    hf.save_pretrained(folder)
    return folder


def test_logits_match_transformers_on_left_padded_batch(hf_folder):
    hf = transformers.GPT2LMHeadModel.from_pretrained(hf_folder).eval()
    ours = build_policy(str(hf_folder)).eval()
    ids, mask, pos = left_padded_batch()
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask.long(), position_ids=pos).logits
        out = ours(ids, pos, mask)
    assert (ref - out)[mask].abs().max() <= 1e-4
    # the padded row equals the same row computed alone without padding: padding is exact
    with torch.no_grad():
        alone = ours(ids[:1, 4:], pos[:1, 4:], None)
    assert (alone[0] - out[0, 4:]).abs().max() <= 1e-4


def test_kv_cache_decoding_equals_full_forward(hf_folder):
    model = build_policy(str(hf_folder)).eval()
    ids, mask, pos = left_padded_batch()
    cache = KVCache(model.cfg, ids.shape[0], ids.shape[1], "cpu")
    with torch.no_grad():
        full = model(ids, pos, mask)
        steps = [model(ids[:, :7], pos[:, :7], mask[:, :7], kv_cache=cache)]
        for t in range(7, ids.shape[1]):
            steps.append(model(ids[:, t : t + 1], pos[:, t : t + 1], mask[:, t : t + 1], kv_cache=cache))
    assert (torch.cat(steps, 1) - full)[mask].abs().max() <= 1e-5


def test_kv_cache_repeat_interleave_shares_one_prefill(hf_folder):
    model = build_policy(str(hf_folder)).eval()
    ids, mask, pos = left_padded_batch(B=2)
    cache = KVCache(model.cfg, 2, 16, "cpu")
    with torch.no_grad():
        model(ids, pos, mask, kv_cache=cache)
        big = cache.repeat_interleave(3)
        nxt = torch.tensor([[5], [5], [5], [7], [7], [7]])
        npos = pos[:, -1:].repeat_interleave(3, 0) + 1
        shared = model(nxt, npos, None, kv_cache=big)
        full = model(
            torch.cat([ids.repeat_interleave(3, 0), nxt], 1),
            torch.cat([pos.repeat_interleave(3, 0), npos], 1),
            torch.cat([mask.repeat_interleave(3, 0), torch.ones(6, 1, dtype=torch.bool)], 1),
        )
    assert (shared[:, -1] - full[:, -1]).abs().max() <= 1e-5


def test_export_reloads_in_transformers(tmp_path, tiny_cfg):
    torch.manual_seed(1)
    ours = GPT2LMHeadModel(tiny_cfg).eval()
    save_hf(ours.state_dict(), tiny_cfg, tmp_path / "export")
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "export").eval()
    ids, mask, pos = left_padded_batch()
    with torch.no_grad():
        diff = hf(input_ids=ids, attention_mask=mask.long(), position_ids=pos).logits - ours(ids, pos, mask)
    assert diff[mask].abs().max() <= 1e-4
    # and back into our model
    again = build_policy(str(tmp_path / "export")).eval()
    with torch.no_grad():
        assert torch.equal(again(ids, pos, mask), ours(ids, pos, mask))


def test_logits_slice_equals_full_logits(tiny_cfg):
    model = GPT2LMHeadModel(tiny_cfg).eval()
    ids, mask, pos = left_padded_batch()
    with torch.no_grad():
        assert torch.allclose(model(ids, pos, mask, logits_slice=slice(5, 9)), model(ids, pos, mask)[:, 5:9])


def test_weights_tied_and_gpt2_init(tiny_cfg):
    model = GPT2LMHeadModel(tiny_cfg)
    assert model.lm_head.weight is model.transformer.wte.weight
    std = model.transformer.h[0].attn.c_proj.weight.std().item()
    assert abs(std - 0.02 / (2 * tiny_cfg.n_layer) ** 0.5) < 0.003
    assert abs(model.transformer.h[0].mlp.c_fc.weight.std().item() - 0.02) < 0.003


def test_reward_read_at_last_real_token_whatever_the_padding(tiny_cfg):
    torch.manual_seed(0)
    rm = RewardModel(tiny_cfg).eval()
    seq = torch.randint(0, 1000, (1, 6))
    pos = torch.arange(6)[None]
    with torch.no_grad():
        r_alone = rm(seq, pos, torch.ones(1, 6, dtype=torch.bool))
        # the same sequence with 3 pads on the left and 2 on the right (pad ids are arbitrary junk)
        padded = torch.cat([torch.full((1, 3), 50256), seq, torch.tensor([[11, 12]])], 1)
        mask = torch.tensor([[False] * 3 + [True] * 6 + [False] * 2])
        ppos = (mask.long().cumsum(-1) - 1).clamp(min=0)
        r_padded = rm(padded, ppos, mask)
    assert torch.allclose(r_alone, r_padded, atol=1e-5)
    assert last_real_index(mask).item() == 8


def test_reward_model_export_loads_in_transformers(tmp_path, tiny_cfg):
    torch.manual_seed(0)
    rm = RewardModel(tiny_cfg).eval()
    rm.gain.fill_(2.0)
    rm.bias.fill_(-0.5)
    save_hf(rm.state_dict(), tiny_cfg, tmp_path / "rm")
    hf = transformers.GPT2ForSequenceClassification.from_pretrained(tmp_path / "rm").eval()
    ids = torch.randint(0, 1000, (2, 7))
    pos = torch.arange(7)[None].expand(2, 7)
    with torch.no_grad():
        ours = rm(ids, pos, torch.ones(2, 7, dtype=torch.bool))
        theirs = hf(input_ids=ids).logits[:, 0]
    assert torch.allclose(ours, theirs, atol=1e-4)
    back = build_reward_model(str(tmp_path / "rm"))
    assert back.gain.item() == 2.0 and back.bias.item() == -0.5


def test_summed_reward_is_the_head_summed_over_the_response_whatever_the_padding(tiny_cfg):
    torch.manual_seed(0)
    rm = RewardModel(tiny_cfg, "sum").eval()
    prompt, response = torch.randint(0, 1000, (1, 5)), torch.randint(0, 1000, (1, 3))
    seq = torch.cat([prompt, response], 1)
    with torch.no_grad():
        h = rm.transformer(seq, torch.arange(8)[None], torch.ones(1, 8, dtype=torch.bool))
        expected = (h[0, 5:] @ rm.score.weight[0]).sum()  # by hand: the head at the 3 response tokens, summed
        # 2 pads left of the prompt, 2 right of the response (junk ids): prompt columns 0..6, response from 7
        padded = torch.cat([torch.full((1, 2), 50256), prompt, response, torch.tensor([[11, 12]])], 1)
        mask = torch.tensor([[False] * 2 + [True] * 8 + [False] * 2])
        ppos = (mask.long().cumsum(-1) - 1).clamp(min=0)
        r_padded = rm(padded, ppos, mask, prompt_len=7)
        r_last = RewardModel(tiny_cfg, "last").eval()
        r_last.load_state_dict(rm.state_dict())
        last = r_last(padded, ppos, mask)
    assert torch.allclose(r_padded, expected[None], atol=1e-5)
    assert not torch.allclose(last, r_padded, atol=1e-3)  # the same weights read another way
    with pytest.raises(ValueError, match="prompt_len"):
        rm(padded, ppos, mask)


def test_reward_pooling_travels_with_the_export_and_a_mismatch_is_refused(tmp_path, tiny_cfg):
    torch.manual_seed(0)
    rm = RewardModel(tiny_cfg, "sum").eval()
    save_hf(rm.state_dict(), tiny_cfg, tmp_path / "rm", reward_pooling="sum")
    back = build_reward_model(str(tmp_path / "rm"))
    assert back.pooling == "sum" and build_reward_model(str(tmp_path / "rm"), pooling="sum").pooling == "sum"
    ids, pos = torch.randint(0, 1000, (2, 7)), torch.arange(7)[None].expand(2, 7)
    with torch.no_grad():
        assert torch.equal(
            back(ids, pos, torch.ones(2, 7, dtype=torch.bool), prompt_len=4),
            rm(ids, pos, torch.ones(2, 7, dtype=torch.bool), prompt_len=4),
        )
    with pytest.raises(ModelLoadError, match="pooling 'sum', not 'last'"):
        build_reward_model(str(tmp_path / "rm"), pooling="last")
    with pytest.raises(ModelLoadError, match="must be one of last, sum"):
        build_reward_model(str(tmp_path / "rm"), pooling="mean")
    save_hf(RewardModel(tiny_cfg).state_dict(), tiny_cfg, tmp_path / "rm_last")  # a last-token head: "last"
    assert build_reward_model(str(tmp_path / "rm_last")).pooling == "last"
    save_hf(GPT2LMHeadModel(tiny_cfg).state_dict(), tiny_cfg, tmp_path / "policy")  # a new head reads either way
    assert build_reward_model(str(tmp_path / "policy"), pooling="sum", new_head=True).pooling == "sum"
    assert build_reward_model(str(tmp_path / "policy"), new_head=True).pooling == "last"
    with pytest.raises(ModelLoadError, match="is a policy .*, not a reward model: its scalar head would be random"):
        build_reward_model(str(tmp_path / "policy"))  # a judge, a scorer: never a random head


def test_clear_errors_for_missing_models(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        build_policy(str(tmp_path / "nope" / "model"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="config.json"):
        build_policy(str(tmp_path / "empty"))
    with pytest.raises(ModelLoadError, match="preset"):
        build_policy("not-a-preset", random_init=True)
