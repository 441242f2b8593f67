"""Supervised fine-tuning of GPT-2 on Reddit TL;DR (trl-lib/tldr).

    python sft.py                                    # one device
    torchrun --nproc_per_node=2 sft.py               # two GPUs (or two CPU processes over gloo)
    python sft.py --help                             # every option

The loss is the negative log-likelihood of the response tokens (the summary and its "\n" end token), summed
and divided by the number of response tokens in the whole global batch, over all ranks and accumulation
steps, so the gradient is the same for any world size and micro-batch size. With --lora_rank r only LoRA adapters
on the attention and MLP projections train (model/lora.py), and the export merges them into a plain GPT-2.
"""

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from data.tldr import SFT_COLUMNS, SFTDataset, ShardedLoader, collate_sft, load_rows
from data.tokenizer import get_tokenizer
from model.lora import LoRAConfig, apply_lora, trainable_summary
from model.weights import build_policy, model_config
from utils.checkpoint import export_hf, find_checkpoint, load_checkpoint, restore_loader, save_checkpoint, update_best
from utils.config import ConfigError, check_context, config_to_dict, parse_config, require_nonempty
from utils.dist import all_reduce_sum, cleanup_distributed, setup_distributed
from utils.fsdp import resolve_dtype, set_gradient_sync, shard_model
from utils.guard import NonFiniteGuard, StopSignal, exit_on_error
from utils.logging import Logger, progress
from utils.losses import sft_loss_sum
from utils.optim import build_optimizer, build_scheduler, clip_grad_norm


@dataclass
class Config(LoRAConfig):  # --lora_rank, --lora_alpha, --lora_dropout, --lora_targets (model/lora.py)
    model: str = "gpt2"
    """Starting weights: a hub name (gpt2, gpt2-medium, gpt2-large, gpt2-xl), a local Hugging Face-format
    folder, or with --random_init a preset (tiny, small, gpt2, ...)."""
    random_init: bool = False
    """Start from random GPT-2 initialisation of the preset named by --model instead of loading weights."""
    train_data: str = "trl-lib/tldr"
    """Training rows (prompt, completion): a hub dataset name, a .jsonl/.parquet file, or a folder of them."""
    train_split: str = "train"
    """Split of --train_data (hub datasets and folders)."""
    val_data: str = "trl-lib/tldr"
    """Validation rows (prompt, completion); empty string to skip validation."""
    val_split: str = "validation"
    """Split of --val_data."""
    val_examples: int = 512
    """Validation rows used (the first N), at most."""
    max_prompt_len: int = 512
    """Prompt tokens kept; longer posts are cut so subreddit, title and "TL;DR:" survive."""
    max_response_len: int = 64
    """Response tokens kept, including the "\\n" end token."""
    batch_size: int = 64
    """Global batch size (rows per optimizer step, over all ranks)."""
    micro_batch_size: int = 8
    """Rows per forward/backward on each rank; batch_size / (micro_batch_size * world) accumulation steps."""
    steps: int = 0
    """Optimizer steps; 0 means one epoch over the training rows."""
    lr: float = 3e-5
    """Peak learning rate (AdamW)."""
    warmup_steps: int = 20
    """Linear warmup steps before cosine decay."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak."""
    weight_decay: float = 0.0
    """AdamW weight decay on weight matrices."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 disables clipping)."""
    prompt_loss_weight: float = 0.0
    """Weight of the next-token loss on prompt tokens, relative to response tokens. 0 (the default) trains on the
    response only, as is usual for TL;DR SFT from pretrained GPT-2; a model trained from scratch (the embedded
    demo) learns to copy words from the post far sooner with some weight on the post itself."""
    prompt_loss_positions: int = 16
    """With --prompt_loss_weight > 0: prompt tokens per row drawn (uniformly, anew each step) for an unbiased
    estimate of the prompt loss; each drawn token is scaled by the row's prompt length / the number drawn."""
    eval_every: int = 100
    """Validation loss every N steps (and at the end); 0 disables."""
    save_every: int = 500
    """Resumable checkpoint every N steps (and at the end); 0 saves only at the end."""
    keep_last: int = 2
    """Resumable checkpoints kept (the best one is kept as well)."""
    best_metric: str = "val/loss"
    """Validation metric whose best value keeps its checkpoint (named in checkpoints/best.json, never pruned);
    a new best is saved when it appears. Empty disables."""
    best_mode: Literal["min", "max"] = "min"
    """min: a lower --best_metric is better; max: a higher one."""
    out_dir: str = "runs/sft"
    """Run directory: checkpoints/, hf/ (the Hugging Face-format export), metrics.jsonl, wandb/."""
    resume: bool = True
    """Resume from the newest checkpoint in --out_dir when there is one (false refuses to start over on top of one)."""
    resume_from: str = ""
    """Start from this checkpoint (a checkpoint folder, or another run directory) when --out_dir has none yet."""
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """A non-finite loss or gradient norm: stop (nothing is stepped or saved; the newest checkpoint is the last
    good state) or skip the step (no optimizer or scheduler step; its batch is dropped)."""
    seed: int = 1
    """Seed for initialisation and data order."""
    device: str = "auto"
    """auto, cuda or cpu."""
    dtype: str = "auto"
    """Compute dtype: bf16, fp32, or auto (bf16 on GPU, fp32 on CPU). Gradients are reduced in fp32."""
    activation_checkpointing: bool = False
    """Recompute block activations in backward to save memory."""
    wandb_mode: str = "auto"
    """online, offline, disabled, or auto (online with a wandb login, offline otherwise)."""
    wandb_project: str = "tldr-rlhf"
    """wandb project."""
    run_name: str = "sft"
    """wandb run name."""

    def validate(self) -> None:
        require_nonempty(self, "model", "train_data", "out_dir")
        self.validate_lora()
        for name in ("batch_size", "micro_batch_size", "max_prompt_len", "max_response_len", "keep_last"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name} must be positive, got {getattr(self, name)}")
        for name in ("steps", "save_every", "val_examples", "grad_clip", "warmup_steps", "weight_decay"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name} must be >= 0, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ConfigError(f"--lr must be positive, got {self.lr}")
        if self.wandb_mode not in ("online", "offline", "disabled", "auto"):
            raise ConfigError(f"--wandb_mode must be online, offline, disabled or auto, got '{self.wandb_mode}'")
        if self.device not in ("auto", "cuda", "cpu"):
            raise ConfigError(f"--device must be auto, cuda or cpu, got '{self.device}'")
        if self.dtype not in ("auto", "bf16", "fp32"):
            raise ConfigError(f"--dtype must be auto, bf16 or fp32, got '{self.dtype}'")


