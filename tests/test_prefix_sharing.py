"""Prefix sharing (grpo --prefix_sharing): each prompt computed and stored once per group gives the numbers of the
unshared layout, where every sample carries its own copy of the prompt (the reference implementation).

fp32 on the CPU, random weights, real TL;DR prompts from ../shared/data (cut at 512 tokens, their real lengths):
log-probs of the same tokens, reward-model scores, reference log-probs, the loss and every parameter gradient
(with and without LoRA), the sampler's tokens and log-probs, all within 1e-5. Also the memory estimates of
rollouts/memory.py against hand-computed numbers and against the caches the sampler allocates."""

from dataclasses import replace

import pytest
import torch

import grpo
import rollouts.models
from data.tldr import PROMPT_COLUMNS, PromptDataset, load_rows, pad_prompts
from data.tokenizer import get_tokenizer
from model.gpt2 import PRESETS, GPT2LMHeadModel, GPTConfig, KVCache, SharedKVCache
from model.heads import RewardModel
from model.lora import apply_lora
from model.sampler import SampleOutput, generate
from model.weights import freeze
from rlhf.policy_gradient import AGGREGATIONS
from rollouts.batches import build_training_batches
from rollouts.memory import GiB, check_memory, kv_cache_bytes, step_memory, update_bytes
from rollouts.sampling import score
from rollouts.update import batch_logprobs, micro_batch_loss
from tests.conftest import shared_file
from utils.config import ConfigError

CFG = GPTConfig(n_layer=2, n_head=2, n_embd=32, n_positions=576)  # GPT-2's vocabulary: real prompt token ids
TOL = 1e-5


@pytest.fixture(scope="module")
def tldr_prompts():
    """Four real TL;DR prompts cut at 512 tokens, left-padded: (ids (4, P), mask (4, P)), of different lengths."""
    rows = load_rows(str(shared_file("tldr-train-sample.jsonl")), "train", PROMPT_COLUMNS)
    prompts = PromptDataset(rows[:4], get_tokenizer(), 512).prompts
    assert len({len(p) for p in prompts}) > 1
    return pad_prompts(prompts)


def random_samples(B: int, G: int, R: int, seed: int = 0) -> SampleOutput:
    """G responses per prompt of ragged lengths 1..R (some without an end token), random token ids."""
    g = torch.Generator().manual_seed(seed)
    N = B * G
    lengths = torch.randint(1, R + 1, (N,), generator=g)
    lengths[0] = R
    mask = torch.arange(R)[None] < lengths[:, None]
    ids = torch.where(mask, torch.randint(0, CFG.vocab_size, (N, R), generator=g), 50256)
    return SampleOutput(ids, mask, -torch.rand(N, R, generator=g) * mask, lengths < R)


def ref_logprobs(batches: list, R: int) -> torch.Tensor:
    """Every micro-batch's reference log-probs (n, R') on the real tokens, 0 elsewhere, padded to (N, R)."""
    return torch.cat(
        [
            torch.nn.functional.pad(
                torch.where(b.response_mask, b.ref_logprobs, 0.0), (0, R - b.response_mask.shape[1])
            )
            for b in batches
        ]
    )


def close(a: torch.Tensor, b: torch.Tensor, rel: bool = False) -> bool:
    scale = b.abs().max().clamp(min=1e-12) if rel else 1.0
    return bool(((a - b).abs().max() / scale) <= TOL)


