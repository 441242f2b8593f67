"""Reward model on Reddit TL;DR comparisons (trl-lib/tldr-preference): GPT-2 with a scalar head.

    python reward_model.py --model runs/sft/hf                         # one device
    torchrun --nproc_per_node=2 reward_model.py --model runs/sft/hf    # two GPUs (or two CPU processes)
    python reward_model.py --help                                      # every option

r(x, y) is the body's hidden state at the last real token of prompt + response (the response's "\\n" end
token) projected to a scalar (model/heads.py). The loss is Bradley-Terry, -log sigmoid(r(x, y_w) - r(x, y_l))
(Stiennon et al. 2020, eq. 1), summed over pairs and divided by the global batch size in pairs, so the gradient
is the same for any world size and micro-batch size.

After training, a gain and bias are fitted so that the rewards of responses sampled from the SFT policy on
training prompts have mean 0 and standard deviation 1 (GRPO reads normalised rewards); they are saved with the
model as the RewardModel's gain/bias buffers and in hf/reward_normalization.json.
"""

import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from data.tldr import PREF_COLUMNS, PreferenceDataset, PromptDataset, ShardedLoader, collate_pairs, load_rows, pad_prompts
from data.tokenizer import get_tokenizer
from evaluation.preference import build_eval_set, evaluate_reward_model, reward_scores
from model.sampler import generate
from model.weights import build_policy, build_reward_model, model_config, save_export

from utils.checkpoint import export_model, find_checkpoint, load_checkpoint, restore_loader, save_checkpoint, update_best
from utils.config import ConfigError, accumulation_steps, check_context, config_to_dict, parse_config, require_nonempty
from utils.dist import all_reduce_sum, cleanup_distributed, setup_distributed
from utils.fsdp import gathered_params, resolve_dtype, set_gradient_sync, shard_model
from utils.guard import NonFiniteGuard, StopSignal, check_rewards, exit_on_error
from utils.logging import Logger, progress
from rlhf.losses import bradley_terry_loss
from utils.optim import build_optimizer, build_scheduler, clip_grad_norm
from rlhf.stats import pair_outcomes, standardizing_gain_bias


