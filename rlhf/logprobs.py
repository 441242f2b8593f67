"""The update's vocabulary work in one chunked pass: the processed (temperature / top-k / top-p) log-prob of each
target token and, when asked, the entropy of the processed distribution, from logits (n, R, V) and targets (n, R).

Why chunks: with GPT-2's 50,257-token vocabulary the (positions x V) fp32 tensors dominate a small model's update.
Doing the processing, log-softmax, gather and entropy as separate whole-batch operations made several
logits-sized temporaries (412 MB each at 128 x 16 positions) and read them from main memory again and again. Here
every step runs on `chunk` positions at a time, so apart from the logits themselves and their gradient nothing of
size (positions x V) is alive, and each chunk's rows are still in cache for the next operation.

The backward is a custom autograd function that recomputes each chunk's processed log-softmax from the saved
logits (not a saved (positions x V) log-softmax), with the gradients of PPO's two per-token terms:

    d log p_t / d z_j = [j = t] - p_j          d H / d z_j = -p_j (log p_j + H)

where z are the processed logits (logits / temperature, -inf outside the top-k / top-p set; the set is a
constant of the backward, as in the unchunked masked_fill) and H = -sum_j p_j log p_j. Tokens outside the set
get no gradient. The entropy is computed from the same log-softmax as the log-prob (one exp more per row), and
only when asked: logging it every N steps (grpo --entropy_every) makes it free on the other steps.

`linear_processed_logprobs` goes one step further for the update and the reference: it takes the hidden states and
the LM head's weight and runs the head's matmul chunk by chunk inside the same pass, so the (positions x V) logits
are never materialised. It saves the processed probabilities in fp32 (the one (positions x V) tensor it keeps, and
only when a gradient is needed: the exp it takes for the entropy anyway), and its backward is two matmuls on them
(see the class) instead of a recomputed softmax, a logits-sized gradient and two matmuls on that gradient.

`process_logits` is the one definition of the processing: model/sampler.py draws tokens with it, so the update's
log-probs describe the distribution the tokens were drawn from.
"""

import torch
import torch.nn.functional as F

CHUNK = 32  # positions per chunk: 32 x 50,257 fp32 is 6.4 MB, a few of them fit a CPU's last-level cache
BLOCK_BYTES = 16 * 2**20  # the fused backward's entropy term: vocabulary blocks of (positions x block) fp32 this size
GPU_CHUNK_BYTES = (
    32 * 2**20
)  # the fused pass on a GPU: as many positions as make ~32 MB of fp32 logits per chunk (a few
# kernel launches per micro-batch, and a chunk's temporaries stay small), against CHUNK positions on a CPU


def process_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """fp32 logits (..., V) divided by the temperature, with tokens outside the top-k / top-p set at -inf; the
    order is temperature, then top-k, then top-p, as the sampler draws (model/sampler.py). Temperature 0 (greedy)
    is treated as 1."""
    logits = logits.float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # (..., 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens ranked above it already hold top_p of the mass (the first always stays)
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def _finite(logp_cV: torch.Tensor, masked: bool) -> torch.Tensor:
    """The log-softmax with -inf (tokens outside top-k / top-p, probability 0) replaced by the lowest float, so that
    p * log p is 0 there instead of NaN; unchanged (no pass over it) when nothing is masked."""
    return logp_cV.clamp(min=torch.finfo(logp_cV.dtype).min) if masked else logp_cV


