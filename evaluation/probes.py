"""Probes of what the embedded task's stages learned (data/synthetic.py has a gold reward): summaries sampled from a
policy and their gold reward and its parts, whether a scorer (a reward model, DPO's implicit reward, a policy's
likelihood) checks a summary's items against the post (the swap probe) and what it pays for an appended item. demo.py
reports them (with eval_kl, where DPO and GRPO are compared); tests/test_learning.py holds their thresholds."""

import json
from pathlib import Path

import torch


@torch.no_grad()
def sample_summary_texts(
    policy_dir: Path, prompts_file: Path, n_prompts: int, samples: int, max_new_tokens: int, seed: int
) -> list[tuple[str, list[str]]]:
    """(prompt, [summary text]) for the first `n_prompts` prompts of a file, `samples` summaries each, sampled at
    temperature 1. A summary ends with "\n" exactly when the policy stopped by itself (EOS counts as "\n")."""
    from data.tldr import PROMPT_COLUMNS, PromptDataset, load_rows, pad_prompts
    from data.tokenizer import get_tokenizer
    from model.sampler import END_ID
    from model.weights import build_policy
    from rollouts.sampling import sample_responses

    tok = get_tokenizer()
    rows = load_rows(str(prompts_file), "train", PROMPT_COLUMNS)[:n_prompts]
    ds = PromptDataset(rows, tok, 256)
    model = build_policy(str(policy_dir))
    ids, mask = pad_prompts(ds.prompts)  # (B, P) left-padded; each call of 32 prompts is cut to its own padding
    out = sample_responses(
        model, ids, mask, samples, max_new_tokens, prompts_per_call=32, generator=torch.Generator().manual_seed(seed)
    )
    texts = []
    for n in range(out.response_ids.shape[0]):
        resp = out.response_ids[n][out.response_mask[n]].tolist()
        if out.has_end[n] and resp[-1] != END_ID:
            resp = resp[:-1] + [END_ID]
        texts.append(tok.decode(resp))
    return [(ds.texts[b], texts[b * samples : (b + 1) * samples]) for b in range(len(ds))]


def gold_of_samples(
    policy_dir: Path, prompts_file: Path, n_prompts: int, samples: int, max_new_tokens: int, seed: int
) -> dict:
    """Means over summaries sampled (temperature 1) from a policy on held-out prompts: the gold reward and each of
    its parts (items_correct, items_invented, words, ended; data.synthetic.gold_parts)."""
    from data.synthetic import gold_parts, gold_reward

    drawn = sample_summary_texts(policy_dir, prompts_file, n_prompts, samples, max_new_tokens, seed)
    pairs = [(prompt, text) for prompt, texts in drawn for text in texts]
    parts = [gold_parts(prompt, text) for prompt, text in pairs]
    out = {"gold_reward": sum(gold_reward(prompt, text) for prompt, text in pairs) / len(pairs)}
    return out | {name: sum(p[name] for p in parts) / len(parts) for name in parts[0]}


@torch.no_grad()
def eval_kl(policy_dir: Path, sft_dir: Path, prompts_file: Path, seed: int) -> float:
    """KL(pi || pi_sft) of a policy's own summaries (the first 200 posts of a file x 8, temperature 1, 24 tokens): the
    mean over the samples of log pi(y|x) - log pi_sft(y|x), each summed over the summary's tokens (eval/kl's
    estimate, evaluation.measure.measure); the KL at which methods are compared, unlike GRPO's per-token train/kl."""
    from data.tokenizer import get_tokenizer
    from evaluation.measure import load_frontier_prompts, measure
    from model.weights import build_policy

    tok = get_tokenizer()
    prompts = load_frontier_prompts(str(prompts_file), "validation", 200, tok, 192, 24)
    policy, sft = build_policy(str(policy_dir)).eval(), build_policy(str(sft_dir)).eval()
    return measure(policy, sft, prompts, 8, 24, tok, torch.Generator().manual_seed(seed))["kl"]


@torch.no_grad()
def score_margins(score, triples: list[tuple[list[int], list[int], list[int]]]) -> torch.Tensor:
    """score(prompt + first) - score(prompt + second) for each (prompt, first, second) of token ids, in batches of 32
    collate_pairs rows; `score` maps such a batch to a score per row."""
    from data.tldr import collate_pairs

    margins = []
    for i in range(0, len(triples), 32):
        batch = collate_pairs(*zip(*triples[i : i + 32], strict=True))
        r = score(batch)
        margins.append(r[: batch["n_pairs"]] - r[batch["n_pairs"] :])
    return torch.cat(margins)


