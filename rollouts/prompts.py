"""A rank's set of prompts with what GRPO's reward sources need to score their responses."""

from dataclasses import dataclass

import torch

from data.tldr import PROMPT_COLUMNS, DataError, PromptDataset, load_optional_column, load_rows, pad_prompts
from rlhf.rewards import RewardSource, row_sources


@dataclass
class PromptSet:
    """Prompts of this rank with what the reward sources need: token ids (B, P) left-padded, texts, dataset rows
    (for error messages), which sources apply to each prompt (B, S), and the dataset's name."""

    ids: torch.Tensor
    mask: torch.Tensor
    texts: list[str]
    rows: list[int]
    applies: torch.Tensor
    where: str
    counted: torch.Tensor | None = None
    """(B,) bool: the prompts an evaluation's means count; False for the padding copies that give every rank as many
    prompts (evaluation/summaries.py). None: every prompt counts."""


def prompt_set(dataset: PromptDataset, index: list[int], applies: torch.Tensor, device, where: str) -> PromptSet:
    """This rank's prompts `index` of `dataset`, left-padded on `device`; applies (rows of the dataset, S)."""
    ids, mask = (t.to(device) for t in pad_prompts([dataset.prompts[i] for i in index]))  # (B, P) left-padded
    return PromptSet(ids, mask, [dataset.texts[i] for i in index], list(index), applies[index], where)


def training_prompts(cfg, tok, sources: list[RewardSource]) -> tuple[PromptDataset, torch.Tensor, str]:
    """--train_data's prompts (cut to --max_prompt_len), which sources apply to each row (rows, S) (--reward_column)
    and the data's name for error messages."""
    where = f"{cfg.train_data}[{cfg.train_split}]"
    rows = load_rows(cfg.train_data, cfg.train_split, PROMPT_COLUMNS)
    dataset = PromptDataset(rows, tok, cfg.max_prompt_len, name=where)
    return dataset, source_applies(cfg.reward_column, cfg.train_data, cfg.train_split, len(dataset), sources), where


def source_applies(column_name: str, data: str, split: str, n_rows: int, sources: list[RewardSource]) -> torch.Tensor:
    """(n_rows, S) bool: the sources each row of `data` names in its column `column_name` (--reward_column); every
    source for a dataset without one."""
    column = load_optional_column(data, split, column_name) if column_name else None
    if column is None:
        return torch.ones(n_rows, len(sources), dtype=torch.bool)
    if len(column) != n_rows:
        raise DataError(f"{data}[{split}]: {len(column)} values in column {column_name!r} for {n_rows} rows")
    return row_sources(column, sources, f"{data}[{split}] column {column_name!r}")