@pytest.mark.parametrize("pooling", ["last", "sum"])
def test_reward_model_scores_and_response_logprobs_match_the_unshared_rows(tldr_prompts, pooling):
    ids, mask = tldr_prompts
    G, R = 5, 9
    samples = random_samples(ids.shape[0], G, R)
    torch.manual_seed(0)
    reward_model = freeze(RewardModel(CFG, pooling))
    # micro-batches of 7 rows: groups split across micro-batches, prompts of 1 to 2 responses per micro-batch
    shared, unshared = (score(reward_model, ids, mask, samples, G, micro=7, prefix_sharing=s) for s in (True, False))
    assert close(shared, unshared) and unshared.std() > 0
    policy = GPT2LMHeadModel(CFG)
    cfg = grpo.Config(max_new_tokens=R, micro_batch_size=7)
    adv = torch.randn(ids.shape[0] * G)
    rows = torch.arange(ids.shape[0] * G)
    for s in (True, False):
        batches = build_training_batches(ids, mask, samples, rows, adv, G, 7, prefix_sharing=s)
        refs = batch_logprobs(policy, batches, cfg, gather=False)
        batches = [replace(b, ref_logprobs=r) for b, r in zip(batches, refs, strict=True)]
        if s:
            logp_shared = ref_logprobs(batches, R)
            tokens_shared = sum(int(b.attention_mask.sum()) for b in batches)
        else:
            logp = ref_logprobs(batches, R)
            tokens = sum(int(b.attention_mask.sum()) for b in batches)
    assert close(logp_shared, logp) and logp.abs().max() > 1
    assert tokens_shared < tokens / 2  # the prompts, most of each row, computed about once per group


@pytest.mark.parametrize("lora", [False, True])
def test_update_loss_and_every_gradient_match_the_unshared_rows(tldr_prompts, lora):
    ids, mask = tldr_prompts
    G, R, micro = 4, 7, 6  # 6 rows per micro-batch: groups of 4 split across micro-batches
    samples = random_samples(ids.shape[0], G, R, seed=1)
    torch.manual_seed(0)
    policy = GPT2LMHeadModel(CFG)
    reference = freeze(GPT2LMHeadModel(CFG))  # another random model: the KL term is not 0
    cfg = grpo.Config(max_new_tokens=R, micro_batch_size=micro, beta=0.1, temperature=0.9, lora_rank=4 if lora else 0)
    if lora:
        apply_lora(policy, cfg)
        with torch.no_grad():  # B starts at zero: make the adapters change the function
            for name, p in policy.named_parameters():
                if name.endswith("lora_B"):
                    p.normal_(0, 0.1)
    rows = torch.arange(ids.shape[0] * G)
    adv = torch.randn(rows.shape[0], generator=torch.Generator().manual_seed(2))
    results = {}
    for s in (True, False):
        batches = build_training_batches(ids, mask, samples, rows, adv, G, micro, prefix_sharing=s)
        refs = batch_logprobs(reference, batches, cfg, gather=False)
        batches = [replace(b, ref_logprobs=r) for b, r in zip(batches, refs, strict=True)]
        policy.zero_grad(set_to_none=True)
        weights = [AGGREGATIONS[cfg.loss_type](b.response_mask, R) for b in batches]
        normaliser = sum(z for _, z in weights)
        total = 0.0
        for batch, (w, _) in zip(batches, weights, strict=True):
            loss, _, _ = micro_batch_loss(policy, batch, w, cfg.objective(), cfg)
            (loss / normaliser).backward()
            total += float(loss.detach()) / float(normaliser)
        ref = ref_logprobs(batches, R)
        grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.requires_grad}
        results[s] = (total, ref, grads)
    (loss_s, ref_s, grads_s), (loss_u, ref_u, grads_u) = results[True], results[False]
    assert abs(loss_s - loss_u) <= TOL * max(1.0, abs(loss_u)) and loss_u != 0
    assert close(ref_s, ref_u)
    assert sorted(grads_s) == sorted(grads_u) and len(grads_u) == (
        4 * 2 * CFG.n_layer if lora else len(list(policy.parameters()))
    )
    for name, g in grads_u.items():
        assert g.abs().max() > 0, name
        assert close(grads_s[name], g, rel=True), name


def test_generate_with_the_prompt_cache_stored_once_samples_the_same_tokens(tldr_prompts):
    ids, mask = tldr_prompts
    torch.manual_seed(0)
    policy = GPT2LMHeadModel(CFG).eval()
    G, new = 4, 8
    outs = [
        generate(
            policy,
            ids,
            mask,
            G,
            new,
            temperature=0.9,
            top_k=50,
            generator=torch.Generator().manual_seed(3),
            stop_ids=(13,),
            prefix_sharing=s,
        )
        for s in (True, False)
    ]
    assert torch.equal(outs[0].response_ids, outs[1].response_ids)
    assert torch.equal(outs[0].response_mask, outs[1].response_mask) and outs[0].response_mask.sum() > ids.shape[0] * G
    assert close(outs[0].logprobs, outs[1].logprobs)