def accumulation_steps(batch_size: int, micro_batch_size: int, world_size: int) -> int:
    if batch_size % (micro_batch_size * world_size):
        raise ConfigError(
            f"--batch_size {batch_size} must be divisible by --micro_batch_size {micro_batch_size} x "
            f"world size {world_size} = {micro_batch_size * world_size}"
        )
    return batch_size // (micro_batch_size * world_size)


def response_nll_sum(model, batch: dict, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed NLL of response tokens, number of response tokens) for one micro-batch.

    Logits are computed only at the positions that predict response tokens: columns P-1 .. P+R-2, where P is
    the (left-padded) prompt width. With GPT-2's 50k vocabulary that saves most of a small model's FLOPs."""
    input_ids = batch["input_ids"].to(device)
    P, R = batch["prompt_len"], batch["response_ids"].shape[1]
    logits = model(
        input_ids, batch["position_ids"].to(device), batch["attention_mask"].to(device), logits_slice=slice(P - 1, P + R - 1)
    )  # (B, R, V)
    mask = batch["response_mask"].to(device)
    return sft_loss_sum(logits, batch["response_ids"].to(device), mask), mask.sum()


def prompt_targets(batch: dict) -> torch.Tensor:
    """(B, P-1) bool: prompt columns 1 .. P-1 whose token and the token before it are real (a left-padded row's
    first real token has nothing to be predicted from)."""
    m, P = batch["attention_mask"], batch["prompt_len"]
    return m[:, 1:P] & m[:, : P - 1]


def weighted_nll_sum(
    model, batch: dict, prompt_weight: float, prompt_positions: int, generator: torch.Generator | None, device
) -> torch.Tensor:
    """Response NLL + prompt_weight * (an unbiased estimate of the) prompt NLL, summed over one micro-batch.

    The prompt term draws `prompt_positions` prompt targets per row uniformly without replacement and scales
    each by (the row's prompt targets / the number drawn), so its expectation is the NLL summed over every prompt
    token, at a fraction of the cost of a 50k-way softmax at every position. With prompt_weight 0 it is the
    response NLL alone."""
    if prompt_weight == 0:
        return response_nll_sum(model, batch, device)[0]
    P, R = batch["prompt_len"], batch["response_ids"].shape[1]
    valid = prompt_targets(batch)  # (B, P-1): column j+1 is a prompt target predicted at column j
    B = valid.shape[0]
    K = min(prompt_positions, P - 1)
    scores = torch.rand(valid.shape, generator=generator).masked_fill(~valid, -1.0)
    chosen = scores.topk(K, dim=1).indices  # (B, K) predictor columns
    drawn = valid.gather(1, chosen)  # (B, K) False where a row has fewer than K prompt targets
    scale = valid.sum(1, keepdim=True) / drawn.sum(1, keepdim=True).clamp(min=1)  # (B, 1)
    columns = torch.cat([chosen, torch.arange(P - 1, P + R - 1).expand(B, R)], dim=1)  # (B, K+R) predictor columns
    input_ids = batch["input_ids"]
    targets = input_ids.gather(1, columns + 1)
    weight = torch.cat([prompt_weight * scale * drawn, batch["response_mask"].float()], dim=1)  # (B, K+R)
    logits = model(
        input_ids.to(device), batch["position_ids"].to(device), batch["attention_mask"].to(device),
        logits_slice=columns.to(device),
    )  # (B, K+R, V)
    return sft_loss_sum(logits, targets.to(device), weight.to(device))


def accumulate_gradients(
    model, micro_batches: list[dict], world: int, device, prompt_weight: float = 0.0, prompt_positions: int = 0,
    generator: torch.Generator | None = None,
) -> float:
    """Forward and backward over this rank's micro-batches of one optimizer step; returns the global loss.

    Every rank divides its summed NLL by the (weighted) token count of the *global* batch. FSDP averages
    gradients over ranks, so each rank's loss is also multiplied by the world size: the reduced gradient is
    then d(sum of all NLL / global count), whatever the world size or the number of micro-batches."""
    n_tokens = sum(b["response_mask"].sum().float() for b in micro_batches)
    if prompt_weight:
        n_tokens = n_tokens + prompt_weight * sum(prompt_targets(b).sum().float() for b in micro_batches)
    n_tokens = all_reduce_sum(n_tokens.to(device))
    loss_sum = torch.zeros((), device=device)
    for i, batch in enumerate(micro_batches):
        set_gradient_sync(model, i == len(micro_batches) - 1)
        s = weighted_nll_sum(model, batch, prompt_weight, prompt_positions, generator, device)
        (s * world / n_tokens).backward()
        loss_sum += s.detach().float()
    return float(all_reduce_sum(loss_sum) / n_tokens)


@torch.no_grad()
def evaluate(model, loader_batches: list[dict], device) -> float:
    """Token-averaged validation NLL over all ranks."""
    model.eval()
    nll, count = torch.zeros((), device=device), torch.zeros((), device=device)
    for batch in loader_batches:
        s, n = response_nll_sum(model, batch, device)
        nll += s.float()
        count += n
    model.train()
    return float(all_reduce_sum(nll) / all_reduce_sum(count).clamp(min=1))


def main(cfg: Config) -> dict:
    # 1. distributed set-up and every check that needs no data and no weights: sizes, the model's config, the
    #    run directory and the checkpoint to resume from (all before any model is built or put on a GPU)
    dist_info = setup_distributed(cfg.device)
    rank, world, device = dist_info.rank, dist_info.world_size, dist_info.device
    accum = accumulation_steps(cfg.batch_size, cfg.micro_batch_size, world)
    model_cfg = model_config(cfg.model, cfg.random_init)
    check_context(model_cfg, cfg.max_prompt_len, cfg.max_response_len, "model")
    meta = {"stage": "sft", "model_config": model_cfg.to_dict(), "lora": cfg.lora_meta()}
    run_dir = Path(cfg.out_dir)
    ckpt = find_checkpoint(run_dir, cfg.resume, cfg.resume_from, meta)
    torch.manual_seed(cfg.seed)

    # 2. data: tokenize, shard per rank, shuffle per epoch
    tok = get_tokenizer()
    train_rows = load_rows(cfg.train_data, cfg.train_split, SFT_COLUMNS)
    train = SFTDataset(train_rows, tok, cfg.max_prompt_len, cfg.max_response_len, name=f"{cfg.train_data}[{cfg.train_split}]")

    def collate(ds):
        return lambda idx: collate_sft([ds.prompts[i] for i in idx], [ds.responses[i] for i in idx])

    loader = ShardedLoader(len(train), cfg.micro_batch_size, rank, world, cfg.seed, collate(train))
    val_batches = []
    if cfg.val_data and cfg.eval_every >= 0:
        val_rows = load_rows(cfg.val_data, cfg.val_split, SFT_COLUMNS)[: cfg.val_examples]
        val = SFTDataset(val_rows, tok, cfg.max_prompt_len, cfg.max_response_len, name=f"{cfg.val_data}[{cfg.val_split}]")
        # every rank evaluates a disjoint slice of the validation rows, in fixed order
        idx = list(range(rank, len(val), world))
        val_batches = [collate(val)(idx[i : i + cfg.micro_batch_size]) for i in range(0, len(idx), cfg.micro_batch_size)]
    total_steps = cfg.steps or max(1, loader.batches_per_epoch // accum)

    # 3. model (with LoRA: frozen, plus trainable adapters), FSDP, optimizer over the trainable parameters
    model = build_policy(cfg.model, cfg.random_init)
    if cfg.lora_enabled:
        apply_lora(model, cfg)
    if rank == 0:
        print(f"sft: {trainable_summary(model)}")
    shard_model(model, resolve_dtype(cfg.dtype, device), activation_checkpointing=cfg.activation_checkpointing)
    model.to(device)
    optimizer = build_optimizer(model, cfg.lr, cfg.weight_decay)
    scheduler = build_scheduler(optimizer, cfg.warmup_steps, total_steps, cfg.min_lr_ratio)

    # 4. resume: weights, optimizer, schedule, every rank's RNG, data position, best validation so far
    step, best = 0, None
    if ckpt is not None:
        state = load_checkpoint(ckpt, model, optimizer, scheduler, meta, rank)
        step, best = state["step"], state["extra"].get("best")
        restore_loader(loader, ckpt, state["extra"])
        if rank == 0:
            print(f"resumed from {ckpt} at step {step}")

    logger = Logger(run_dir, config_to_dict(cfg), cfg.wandb_project, cfg.run_name, cfg.wandb_mode, rank == 0, resume_step=step)
    if rank == 0:
        print(f"sft: {len(train)} rows, world {world}, {accum} accumulation steps, {total_steps} steps")
    batches = iter(loader)
    bar = progress(total_steps, step, rank == 0, "sft")
    model.train()
    metrics = {}
    guard = NonFiniteGuard("sft", cfg.on_nonfinite, device)
    stopping = False
    with StopSignal() as stop:  # SIGTERM / SIGINT: finish the step, save, exit 0
        while step < total_steps:
            t0 = time.perf_counter()
            # 5. one optimizer step: the loss is normalised by the global count of response tokens; a non-finite
            #    loss or gradient norm stops the run, or skips the step (--on_nonfinite)
            micro = [next(batches) for _ in range(accum)]
            prompt_gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * 101 + rank)  # resumes exactly
            loss = accumulate_gradients(model, micro, world, device, cfg.prompt_loss_weight, cfg.prompt_loss_positions, prompt_gen)
            grad_norm = clip_grad_norm(model, cfg.grad_clip)
            finite = guard.ok(step + 1, {"train/loss": loss, "train/grad_norm": grad_norm})
            if finite:
                optimizer.step()
                scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            # 6. log
            dt = time.perf_counter() - t0
            seen = all_reduce_sum(torch.tensor(float(sum(b["attention_mask"].sum() for b in micro)), device=device))
            metrics = {
                "train/loss": loss,
                "train/grad_norm": grad_norm,
                "train/lr": scheduler.get_last_lr()[0],
                "train/skipped": float(not finite),
                "perf/step_seconds": dt,
                "perf/tokens_per_second": float(seen) / dt,
                "perf/tokens_per_second_per_device": float(seen) / dt / world,
            }
            if cfg.eval_every > 0 and val_batches and (step % cfg.eval_every == 0 or step == total_steps):
                metrics["val/loss"] = evaluate(model, val_batches, device)
            logger.log(metrics, step)
            bar.update(1)
            bar.set_postfix(loss=f"{metrics['train/loss']:.3f}")

            # 7. checkpoint: on schedule, at the end, at a new best validation metric, or when a signal came
            best, improved = update_best(best, metrics, cfg.best_metric, cfg.best_mode, step)
            stopping = stop.requested(device)
            if stopping or improved or step == total_steps or (cfg.save_every > 0 and step % cfg.save_every == 0):
                save_checkpoint(
                    run_dir, step, model, optimizer, scheduler, meta, extra={"loader": loader.state_dict(), "best": best},
                    keep_last=cfg.keep_last, rank=rank, best=best if improved else None,
                )
            if stopping:
                break
    bar.close()

    # 8. export a Hugging Face-format folder for the next stage (not after a signal: the run is not finished)
    if stopping:
        stop.report(step, run_dir / "checkpoints", rank)
    else:
        export_hf(model, model_cfg, run_dir / "hf", rank)
        if rank == 0:
            print(f"exported {run_dir / 'hf'}; final metrics: " + ", ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
    logger.finish()
    cleanup_distributed()
    return metrics


if __name__ == "__main__":
    with exit_on_error():
        main(parse_config(Config, description=__doc__.split("\n\n")[0]))