@torch.no_grad()
def swap_accuracy(score, pairs_file: Path, seed: int) -> float:
    """How often `score` (a collate_pairs batch -> a score per row) puts a summary above the same summary with one key
    item swapped for an invented one (data.synthetic.swap_key_item), over the summaries of a labelled-pairs file that
    name a key item: 1 when the scorer checks every item against the post, 0.5 when it cannot tell a key item from an
    invented one (it counts items)."""
    import random

    from data.synthetic import swap_key_item
    from data.tldr import encode_prompt, encode_response
    from data.tokenizer import get_tokenizer

    tok, rng = get_tokenizer(), random.Random(f"demo-swap/{seed}")
    triples = []
    for line in open(pairs_file, encoding="utf-8"):
        row = json.loads(line)
        for text in (row["chosen"], row["rejected"]):
            swapped = swap_key_item(row["prompt"], text, rng)
            if swapped is not None:
                triples.append(
                    (
                        encode_prompt(tok, row["prompt"], 192),
                        encode_response(tok, text, 32),
                        encode_response(tok, swapped, 32),
                    )
                )
    return int((score_margins(score, triples) > 0).sum()) / len(triples)


def reward_probes(out: Path, pairs_file: Path, prompts_file: Path, seed: int) -> dict:
    """swap_accuracy of the reward model (its score), of DPO's implicit reward (log pi_dpo - log pi_sft of the
    summary; beta does not change the order) and of the SFT policy's own log-likelihood of the summary (which
    prefers the item it would copy); and the reward model's appended_item_gains on the first 200 prompts of
    `prompts_file`, in its normalised units (the std of its rewards over SFT samples: what GRPO reads)."""
    from evaluation.preference import pair_logprobs, reward_scores
    from model.weights import build_policy, build_reward_model

    rm = build_reward_model(str(out / "rm" / "hf")).eval()
    dpo, sft = build_policy(str(out / "dpo" / "hf")).eval(), build_policy(str(out / "sft" / "hf")).eval()
    gains = appended_item_gains(lambda b: rm.normalize(reward_scores(rm, b, "cpu")), prompts_file, 200, seed)
    return {
        "rm_swap_accuracy": swap_accuracy(lambda b: reward_scores(rm, b, "cpu"), pairs_file, seed),
        "dpo_swap_accuracy": swap_accuracy(
            lambda b: pair_logprobs(dpo, b, "cpu") - pair_logprobs(sft, b, "cpu"), pairs_file, seed
        ),
        "sft_swap_accuracy": swap_accuracy(lambda b: pair_logprobs(sft, b, "cpu"), pairs_file, seed),
        "rm_append_correct": gains["append_correct"],
        "rm_append_invented": gains["append_invented"],
    }


@torch.no_grad()
def appended_item_gains(score, prompts_file: Path, n_prompts: int, seed: int) -> dict:
    """What `score` (a collate_pairs batch -> a score per row) gains by appending the post's feeling to a summary
    naming its person and object, and by appending an invented feeling (data.synthetic.appended_item_summaries; gold
    +1 and -1), means over the first `n_prompts` prompts of a file: (append_correct, append_invented). A scorer that
    checks items gives the first > 0 > the second; one that pays for naming items gives both > 0, and GRPO against
    it gains by naming more items, invented or not."""
    import random

    from data.synthetic import appended_item_summaries
    from data.tldr import PROMPT_COLUMNS, encode_prompt, encode_response, load_rows
    from data.tokenizer import get_tokenizer

    tok, rng = get_tokenizer(), random.Random(f"demo-append/{seed}")
    prompts = [row["prompt"] for row in load_rows(str(prompts_file), "train", PROMPT_COLUMNS)[:n_prompts]]
    quads = [
        (encode_prompt(tok, p, 192), *(encode_response(tok, s, 32) for s in appended_item_summaries(p, rng)))
        for p in prompts
    ]  # (prompt, base, right, invented)
    right = score_margins(score, [(p, r, b) for p, b, r, _ in quads])
    invented = score_margins(score, [(p, i, b) for p, b, _, i in quads])
    return {"append_correct": float(right.double().mean()), "append_invented": float(invented.double().mean())}
