"""Preference pairs of a policy's own summaries labelled by a gold reward model, the setting of Gao, Schulman and
Hilton 2022 (arXiv 2210.10760) on real data: a larger gold reward model stands in for the human labellers, the proxy
reward model trains on its labels (reward_model.py, unchanged), and every policy is scored by the gold model
(dpo.py / grpo.py --frontier_gold_model, python -m evaluation.frontier --gold_model). docs/reporting.md gives the
whole procedure on TL;DR.

    python -m evaluation.label_pairs --policy runs/sft/hf --gold_model runs/gold_rm/hf --prompts trl-lib/tldr \\
        --split train --n_prompts 20000 --out runs/gold_pairs/train.jsonl

Each of the first --n_prompts distinct prompts gets --samples summaries sampled from the policy at --temperature;
the gold model scores each summary that ended by itself and says something, on the tokens the proxy will read
(the written text encoded as reward_model.py's loader encodes it: data.tldr.encode_response); each prompt's
summaries are then paired by data.labels.pairs_by_score (disjoint pairs in sample order, the higher gold score
chosen, ties no pair). Rows in trl-lib/tldr-preference's layout, prompt, chosen, rejected (the summaries without
the end token, which the loader appends), plus gold_chosen and gold_rejected: the gold model's normalized scores.
"""

import json
import time
from pathlib import Path

import torch

from data.labels import pairs_by_score
from data.tldr import decode_responses
from data.tokenizer import END
from evaluation.measure import FrontierPrompts, load_frontier_prompts
from evaluation.samples import sample_summaries
from evaluation.summaries import reference_summaries
from rollouts.sampling import score


def usable_summary(text: str) -> bool:
    """A summary (as decode_responses gives it) that can be labelled: it ended by itself (a summary cut at the token
    budget would be read with an end token it never chose) and says something once stripped (the loader refuses an
    empty one)."""
    return text.endswith(END) and bool(text[: -len(END)].strip())


def labelled_rows(
    prompts: list[str], summaries: list[list[str]], scores: list[list[float]], usable: list[list[bool]]
) -> list[dict]:
    """The pairs of every prompt (data.labels.pairs_by_score of its summaries' scores), as rows: prompt, chosen,
    rejected (each without its end token), gold_chosen, gold_rejected."""
    rows = []
    for prompt, texts, values, ok in zip(prompts, summaries, scores, usable, strict=True):
        for i, j in pairs_by_score(values, ok):
            rows.append(
                {
                    "prompt": prompt,
                    "chosen": texts[i].removesuffix(END),
                    "rejected": texts[j].removesuffix(END),
                    "gold_chosen": values[i],
                    "gold_rejected": values[j],
                }
            )
    return rows


@torch.no_grad()
def gold_scores(
    gold_model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, rows: list[tuple[int, str]], tok, max_len: int
) -> list[float]:
    """The gold model's normalized score (gain * raw + bias) of each (prompt index, summary text without its end
    token) of `rows`, the summary encoded as the pair loader encodes it (data.tldr.encode_response, cut to `max_len`
    tokens with the end token)."""
    if not rows:
        return []
    device = prompt_ids.device
    samples = reference_summaries([text for _, text in rows], tok, max_len, device)
    of_row = torch.tensor([p for p, _ in rows], device=device)
    raw = score(gold_model, prompt_ids[of_row], prompt_mask[of_row], samples, 1, 64, prefix_sharing=False)
    return gold_model.normalize(raw).double().cpu().tolist()


@torch.no_grad()
def label_policy_samples(
    policy,
    gold_model,
    prompts: FrontierPrompts,
    samples: int,
    max_new_tokens: int,
    tok,
    generator: torch.Generator,
    temperature: float = 1.0,
) -> tuple[list[dict], dict[str, int]]:
    """`samples` summaries of each prompt from the policy, scored by the gold model and paired (module docstring).
    Returns the rows and the counts: prompts, summaries, usable (ended, not empty), pairs."""
    ids, mask, drawn = sample_summaries(
        policy, prompts.prompts, samples, max_new_tokens, temperature=temperature, generator=generator
    )
    texts = decode_responses(tok, drawn.response_ids, drawn.response_mask, drawn.has_end)
    P = len(prompts.prompts)
    by_prompt = [texts[p * samples : (p + 1) * samples] for p in range(P)]
    usable = [[usable_summary(t) for t in group] for group in by_prompt]
    rows = [(p, t.removesuffix(END)) for p in range(P) for t, ok in zip(by_prompt[p], usable[p], strict=True) if ok]
    values = iter(gold_scores(gold_model, ids, mask, rows, tok, max_new_tokens))
    scores = [[next(values) if ok else float("nan") for ok in group] for group in usable]
    labelled = labelled_rows(prompts.texts, by_prompt, scores, usable)
    counts = {"prompts": P, "summaries": P * samples, "usable": len(rows), "pairs": len(labelled)}
    return labelled, counts