def test_kv_cache_estimate_is_what_the_sampler_allocates(tldr_prompts):
    ids, mask = tldr_prompts
    B, P = ids.shape
    G, new = 8, 10
    policy = GPT2LMHeadModel(CFG).eval()
    prompt_cache = KVCache(CFG, B, P, "cpu")
    with torch.no_grad():
        policy(ids, (mask.long().cumsum(-1) - 1).clamp(min=0), mask, kv_cache=prompt_cache)
    shared = SharedKVCache(prompt_cache, G, new)
    unshared = KVCache(CFG, B, P + new, "cpu")
    unshared.update(0, *(torch.zeros(B, CFG.n_head, 1, CFG.n_embd // CFG.n_head),) * 2)
    unshared = unshared.repeat_interleave(G)
    assert shared.nbytes() == kv_cache_bytes(CFG, B, G, P, new, 4, prefix_sharing=True)
    assert unshared.k.nbytes + unshared.v.nbytes == kv_cache_bytes(CFG, B, G, P, new, 4, prefix_sharing=False)


def test_memory_estimates_against_hand_numbers():
    # KV cache of one generate call at the defaults (16 prompts x 64 samples, 512 + 53 positions, bf16): GPT-2
    # keeps 2 x 12 layers x 768 x 2 bytes = 36,864 bytes per position
    rows = 16 * 64
    assert kv_cache_bytes(PRESETS["gpt2"], 16, 64, 512, 53, 2, prefix_sharing=False) == rows * 565 * 36_864  # 21.3 GB
    assert (
        kv_cache_bytes(PRESETS["gpt2"], 16, 64, 512, 53, 2, prefix_sharing=True) == (16 * 512 + rows * 53) * 36_864
    )  # 2.3 GB
    assert (
        kv_cache_bytes(PRESETS["gpt2-xl"], 16, 64, 512, 53, 2, prefix_sharing=False) == rows * 565 * 307_200
    )  # 177.7 GB
    # gpt2-xl activations, micro-batch 32 of 565-token rows, bf16, no checkpointing: 34 bytes per token, channel
    # and layer (arXiv 2205.05198) = 48 x 34 x 18,080 x 1,600 = 47.2 GB, plus logits and their gradient
    logits = 32 * 53 * 50257 * (2 + 4)
    assert (
        update_bytes(PRESETS["gpt2-xl"], 32, 32, 512, 53, 2, prefix_sharing=False, checkpointing=False)
        == 48 * 34 * 18_080 * 1600 + logits
    )
    # checkpointing keeps each block's input (2 bytes per token and channel) and one block's activations
    assert update_bytes(PRESETS["gpt2-xl"], 32, 32, 512, 53, 2, prefix_sharing=False, checkpointing=True) == (
        48 * 2 * 18_080 * 1600 + 34 * 18_080 * 1600 + logits
    )


def test_memory_terms_for_frozen_models_gathers_no_sync_gradients_and_math_attention():
    from rollouts.memory import attention_scores_bytes, generate_bytes, no_sync_grad_bytes, param_count, weight_bytes

    gpt2, xl = PRESETS["gpt2"], PRESETS["gpt2-xl"]
    n = param_count(gpt2)
    assert n == 124_439_808  # GPT-2 small, tied head counted once
    # frozen reference and reward model keep fp32 shards (4 bytes per parameter), whatever the compute dtype; the
    # policy 16 (weights, gradients, two AdamW moments); over 2 ranks. Offloaded frozen models cost the device nothing.
    assert weight_bytes(gpt2, gpt2, 2, lora=False) == (16 + 4 + 4) * n // 2
    assert weight_bytes(gpt2, gpt2, 2, lora=False, frozen_offload=True) == 16 * n // 2
    # a frozen copy of the starting policy (--ref_refresh_every with --frontier_prompts): 4 more bytes per parameter
    assert weight_bytes(gpt2, gpt2, 2, lora=False, start_copy=True) == (16 + 4 + 4 + 4) * n // 2
    assert weight_bytes(gpt2, gpt2, 2, lora=False, frozen_offload=True, start_copy=True) == 16 * n // 2
    assert weight_bytes(gpt2, None, 1, lora=True) == 4 * n  # LoRA: the frozen base; the reference is the policy itself
    # generation holds the whole gathered policy (bf16: 2 bytes per parameter) beside the KV cache and logits
    cfg = grpo.Config(max_prompt_len=512)
    est = step_memory(cfg, gpt2, gpt2, 8, 2)
    assert est.generate == 2 * n + generate_bytes(gpt2, 16, 64, 512, 53, 2, prefix_sharing=True)
    # the unsharded fp32 gradients between micro-batches: 256 prompts x 8 kept / 8 ranks / 32 rows = 8 micro-batches
    assert no_sync_grad_bytes(gpt2, 8, lora=False) == 4 * n
    assert no_sync_grad_bytes(gpt2, 1, lora=False) == 0  # one micro-batch reduce-scatters in its own backward
    one_micro = grpo.Config(max_prompt_len=512, prompts_per_step=32, micro_batch_size=32)  # 32 x 8 / 8 ranks = 32 rows
    assert est.update - step_memory(one_micro, gpt2, gpt2, 8, 2).update == 4 * n
    # --deterministic's math attention: two (T, T) tensors per head and layer kept for the backward; gpt2-xl, 8 rows of
    # 512 + 53 tokens, bf16: 2 x 25 heads x 8 x 565^2 x 2 bytes = 255 MB per layer, 12.3 GB over 48 layers
    assert attention_scores_bytes(xl, 8, 8, 512, 53, 2, prefix_sharing=False) == 2 * 25 * 8 * 565 * 565 * 2
    plain = update_bytes(xl, 8, 8, 512, 53, 2, prefix_sharing=False, checkpointing=False)
    math = update_bytes(xl, 8, 8, 512, 53, 2, prefix_sharing=False, checkpointing=False, math_attention=True)
    assert math - plain == 48 * 2 * 25 * 8 * 565 * 565 * 2 == 12_258_240_000
    # shared prefix: 2 prompts of 512 attend to themselves once, 8 responses of 53 to their prompt and themselves
    assert (
        attention_scores_bytes(xl, 8, 2, 512, 53, 2, prefix_sharing=True) == 2 * 25 * (2 * 512 * 512 + 8 * 53 * 565) * 2
    )
    checkpointed = update_bytes(xl, 8, 8, 512, 53, 2, prefix_sharing=False, checkpointing=True, math_attention=True)
    assert (
        checkpointed - update_bytes(xl, 8, 8, 512, 53, 2, prefix_sharing=False, checkpointing=True)
        == 2 * 25 * 8 * 565 * 565 * 2
    )
    deterministic = grpo.Config(max_prompt_len=512, deterministic=True)
    assert (
        step_memory(deterministic, xl, xl, 1, 2).update
        > step_memory(grpo.Config(max_prompt_len=512), xl, xl, 1, 2).update
    )


def test_memory_check_names_the_option_to_lower():
    xl = PRESETS["gpt2-xl"]
    cfg = grpo.Config(max_prompt_len=512, prefix_sharing=False)
    free = 80 * GiB
    with pytest.raises(ConfigError) as info:
        check_memory(cfg, xl, xl, 1, 2, free, "cuda:0")
    # unshared: the gathered policy (2.9 GiB) and the KV cache (166 GiB, 10.4 per prompt) of one generate call, and the
    # activations of 32 rows x 565 tokens (44.4 GiB) plus the unsharded fp32 gradients FSDP2 keeps between the step's
    # 64 micro-batches (5.8 GiB), beside 34.8 GiB of weights (1.56B parameters x 16 bytes for the policy and 4 each for
    # the fp32 reference and reward model) in 90% of 80 GiB
    assert str(info.value) == (
        "not enough device memory, 34.8 GiB of weights and 80.0 GiB is free on cuda:0 (or set --prefix_sharing true); "
        "--gen_prompts 16 needs about 169.2 GiB (KV cache and logits of one generate call): lower --gen_prompts to 2; "
        "--micro_batch_size 32 needs about 50.2 GiB (one training micro-batch: its activations, or the reference's "
        "log-probs): lower --micro_batch_size to 16 or set --activation_checkpointing true"
    )
    est = check_memory(grpo.Config(max_prompt_len=512), xl, xl, 1, 2, free, "cuda:0")  # the defaults fit with sharing
    assert est.peak < 0.9 * free
    big_micro = grpo.Config(max_prompt_len=512, micro_batch_size=256, prefix_sharing=True)
    with pytest.raises(
        ConfigError,
        match=r"; --micro_batch_size 256 needs .* lower --micro_batch_size to \d+ or set "
        r"--activation_checkpointing true$",
    ):
        check_memory(big_micro, xl, xl, 1, 2, free, "cuda:0")
    assert (
        step_memory(big_micro, xl, xl, 1, 2).update > step_memory(big_micro, xl, xl, 1, 2, micro_batch_size=32).update
    )


def test_grpo_stops_before_loading_weights_when_generation_cannot_fit(tmp_path, capsys, monkeypatch):
    # a device with room for the weights, the update and a third of one generate call: one line naming
    # --gen_prompts, before any model is built (free memory is read on GPUs only; here it is stood in for)
    from tests.helpers import run_cli, write_sft_rows

    rows = write_sft_rows(tmp_path / "rows.jsonl", n=8)
    cfg = grpo.Config(
        model="tiny",
        random_init=True,
        rewards="length",
        max_prompt_len=64,
        num_samples=64,
        num_kept=2,
        gen_prompts=8,
        prompts_per_step=8,
        micro_batch_size=2,
    )
    est = step_memory(cfg, PRESETS["tiny"], None, 1, 4)
    assert est.generate // 3 > est.update
    monkeypatch.setattr(
        rollouts.models, "free_device_bytes", lambda device: int((est.weights + est.generate // 3) / 0.9) + 1
    )
    monkeypatch.setattr(grpo, "build_models", lambda *a, **k: pytest.fail("models built after a failed memory check"))
    args = [
        "--model",
        "tiny",
        "--random_init",
        "true",
        "--rewards",
        "length",
        "--train_data",
        str(rows),
        "--val_data",
        "",
        "--pref_data",
        "",
        "--eval_every",
        "-1",
        "--num_samples",
        "64",
        "--num_kept",
        "2",
        "--max_prompt_len",
        "64",
        "--gen_prompts",
        "8",
        "--prompts_per_step",
        "8",
        "--micro_batch_size",
        "2",
        "--steps",
        "1",
        "--wandb_mode",
        "disabled",
        "--out_dir",
        str(tmp_path / "run"),
    ]
    code, message = run_cli(grpo, args, capsys)
    assert code == 2
    assert message.startswith("error: not enough device memory") and "--gen_prompts 8 needs about 432 MiB" in message
    assert "lower --gen_prompts to 2" in message and "--micro_batch_size" not in message  # 8 -> 4 -> 2 (halving)


@pytest.mark.parametrize("pooling", ["last", "sum"])
def test_pair_batches_packed_match_the_padded_rows(tldr_prompts, pooling):
    """evaluation.preference's packed pairs (reward_model.py and dpo.py, --prefix_sharing): each pair's prompt once for
    its chosen and rejected response gives the padded rows' reward scores, response log-probs and gradients."""
    from data.tldr import collate_pairs
    from evaluation.preference import pair_logprobs, reward_scores

    ids, mask = tldr_prompts
    prompts = [row[m].tolist() for row, m in zip(ids, mask, strict=True)]
    g = torch.Generator().manual_seed(1)
    chosen = [torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist() for n in (3, 9, 1, 5)]
    rejected = [torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist() for n in (6, 2, 9, 4)]
    batch = collate_pairs(prompts, chosen, rejected)
    torch.manual_seed(0)
    reward_model, policy = RewardModel(CFG, pooling), GPT2LMHeadModel(CFG)
    out = {}
    for shared in (True, False):
        reward_model.zero_grad()
        r = reward_scores(reward_model, batch, "cpu", shared)
        (r * torch.arange(1.0, 9.0)).sum().backward()
        logp = pair_logprobs(policy, batch, "cpu", shared)
        out[shared] = r.detach(), logp.detach(), reward_model.transformer.h[0].attn.c_attn.weight.grad.clone()
    for a, b in zip(out[True], out[False], strict=True):
        assert close(a, b, rel=True)
    assert out[False][0].std() > 0 and out[False][1].abs().min() > 1 and out[False][2].abs().max() > 0


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")],
        ),
    ],
)
def test_bf16_with_the_default_attention_kernel_matches_fp32_on_left_padded_and_packed_rows(device):
    """The production path: bf16 weights and activations, the attention kernel torch picks (flash or memory-efficient
    on a GPU; not the math kernel --deterministic forces), on left-padded rows and on packed prefix-sharing rows,
    against fp32. The tolerance is set against what a masking error costs: attending to the left padding moves the
    log-probs at least 5x more than bf16 rounding does."""
    from data.tldr import collate_pairs
    from evaluation.preference import pair_logprobs, reward_scores

    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=128, n_positions=256)
    policy, reward_model = GPT2LMHeadModel(cfg), RewardModel(cfg, "last")
    with torch.no_grad():  # sharper attention than GPT-2's init, so that which keys are attended matters
        for m in (policy, reward_model):
            for block in m.modules():
                if hasattr(block, "c_attn"):
                    block.c_attn.weight.mul_(8)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 50000, (n,), generator=g).tolist() for n in (40, 7, 23, 31)]  # left-padded to 40
    chosen = [torch.randint(0, 50000, (n,), generator=g).tolist() for n in (5, 12, 3, 9)]
    rejected = [torch.randint(0, 50000, (n,), generator=g).tolist() for n in (8, 2, 11, 6)]
    batch = collate_pairs(prompts, chosen, rejected)
    policy, reward_model = policy.to(device).eval(), reward_model.to(device).eval()
    with torch.no_grad():
        want_logp = pair_logprobs(policy, batch, device, prefix_sharing=False).float()
        want_score = reward_scores(reward_model, batch, device, prefix_sharing=False).float()
        wrong = dict(batch, attention_mask=torch.ones_like(batch["attention_mask"]))  # attends to the padding
        masking_error = (pair_logprobs(policy, wrong, device, prefix_sharing=False).float() - want_logp).abs().max()
        policy16, reward16 = policy.to(torch.bfloat16), reward_model.to(torch.bfloat16)
        for shared in (False, True):
            logp_error = (pair_logprobs(policy16, batch, device, shared).float() - want_logp).abs().max()
            score_error = (reward_scores(reward16, batch, device, shared).float() - want_score).abs().max()
            assert torch.isfinite(logp_error) and logp_error < masking_error / 5, (shared, logp_error, masking_error)
            assert score_error < 0.02 * want_score.abs().max() + 0.02, (shared, score_error, want_score)


