"""Preference pairs as reward_model.py and dpo.py train on them: the options both scripts declare (PairConfig) and
what they build from them (PairData: the tokenized training pairs, their resumable sharded loader, the fixed batch of
--overfit_batch, and the validation EvalSet of evaluation/preference.py, split disjointly over ranks).

Both stages read the same (prompt, chosen, rejected) rows and batch them the same way (collate_pairs: chosen rows
0..B-1, rejected rows B..2B-1, one forward pass for both), so they take their data from here; what they do with a
batch (a scalar reward and the Bradley-Terry loss, or log-prob ratios and the DPO loss) stays in each script.
"""

from dataclasses import dataclass

from data.tldr import PREF_COLUMNS, PreferenceDataset, ShardedLoader, collate_pairs, load_rows
from evaluation.preference import EvalSet, build_eval_set
from utils.config import ConfigError, DataConfig


@dataclass
class PairConfig(DataConfig):
    train_data: str = "trl-lib/tldr-preference"
    val_data: str = "trl-lib/tldr-preference"
    # --- data
    max_response_len: int = 64
    """Response tokens kept, including the "\\n" end token."""
    # --- batch sizes and optimisation
    batch_size: int = 64
    """Global batch size in pairs per optimizer step, over all ranks."""
    micro_batch_size: int = 8
    """Pairs per forward/backward on each rank (2x rows: chosen and rejected in one pass)."""
    group_by_length: bool = True
    """Each step's pairs (all ranks) sorted by length and dealt out as micro-batches, validation pairs too: less
    padding computed, the same gradient up to float summation order. false: each rank's own slice, in loader order."""
    overfit_batch: bool = False
    """Debugging: train every step on the first global batch (the loss should fall quickly)."""
    prefix_sharing: bool = True
    """Each pair's prompt computed once for both its responses, in training and evaluation (packed rows,
    evaluation.preference.packed_pairs): the same numbers up to rounding for about half the prompt tokens; false:
    one padded row per response (prompt + response, as transformers computes them)."""

    def validate_pairs(self) -> None:
        self.validate_data()
        for name in ("batch_size", "micro_batch_size", "max_response_len"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name} must be positive, got {getattr(self, name)}")


@dataclass
class PairData:
    rows: list[dict[str, str]]
    """The training rows as read (the reward model draws its normalisation prompts from them)."""
    train: PreferenceDataset
    loader: ShardedLoader
    """This rank's micro-batches of the training pairs, shuffled per epoch, resumable (utils/run.py's resume)."""
    val_set: EvalSet | None
    """This rank's slice of the validation pairs; None without --val_data or with --eval_every -1."""

    def collate(self, index: list[int]) -> dict:
        t = self.train
        return collate_pairs(
            [t.prompts[i] for i in index], [t.chosen[i] for i in index], [t.rejected[i] for i in index]
        )

    def step_batches(self, accum: int, overfit: bool):
        """This rank's `accum` micro-batches of each optimizer step, continuing from the loader's position. With
        `overfit`, always the first global batch of epoch 0, drawn without moving the loader (so resume is exact)."""
        fixed = self.loader.step_batches([(0, i) for i in range(accum)]) if overfit else None
        while True:
            yield fixed or self.loader.next_step(accum)


def load_pairs(cfg: PairConfig, tok, rank: int, world: int, seed: int, validate: bool) -> PairData:
    """Read and tokenize the training pairs, shard them over ranks, and (when `validate` and --val_data) build this
    rank's slice of the first --val_rows validation pairs."""
    rows = load_rows(cfg.train_data, cfg.train_split, PREF_COLUMNS)
    train = PreferenceDataset(
        rows, tok, cfg.max_prompt_len, cfg.max_response_len, name=f"{cfg.train_data}[{cfg.train_split}]"
    )
    data = PairData(rows, train, None, None)
    lengths = train.lengths() if cfg.group_by_length else None
    data.loader = ShardedLoader(len(train), cfg.micro_batch_size, rank, world, seed, data.collate, lengths)
    if validate and cfg.val_data:
        val_rows = load_rows(cfg.val_data, cfg.val_split, PREF_COLUMNS)
        val_rows = val_rows[: cfg.val_rows] if cfg.val_rows else val_rows
        data.val_set = build_eval_set(
            val_rows,
            tok,
            cfg.max_prompt_len,
            cfg.max_response_len,
            cfg.micro_batch_size,
            rank,
            world,
            name=f"{cfg.val_data}[{cfg.val_split}]",
            by_length=cfg.group_by_length,
        )
    return data