class _ChunkedLogprobs(torch.autograd.Function):
    """(log p(target) (M,), entropy (M,) or None) from logits (M, V) and targets (M,); see the module docstring.
    Saves the logits (alive anyway: the caller holds them) and the entropy (M,), nothing of size (M, V)."""

    @staticmethod
    def forward(ctx, logits_MV, targets_M, temperature, top_k, top_p, with_entropy, chunk):
        M, masked = logits_MV.shape[0], top_k > 0 or top_p < 1.0
        logp_M = torch.empty(M, dtype=torch.float32, device=logits_MV.device)
        entropy_M = torch.empty(M, dtype=torch.float32, device=logits_MV.device) if with_entropy else None
        for s in range(0, M, chunk):
            logp_cV = process_logits(logits_MV[s : s + chunk], temperature, top_k, top_p).log_softmax(-1)  # (c, V)
            logp_M[s : s + chunk] = logp_cV.gather(-1, targets_M[s : s + chunk, None]).squeeze(-1)
            if with_entropy:  # H = -sum p log p from the same log-softmax: one exp and one multiply-sum more
                entropy_M[s : s + chunk] = -(logp_cV.exp() * _finite(logp_cV, masked)).sum(-1)
        ctx.save_for_backward(logits_MV, targets_M, entropy_M)
        ctx.settings = (temperature, top_k, top_p, chunk)
        ctx.set_materialize_grads(False)  # an output nobody differentiates (the logged entropy) gets grad None
        return logp_M, entropy_M

    @staticmethod
    def backward(ctx, grad_logp_M, grad_entropy_M):
        logits_MV, targets_M, entropy_M = ctx.saved_tensors
        temperature, top_k, top_p, chunk = ctx.settings
        if grad_logp_M is None and grad_entropy_M is None:
            return (None,) * 7
        masked = top_k > 0 or top_p < 1.0
        # d z / d logits = 1 / temperature (0 outside the set, zeroed below): folded into the (c, 1) upstream grads
        scale = 1.0 / temperature if temperature > 0 and temperature != 1.0 else 1.0
        grad_MV = torch.empty_like(logits_MV)
        in_place = grad_MV.dtype == torch.float32  # write each chunk's fp32 gradient straight into the result
        for s in range(0, logits_MV.shape[0], chunk):
            e = min(s + chunk, logits_MV.shape[0])
            z_cV = process_logits(logits_MV[s:e], temperature, top_k, top_p)  # (c, V)
            out_cV = grad_MV[s:e] if in_place else torch.empty_like(z_cV)
            if grad_entropy_M is None:
                torch.softmax(
                    z_cV, -1, out=out_cV
                )  # p, in one kernel (cheaper than exp of the log-softmax: docs/benchmarks.md)
            else:  # -p_j (log p_j + H) g_H needs log p too
                torch.log_softmax(z_cV, -1, out=out_cV)
                term_cV = (_finite(out_cV, masked) + entropy_M[s:e, None]).mul_(-scale * grad_entropy_M[s:e, None])
                out_cV.exp_()  # p
                term_cV.mul_(out_cV)
            if grad_logp_M is not None:  # ([j = t] - p_j) g
                g_c1 = grad_logp_M[s:e, None] * scale
                out_cV.mul_(-g_c1).scatter_add_(-1, targets_M[s:e, None], g_c1)
                if grad_entropy_M is not None:
                    out_cV.add_(term_cV)
            else:
                out_cV.copy_(term_cV)
            if masked:  # outside the top-k / top-p set the processed logit is a constant -inf: no gradient
                out_cV.masked_fill_(z_cV == float("-inf"), 0.0)
            if not in_place:
                grad_MV[s:e] = out_cV
        return grad_MV, None, None, None, None, None, None


