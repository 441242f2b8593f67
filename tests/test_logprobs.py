"""rlhf/logprobs.py: the chunked log-probs and entropy equal the unchunked functions they replace (model/sampler.py's
processed_logprobs, rlhf/policy_gradient.py's token_entropy of the processed logits) in value and gradient, for
temperature, top-k, top-p, padded rows and targets outside the top-k / top-p set; nothing of size (positions x V) is
saved for the backward; the processing is the sampler's, bit for bit."""

import math

import pytest
import torch

from model import sampler
from rlhf import logprobs
from rlhf.logprobs import linear_processed_logprobs, processed_logprobs
from rlhf.policy_gradient import LOGPROB_FLOOR, token_entropy

SETTINGS = [
    {},
    {"temperature": 0.7},
    {"temperature": 1.6},
    {"top_k": 20},
    {"top_p": 0.8},
    {"temperature": 0.8, "top_k": 50, "top_p": 0.9},
]


def logits_targets_mask(n=3, R=7, V=500, seed=0):
    """Peaked logits (n, R, V); targets mostly among each row's 5 likeliest tokens (inside any top-k / top-p set),
    some anywhere (often outside); the last row padded after 4 tokens, its padding targets a fixed id."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, R, V, generator=g) * 3
    top5 = torch.topk(logits, 5, dim=-1).indices  # (n, R, 5)
    pick = top5.gather(-1, torch.randint(5, (n, R, 1), generator=g)).squeeze(-1)
    targets = torch.where(torch.rand(n, R, generator=g) < 0.7, pick, torch.randint(V, (n, R), generator=g))
    mask = torch.ones(n, R, dtype=torch.bool)
    mask[-1, 4:] = False
    targets[-1, 4:] = V - 1
    return logits, targets, mask


def objective(logp, entropy, mask, g_logp, g_entropy):
    """A weighted sum as the GRPO loss forms it: masked tokens replaced by 0, out-of-set log-probs floored."""
    kept = torch.where(mask, logp, 0.0).clamp(min=LOGPROB_FLOOR)
    return (g_logp * kept).sum() + (g_entropy * torch.where(mask, entropy, 0.0)).sum()


@pytest.mark.parametrize("proc", SETTINGS, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()) or "plain")
@pytest.mark.parametrize("chunk", [1, 4, 1000])
def test_values_and_gradients_equal_the_unchunked_functions(proc, chunk):
    logits, targets, mask = logits_targets_mask()
    g = torch.Generator().manual_seed(1)
    g_logp, g_entropy = torch.randn(mask.shape, generator=g), torch.randn(mask.shape, generator=g)

    x_old = logits.clone().requires_grad_()
    logp_old = sampler.processed_logprobs(x_old, targets, **proc)
    entropy_old = token_entropy(sampler.process_logits(x_old, **proc))
    (grad_old,) = torch.autograd.grad(objective(logp_old, entropy_old, mask, g_logp, g_entropy), x_old)

    x_new = logits.clone().requires_grad_()
    logp_new, entropy_new = processed_logprobs(x_new, targets, with_entropy=True, chunk=chunk, **proc)
    (grad_new,) = torch.autograd.grad(objective(logp_new, entropy_new, mask, g_logp, g_entropy), x_new)

    if proc.get("top_k") or proc.get("top_p"):
        assert torch.isinf(logp_old).any() and torch.isfinite(logp_old[mask]).any()  # both kinds of target occur
    assert torch.equal(torch.isinf(logp_new), torch.isinf(logp_old))
    torch.testing.assert_close(logp_new, logp_old, rtol=0, atol=1e-6)  # bit for bit today: the same row operations
    torch.testing.assert_close(entropy_new, entropy_old, rtol=0, atol=1e-6)
    torch.testing.assert_close(grad_new, grad_old, rtol=0, atol=1e-6)
    assert torch.isfinite(grad_new).all()
    # log-prob only (the logged entropy is detached): the same gradient as the log-prob branch alone
    x_lp = logits.clone().requires_grad_()
    logp_only, entropy_logged = processed_logprobs(x_lp, targets, with_entropy=True, chunk=chunk, **proc)
    (grad_lp,) = torch.autograd.grad(objective(logp_only, entropy_logged.detach(), mask, g_logp, g_entropy), x_lp)
    x_ref = logits.clone().requires_grad_()
    (grad_ref,) = torch.autograd.grad(
        objective(
            sampler.processed_logprobs(x_ref, targets, **proc),
            torch.zeros_like(mask, dtype=torch.float),
            mask,
            g_logp,
            g_entropy,
        ),
        x_ref,
    )
    torch.testing.assert_close(grad_lp, grad_ref, rtol=0, atol=1e-6)


def test_entropy_only_gradient_and_no_entropy_when_not_asked():
    logits, targets, _ = logits_targets_mask()
    x = logits.clone().requires_grad_()
    _, entropy = processed_logprobs(x, targets, top_k=30, chunk=5)
    assert entropy is None
    _, entropy = processed_logprobs(x, targets, top_k=30, with_entropy=True, chunk=5)
    (grad,) = torch.autograd.grad(entropy.sum(), x)
    x_old = logits.clone().requires_grad_()
    (grad_old,) = torch.autograd.grad(token_entropy(sampler.process_logits(x_old, top_k=30)).sum(), x_old)
    torch.testing.assert_close(grad, grad_old, rtol=0, atol=1e-6)


def test_hand_computed_values():
    V = 8
    logits = torch.zeros(1, 2, V)
    logits[0, 1, :2] = math.log(3.0)  # row 2: tokens 0 and 1 three times as likely as each of the other 6
    logp, entropy = processed_logprobs(logits, torch.tensor([[5, 0]]), with_entropy=True)
    assert logp[0, 0] == pytest.approx(-math.log(8)) and entropy[0, 0] == pytest.approx(math.log(8))
    p = torch.tensor([3.0, 3, 1, 1, 1, 1, 1, 1]) / 12
    assert logp[0, 1] == pytest.approx(math.log(0.25)) and entropy[0, 1] == pytest.approx(float(-(p * p.log()).sum()))
    logp, entropy = processed_logprobs(logits, torch.tensor([[5, 0]]), top_k=2, with_entropy=True)  # row 1: a tie
    assert logp[0, 1] == pytest.approx(math.log(0.5)) and entropy[0, 1] == pytest.approx(math.log(2))


def test_bf16_logits_get_a_bf16_gradient_equal_to_the_fp32_one_rounded():
    logits, targets, _ = logits_targets_mask()
    x16 = logits.bfloat16().requires_grad_()
    logp, _ = processed_logprobs(x16, targets, temperature=0.7, chunk=4)
    assert logp.dtype == torch.float32
    (grad16,) = torch.autograd.grad(logp.sum(), x16)
    x32 = logits.bfloat16().float().requires_grad_()
    (grad32,) = torch.autograd.grad(processed_logprobs(x32, targets, temperature=0.7, chunk=4)[0].sum(), x32)
    assert grad16.dtype == torch.bfloat16 and torch.equal(grad16, grad32.bfloat16())


def test_only_the_logits_and_per_position_vectors_are_saved_for_backward():
    """The unchunked path saved a (positions x V) log-softmax besides the logits; this saves nothing of that size."""
    logits, targets, _ = logits_targets_mask(V=2000)
    x = logits.clone().requires_grad_()
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        processed_logprobs(x, targets, temperature=0.7, top_k=10, with_entropy=True, chunk=4)
    big = [t for t in saved if t.numel() >= x[0, 0].numel()]
    assert len(big) == 1 and big[0].data_ptr() == x.data_ptr(), [tuple(t.shape) for t in big]


@pytest.mark.parametrize("proc", SETTINGS, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()) or "plain")
@pytest.mark.parametrize("chunk,block_bytes", [(1, 64), (4, 4000), (1000, 16 * 2**20)])
def test_fused_head_equals_the_logits_path(proc, chunk, block_bytes, monkeypatch):
    """linear_processed_logprobs(h, W) == processed_logprobs(F.linear(h, W)) in value and in the gradients of the
    hidden states and the weight, for every processing, chunk and vocabulary block size (block_bytes 64: one token
    per block), with padded rows and targets outside the top-k / top-p set."""
    monkeypatch.setattr(logprobs, "BLOCK_BYTES", block_bytes)
    n, R, C, V = 3, 7, 16, 500
    g = torch.Generator().manual_seed(2)
    hidden, weight = torch.randn(n, R, C, generator=g), torch.randn(V, C, generator=g) * 0.7
    _, targets, mask = logits_targets_mask(n, R, V)
    top5 = torch.topk(torch.nn.functional.linear(hidden, weight), 5, dim=-1).indices
    targets = torch.where(torch.rand(n, R, generator=g) < 0.7, top5[..., 0], targets)  # mostly inside the set
    g_logp, g_entropy = torch.randn(n, R, generator=g), torch.randn(n, R, generator=g)

    h_old, w_old = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp_old, entropy_old = processed_logprobs(
        torch.nn.functional.linear(h_old, w_old), targets, with_entropy=True, **proc
    )
    grads_old = torch.autograd.grad(objective(logp_old, entropy_old, mask, g_logp, g_entropy), (h_old, w_old))

    h_new, w_new = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp_new, entropy_new = linear_processed_logprobs(h_new, w_new, targets, with_entropy=True, chunk=chunk, **proc)
    grads_new = torch.autograd.grad(objective(logp_new, entropy_new, mask, g_logp, g_entropy), (h_new, w_new))

    assert torch.equal(torch.isinf(logp_new), torch.isinf(logp_old))
    # a matmul of `chunk` rows may round differently from one of all rows: within 1e-6, relative to |log p| ~ 20
    torch.testing.assert_close(logp_new, logp_old, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(entropy_new, entropy_old, rtol=1e-6, atol=1e-6)
    for new, old in zip(grads_new, grads_old, strict=True):
        torch.testing.assert_close(new, old, rtol=1e-5, atol=1e-5)
        assert old.abs().max() > 0.1  # a real gradient, not zeros on both sides
    # the log-prob alone (entropy detached), and a frozen weight: no weight gradient, the same hidden gradient
    h_lp = hidden.clone().requires_grad_()
    logp_lp, _ = linear_processed_logprobs(h_lp, weight, targets, chunk=chunk, **proc)
    (grad_lp,) = torch.autograd.grad(objective(logp_lp, torch.zeros(n, R), mask, g_logp, g_entropy), h_lp)
    h_ref = hidden.clone().requires_grad_()
    logp_ref, _ = processed_logprobs(torch.nn.functional.linear(h_ref, weight), targets, **proc)
    (grad_ref,) = torch.autograd.grad(objective(logp_ref, torch.zeros(n, R), mask, g_logp, g_entropy), h_ref)
    torch.testing.assert_close(grad_lp, grad_ref, rtol=1e-5, atol=1e-5)


def test_fused_head_keeps_no_logits_and_saves_nothing_without_a_gradient():
    n, R, C, V = 4, 8, 16, 3000
    hidden, weight = torch.randn(n, R, C), torch.randn(V, C)
    targets = torch.randint(V, (n, R))
    saved = []

    def pack(t):
        saved.append(t)
        return t

    for requires_grad in (False, True):
        saved.clear()
        h = hidden.clone().requires_grad_(requires_grad)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            linear_processed_logprobs(h, weight, targets, top_k=10, with_entropy=True, chunk=4)
        big = [t for t in saved if t.numel() >= n * R * V]
        assert len(big) == requires_grad, [tuple(t.shape) for t in big]  # only the fp32 log-softmax, for the backward
        assert all(t.dtype == torch.float32 for t in big)


@pytest.mark.parametrize("top_k,top_p,entropy_weight", [(0, 1.0, 0.0), (50, 0.8, 0.3)])
def test_fused_head_in_bf16_matches_the_bf16_logits_path(top_k, top_p, entropy_weight):
    """Under the bf16 policy the head runs in bf16 as nn.Linear does; log-probs stay fp32 and the gradients come
    back in bf16, close to the unfused path's (which rounds the logit gradient to bf16 before its matmuls), with and
    without top-k / top-p masking and an entropy term. The backward writes over the saved probabilities, so autograd
    refuses a second backward through the same graph."""
    n, R, C, V = 2, 5, 16, 400
    g = torch.Generator().manual_seed(4)
    hidden, weight = torch.randn(n, R, C, generator=g).bfloat16(), (torch.randn(V, C, generator=g) * 0.5).bfloat16()
    targets = torch.randint(V, (n, R), generator=g)
    kw = dict(temperature=0.7, top_k=top_k, top_p=top_p, with_entropy=True)

    def loss(logp, entropy):
        return torch.where(torch.isfinite(logp), logp, 0.0).sum() + entropy_weight * entropy.sum()

    h_old, w_old = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp_old, entropy_old = processed_logprobs(torch.nn.functional.linear(h_old, w_old), targets, **kw)
    grads_old = torch.autograd.grad(loss(logp_old, entropy_old), (h_old, w_old))
    h_new, w_new = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp_new, entropy_new = linear_processed_logprobs(h_new, w_new, targets, chunk=3, **kw)
    grads_new = torch.autograd.grad(loss(logp_new, entropy_new), (h_new, w_new), retain_graph=True)
    assert logp_new.dtype == torch.float32
    torch.testing.assert_close(logp_new, logp_old, rtol=1e-6, atol=1e-5)  # the same bf16 logits, rounded alike
    for new, old in zip(grads_new, grads_old, strict=True):
        assert new.dtype == torch.bfloat16
        torch.testing.assert_close(new.float(), old.float(), rtol=2e-2, atol=2e-2 * old.abs().max().item())
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(loss(logp_new, entropy_new), (h_new, w_new))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_head_on_gpu_matches_and_saves_memory():
    """On CUDA in bf16 (the GPU default), at a GRPO micro-batch's shape (32 x 53 positions, GPT-2's vocabulary):
    the fused pass agrees with the logits path; its peak memory over forward + backward is below the chunked
    logits path's and at least two fp32 logits-sized tensors below the whole-tensor functions it replaced."""
    device = torch.device("cuda")
    n, R, C, V = 32, 53, 768, 50257
    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(n, R, C, device=device, generator=g).bfloat16()
    weight = (torch.randn(V, C, device=device, generator=g) * 0.02).bfloat16()
    targets = torch.randint(V, (n, R), device=device, generator=g)
    logits_bytes = n * R * V * 4

    def peak(fn):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        logp, entropy = fn(h, w)
        (logp.sum() + 0.01 * entropy.sum()).backward()
        torch.cuda.synchronize()
        return logp.detach(), h.grad, w.grad, torch.cuda.max_memory_allocated() - base

    def whole(h, w):
        logits = torch.nn.functional.linear(h, w)
        return sampler.processed_logprobs(logits, targets, temperature=0.9), token_entropy(
            sampler.process_logits(logits, temperature=0.9)
        )

    original = peak(whole)
    chunked = peak(
        lambda h, w: processed_logprobs(torch.nn.functional.linear(h, w), targets, temperature=0.9, with_entropy=True)
    )
    fused = peak(lambda h, w: linear_processed_logprobs(h, w, targets, temperature=0.9, with_entropy=True))
    torch.testing.assert_close(fused[0], chunked[0], rtol=1e-5, atol=1e-3)
    for new, old in zip(fused[1:3], chunked[1:3], strict=True):
        torch.testing.assert_close(new.float(), old.float(), rtol=5e-2, atol=5e-2 * old.float().abs().max().item())
    print(
        f"peak over forward + backward: whole-tensor {original[3] / 2**20:.0f} MiB, chunked {chunked[3] / 2**20:.0f}"
        f" MiB, fused {fused[3] / 2**20:.0f} MiB; fp32 logits {logits_bytes / 2**20:.0f} MiB"
    )
    assert fused[3] < chunked[3]
    assert original[3] - fused[3] >= 2 * logits_bytes


