"""The sampler: exact left padding, one prefill per group, stopping, and log-probs that match training."""

import math

import pytest
import torch

from model.gpt2 import GPT2LMHeadModel, GPTConfig
from model.sampler import (
    END_ID,
    PAD_ID,
    generate,
    process_logits,
    processed_logprobs,
    sample_tokens,
)

CFG = GPTConfig(vocab_size=512, n_layer=2, n_head=2, n_embd=32, n_positions=128)


def model_and_prompts(seed=0):
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(CFG).eval()
    with torch.no_grad():  # make "\n" likely (logit about 2 above the rest) so some rows stop early
        v = torch.nn.functional.normalize(torch.randn(CFG.n_embd), dim=0)
        model.transformer.ln_f.bias.copy_(v)
        model.transformer.wte.weight[END_ID] = 2.0 * v
    prompts = [[10, 20, 30, 40, 50], [7, 8], [300, 301, 302]]
    P = max(map(len, prompts))
    ids = torch.tensor([[0] * (P - len(p)) + p for p in prompts])  # pad id inside the small vocabulary
    mask = torch.tensor([[False] * (P - len(p)) + [True] * len(p) for p in prompts])
    return model, prompts, ids, mask


def lora_model_and_prompts():
    from model.lora import LoRAConfig, apply_lora

    model, prompts, ids, mask = model_and_prompts()
    apply_lora(model, LoRAConfig(lora_rank=2, lora_alpha=4.0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    return model.eval(), ids, mask


def training_logprobs(model, prompt, response, **proc):
    """Log-probs of `response` after `prompt` from one full forward pass, no padding, no cache."""
    ids = torch.tensor([prompt + response])
    pos = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        logits = model(ids, pos, None, logits_slice=slice(len(prompt) - 1, ids.shape[1] - 1))
    return processed_logprobs(logits, torch.tensor([response]), **proc)[0]


def test_greedy_left_padded_batch_equals_each_prompt_alone():
    model, prompts, ids, mask = model_and_prompts()
    batch = generate(model, ids, mask, num_samples=1, max_new_tokens=8, temperature=0)
    for i, p in enumerate(prompts):
        alone = generate(model, torch.tensor([p]), torch.ones(1, len(p), dtype=torch.bool), 1, 8, temperature=0)
        assert torch.equal(batch.response_ids[i], alone.response_ids[0])


def test_sampler_logprobs_equal_training_forward_logprobs():
    model, prompts, ids, mask = model_and_prompts()
    for proc in [dict(temperature=1.0), dict(temperature=0.7, top_k=50), dict(temperature=1.3, top_p=0.9)]:
        g = torch.Generator().manual_seed(1)
        out = generate(model, ids, mask, num_samples=4, max_new_tokens=10, generator=g, **proc)
        for n in range(out.response_ids.shape[0]):
            m = out.response_mask[n]
            resp = out.response_ids[n][m].tolist()
            ref = training_logprobs(model, prompts[n // 4], resp, **proc)
            assert torch.allclose(out.logprobs[n][m], ref, atol=1e-4), (proc, n)
            assert torch.isfinite(ref).all()
            assert (out.logprobs[n][~m] == 0).all()


def test_stops_at_end_token_and_pads_after_it():
    model, prompts, ids, mask = model_and_prompts()
    out = generate(model, ids, mask, num_samples=8, max_new_tokens=12, generator=torch.Generator().manual_seed(0))
    assert out.has_end.any() and (~out.has_end).any()  # the test sees both kinds of rows
    for row, m, ended in zip(out.response_ids, out.response_mask, out.has_end, strict=True):
        stops = row == END_ID
        n_real = int(m.sum())
        assert m[:n_real].all() and not m[n_real:].any()  # mask is a prefix
        if ended:
            assert stops[n_real - 1] and not stops[: n_real - 1].any()  # the first end token is the last real one
        else:
            assert n_real == 12 and not stops.any()
        assert (row[n_real:] == PAD_ID).all()


def reference_generate(model, ids, mask, G, max_new, generator, temperature=1.0):
    """Sampling without a cache and with every row through the head at every step: each step runs the whole
    left-padded sequence so far; finished rows keep drawing (and ignore) their uniform, as generate() does."""
    ids, mask = ids.repeat_interleave(G, 0), mask.repeat_interleave(G, 0)
    N = ids.shape[0]
    tokens = torch.full((N, max_new), PAD_ID)
    logprobs = torch.zeros(N, max_new)
    done = torch.zeros(N, dtype=torch.bool)
    for t in range(max_new):
        pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            logits = model(ids, pos, mask, logits_slice=slice(-1, None))[:, -1]
        z = process_logits(logits, temperature, 0, 1.0)
        logp = z.log_softmax(-1)
        tok = sample_tokens(z.softmax(-1), generator)
        tokens[:, t] = torch.where(done, PAD_ID, tok)
        logprobs[:, t] = torch.where(done, 0.0, logp.gather(-1, tok[:, None]).squeeze(-1))
        done = done | (tok == END_ID)
        if done.all():
            break
        ids, mask = torch.cat([ids, tok[:, None]], 1), torch.cat([mask, torch.ones(N, 1, dtype=torch.bool)], 1)
    return tokens, logprobs


def test_head_on_unfinished_rows_only_equals_every_row_through_the_head():
    """generate() runs the head, softmax and draw only on the rows unfinished at its last check (every token on a
    CPU, every few on a GPU); the tokens, mask and log-probs are those of the plain loop over every row."""
    model, prompts, ids, mask = model_and_prompts()
    ref_tokens, ref_logprobs = reference_generate(model, ids, mask, 8, 12, torch.Generator().manual_seed(3))
    ended = (ref_tokens == END_ID).any(1)
    assert ended.any() and (~ended).any()  # rows finish at different steps
    for check_every in (1, 3):
        out = generate(
            model, ids, mask, 8, 12, generator=torch.Generator().manual_seed(3), done_check_every=check_every
        )
        assert torch.equal(out.response_ids, ref_tokens[:, : out.response_ids.shape[1]]), check_every
        assert torch.equal(out.response_mask, out.response_ids != PAD_ID)
        assert torch.allclose(out.logprobs, ref_logprobs[:, : out.logprobs.shape[1]], atol=1e-5)


def test_prompt_prefilled_once_per_group():
    model, prompts, ids, mask = model_and_prompts()
    widths = []
    hook = model.transformer.register_forward_hook(lambda mod, args, out: widths.append(tuple(args[0].shape)))
    generate(model, ids, mask, num_samples=16, max_new_tokens=4, generator=torch.Generator().manual_seed(0))
    hook.remove()
    assert widths[0] == (3, ids.shape[1])  # one prefill over the 3 prompts, not 48
    assert all(w == (48, 1) for w in widths[1:])


def test_top_k_and_top_p_filters_by_hand():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = torch.isfinite(process_logits(logits, top_k=2))
    assert kept.tolist() == [[True, True, False, False]]
    # top_p 0.8: 0.5 then 0.5+0.3=0.8 reaches it, so the third token (mass above it 0.8 >= 0.8) is dropped
    kept = torch.isfinite(process_logits(logits, top_p=0.8))
    assert kept.tolist() == [[True, True, False, False]]
    kept = torch.isfinite(process_logits(logits, top_p=0.85))
    assert kept.tolist() == [[True, True, True, False]]
    lp = processed_logprobs(logits[None], torch.tensor([[1]]), temperature=1.0, top_p=0.8)
    assert math.isclose(lp.item(), math.log(0.3 / 0.8), rel_tol=1e-5)
    lp = processed_logprobs(logits[None], torch.tensor([[0]]), temperature=2.0)
    p = torch.tensor([0.5, 0.3, 0.15, 0.05]) ** 0.5
    assert math.isclose(lp.item(), math.log(p[0] / p.sum()), rel_tol=1e-5)


def test_top_k_one_is_greedy():
    model, prompts, ids, mask = model_and_prompts()
    greedy = generate(model, ids, mask, 1, 8, temperature=0)
    topk1 = generate(model, ids, mask, 1, 8, temperature=1.0, top_k=1, generator=torch.Generator().manual_seed(3))
    assert torch.equal(greedy.response_ids, topk1.response_ids)


def test_sample_tokens_matches_the_distribution_and_never_draws_zero_probability():
    # V = 1000 is not a multiple of the block, so the short last block is exercised; a third of the tokens
    # have probability 0 (as outside top-k / top-p), and the others span six orders of magnitude.
    g = torch.Generator().manual_seed(0)
    V, N = 1000, 200_000
    logits = torch.randn(V, generator=g) * 3
    logits[torch.randperm(V, generator=g)[: V // 3]] = float("-inf")
    logp = logits.log_softmax(-1)
    tok = sample_tokens(logp.exp().expand(N, V), torch.Generator().manual_seed(1), block=64)  # a view: no copy
    counts = torch.bincount(tok, minlength=V).double()
    assert counts[logits == float("-inf")].sum() == 0
    expected = logp.exp().double() * N
    # Pearson chi-square over tokens expected at least 5 times, against its mean (= dof) + 5 sd
    big = expected >= 5
    chi2 = ((counts[big] - expected[big]) ** 2 / expected[big]).sum()
    dof = int(big.sum()) - 1
    assert chi2 < dof + 5 * math.sqrt(2 * dof), (chi2, dof)
    # rows are independent: a batch of different distributions, each a point mass on its own token
    point = torch.full((5, V), float("-inf"))
    point[torch.arange(5), torch.tensor([0, 63, 64, 999, 500])] = 0.0
    assert sample_tokens(point.exp(), g, block=64).tolist() == [0, 63, 64, 999, 500]


def test_sample_tokens_is_deterministic_given_the_generator():
    probs = torch.randn(8, 300).softmax(-1)
    a = sample_tokens(probs, torch.Generator().manual_seed(3))
    b = sample_tokens(probs, torch.Generator().manual_seed(3))
    assert torch.equal(a, b)


def test_sample_tokens_reads_views_unnormalised_mass_and_the_short_last_block():
    """The draw reads the probabilities where they lie: a strided view draws as its contiguous copy, mass scaled by
    a power of two (exact in floating point) draws the same tokens, and V = 300 leaves the last 256-token block 44
    tokens long: a row with all its mass on the vocabulary's last token draws it, even at u close to 1."""
    V = 300
    g = torch.Generator().manual_seed(5)
    probs = torch.randn(6, 2 * V, generator=g).softmax(-1)[:, ::2]  # (6, V), every other column: not contiguous
    u = torch.rand(6, 1, generator=g, dtype=torch.float64)
    drawn = sample_tokens(probs, uniforms=u)
    assert torch.equal(drawn, sample_tokens(probs.contiguous(), uniforms=u))
    assert torch.equal(drawn, sample_tokens(probs * 8, uniforms=u))
    last = torch.zeros(1, V)
    last[0, -1] = 1.0
    assert sample_tokens(last, uniforms=torch.tensor([[0.999999]], dtype=torch.float64)).item() == V - 1
    assert sample_tokens(last, uniforms=torch.tensor([[0.0]], dtype=torch.float64)).item() == V - 1


def compiled_equals_eager(model, ids, mask, prefix_sharing: bool):
    """generate(compile=True) against eager on the same draws: tokens and mask identical, log-probs within 1e-5;
    rows finish at different steps, so the head's row buckets change. A second call compiles nothing new."""
    from torch._dynamo.utils import counters

    kw = dict(num_samples=4, max_new_tokens=10, temperature=0.9, prefix_sharing=prefix_sharing)
    device = ids.device
    eager = generate(model, ids, mask, generator=torch.Generator(device).manual_seed(3), **kw)
    ended = (eager.response_ids == END_ID).any(1)
    assert ended.any() and (~ended).any() and len(set(eager.response_mask.sum(1).tolist())) > 2
    compiled = generate(model, ids, mask, generator=torch.Generator(device).manual_seed(3), compile=True, **kw)
    graphs = counters["stats"]["unique_graphs"]
    again = generate(model, ids, mask, generator=torch.Generator(device).manual_seed(3), compile=True, **kw)
    assert counters["stats"]["unique_graphs"] == graphs  # compiled once per run, not once per call
    for out in (compiled, again):
        assert torch.equal(out.response_ids, eager.response_ids) and torch.equal(out.response_mask, eager.response_mask)
        assert torch.equal(out.has_end, eager.has_end)
        assert (out.logprobs - eager.logprobs).abs().max() <= 1e-5


def test_compiled_decode_step_with_a_shared_prefix_and_lora_equals_eager():
    """--compile (inductor on CPU) on the default path: the prompt's cache stored once per group, a LoRA policy
    (adapters with non-zero B, so they change the logits)."""
    model, ids, mask = lora_model_and_prompts()
    compiled_equals_eager(model, ids, mask, prefix_sharing=True)


@pytest.mark.slow
def test_compiled_decode_step_without_prefix_sharing_equals_eager():
    model, prompts, ids, mask = model_and_prompts()
    compiled_equals_eager(model, ids, mask, prefix_sharing=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_compiled_decode_step_with_cuda_graphs_equals_eager():
    """--compile on CUDA (each step and its draw recorded as a CUDA graph, StepGraph, over a cache written in place),
    fp32, both layouts."""
    model, prompts, ids, mask = model_and_prompts()
    model, ids, mask = model.cuda(), ids.cuda(), mask.cuda()
    for share in (True, False):
        compiled_equals_eager(model, ids, mask, prefix_sharing=share)


@pytest.mark.slow
def test_compiled_decode_captures_each_shape_once_under_fsdp2(tmp_path):
    """sample_responses(compile=True) on an FSDP2 policy over 2 gloo processes, called with prompt batches of nine
    widths (two width buckets) and two chunk sizes: a call compiles a graph only when it brings a decode shape not
    seen before, and every call of a shape reads and writes the same buffers (the addresses a CUDA graph replays);
    tokens as the eager sampler's (tests/scripts/compiled_decode.py)."""
    from tests.conftest import run_script

    out = tmp_path / "records.pt"
    run_script(["tests/scripts/compiled_decode.py", str(out)], nproc=2)
    records = torch.load(out)
    seen, graphs = {}, 0
    for r in records:
        assert r["same_tokens"] and r["logprob_gap"] <= 1e-5
        new_shapes = set(r["buffers"]) - set(seen)
        assert (r["graphs"] > graphs) == bool(new_shapes), (r["graphs"], graphs, new_shapes)  # none after warm-up
        assert r["weights"] == records[0]["weights"]  # static_weights: the same copy of the weights at every call
        for key, addresses in r["buffers"].items():
            assert seen.setdefault(key, addresses) == addresses, key  # the same tensors at every call
        graphs = r["graphs"]
    assert records[len(records) // 2 - 1]["graphs"] == records[-1]["graphs"]  # the second pass compiles nothing
    widths = {key[4] for key in seen}
    assert widths == {64, 128} and len(seen) == 4  # 9 widths -> 2 buckets, x 2 chunk sizes


def test_static_weights_swap_in_one_kept_copy_and_give_the_parameters_back():
    """Inside static_weights the model computes with a copy of its parameters (tied ones tied), the same objects at
    every entry, refreshed from the parameters' present values; at exit the parameters are the model's again."""
    from model.sampler import static_weights

    model = GPT2LMHeadModel(GPTConfig(vocab_size=300, n_layer=1, n_head=2, n_embd=16, n_positions=32))
    params = dict(model.named_parameters())
    ids, pos = torch.randint(0, 300, (2, 5)), torch.arange(5).expand(2, 5)
    expected = model(ids, pos)
    kept = []
    for _ in range(2):
        with static_weights(model):
            inside = dict(model.named_parameters())
            assert inside.keys() == params.keys() and all(inside[k] is not params[k] for k in params)
            assert model.lm_head.weight is model.transformer.wte.weight
            assert all(torch.equal(inside[k], params[k]) for k in params)
            torch.testing.assert_close(model(ids, pos), expected)
            kept.append([p.data_ptr() for p in inside.values()])
        assert all(p is params[k] for k, p in model.named_parameters())
        with torch.no_grad():
            model.transformer.wte.weight.mul_(2.0)  # the next entry must see the new values
        expected = model(ids, pos)
    assert kept[0] == kept[1]


@pytest.mark.parametrize("one_softmax", [False, True])
def test_graphed_decode_equals_eager_and_records_each_head_bucket_once(monkeypatch, one_softmax):
    """generate(compile=True, cuda_graphs=True) on a CPU runs StepGraph's emulated contract (each step replayed into
    the outputs of its first run, reading only DecodeBuffers and static_weights), so everything a CUDA graph of the
    step relies on is checked here: the same tokens, masks and log-probs as eager, both layouts, a LoRA policy, rows
    finishing at different steps (several head buckets); a second call records nothing. one_softmax: the GPU's
    attention (one_softmax_decode_attention) and padded head on the CPU, eager and graphed alike."""
    import model.gpt2 as gpt2
    import model.sampler as sampler

    if one_softmax:
        monkeypatch.setattr(gpt2, "ONE_SOFTMAX_DEVICES", ("cpu",))
        monkeypatch.setattr(sampler, "PADDED_HEAD_DEVICES", ("cpu",))
    model, ids, mask = lora_model_and_prompts()
    for share in (True, False):
        kw = dict(num_samples=4, max_new_tokens=30, temperature=0.9, prefix_sharing=share)
        eager = generate(model, ids, mask, generator=torch.Generator().manual_seed(3), **kw)
        graphed_kw = dict(compile=True, cuda_graphs=True, **kw)
        buffers = sampler.decode_buffers(model, 3, 64, 4, 30, share, ids.device)  # the call's (kept per process)
        before = buffers.recorded
        graphed = generate(model, ids, mask, generator=torch.Generator().manual_seed(3), **graphed_kw)
        recorded = buffers.recorded - before
        assert recorded >= 3 and len(buffers.graphs) == recorded  # rows finished in steps: several head buckets
        again = generate(model, ids, mask, generator=torch.Generator().manual_seed(3), **graphed_kw)
        assert buffers.recorded - before == recorded
        for out in (graphed, again):
            assert torch.equal(out.response_ids, eager.response_ids)
            assert torch.equal(out.response_mask, eager.response_mask) and torch.equal(out.has_end, eager.has_end)
            assert (out.logprobs - eager.logprobs).abs().max() <= 1e-5
    if one_softmax:  # against the default path's tokens
        monkeypatch.setattr(gpt2, "ONE_SOFTMAX_DEVICES", ())
        monkeypatch.setattr(sampler, "PADDED_HEAD_DEVICES", ())
        reference = generate(model, ids, mask, generator=torch.Generator().manual_seed(3), **kw)
        assert torch.equal(reference.response_ids, eager.response_ids)
        assert (reference.logprobs - eager.logprobs).abs().max() <= 1e-5


def test_graphed_decode_records_again_when_its_inputs_move():
    """A StepGraph holds the addresses of the weights and caches and the sampling options as constants: another
    temperature records graphs of its own beside the first ones, another model of the same shape drops them all
    (with their memory pool) and records again; the same call again records nothing."""
    import model.sampler as sampler

    model, prompts, ids, mask = model_and_prompts()
    kw = dict(num_samples=2, max_new_tokens=4, compile=True, cuda_graphs=True, stop_ids=())
    generate(model, ids, mask, generator=torch.Generator().manual_seed(0), **kw)
    buffers = sampler.decode_buffers(model, 3, 64, 2, 4, True, ids.device)
    first = buffers.recorded
    generate(model, ids, mask, generator=torch.Generator().manual_seed(0), **kw)
    assert buffers.recorded == first
    pool = buffers.pool = object()  # stands for a GPU's memory pool
    generate(model, ids, mask, generator=torch.Generator().manual_seed(0), temperature=0.5, **kw)
    assert buffers.recorded == first + 1 and buffers.pool is pool and len(buffers.graphs) == 2
    generate(model, ids, mask, generator=torch.Generator().manual_seed(0), **kw)  # temperature 1's graph again
    assert buffers.recorded == first + 1
    other, *_ = model_and_prompts(seed=1)
    out = generate(other, ids, mask, generator=torch.Generator().manual_seed(0), temperature=0.5, **kw)
    assert buffers.recorded == first + 2 and len(buffers.graphs) == 1
    assert buffers.pool is None  # dropped with its graphs: a pool whose graphs are gone cannot record again
    eager = generate(
        other,
        ids,
        mask,
        generator=torch.Generator().manual_seed(0),
        temperature=0.5,
        stop_ids=(),
        num_samples=2,
        max_new_tokens=4,
    )
    assert torch.equal(out.response_ids, eager.response_ids)


@pytest.mark.parametrize("hs", [16, 24])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_softmax_decode_attention_equals_attention_over_each_rows_own_copy_of_its_prompt(hs, dtype):
    """The GPU's shared-prefix decode attention against SDPA over every row's prompt keys copied beside its own
    keys, with left padding in the prompts and a causal mask over T = 2 new tokens; head size 16 scales q exactly,
    24 scales the scores."""
    from model.gpt2 import decode_key_mask, one_softmax_decode_attention

    torch.manual_seed(0)
    B, nh, G, T, P, L = 2, 3, 4, 2, 7, 5
    q, own_k, own_v = (torch.randn(B, nh, G, n, hs, dtype=dtype) for n in (T, L, L))
    prompt_k, prompt_v = (torch.randn(B, nh, P, hs, dtype=dtype) for _ in range(2))
    prompt_valid = torch.ones(B, P, dtype=torch.bool)
    prompt_valid[1, :3] = False
    own_hidden = torch.arange(L)[None, :] > torch.arange(L - T, L)[:, None]  # (T, L) causal
    hidden = decode_key_mask(~prompt_valid[:, None, None, :], own_hidden, T, L)
    got = one_softmax_decode_attention(q, prompt_k, prompt_v, own_k, own_v, hidden)
    keys = torch.cat([prompt_k[:, :, None].expand(B, nh, G, P, hs), own_k], dim=3).float()
    values = torch.cat([prompt_v[:, :, None].expand(B, nh, G, P, hs), own_v], dim=3).float()
    visible = ~hidden[:, :, :, None].expand(B, 1, G, 1, T, P + L)[:, :, :, 0]  # (B, 1, G, T, P + L)
    want = torch.nn.functional.scaled_dot_product_attention(q.float(), keys, values, attn_mask=visible)
    assert got.dtype == dtype and got.shape == (B, nh, G, T, hs)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


def test_static_weights_turn_forward_hooks_off_and_back_on():
    """Inside static_weights no forward hook runs (FSDP2's unit hooks would run inside a recorded step); after it
    they run again."""
    from model.sampler import static_weights

    model = GPT2LMHeadModel(GPTConfig(vocab_size=300, n_layer=1, n_head=2, n_embd=16, n_positions=32))
    calls = []
    model.register_forward_pre_hook(lambda m, args: calls.append("pre"))
    model.transformer.h[0].register_forward_hook(lambda m, args, out: calls.append("post"))
    ids, pos = torch.randint(0, 300, (2, 5)), torch.arange(5).expand(2, 5)
    with static_weights(model):
        model(ids, pos)
    assert calls == []
    model(ids, pos)
    assert calls == ["pre", "post"]
