"""The reward model's normalisation (reward_model.py's last stage): a gain and bias that give the rewards of responses
sampled from the SFT policy on training prompts mean 0 and standard deviation 1 over all ranks, so GRPO reads
normalised rewards (gain * raw + bias). `cfg` is reward_model.py's Config."""

import math
import random

import torch

from data.tldr import pad_prompts
from rlhf.stats import standardizing_gain_bias
from rollouts.sampling import sample_responses
from utils.dist import all_reduce_sum, stream
from utils.guard import check_rewards
from utils.logging import track
from utils.metrics import metric


def normalization_prompts(rows: list[dict[str, str]], n: int, seed: int) -> list[dict[str, str]]:
    """n distinct training prompts (the preference data repeats a post once per comparison), in seeded order."""
    prompts = sorted({row["prompt"] for row in rows})
    random.Random(seed).shuffle(prompts)
    return [{"prompt": p} for p in prompts[:n]]


metric("norm/raw_mean", None, "mean raw score of the normalisation samples before the gain and bias")
metric("norm/raw_std", None, "standard deviation of those raw scores")
metric("norm/samples", None, "normalisation samples scored (all ranks)")
metric("norm/end_rate", None, "share of the normalisation samples that end with the end token")
metric("norm/gain", None, "the fitted gain (normalised score = gain x raw + bias)")
metric("norm/bias", None, "the fitted bias")


@torch.no_grad()
def fit_normalization(
    reward_model, policy, prompts: list[list[int]], cfg, rank: int, world: int, device, step: int = 0
) -> dict:
    """Sample cfg.norm_samples_per_prompt responses per prompt from `policy`, score them with `reward_model`,
    and set its gain and bias so those rewards have mean 0 and (population) std 1 over all ranks. Rewards that
    are NaN or all equal stop the run (a gain cannot be fitted; `step` is named in the message).

    Rank r takes a contiguous slice of the prompts, padded with copies of prompt 0 (whose rewards are not
    counted) so every rank runs the same number of FSDP forward passes."""
    G = cfg.norm_samples_per_prompt
    per_rank = math.ceil(len(prompts) / world)
    mine = list(range(rank * per_rank, (rank + 1) * per_rank))
    generator = stream(cfg.seed, step, rank, "normalization", device=device)  # the one per-rank stream scheme
    reward_model.eval()
    sums = torch.zeros(4, dtype=torch.float64, device=device)  # count, sum, sum of squares, responses with an end
    counted = []  # this rank's rewards of real prompts, for the NaN / constant check
    for start in track(
        range(0, per_rank, cfg.norm_batch_size),
        "normalisation samples",
        len(prompts),
        lambda start: len(mine[start : start + cfg.norm_batch_size]),
        unit="prompts",
    ):
        index = mine[start : start + cfg.norm_batch_size]
        valid = torch.tensor([i < len(prompts) for i in index], device=device).repeat_interleave(G)  # (N,)
        prompt_ids, prompt_mask = pad_prompts([prompts[i if i < len(prompts) else 0] for i in index])  # (B, P)
        prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
        # 1. sample: rows b*G .. b*G+G-1 belong to prompt b
        out = sample_responses(
            policy,
            prompt_ids,
            prompt_mask,
            G,
            cfg.max_response_len,
            prompts_per_call=len(index),
            temperature=cfg.norm_temperature,
            generator=generator,
            compile=cfg.compile,
        )
        # 2. score prompt + response (read at the last real token, the end token when there is one, or summed over
        #    the response: the model's pooling); the responses start at column P
        input_ids = torch.cat([prompt_ids.repeat_interleave(G, 0), out.response_ids], dim=1)  # (N, P+R)
        attention_mask = torch.cat([prompt_mask.repeat_interleave(G, 0), out.response_mask], dim=1)  # (N, P+R)
        position_ids = (attention_mask.long().cumsum(1) - 1) * attention_mask  # (N, P+R)
        rows = 2 * cfg.micro_batch_size
        rewards = torch.cat(
            [
                reward_model(
                    input_ids[i : i + rows],
                    position_ids[i : i + rows],
                    attention_mask[i : i + rows],
                    prompt_len=prompt_ids.shape[1],
                )
                for i in range(0, input_ids.shape[0], rows)
            ]
        ).double()  # (N,)
        v = valid.double()
        counted.append(rewards[valid])
        sums += torch.stack(
            [v.sum(), (rewards * v).sum(), (rewards * rewards * v).sum(), (out.has_end.double() * v).sum()]
        )
    check_rewards(torch.cat(counted), "reward_model (normalisation samples)", step, device)
    count, total, total_sq, n_end = all_reduce_sum(sums).tolist()
    gain, bias = standardizing_gain_bias(count, total, total_sq)
    reward_model.gain.fill_(gain)
    reward_model.bias.fill_(bias)
    reward_model.train()
    mean = total / count
    return {
        "norm/raw_mean": mean,
        "norm/raw_std": math.sqrt(max(total_sq / count - mean * mean, 0.0)),
        "norm/samples": count,
        "norm/end_rate": n_end / count,
        "norm/gain": gain,
        "norm/bias": bias,
    }