def main(argv: list[str] | None = None) -> dict[str, int]:
    """python -m evaluation.label_pairs --policy DIR --gold_model DIR --prompts SOURCE --out FILE: the labelled pairs
    (module docstring) as a .jsonl file; returns the counts."""
    import argparse

    from data.tokenizer import get_tokenizer
    from model.weights import build_policy, build_reward_model, model_config
    from utils.dist import stream

    p = argparse.ArgumentParser(description=main.__doc__.split("\n\n")[0])
    p.add_argument("--policy", required=True, help="the policy whose summaries are labelled (sft.py's hf/ folder)")
    p.add_argument(
        "--gold_model",
        required=True,
        help="the gold reward model (reward_model.py's hf/ folder, larger than the proxy) whose normalized score "
        "labels each pair",
    )
    p.add_argument("--prompts", required=True, help="prompts: a hub dataset, a .jsonl/.parquet file or a folder")
    p.add_argument("--split", default="train", help="split of --prompts")
    p.add_argument("--n_prompts", type=int, default=1000, help="the first N distinct prompts of --prompts")
    p.add_argument("--samples", type=int, default=2, help="summaries per prompt (up to samples // 2 pairs each)")
    p.add_argument("--max_new_tokens", type=int, default=53, help="tokens per summary, the end token included")
    p.add_argument(
        "--max_prompt_len",
        type=int,
        default=448,
        help="tokens per prompt at most (cut from the start of the post); give reward_model.py's, so that the gold "
        "model labels what the proxy will read",
    )
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    p.add_argument("--seed", type=int, default=0, help="seed of the samples")
    p.add_argument("--device", default="", help="cpu or cuda; empty: cuda when there is one")
    p.add_argument("--out", required=True, help="the .jsonl file of pairs (its folder is created)")
    args = p.parse_args(argv)
    if args.samples < 2:
        p.error(f"--samples must be at least 2 (a pair), got {args.samples}")
    if args.n_prompts < 1:
        p.error(f"--n_prompts must be positive, got {args.n_prompts}")
    if args.temperature <= 0:
        p.error(f"--temperature must be positive, got {args.temperature}")
    if Path(args.out).suffix != ".jsonl":
        p.error(f"--out must be a .jsonl file, got {args.out}")
    # each model's kind before anything is read (a policy as --gold_model would score with a random head)
    model_config(args.policy, kind="policy", option="--policy")
    model_config(args.gold_model, kind="reward_model", option="--gold_model")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tok = get_tokenizer()
    t0 = time.time()
    prompts = load_frontier_prompts(
        args.prompts, args.split, args.n_prompts, tok, args.max_prompt_len, args.max_new_tokens
    )
    policy = build_policy(args.policy).to(device).eval()
    gold_model = build_reward_model(args.gold_model).to(device).eval()
    generator = stream(args.seed, 0, 0, "label-pairs", device=device)
    rows, counts = label_policy_samples(
        policy, gold_model, prompts, args.samples, args.max_new_tokens, tok, generator, args.temperature
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(
        f"{counts['pairs']} pairs from {counts['prompts']} prompts x {args.samples} summaries of {args.policy} "
        f"({counts['usable']} of {counts['summaries']} ended and say something), labelled by {args.gold_model}: "
        f"wrote {out} ({time.time() - t0:.0f} s)"
    )
    return counts


if __name__ == "__main__":
    from utils.guard import exit_on_error

    with exit_on_error():  # a user error (ConfigError, ModelLoadError, ...): one `error:` line and its exit code
        main()