def processed_logprobs(
    logits_NRV: torch.Tensor,
    targets_NR: torch.Tensor,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    with_entropy: bool = False,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(target) (n, R), entropy (n, R) or None), fp32, of the processed distribution at every position, in
    chunks of `chunk` positions. Both are differentiable with respect to the logits; a target outside the top-k /
    top-p set has log-prob -inf (the caller masks or floors it)."""
    *lead, V = logits_NRV.shape
    logits_MV = logits_NRV.reshape(-1, V)
    logp_M, entropy_M = _ChunkedLogprobs.apply(
        logits_MV, targets_NR.reshape(-1), temperature, top_k, top_p, with_entropy, chunk
    )
    return logp_M.view(lead), entropy_M.view(lead) if entropy_M is not None else None


class _LinearChunkedLogprobs(torch.autograd.Function):
    """(log p(target) (M,), entropy (M,) or None) from hidden states h (M, C) and the head weight W (V, C): the
    logits of `chunk` positions at a time, F.linear as nn.Linear computes them. `settings`: (temperature, top_k, top_p,
    with_entropy, chunk, the outputs' shape). Saves h and W (alive anyway), the
    entropy (M,) and, when an input needs a gradient, the processed probabilities P (M, V) (fp32, or the head's 16-bit
    dtype).

    With P saved, the backward of the log-prob term needs no pass over (M, V) at all. The logit gradient is
    G = diag(g) (onehot(t) - P), so
        dh = G W = g * (W[t] - P W)            dW = G^T h = onehot(t)^T (g * h) - P^T (g * h)
    two matmuls on P and a row gather / index-add. The entropy term (only when it is a bonus) adds
    -diag(g_H) Q with Q = P log P + P H, built in vocabulary blocks.

    With a 16-bit head (P saved in its dtype) the backward instead writes G over P, in vocabulary blocks computed in
    fp32 and rounded once, and runs the two matmuls on it, dh = G W and dW = G^T h, as the unfused pass's linear
    backward does on its 16-bit logit gradient: no (V, C) buffer in fp32, so the pass's peak stays below the
    logits path's. P is consumed: a second backward through the same graph (retain_graph) is refused by autograd (the
    saved tensor was modified in place)."""

    @staticmethod
    def forward(ctx, hidden_MC, weight_VC, targets_M, settings):
        temperature, top_k, top_p, with_entropy, chunk, lead = settings
        M, V = hidden_MC.shape[0], weight_VC.shape[0]
        masked = top_k > 0 or top_p < 1.0
        needs_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        # P in the head's dtype when that is 16-bit: the backward's matmuls run in it (as nn.Linear's would on the
        # bf16 logit gradient), so rounding P first costs no precision they keep, and halves the saved tensor
        probs_dtype = weight_VC.dtype if weight_VC.dtype in (torch.bfloat16, torch.float16) else torch.float32
        probs_MV = torch.empty(M, V, dtype=probs_dtype, device=hidden_MC.device) if needs_grad else None
        # the outputs in the caller's shape `lead` (not views of flat tensors: FSDP hooks a module's outputs)
        logp_out = torch.empty(lead, dtype=torch.float32, device=hidden_MC.device)
        entropy_out = torch.empty(lead, dtype=torch.float32, device=hidden_MC.device) if with_entropy else None
        logp_M = logp_out.view(-1)
        entropy_M = entropy_out.view(-1) if with_entropy else None
        for s in range(0, M, chunk):
            z_cV = process_logits(F.linear(hidden_MC[s : s + chunk], weight_VC), temperature, top_k, top_p)  # (c, V)
            logp_cV = z_cV.log_softmax(-1)
            logp_M[s : s + chunk] = logp_cV.gather(-1, targets_M[s : s + chunk, None]).squeeze(-1)
            if needs_grad and probs_dtype == torch.float32:  # exp straight into the saved P
                p_cV = torch.exp(logp_cV, out=probs_MV[s : s + chunk])
            elif needs_grad or with_entropy:
                p_cV = logp_cV.exp()
                if needs_grad:
                    probs_MV[s : s + chunk] = p_cV
            if with_entropy:  # p log p written over the log-probs, which nothing reads after
                entropy_M[s : s + chunk] = -_finite(logp_cV, masked).mul_(p_cV).sum(-1)
        ctx.save_for_backward(hidden_MC, weight_VC, targets_M, probs_MV, entropy_out, logp_out)  # outputs, not views
        ctx.settings = (temperature, masked)
        ctx.set_materialize_grads(False)
        return logp_out, entropy_out

    @staticmethod
    def backward(ctx, grad_logp_M, grad_entropy_M):
        hidden_MC, weight_VC, targets_M, probs_MV, entropy_out, logp_out = ctx.saved_tensors
        temperature, masked = ctx.settings
        if grad_logp_M is None and grad_entropy_M is None:
            return (None,) * 4
        if probs_MV.dtype != torch.float32:
            return _LinearChunkedLogprobs.backward_16bit(ctx, grad_logp_M, grad_entropy_M)
        logp_M, entropy_M = logp_out.reshape(-1), entropy_out.reshape(-1) if entropy_out is not None else None
        grad_logp_M = grad_logp_M.reshape(-1) if grad_logp_M is not None else None
        grad_entropy_M = grad_entropy_M.reshape(-1) if grad_entropy_M is not None else None
        scale = 1.0 / temperature if temperature > 0 and temperature != 1.0 else 1.0  # d z / d logits
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        M, V = probs_MV.shape
        dtype = weight_VC.dtype
        probs = probs_MV.to(dtype)  # the matmuls run in the head's dtype (no copy when P already has it)
        grad_hidden_MC = grad_weight_VC = None
        if grad_logp_M is not None:
            g_M1 = grad_logp_M[:, None] * scale  # (M, 1)
            # the target's one-hot term only where the target is inside the top-k / top-p set: outside, its
            # processed logit is a constant -inf and gets no gradient, as in the unfused pass
            g_target_M1 = torch.where(torch.isfinite(logp_M)[:, None], g_M1, 0.0) if masked else g_M1
            if want_hidden:
                grad_hidden_MC = g_target_M1 * weight_VC[targets_M].float() - g_M1 * (probs @ weight_VC).float()
            if want_weight:  # - P^T (g h) as one product on -(g h) (exactly its negation): no (V, C) zeros or pass
                neg_gh_MC = (g_M1 * hidden_MC.float()).neg_().to(dtype)
                grad_weight_VC = (probs.T @ neg_gh_MC).float()
                grad_weight_VC.index_add_(0, targets_M, g_target_M1 * hidden_MC.float())
        if grad_entropy_M is not None:  # d H / d z_j = -p_j (log p_j + H), in vocabulary blocks
            if want_hidden and grad_hidden_MC is None:
                grad_hidden_MC = torch.zeros(M, hidden_MC.shape[1], dtype=torch.float32, device=hidden_MC.device)
            if want_weight and grad_weight_VC is None:
                grad_weight_VC = torch.zeros(V, weight_VC.shape[1], dtype=torch.float32, device=weight_VC.device)
            gH_M1 = grad_entropy_M[:, None] * scale
            block = max(1, BLOCK_BYTES // (4 * M))
            for v in range(0, V, block):
                p_Mb = probs_MV[:, v : v + block].float()
                q_Mb = (torch.special.xlogy(p_Mb, p_Mb) + p_Mb * entropy_M[:, None]).mul_(-gH_M1).to(dtype)  # (M, b)
                if want_hidden:
                    grad_hidden_MC += (q_Mb @ weight_VC[v : v + block]).float()
                if want_weight:
                    grad_weight_VC[v : v + block] += (q_Mb.T @ hidden_MC).float()
        grad_hidden_MC = grad_hidden_MC.to(hidden_MC.dtype) if want_hidden else None
        grad_weight_VC = grad_weight_VC.to(dtype) if want_weight else None
        return grad_hidden_MC, grad_weight_VC, None, None

    @staticmethod
    def backward_16bit(ctx, grad_logp_M, grad_entropy_M):
        """The backward with P in 16 bits: G = diag(g) (onehot(t) - P) - diag(g_H) (P log P + P H) written over P."""
        hidden_MC, weight_VC, targets_M, probs_MV, entropy_out, logp_out = ctx.saved_tensors
        temperature, masked = ctx.settings
        scale = 1.0 / temperature if temperature > 0 and temperature != 1.0 else 1.0  # d z / d logits
        M, V = probs_MV.shape
        g_M1 = grad_logp_M.reshape(-1, 1) * scale if grad_logp_M is not None else None
        if g_M1 is not None and masked:  # the target's one-hot term only where it is inside the top-k / top-p set
            g_M1_target = torch.where(torch.isfinite(logp_out.reshape(-1, 1)), g_M1, 0.0)
        else:
            g_M1_target = g_M1
        gH_M1 = grad_entropy_M.reshape(-1, 1) * scale if grad_entropy_M is not None else None
        entropy_M1 = entropy_out.reshape(-1, 1) if entropy_out is not None else None
        block = max(1, BLOCK_BYTES // (4 * M))
        for v in range(0, V, block):
            p_Mb = probs_MV[:, v : v + block].float()
            G_Mb = torch.zeros_like(p_Mb)
            if g_M1 is not None:
                G_Mb -= g_M1 * p_Mb
                inside = (targets_M >= v) & (targets_M < v + p_Mb.shape[1])  # rows whose target is in this block
                column = (targets_M - v).clamp(0, p_Mb.shape[1] - 1)[:, None]
                G_Mb.scatter_add_(1, column, torch.where(inside[:, None], g_M1_target, 0.0))
            if gH_M1 is not None:  # d H / d z_j = -p_j (log p_j + H)
                G_Mb -= gH_M1 * (torch.special.xlogy(p_Mb, p_Mb) + p_Mb * entropy_M1)
            probs_MV[:, v : v + block] = G_Mb
        grad_hidden_MC = (probs_MV @ weight_VC).to(hidden_MC.dtype) if ctx.needs_input_grad[0] else None
        grad_weight_VC = probs_MV.T @ hidden_MC.to(weight_VC.dtype) if ctx.needs_input_grad[1] else None
        return grad_hidden_MC, grad_weight_VC, None, None


def linear_processed_logprobs(
    hidden_NRC: torch.Tensor,
    weight_VC: torch.Tensor,
    targets_NR: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    with_entropy: bool = False,
    chunk: int | None = None,
    mask_NR: torch.Tensor | None = None,
    positions_K: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """processed_logprobs(F.linear(hidden, weight), targets, ...) without the (n, R, V) logits: the LM head applied
    `chunk` positions at a time inside the pass (default: CHUNK on a CPU, GPU_CHUNK_BYTES of logits on a GPU).
    Differentiable with respect to the hidden states and the weight (a frozen weight gets no gradient computed).
    GPT2LMHeadModel.forward(..., head=...) calls it with its tied head weight, inside the root module's forward, so
    FSDP has the weight gathered.

    With `mask_NR` (bool, the shape of targets_NR) the head runs only at the True positions, packed together: a
    batch of padded responses (about half padding in the demo's SFT) pays for its real tokens only. The False
    positions get log-prob 0 and entropy 0, and no gradient reaches their hidden states. Finding the True positions
    reads their count on the host; `positions_K` (long (K,), the flat row-major indices of the True positions of
    targets_NR, found beforehand) does the same with no host read, so a caller's pass can compile as one graph."""
    *lead, C = hidden_NRC.shape
    if chunk is None:
        chunk = CHUNK if hidden_NRC.device.type == "cpu" else max(CHUNK, GPU_CHUNK_BYTES // (4 * weight_VC.shape[0]))
    settings = (temperature, top_k, top_p, with_entropy, chunk)
    if mask_NR is None and positions_K is None:
        return _LinearChunkedLogprobs.apply(
            hidden_NRC.reshape(-1, C), weight_VC, targets_NR.reshape(-1), (*settings, tuple(lead))
        )
    if positions_K is None:
        if mask_NR.shape != targets_NR.shape:
            raise ValueError(
                f"mask_NR has shape {tuple(mask_NR.shape)}, targets_NR {tuple(targets_NR.shape)}: expected the same"
            )
        positions_K = mask_NR.reshape(-1).nonzero().squeeze(1)  # the True positions, in row-major order
    hidden_KC = hidden_NRC.reshape(-1, C).index_select(0, positions_K)
    targets_K = targets_NR.reshape(-1).index_select(0, positions_K)
    settings = (*settings, (targets_K.shape[0],))
    logp_K, entropy_K = _LinearChunkedLogprobs.apply(hidden_KC, weight_VC, targets_K, settings)
    # back in the caller's shape as new tensors, not views of flat ones (FSDP hooks a module's outputs)
    index = torch.unravel_index(positions_K, targets_NR.shape)
    zeros = torch.zeros(targets_NR.shape, dtype=torch.float32, device=hidden_NRC.device)
    entropy = zeros.index_put(index, entropy_K) if entropy_K is not None else None
    return zeros.index_put(index, logp_K), entropy