def test_compile_keeps_a_weights_copy_and_the_decode_caches_of_every_bucket_in_the_estimate():
    """--compile's static weights copy, its DecodeBuffers' KV caches and its step graphs' memory pools (one per
    prompt-width bucket up to --max_prompt_len's) stay allocated for the run: the estimate adds them to the weights,
    and nothing else moves."""
    import grpo
    from rollouts.memory import kv_cache_bytes, param_count, step_memory

    gpt2 = PRESETS["gpt2"]
    plain = grpo.Config(max_prompt_len=300, max_new_tokens=50, gen_prompts=4, num_samples=8)
    compiled = grpo.Config(max_prompt_len=300, max_new_tokens=50, gen_prompts=4, num_samples=8, compile=True)
    a, b = step_memory(plain, gpt2, gpt2, 1, 2), step_memory(compiled, gpt2, gpt2, 1, 2)
    widths = (64, 128, 256, 384)  # 300 -> the 384 bucket
    caches = sum(kv_cache_bytes(gpt2, 4, 8, w, 50, 2, True) for w in widths)
    pools = len(widths) * 4 * (4 * 8) * gpt2.vocab_size * 4  # the recorded steps' scratch: 4 (rows, V) fp32 tensors
    assert b.weights - a.weights == param_count(gpt2) * 2 + caches + pools
    assert (a.generate, a.score, a.reference, a.update) == (b.generate, b.score, b.reference, b.update)
