"""Supervised fine-tuning of GPT-2 on Reddit TL;DR (trl-lib/tldr).

    python sft.py                                    # one device
    torchrun --nproc_per_node=2 sft.py               # two GPUs (or two CPU processes over gloo)
    python sft.py --help                             # every option

The loss is the negative log-likelihood of the response tokens (the summary and its "\n" end token; one micro-batch's:
training/nll.py), summed and divided by the number of response tokens in the whole global batch, over all ranks and
accumulation steps, so the gradient is the same for any world size and micro-batch size. With --lora_rank r only LoRA
adapters on the attention and MLP projections train (model/lora.py), and the export merges them into a plain GPT-2.
"""

import time
from dataclasses import dataclass

import torch

from data.tldr import SFT_COLUMNS, SFTDataset, ShardedLoader, load_rows, real_rows, validation_batches
from data.tokenizer import get_tokenizer
from evaluation.samples import Judge, JudgeConfig, SampleLog
from model.lora import LoRAConfig, apply_lora, trainable_summary
from model.weights import build_policy, model_config, save_export
from training.nll import prompt_targets, response_nll_sum, weighted_nll_sum
from utils.config import (
    ConfigError,
    DataConfig,
    OptimConfig,
    RunConfig,
    accumulation_steps,
    fit_context,
    option,
    parse_config,
)
from utils.dist import all_reduce_sum, stream_seed
from utils.fsdp import shard_model
from utils.guard import exit_on_error
from utils.logging import track
from utils.metrics import metric
from utils.optim import accumulate_micro_batches, build_optimization, guarded_step, step_throughput
from utils.run import check_best_metric, end_of_step, epoch_steps, finish, resume, start_run


@dataclass
class Config(RunConfig, OptimConfig, DataConfig, LoRAConfig, JudgeConfig):  # shared options; --judge: win rate
    # --- models
    model: str = option("gpt2", model="policy")
    """Starting weights: a hub name (gpt2, gpt2-medium, gpt2-large, gpt2-xl), a local Hugging Face-format
    folder, or with --random_init a preset (tiny, small, gpt2, ...)."""
    random_init: bool = False
    """Start from random GPT-2 initialisation of the preset named by --model instead of loading weights."""
    # --- data
    max_response_len: int = 64
    """Response tokens kept, including the "\\n" end token."""
    # --- batch sizes and optimisation
    batch_size: int = 64
    """Global batch size (rows per optimizer step, over all ranks)."""
    micro_batch_size: int = 8
    """Rows per forward/backward on each rank; batch_size / (micro_batch_size * world) accumulation steps."""
    group_by_length: bool = True
    """Each step's rows (all ranks) sorted by length and dealt out as micro-batches, validation rows too: less padding
    computed, the same gradient up to float summation order. false: each rank's own slice, in loader order."""
    # --- objective
    prompt_loss_weight: float = 0.0
    """Weight of the next-token loss on prompt tokens, relative to response tokens. 0 (the default) trains on the
    response only, as is usual for TL;DR SFT from pretrained GPT-2. On the embedded demo (a model from scratch) a
    weight of 0.1 or 1.0 did not bring its copying of the post's key items sooner (docs/results.md)."""
    prompt_loss_positions: int = 16
    """With --prompt_loss_weight > 0: prompt tokens per row drawn (uniformly, anew each step) for an unbiased
    estimate of the prompt loss; each drawn token is scaled by the row's prompt length / the number drawn."""
    # shared options, with this stage's defaults
    eval_every: int = 100
    """Validation loss every N steps and after the last; 0: only after the last; -1: never."""
    eval_samples: int = 4
    """Validation prompts whose greedy summaries are logged at every evaluation (samples.jsonl, a wandb table);
    0: none."""
    out_dir: str = "runs/sft"
    run_name: str = "sft"

    def validate(self) -> None:
        self.validate_shared()  # --model, data, run, optimisation (and LoRA) options
        if self.eval_samples < 0:
            raise ConfigError(f"--eval_samples must be >= 0, got {self.eval_samples}")
        self.validate_judge()
        for name in ("batch_size", "micro_batch_size", "max_response_len"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name} must be positive, got {getattr(self, name)}")