@dataclass
class Config:
    model: str = "runs/sft/hf"
    """Starting weights: an SFT export (Hugging Face-format folder; a new scalar head is added), a reward-model
    folder (its head is kept), a hub name (gpt2, ...), or with --random_init a preset (tiny, small, gpt2, ...)."""
    random_init: bool = False
    """Start from random GPT-2 initialisation of the preset named by --model instead of loading weights."""
    train_data: str = "trl-lib/tldr-preference"
    """Training pairs (prompt, chosen, rejected): a hub dataset name, a .jsonl/.parquet file, or a folder."""
    train_split: str = "train"
    """Split of --train_data (hub datasets and folders)."""
    val_data: str = "trl-lib/tldr-preference"
    """Validation pairs; empty string to skip validation."""
    val_split: str = "validation"
    """Split of --val_data."""
    val_pairs: int = 512
    """Validation pairs used (the first N), at most; 0 for all."""
    max_prompt_len: int = 512
    """Prompt tokens kept; longer posts are cut so subreddit, title and "TL;DR:" survive."""
    max_response_len: int = 64
    """Response tokens kept, including the "\\n" end token (also the sampling length of the normalisation)."""
    batch_size: int = 64
    """Global batch size in pairs per optimizer step, over all ranks."""
    micro_batch_size: int = 8
    """Pairs per forward/backward on each rank (2x rows: chosen and rejected in one pass)."""
    steps: int = 0
    """Optimizer steps; 0 means one epoch over the training pairs."""
    lr: float = 1e-5
    """Peak learning rate (AdamW)."""
    warmup_steps: int = 20
    """Linear warmup steps before cosine decay."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak."""
    weight_decay: float = 0.0
    """AdamW weight decay on weight matrices."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 disables clipping)."""
    overfit_batch: bool = False
    """Debugging: train every step on the first global batch (the loss should go towards 0)."""
    eval_every: int = 100
    """Validation accuracy every N steps, before the first step and at the end; 0 only at the end."""
    save_every: int = 500
    """Resumable checkpoint every N steps (and at the end); 0 saves only at the end."""
    keep_last: int = 2
    """Resumable checkpoints kept (the best one is kept as well)."""
    best_metric: str = "val/accuracy"
    """Validation metric whose best value keeps its checkpoint (named in checkpoints/best.json, never pruned);
    a new best is saved when it appears. Empty disables."""
    best_mode: Literal["min", "max"] = "max"
    """min: a lower --best_metric is better; max: a higher one."""
    sft_policy: str = ""
    """Policy whose samples fit the reward normalisation: an SFT export folder or hub name; empty: --model
    (with --random_init, a random policy of that preset)."""
    norm_prompts: int = 256
    """Distinct training prompts sampled for the normalisation; 0 skips it (gain 1, bias 0)."""
    norm_samples_per_prompt: int = 4
    """Responses sampled per normalisation prompt."""
    norm_batch_size: int = 16
    """Normalisation prompts per generation call on each rank."""
    norm_temperature: float = 1.0
    """Sampling temperature of the normalisation responses (use the temperature GRPO samples at)."""
    out_dir: str = "runs/rm"
    """Run directory: checkpoints/, hf/ (the Hugging Face-format export), metrics.jsonl, wandb/."""
    resume: bool = True
    """Resume from the newest checkpoint in --out_dir when there is one (false refuses to start over on top of one)."""
    resume_from: str = ""
    """Start from this checkpoint (a checkpoint folder, or another run directory) when --out_dir has none yet."""
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """A non-finite loss or gradient norm: stop (nothing is stepped or saved; the newest checkpoint is the last
    good state) or skip the step (no optimizer or scheduler step; its batch is dropped)."""
    seed: int = 1
    """Seed for the head's initialisation, data order and normalisation samples."""
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
    run_name: str = "reward_model"
    """wandb run name."""

    def validate(self) -> None:
        require_nonempty(self, "model", "train_data", "out_dir")
        for name in ("batch_size", "micro_batch_size", "max_prompt_len", "max_response_len", "norm_samples_per_prompt",
                     "norm_batch_size", "keep_last"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name} must be positive, got {getattr(self, name)}")
        for name in ("norm_prompts", "val_pairs", "steps", "save_every", "grad_clip", "warmup_steps", "weight_decay"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name} must be >= 0, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ConfigError(f"--lr must be positive, got {self.lr}")
        if self.norm_prompts == 1 and self.norm_samples_per_prompt == 1:
            raise ConfigError("the normalisation needs at least 2 samples (--norm_prompts x --norm_samples_per_prompt)")
        if self.wandb_mode not in ("online", "offline", "disabled", "auto"):
            raise ConfigError(f"--wandb_mode must be online, offline, disabled or auto, got '{self.wandb_mode}'")
        if self.device not in ("auto", "cuda", "cpu"):
            raise ConfigError(f"--device must be auto, cuda or cpu, got '{self.device}'")
        if self.dtype not in ("auto", "bf16", "fp32"):
            raise ConfigError(f"--dtype must be auto, bf16 or fp32, got '{self.dtype}'")