@pytest.mark.parametrize("proc", [{}, {"temperature": 0.8, "top_k": 50, "top_p": 0.9}], ids=["plain", "processed"])
def test_fused_head_with_a_mask_runs_only_the_real_positions(proc):
    """mask_NR: the head runs at the True positions only. Their log-probs, entropies and every gradient equal the
    unmasked pass's (times the mask); the False positions give 0 and send no gradient to their hidden states, even
    where the caller weighs them; the head sees only the packed True rows."""
    n, R, C, V = 3, 7, 16, 500
    g = torch.Generator().manual_seed(5)
    hidden, weight = torch.randn(n, R, C, generator=g), torch.randn(V, C, generator=g) * 0.7
    targets = torch.randint(V, (n, R), generator=g)
    mask = torch.rand(n, R, generator=g) < 0.6
    mask[0, 0], mask[1] = True, False  # a row with no real position at all
    g_logp, g_entropy = torch.randn(n, R, generator=g), torch.randn(n, R, generator=g)

    h_ref, w_ref = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp_ref, entropy_ref = linear_processed_logprobs(h_ref, w_ref, targets, with_entropy=True, chunk=4, **proc)
    grads_ref = torch.autograd.grad(objective(logp_ref, entropy_ref, mask, g_logp, g_entropy), (h_ref, w_ref))

    rows = []
    original = logprobs._LinearChunkedLogprobs.forward

    def counting(ctx, hidden_MC, *args):
        rows.append(hidden_MC.shape[0])
        return original(ctx, hidden_MC, *args)

    h_new, w_new = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(logprobs._LinearChunkedLogprobs, "forward", staticmethod(counting))
        logp_new, entropy_new = linear_processed_logprobs(
            h_new, w_new, targets, with_entropy=True, chunk=4, mask_NR=mask, **proc
        )
    assert rows == [int(mask.sum())]
    assert logp_new.shape == entropy_new.shape == (n, R)
    assert torch.equal(logp_new[~mask], torch.zeros(int((~mask).sum()))) and torch.equal(
        entropy_new[~mask], logp_new[~mask]
    )
    torch.testing.assert_close(logp_new[mask], logp_ref[mask], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(entropy_new[mask], entropy_ref[mask], rtol=1e-6, atol=1e-6)
    ones = torch.ones(n, R, dtype=torch.bool)  # the caller weighs padding too: it still gets no gradient
    grads_new = torch.autograd.grad(objective(logp_new, entropy_new, ones, g_logp, g_entropy), (h_new, w_new))
    for new, ref in zip(grads_new, grads_ref, strict=True):
        torch.testing.assert_close(new, ref, rtol=1e-5, atol=1e-5)
        assert ref.abs().max() > 0.1
    assert torch.equal(grads_new[0][~mask], torch.zeros(int((~mask).sum()), C))
    with pytest.raises(ValueError, match="mask_NR has shape"):
        linear_processed_logprobs(hidden, weight, targets, mask_NR=mask[:, :3])
