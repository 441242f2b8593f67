"""Batched sampling on the KV-cache path of model/gpt2.py.

Prompts arrive left-padded with a boolean mask; position ids count real tokens only, so a padded prompt is
computed exactly as it would be alone (GPT-2's positions are absolute). Each prompt is prefilled once for its
`num_samples` samples: 64 samples of one prompt cost one prefill, not 64. With `prefix_sharing` (the default) its
keys and values are also stored once (model/gpt2.py's SharedKVCache) and every decode step reads them once per
prompt, not once per sample: the cache holds B*P + N*max_new_tokens positions instead of N*(P + max_new_tokens).
Without it they are copied to every sample (KVCache.repeat_interleave), the reference the tests compare against.

The token distribution is processed in a fixed order: logits in fp32, divided by the temperature, then top-k,
then top-p (nucleus) masking (rlhf/logprobs.py's `process_logits`). `processed_logprobs` here (and rlhf/logprobs.py's
chunked pass, which grpo.py's update uses) applies exactly the same processing to training-time logits, so the log-probs of a GRPO ratio and KL
describe the distribution the tokens were drawn from.

Decoding stops per row at the first end token ("\\n", id 198) or EOS (50256); later positions are padding.
Under FSDP, wrap the call in `utils.fsdp.gathered_params(model)` so parameters are gathered once per call.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from model.gpt2 import KVCache, SharedKVCache
from rlhf.logprobs import process_logits  # the one definition of the processing, shared with the update

END_ID, EOS_ID, PAD_ID = 198, 50256, 50256  # GPT-2's "\n", <|endoftext|>, and the id used for padding
DONE_CHECK_EVERY_GPU = 8  # decoded tokens between host checks that every row has finished, on a GPU (generate)


@dataclass
class SampleOutput:
    response_ids: torch.Tensor  # (N, R) long; PAD_ID after the first end token
    response_mask: torch.Tensor  # (N, R) bool; True up to and including the first end token
    logprobs: torch.Tensor  # (N, R) fp32 log-prob of each token under the processed distribution; 0 where masked
    has_end: torch.Tensor  # (N,) bool; False when max_new_tokens ran out first


def processed_logprobs(
    logits_BTV: torch.Tensor, targets_BT: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor:
    """log p(target) (B, T) in fp32 under the same processing the sampler used. The plain whole-tensor form;
    grpo.py's reference and update use rlhf/logprobs.py, the same numbers in chunks with the entropy beside them
    (model/ may not import rlhf/; tests/test_logprobs.py checks the two agree)."""
    logp = process_logits(logits_BTV, temperature, top_k, top_p).log_softmax(-1)
    return torch.gather(logp, -1, targets_BT.unsqueeze(-1)).squeeze(-1)


def sample_tokens(
    logp: torch.Tensor, generator: torch.Generator | None = None, block: int = 256, uniforms: torch.Tensor | None = None
) -> torch.Tensor:
    """One token per row of log-probs (N, V), by inverting the CDF with one float64 uniform per row (drawn from
    `generator`, or `uniforms` (N, 1) float64 in [0, 1) when given).

    The same distribution as torch.multinomial at a fraction of its cost on CPU (multinomial draws V
    exponentials per row). Two levels keep it exact without a float64 copy of the whole (N, V) array: pick a
    block of `block` tokens from the float64 CDF of the block sums, then a token from the CDF inside that
    block. Tokens of probability 0 (outside top-k / top-p) are never drawn."""
    N, V = logp.shape
    probs = logp.exp()
    full = V // block * block
    sums = probs[:, :full].view(N, -1, block).sum(-1)  # (N, V // block)
    if full < V:
        sums = torch.cat([sums, probs[:, full:].sum(-1, keepdim=True)], dim=1)  # the short last block
    block_cdf = sums.double().cumsum(-1)  # (N, nb)
    if uniforms is None:
        uniforms = torch.rand(N, 1, generator=generator, device=logp.device, dtype=torch.float64)
    u = uniforms * block_cdf[:, -1:]
    b = torch.searchsorted(block_cdf, u, right=True).clamp(max=block_cdf.shape[1] - 1)  # (N, 1) first CDF > u
    below = torch.where(b > 0, block_cdf.gather(-1, (b - 1).clamp(min=0)), 0.0)
    idx = b * block + torch.arange(block, device=logp.device)  # (N, block) the chosen block's token ids
    inside = probs.gather(-1, idx.clamp(max=V - 1)).masked_fill(idx >= V, 0.0)
    inner_cdf = inside.double().cumsum(-1)  # (N, block)
    rest = torch.minimum(u - below, inner_cdf[:, -1:] * (1 - 1e-12))  # rounding must not step past the block
    j = torch.searchsorted(inner_cdf, rest, right=True)
    return (b * block + j).squeeze(-1)


@torch.no_grad()
def generate(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    num_samples: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    generator: torch.Generator | None = None,
    stop_ids: tuple[int, ...] = (END_ID, EOS_ID),
    done_check_every: int | None = None,
    prefix_sharing: bool = True,
) -> SampleOutput:
    """Sample `num_samples` responses for each of B left-padded prompts (B, P); `prefix_sharing`: one copy of each
    prompt's keys and values for its samples (see the module docstring).

    Returns N = B * num_samples rows grouped by prompt: rows b*G .. b*G+G-1 belong to prompt b.

    done_check_every: decoded tokens between checks that every row has finished. The check copies a flag to the
    host, which on a GPU waits for every queued kernel, so the Python loop can no longer run ahead of the device;
    None: every token on CPU (free there), every DONE_CHECK_EVERY_GPU tokens on a GPU. Each check also drops the
    finished rows from the head; rows that finished since keep going through it until the next one. Either way it
    changes the work done, never a row's tokens, mask or log-probs (the generator draws for every row at every
    step)."""
    if done_check_every is None:
        done_check_every = DONE_CHECK_EVERY_GPU if prompt_ids.device.type == "cuda" else 1
    B, P = prompt_ids.shape
    G, device = num_samples, prompt_ids.device
    if P + max_new_tokens > model.cfg.n_positions:
        raise ValueError(f"prompt width {P} + {max_new_tokens} new tokens exceeds the model's {model.cfg.n_positions} positions")
    prompt_pos = (prompt_mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, P) positions of real tokens from 0

    # 1. prefill each prompt once; its cache is then shared by its G samples, or copied to each of them
    cache = KVCache(model.cfg, B, P if prefix_sharing else P + max_new_tokens, device)
    logits = model(prompt_ids, prompt_pos, prompt_mask, kv_cache=cache, logits_slice=slice(-1, None))[:, -1]  # (B, V)
    if prefix_sharing:
        cache = SharedKVCache(cache, G, max_new_tokens)
    elif G > 1:
        cache = cache.repeat_interleave(G)
    logits = logits.repeat_interleave(G, dim=0)  # (N, V)
    N = B * G
    next_pos = prompt_mask.sum(-1).repeat_interleave(G)  # (N,) position of the first response token
    stop = torch.tensor(stop_ids, device=device)

    # 2. decode one token per step for every row. Finished rows keep stepping through the body on their last token
    #    (every row advances together in the cache), but the head, the softmax and the draw, most of a decode step's
    #    cost with a 50,257-word vocabulary, run only on `rows`: the rows unfinished at the last check (all rows
    #    until one finishes). Every row's uniform is drawn at every step, so a row's tokens do not depend on which
    #    other rows are still running.
    tokens = torch.full((N, max_new_tokens), PAD_ID, dtype=torch.long, device=device)
    logprobs = torch.zeros(N, max_new_tokens, dtype=torch.float32, device=device)
    mask = torch.zeros(N, max_new_tokens, dtype=torch.bool, device=device)
    done = torch.zeros(N, dtype=torch.bool, device=device)
    rows = None  # None: every row (always so at t = 0, which sets `tok`); else the (n,) indices whose logits are computed
    for t in range(max_new_tokens):
        logp = process_logits(logits, temperature, top_k, top_p).log_softmax(-1)  # (n, V)
        if temperature == 0:
            drawn = logp.argmax(-1)
        else:
            u = torch.rand(N, 1, generator=generator, device=device, dtype=torch.float64)
            drawn = sample_tokens(logp, uniforms=u if rows is None else u[rows])  # (n,)
        drawn_logp = logp.gather(-1, drawn[:, None]).squeeze(-1)
        if rows is None:
            tok, tok_logp = drawn, drawn_logp
        else:
            tok = tok.index_copy(0, rows, drawn)  # rows outside `rows` finished: their token is never read
            tok_logp = torch.zeros(N, dtype=torch.float32, device=device).index_copy(0, rows, drawn_logp)
        live = ~done
        tokens[:, t] = torch.where(live, tok, PAD_ID)
        logprobs[:, t] = torch.where(live, tok_logp, 0.0)
        mask[:, t] = live
        done = done | (live & torch.isin(tok, stop))
        if t == max_new_tokens - 1:
            break
        if (t + 1) % done_check_every == 0:  # a host sync on a GPU, hence only every done_check_every tokens
            unfinished = (~done).nonzero().squeeze(1)
            if len(unfinished) == 0:
                break
            rows = None if len(unfinished) == N else unfinished
        # finished rows are fed a token they drew (ignored), not PAD_ID, which may lie outside a small vocabulary
        head = None if rows is None else (lambda h, w, rows=rows: F.linear(h[rows], w))  # h (N, 1, C) -> logits (n, 1, V)
        logits = model(tok[:, None], (next_pos + t)[:, None], None, kv_cache=cache, head=head)[:, -1]  # (n, V)
    return SampleOutput(tokens, mask, logprobs, done)
