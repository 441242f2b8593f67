"""Padding computed for nothing, per stage, on real TL;DR rows: real tokens / computed tokens of every micro-batch
the training loaders build, with and without --group_by_length, and the SFT step's time on the same micro-batches.

    python -m bench.padding                    # ../shared/data, the stages' default batch sizes, 1 and 2 ranks
    python -m bench.padding --time_steps 3     # also time SFT steps, grouped vs not, interleaved (tiny preset)

Rows: ../shared/data/tldr-validation-sample.jsonl (SFT: prompt, completion) and
tldr-preference-validation-sample.jsonl (reward model and DPO: prompt, chosen, rejected), tokenized as the scripts
tokenize them (max prompt 512, max response 64). Each stage's loader is data.tldr.ShardedLoader with the stage's
own collate, batch 64 and micro-batch 8 (the defaults), every optimizer step of one epoch, for every rank.

GRPO: the same validation posts as prompts, 256 per step over the ranks, 64 samples each scored in micro-batches of
128, 8 kept each trained in micro-batches of 32 (its defaults), its micro-batches cut by each rank.

Computed tokens are the positions the model's forward runs on:
    SFT                      rows x (longest prompt + longest response) of the micro-batch (data.tldr.collate_sft)
    pairs, prefix sharing    B x longest prompt + 2B x longest response (one packed row, evaluation.preference)
    pairs, padded rows       2B x (longest prompt + longest response) (data.tldr.collate_pairs)
    GRPO, prefix sharing     prompts x longest prompt + rows x longest response (rollouts.sampling.shared_prompt_rows)
Real tokens are the prompt and response tokens themselves (a pair's prompt counted once when it is shared, twice
when each response row carries its copy).
"""

import argparse
import statistics
import time
from pathlib import Path

import torch

import sft
from data.tldr import (
    PREF_COLUMNS,
    SFT_COLUMNS,
    PreferenceDataset,
    SFTDataset,
    ShardedLoader,
    collate_pairs,
    collate_sft,
    load_rows,
    pad_prompts,
)
from data.tokenizer import get_tokenizer
from model.gpt2 import PRESETS, GPT2LMHeadModel
from rollouts.sampling import micro_batch_rows, shared_prompt_rows

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def sft_tokens(batch: dict) -> tuple[int, int]:
    """(real, computed) tokens of a collate_sft micro-batch."""
    return int(batch["attention_mask"].sum()), batch["input_ids"].numel()


def pair_tokens(batch: dict, prefix_sharing: bool) -> tuple[int, int]:
    """(real, computed) tokens of a collate_pairs micro-batch, as the pair stages lay it out."""
    B, P = batch["n_pairs"], batch["prompt_len"]
    prompt_real = int(batch["attention_mask"][:B, :P].sum())
    response_real = int(batch["response_mask"].sum())
    R = batch["response_ids"].shape[1]
    if prefix_sharing:
        return prompt_real + response_real, B * P + 2 * B * R
    return 2 * prompt_real + response_real, 2 * B * (P + R)