def accumulate_gradients(model, micro_batches: list[dict], world: int, n_pairs: int, device) -> dict[str, float]:
    """Forward and backward over this rank's micro-batches of one optimizer step; returns global metrics.

    Each rank's summed loss is divided by the global number of pairs and multiplied by the world size (FSDP
    averages gradients over ranks), so the reduced gradient is d(mean loss over the global batch)."""
    # sums over pairs: loss, correct (ties 1/2), chosen reward, rejected reward
    sums = torch.zeros(4, dtype=torch.float64, device=device)
    for i, batch in enumerate(micro_batches):
        set_gradient_sync(model, i == len(micro_batches) - 1)
        B = batch["n_pairs"]
        rewards = reward_scores(model, batch, device)  # (2B,)
        r_chosen, r_rejected = rewards[:B], rewards[B:]  # (B,), (B,)
        losses = bradley_terry_loss(r_chosen, r_rejected)  # (B,)
        (losses.sum() * world / n_pairs).backward()
        r_chosen, r_rejected = r_chosen.detach().double(), r_rejected.detach().double()
        sums += torch.stack([
            losses.detach().double().sum(), pair_outcomes(r_chosen, r_rejected).sum(), r_chosen.sum(), r_rejected.sum(),
        ])
    loss, accuracy, chosen, rejected = (all_reduce_sum(sums) / n_pairs).tolist()
    return {
        "train/loss": loss, "train/accuracy": accuracy, "train/reward_chosen": chosen,
        "train/reward_rejected": rejected, "train/reward_margin": chosen - rejected,
    }


def normalization_prompts(rows: list[dict[str, str]], n: int, seed: int) -> list[dict[str, str]]:
    """n distinct training prompts (the preference data repeats a post once per comparison), in seeded order."""
    prompts = sorted({row["prompt"] for row in rows})
    random.Random(seed).shuffle(prompts)
    return [{"prompt": p} for p in prompts[:n]]


@torch.no_grad()
def fit_normalization(
    reward_model, policy, prompts: list[list[int]], cfg: Config, rank: int, world: int, device, step: int = 0
) -> dict:
    """Sample cfg.norm_samples_per_prompt responses per prompt from `policy`, score them with `reward_model`,
    and set its gain and bias so those rewards have mean 0 and (population) std 1 over all ranks. Rewards that
    are NaN or all equal stop the run (a gain cannot be fitted; `step` is named in the message).

    Rank r takes a contiguous slice of the prompts, padded with copies of prompt 0 (whose rewards are not
    counted) so every rank runs the same number of FSDP forward passes."""
    G = cfg.norm_samples_per_prompt
    per_rank = math.ceil(len(prompts) / world)
    mine = list(range(rank * per_rank, (rank + 1) * per_rank))
    generator = torch.Generator(device=device).manual_seed(cfg.seed * 1000 + rank)
    reward_model.eval()
    sums = torch.zeros(4, dtype=torch.float64, device=device)  # count, sum, sum of squares, responses with an end
    counted = []  # this rank's rewards of real prompts, for the NaN / constant check
    for start in range(0, per_rank, cfg.norm_batch_size):
        index = mine[start : start + cfg.norm_batch_size]
        valid = torch.tensor([i < len(prompts) for i in index], device=device).repeat_interleave(G)  # (N,)
        prompt_ids, prompt_mask = pad_prompts([prompts[i if i < len(prompts) else 0] for i in index])  # (B, P)
        prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
        # 1. sample: rows b*G .. b*G+G-1 belong to prompt b
        with gathered_params(policy):
            out = generate(
                policy, prompt_ids, prompt_mask, G, cfg.max_response_len, temperature=cfg.norm_temperature, generator=generator
            )
        # 2. score prompt + response; the reward is read at the last real token (the end token when there is one)
        input_ids = torch.cat([prompt_ids.repeat_interleave(G, 0), out.response_ids], dim=1)  # (N, P+R)
        attention_mask = torch.cat([prompt_mask.repeat_interleave(G, 0), out.response_mask], dim=1)  # (N, P+R)
        position_ids = (attention_mask.long().cumsum(1) - 1) * attention_mask  # (N, P+R)
        rows = 2 * cfg.micro_batch_size
        rewards = torch.cat([
            reward_model(input_ids[i : i + rows], position_ids[i : i + rows], attention_mask[i : i + rows])
            for i in range(0, input_ids.shape[0], rows)
        ]).double()  # (N,)
        v = valid.double()
        counted.append(rewards[valid])
        sums += torch.stack([v.sum(), (rewards * v).sum(), (rewards * rewards * v).sum(), (out.has_end.double() * v).sum()])
    check_rewards(torch.cat(counted), "reward_model (normalisation samples)", step, device)
    count, total, total_sq, n_end = all_reduce_sum(sums).tolist()
    gain, bias = standardizing_gain_bias(count, total, total_sq)
    reward_model.gain.fill_(gain)
    reward_model.bias.fill_(bias)
    reward_model.train()
    mean = total / count
    return {
        "norm/raw_mean": mean, "norm/raw_std": math.sqrt(max(total_sq / count - mean * mean, 0.0)),
        "norm/samples": count, "norm/end_rate": n_end / count, "norm/gain": gain, "norm/bias": bias,
    }