def accumulate_gradients(
    model,
    micro_batches: list[dict],
    world: int,
    device,
    prompt_weight: float = 0.0,
    prompt_positions: int = 0,
    draw_seed: int | None = None,
) -> float:
    """Forward and backward over this rank's micro-batches of one optimizer step; returns the global loss.

    Every rank's summed NLL is divided by the (weighted) token count of the *global* batch (utils/optim.py
    accumulate_micro_batches), so the gradient is d(sum of all NLL / global count), whatever the world size or the
    number of micro-batches."""
    n_tokens = sum(b["response_mask"].sum().float() for b in micro_batches)
    if prompt_weight:
        n_tokens = n_tokens + prompt_weight * sum(prompt_targets(b).sum().float() for b in micro_batches)
    n_tokens = all_reduce_sum(n_tokens.to(device))

    def loss_of(batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        s = weighted_nll_sum(model, batch, prompt_weight, prompt_positions, draw_seed, device)
        return s, s.detach().float()

    sums = accumulate_micro_batches(model, micro_batches, loss_of, world, n_tokens)
    return float(all_reduce_sum(sum(sums, torch.zeros((), device=device))) / n_tokens)


metric("val/loss", "min", "token-averaged NLL of the validation summaries", headline=("sft",))


@torch.no_grad()
def evaluate(model, loader_batches: list[dict], device, rows: int = 0) -> float:
    """Token-averaged validation NLL over all ranks (a collective: every rank holds as many batches, see
    validation_batches). `rows`: the validation rows over all ranks, for the progress shown."""
    model.eval()
    nll, count = torch.zeros((), device=device), torch.zeros((), device=device)
    for batch in track(loader_batches, "validation loss", rows or sum(map(real_rows, loader_batches)), real_rows):
        s, n = response_nll_sum(model, batch, device)
        nll += s.float()
        count += n
    model.train()
    return float(all_reduce_sum(nll) / all_reduce_sum(count).clamp(min=1))


def main(cfg: Config) -> dict:
    # 1. distributed set-up and every check that needs no data and no weights: sizes, the model's config, the
    #    run directory and the checkpoint to resume from (all before any model is built or put on a GPU)
    model_cfg = model_config(cfg.model, cfg.random_init, kind="policy")
    fit_context(cfg, (model_cfg, "max_response_len", "model"), *cfg.judge_limits(model_cfg))
    run = start_run(cfg, {"stage": "sft", "model_config": model_cfg.to_dict(), "lora": cfg.lora_meta()})
    rank, world, device = run.rank, run.world, run.device
    accum = accumulation_steps(cfg.batch_size, cfg.micro_batch_size, world)

    # 2. data: tokenize, shard per rank, shuffle per epoch
    tok = get_tokenizer()
    train_rows, name = load_rows(cfg.train_data, cfg.train_split, SFT_COLUMNS), f"{cfg.train_data}[{cfg.train_split}]"
    train = SFTDataset(train_rows, tok, cfg.max_prompt_len, cfg.max_response_len, name=name)
    lengths = train.lengths() if cfg.group_by_length else None  # each step's rows sorted by length, dealt out
    loader = ShardedLoader(len(train), cfg.micro_batch_size, rank, world, cfg.seed, train.collate, lengths)
    val_batches, samples = [], None
    if cfg.val_data and cfg.eval_every >= 0:
        val_rows = load_rows(cfg.val_data, cfg.val_split, SFT_COLUMNS)
        val_rows = val_rows[: cfg.val_rows] if cfg.val_rows else val_rows
        val = SFTDataset(
            val_rows, tok, cfg.max_prompt_len, cfg.max_response_len, name=f"{cfg.val_data}[{cfg.val_split}]"
        )
        val_batches = validation_batches(val, rank, world, cfg.micro_batch_size, cfg.group_by_length)
        samples = SampleLog(
            val_rows[: cfg.eval_samples], "completion", tok, cfg.max_prompt_len, cfg.max_response_len, cfg.seed
        )
    total_steps = epoch_steps(cfg.steps, loader.n_examples, loader.batches_per_epoch, accum, cfg.batch_size)

    # 3. model (with LoRA: frozen, plus trainable adapters), FSDP, optimizer over the trainable parameters
    model = build_policy(cfg.model, cfg.random_init)
    if cfg.lora_enabled:
        apply_lora(model, cfg)
    run.say(f"sft: {trainable_summary(model)}")
    shard_model(model, run.dtype, activation_checkpointing=cfg.activation_checkpointing).to(device)
    judge = None  # --judge: its reward model and posts, for the win rate at every evaluation
    if cfg.judge:
        judge = Judge(cfg, tok, cfg.max_prompt_len, run.dtype, device, 2 * cfg.micro_batch_size, cfg.seed)
    check_best_metric(cfg, ({"val/loss"} if val_batches else set()) | (judge.metric_names("val/") if judge else set()))
    optimizer, scheduler = build_optimization(model, cfg, total_steps)

    # 4. resume: weights, optimizer, schedule, every rank's RNG, data position, best validation so far
    step = resume(run, cfg, model, optimizer, scheduler, loader, total_steps)
    run.say(f"sft: {len(train)} rows, world {world}, {accum} accumulation steps, {total_steps} steps")
    model.train()
    metrics, stopping = {}, False
    with run.stop:  # SIGTERM / SIGINT: finish the step, save, exit 0
        while step < total_steps:
            t0 = time.perf_counter()
            # 5. one optimizer step: the loss is normalised by the global count of response tokens; a non-finite
            #    loss or gradient norm stops the run, or skips the step (--on_nonfinite)
            micro = loader.next_step(accum)
            draw_seed = stream_seed(cfg.seed, step, "prompt_positions")  # from the step: resumes exactly
            loss = accumulate_gradients(
                model, micro, world, device, cfg.prompt_loss_weight, cfg.prompt_loss_positions, draw_seed
            )
            metrics = {"train/loss": loss}
            guarded_step(model, optimizer, scheduler, run.guard, step + 1, metrics, cfg.grad_clip)
            step += 1

            # 6. log, validate, checkpoint (on schedule, at the end, at a new best, or when a signal came)
            metrics.update(step_throughput(micro, time.perf_counter() - t0, world, device))
            if val_batches and cfg.eval_due(step, total_steps):
                metrics["val/loss"] = evaluate(model, val_batches, device, len(val))
                samples.log(run.logger, model, step)
            if judge is not None and cfg.eval_due(step, total_steps):
                metrics.update(judge.evaluate(model, "val/"))
            stopping = end_of_step(run, cfg, step, total_steps, metrics, model, optimizer, scheduler, loader)
            if stopping:
                break

    # 7. export a Hugging Face-format folder for the next stage (not after a signal: the run is not finished)
    finish(run, model, step, metrics, stopping, lambda sd: save_export(model, sd, model_cfg, run.dir / "hf"))
    return metrics


if __name__ == "__main__":
    with exit_on_error():
        main(parse_config(Config, description=__doc__.split("\n\n")[0]))