def epoch_ratio(n, lengths, collate, tokens, world, batch, micro) -> float:
    """Real / computed tokens over every optimizer step of one epoch, summed over ranks."""
    accum = batch // (micro * world)
    loaders = [ShardedLoader(n, micro, r, world, 0, collate, lengths) for r in range(world)]
    real = computed = 0
    for _ in range(loaders[0].batches_per_epoch // accum):  # whole steps of one epoch
        for loader in loaders:
            for b in loader.next_step(accum):
                r, c = tokens(b)
                real, computed = real + r, computed + c
    return real / computed


def ratios(world: int, batch: int, micro: int) -> list[tuple[str, float, float]]:
    tok = get_tokenizer()
    out = []
    sft_ds = SFTDataset(load_rows(str(DATA / "tldr-validation-sample.jsonl"), "train", SFT_COLUMNS), tok, 512, 64)

    def collate(i):
        return collate_sft([sft_ds.prompts[j] for j in i], [sft_ds.responses[j] for j in i])

    per = [
        epoch_ratio(len(sft_ds), lengths, collate, sft_tokens, world, batch, micro)
        for lengths in (None, sft_ds.lengths())
    ]
    out.append(("SFT", *per))
    rows = load_rows(str(DATA / "tldr-preference-validation-sample.jsonl"), "train", PREF_COLUMNS)
    pairs = PreferenceDataset(rows, tok, 512, 64)

    def collate_p(i):
        return collate_pairs(
            [pairs.prompts[j] for j in i], [pairs.chosen[j] for j in i], [pairs.rejected[j] for j in i]
        )

    for sharing, label in ((True, "reward model / DPO (prefix sharing)"), (False, "reward model / DPO (padded rows)")):
        per = [
            epoch_ratio(len(pairs), lengths, collate_p, lambda b, s=sharing: pair_tokens(b, s), world, batch, micro)
            for lengths in (None, pairs.lengths())
        ]
        out.append((label, *per))
    return out


def grpo_ratios(
    world: int, key: str, prompts_per_step=256, samples=64, kept=8, micro=32, score_micro=128, new_tokens=53
) -> dict[str, float]:
    """GRPO's (scoring, update) real / computed tokens at its defaults (prefix sharing: each micro-batch's prompts
    once, rollouts.sampling.shared_prompt_rows) over the steps of one epoch of the real prompts, all ranks, with the
    micro-batches cut as rollouts.sampling.micro_batch_rows cuts them, also for their prompt and response columns apart
    ("score/prompts", ...): `key` "none" (--group_by_length false), "prompt"
    (true: each rank's groups by prompt length), or "prompt+response" (by prompt length + the group's longest
    response, an alternative measured against it). Response lengths are not known without a policy: each sample
    takes the length of a reference summary drawn at random (the summaries' own lengths, end token included, cut at
    `new_tokens`)."""
    tok = get_tokenizer()
    ds = SFTDataset(load_rows(str(DATA / "tldr-validation-sample.jsonl"), "train", SFT_COLUMNS), tok, 512, new_tokens)
    summary_lengths = torch.tensor([len(r) for r in ds.responses])
    g = torch.Generator().manual_seed(0)
    per_rank = prompts_per_step // world
    totals = {f"{stage}{part}": [0, 0] for stage in ("score", "update") for part in ("", "/prompts", "/responses")}
    for rank in range(world):
        loader = ShardedLoader(len(ds), per_rank, rank, world, 0, lambda idx: idx)
        for _ in range(loader.batches_per_epoch):
            prompt_ids, prompt_mask = pad_prompts([ds.prompts[i] for i in next(loader)])
            lengths = summary_lengths[torch.randint(len(ds), (per_rank * samples,), generator=g)]
            response_mask = torch.arange(new_tokens)[None, :] < lengths[:, None]  # (B*G, new_tokens)
            response_ids = torch.where(response_mask, 1, 0)
            kept_rows = torch.arange(per_rank * samples).view(per_rank, samples)[:, :kept].reshape(-1)  # (B*K,)
            for stage, rows_all, size, per_prompt in (
                ("score", torch.arange(per_rank * samples), score_micro, samples),
                ("update", kept_rows, micro, kept),
            ):
                longest_response = lengths[rows_all].view(-1, per_prompt).amax(1)  # (B,)
                prompt_lengths = {
                    "none": None,
                    "prompt": prompt_mask.sum(1),
                    "prompt+response": prompt_mask.sum(1) + longest_response,
                }[key]
                for index in micro_batch_rows(rows_all // samples, prompt_lengths, size):
                    rows = rows_all[index]
                    batch = shared_prompt_rows(
                        prompt_ids, prompt_mask, response_ids[rows], response_mask[rows], rows // samples
                    )
                    real, computed = int(batch["attention_mask"].sum()), batch["input_ids"].numel()
                    response_real, response_computed = int(batch["response_mask"].sum()), batch["response_mask"].numel()
                    for part, r, c in (
                        ("", real, computed),
                        ("/prompts", real - response_real, computed - response_computed),
                        ("/responses", response_real, response_computed),
                    ):
                        totals[stage + part][0] += r
                        totals[stage + part][1] += c
    return {k: real / computed for k, (real, computed) in totals.items()}


def time_sft(steps: int, preset: str, rows: int) -> tuple[float, float, float]:
    """Median seconds of sft.accumulate_gradients over one step's micro-batches (the loader's first step: `rows` real
    rows, one process, micro-batch 8), without and with grouping by length, the two interleaved; and the relative
    gradient difference between them. Prompts are cut to fit the preset's positions (448 tokens for tiny)."""
    tok = get_tokenizer()
    cfg = PRESETS[preset]
    max_prompt = min(512, cfg.n_positions - 64)  # as the scripts fit --max_prompt_len to the model
    ds = SFTDataset(load_rows(str(DATA / "tldr-validation-sample.jsonl"), "train", SFT_COLUMNS), tok, max_prompt, 64)

    def collate(i):
        return collate_sft([ds.prompts[j] for j in i], [ds.responses[j] for j in i])

    plain = ShardedLoader(len(ds), 8, 0, 1, 0, collate).next_step(rows // 8)
    grouped = ShardedLoader(len(ds), 8, 0, 1, 0, collate, ds.lengths()).next_step(rows // 8)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    times = {"plain": [], "grouped": []}
    grads = {}
    for i in range(steps + 1):
        for name, micro in (("plain", plain), ("grouped", grouped)):
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            sft.accumulate_gradients(model, micro, 1, torch.device("cpu"))
            if i:  # the first round warms up
                times[name].append(time.perf_counter() - t0)
            grads[name] = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    diff = float((grads["plain"] - grads["grouped"]).norm() / grads["plain"].norm())
    return statistics.median(times["plain"]), statistics.median(times["grouped"]), diff


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=64, help="global batch (rows or pairs per optimizer step)")
    p.add_argument("--micro", type=int, default=8, help="rows (pairs) per micro-batch")
    p.add_argument("--time_steps", type=int, default=0, help="also time this many SFT steps of each kind (0: none)")
    p.add_argument("--preset", default="tiny", help="model.gpt2 preset of the timed SFT steps")
    args = p.parse_args()
    if not DATA.is_dir():
        raise SystemExit(f"error: {DATA} is absent: this benchmark reads the real TL;DR rows there")
    print(f"real / computed tokens, one epoch, batch {args.batch}, micro-batch {args.micro}")
    print(f"{'stage':40s} {'ranks':>5s} {'ungrouped':>10s} {'grouped':>8s}")
    for world in (1, 2):
        for label, plain, grouped in ratios(world, args.batch, args.micro):
            print(f"{label:40s} {world:5d} {plain:10.3f} {grouped:8.3f}")
    for world in (1, 2):
        plain, grouped, both = (grpo_ratios(world, key) for key in ("none", "prompt", "prompt+response"))
        for stage in ("score", "update"):
            label = f"GRPO {'scoring' if stage == 'score' else 'update'} (prefix sharing)"
            print(
                f"{label:40s} {world:5d} {plain[stage]:10.3f} {grouped[stage]:8.3f}  "
                f"(prompt columns {plain[stage + '/prompts']:.3f} -> {grouped[stage + '/prompts']:.3f}, response "
                f"columns {plain[stage + '/responses']:.3f} -> {grouped[stage + '/responses']:.3f}; groups by prompt "
                f"+ response length: {both[stage]:.3f})"
            )
    if args.time_steps:
        t_plain, t_grouped, diff = time_sft(args.time_steps, args.preset, args.batch)
        print(
            f"SFT step ({args.preset}, {args.batch} rows, micro-batch 8, one process, fp32 CPU, median of "
            f"{args.time_steps}): ungrouped {t_plain:.3f} s, grouped {t_grouped:.3f} s ({t_plain / t_grouped:.2f}x); "
            f"gradient relative difference {diff:.1e}"
        )


if __name__ == "__main__":
    main()