def main(cfg: Config) -> dict:
    # 1. distributed set-up and every check that needs no data and no weights: sizes, the models' configs (the
    #    normalisation's SFT policy too, so a wrong folder fails now and not after training), the run directory and
    #    the checkpoint to resume from (all before any model is built or put on a GPU)
    dist_info = setup_distributed(cfg.device)
    rank, world, device = dist_info.rank, dist_info.world_size, dist_info.device
    accum = accumulation_steps(cfg.batch_size, cfg.micro_batch_size, world)
    model_cfg = model_config(cfg.model, cfg.random_init)
    check_context(model_cfg, cfg.max_prompt_len, cfg.max_response_len, "reward model")
    policy_name = cfg.sft_policy or cfg.model
    if cfg.norm_prompts > 0:
        policy_random_init = cfg.random_init and not cfg.sft_policy
        check_context(model_config(policy_name, policy_random_init), cfg.max_prompt_len, cfg.max_response_len, "SFT policy")
    meta = {"stage": "reward_model", "model_config": model_cfg.to_dict()}
    run_dir = Path(cfg.out_dir)
    ckpt = find_checkpoint(run_dir, cfg.resume, cfg.resume_from, meta)
    torch.manual_seed(cfg.seed)
    dtype = resolve_dtype(cfg.dtype, device)

    # 2. data: tokenize, shard per rank, shuffle per epoch; validation pairs split disjointly over ranks
    tok = get_tokenizer()
    train_rows = load_rows(cfg.train_data, cfg.train_split, PREF_COLUMNS)
    train = PreferenceDataset(train_rows, tok, cfg.max_prompt_len, cfg.max_response_len, name=f"{cfg.train_data}[{cfg.train_split}]")

    def collate(idx):
        return collate_pairs([train.prompts[i] for i in idx], [train.chosen[i] for i in idx], [train.rejected[i] for i in idx])

    loader = ShardedLoader(len(train), cfg.micro_batch_size, rank, world, cfg.seed, collate)
    val_set = None
    if cfg.val_data:
        val_rows = load_rows(cfg.val_data, cfg.val_split, PREF_COLUMNS)
        val_rows = val_rows[: cfg.val_pairs] if cfg.val_pairs else val_rows
        val_set = build_eval_set(
            val_rows, tok, cfg.max_prompt_len, cfg.max_response_len, cfg.micro_batch_size, rank, world,
            name=f"{cfg.val_data}[{cfg.val_split}]",
        )
    total_steps = cfg.steps or max(1, loader.batches_per_epoch // accum)

    # 3. model, FSDP, optimizer. Training changes the rewards, so a loaded normalisation no longer holds.
    model = build_reward_model(cfg.model, cfg.random_init)
    model.gain.fill_(1.0)
    model.bias.fill_(0.0)
    shard_model(model, dtype, activation_checkpointing=cfg.activation_checkpointing)
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
        print(f"reward model: {len(train)} pairs, world {world}, {accum} accumulation steps, {total_steps} steps")
    if val_set is not None and step == 0 and cfg.eval_every > 0:
        logger.log({f"val/{k}": v for k, v in evaluate_reward_model(model, val_set, device).items()}, step=0)
    batches = iter(loader)
    # --overfit_batch: always the first global batch of epoch 0, drawn without moving the loader (so resume is exact)
    fixed = [collate(loader.batch_indices(0, i)) for i in range(accum)] if cfg.overfit_batch else None
    bar = progress(total_steps, step, rank == 0, "reward model")
    model.train()
    metrics = {}
    guard = NonFiniteGuard("reward_model", cfg.on_nonfinite, device)
    stopping = False
    with StopSignal() as stop:  # SIGTERM / SIGINT: finish the step, save, exit 0
        while step < total_steps:
            t0 = time.perf_counter()
            # 5. one optimizer step: Bradley-Terry loss summed over pairs / global number of pairs; a non-finite loss
            #    or gradient norm stops the run, or skips the step (--on_nonfinite)
            micro = fixed or [next(batches) for _ in range(accum)]
            metrics = accumulate_gradients(model, micro, world, cfg.batch_size, device)
            metrics["train/grad_norm"] = clip_grad_norm(model, cfg.grad_clip)
            finite = guard.ok(step + 1, {k: metrics[k] for k in ("train/loss", "train/grad_norm")})
            if finite:
                optimizer.step()
                scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            # 6. log; validation accuracy with its bootstrap interval
            dt = time.perf_counter() - t0
            seen = all_reduce_sum(torch.tensor(float(sum(b["attention_mask"].sum() for b in micro)), device=device))
            metrics.update({
                "train/lr": scheduler.get_last_lr()[0],
                "train/skipped": float(not finite),
                "perf/step_seconds": dt,
                "perf/tokens_per_second": float(seen) / dt,
                "perf/tokens_per_second_per_device": float(seen) / dt / world,
            })
            if val_set is not None and (step == total_steps or (cfg.eval_every > 0 and step % cfg.eval_every == 0)):
                val = evaluate_reward_model(model, val_set, device)
                metrics.update({f"val/{k}": v for k, v in val.items()})
            logger.log(metrics, step)
            bar.update(1)
            bar.set_postfix(loss=f"{metrics['train/loss']:.3f}", acc=f"{metrics['train/accuracy']:.3f}")

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
    if stopping:  # the run is not finished: no normalisation, no export
        stop.report(step, run_dir / "checkpoints", rank)
        logger.finish()
        cleanup_distributed()
        return metrics

    # 8. reward normalisation on samples of the SFT policy (GRPO reads gain * r + bias)
    if cfg.norm_prompts > 0:
        policy = build_policy(policy_name, cfg.random_init and not cfg.sft_policy)
        shard_model(policy, dtype)
        policy.to(device)
        prompt_rows = normalization_prompts(train_rows, cfg.norm_prompts, cfg.seed)
        prompts = PromptDataset(prompt_rows, tok, cfg.max_prompt_len, name="normalisation prompts").prompts
        norm = fit_normalization(model, policy, prompts, cfg, rank, world, device, step)
        del policy
        logger.log(norm, step)
        metrics.update(norm)
        if rank == 0:
            print(f"reward normalisation over {int(norm['norm/samples'])} samples of {policy_name}: raw mean "
                  f"{norm['norm/raw_mean']:.4f}, std {norm['norm/raw_std']:.4f} -> gain {norm['norm/gain']:.4f}, bias {norm['norm/bias']:.4f}")

    # 9. export a Hugging Face-format folder (gain and bias go to reward_normalization.json)
    export_model(model, lambda sd: save_export(model, sd, model_cfg, run_dir / "hf"), rank)
    if rank == 0:
        print(f"exported {run_dir / 'hf'}; final metrics: " + ", ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
    logger.finish()
    cleanup_distributed()
    return metrics


if __name__ == "__main__":
    with exit_on_error():
        main(parse_config(Config, description=__doc__.split("\n\n")[0]))
