"""The next-token loss of one SFT micro-batch (sft.py's loss, the rows of data/tldr.py's SFTDataset.collate): the summed
NLL of the response tokens, plus with --prompt_loss_weight an unbiased estimate of the prompt tokens' NLL from a few
drawn positions per row. The LM head runs inside rlhf/logprobs.py's chunked pass, at the predicting positions only,
found on the host from the batch's masks (utils/dist.py true_positions), so a micro-batch makes the host wait for the
device nowhere."""

from functools import partial

import torch

from rlhf.logprobs import linear_processed_logprobs
from rlhf.losses import sft_loss_sum
from utils.dist import stream, to_device, true_positions


def response_nll_sum(model, batch: dict, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed NLL of response tokens, number of response tokens) for one micro-batch.

    The LM head runs only at the positions that predict real response tokens (columns P-1 .. P+R-2, where P is the
    left-padded prompt width, less the right padding of shorter responses), inside rlhf/logprobs.py's chunked pass,
    so the (B, R, V) logits are never materialised: with GPT-2's 50k vocabulary the head is most of a small model's
    FLOPs and memory."""
    P, R = batch["prompt_len"], batch["response_ids"].shape[1]
    mask = to_device(batch["response_mask"], device)
    logp_BR, _ = model(
        to_device(batch["input_ids"], device),
        to_device(batch["position_ids"], device),
        to_device(batch["attention_mask"], device),
        logits_slice=slice(P - 1, P + R - 1),
        head=partial(
            linear_processed_logprobs,
            targets_NR=to_device(batch["response_ids"], device),
            positions_K=true_positions(batch["response_mask"], device),
        ),
    )  # (B, R), 0 at padding
    return sft_loss_sum(logp_BR, mask), mask.sum()


def prompt_targets(batch: dict) -> torch.Tensor:
    """(B, P-1) bool: prompt columns 1 .. P-1 whose token and the token before it are real (a left-padded row's
    first real token has nothing to be predicted from)."""
    m, P = batch["attention_mask"], batch["prompt_len"]
    return m[:, 1:P] & m[:, : P - 1]


def weighted_nll_sum(
    model, batch: dict, prompt_weight: float, prompt_positions: int, draw_seed: int | None, device
) -> torch.Tensor:
    """Response NLL + prompt_weight * (an unbiased estimate of the) prompt NLL, summed over one micro-batch.

    The prompt term draws `prompt_positions` prompt targets per row uniformly without replacement and scales
    each by (the row's prompt targets / the number drawn), so its expectation is the NLL summed over every prompt
    token, at a fraction of the cost of a 50k-way softmax at every position. A row's draw depends on `draw_seed` and
    its example index (batch["example"]) only, not on where it is computed. prompt_weight 0: the response NLL."""
    if prompt_weight == 0:
        return response_nll_sum(model, batch, device)[0]
    P, R = batch["prompt_len"], batch["response_ids"].shape[1]
    valid = prompt_targets(batch)  # (B, P-1): column j+1 is a prompt target predicted at column j
    B, K = valid.shape[0], min(prompt_positions, P - 1)
    scores = torch.full(valid.shape, -1.0)  # (B, P-1): a random score per prompt target, the top K drawn
    for row, example in enumerate(batch["example"].tolist()):
        scores[row, valid[row]] = torch.rand(int(valid[row].sum()), generator=stream(draw_seed, example))
    chosen = scores.topk(K, dim=1).indices  # (B, K) predictor columns
    drawn = valid.gather(1, chosen)  # (B, K) False where a row has fewer than K prompt targets
    scale = valid.sum(1, keepdim=True) / drawn.sum(1, keepdim=True).clamp(min=1)  # (B, 1)
    columns = torch.cat([chosen, torch.arange(P - 1, P + R - 1).expand(B, R)], dim=1)  # (B, K+R) predictor columns
    targets = batch["input_ids"].gather(1, columns + 1)
    weight = torch.cat([prompt_weight * scale * drawn, batch["response_mask"].float()], dim=1)  # (B, K+R)
    logp, _ = model(
        to_device(batch["input_ids"], device),
        to_device(batch["position_ids"], device),
        to_device(batch["attention_mask"], device),
        logits_slice=to_device(columns, device),
        head=partial(
            linear_processed_logprobs,
            targets_NR=to_device(targets, device),
            positions_K=true_positions(weight > 0, device),
        ),
    )  # (B, K+R), 0 where the weight is
    return sft_loss_sum(logp, to_device(weight, device))
