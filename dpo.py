"""Direct Preference Optimization (Rafailov et al. 2023) on Reddit TL;DR comparisons, from the SFT model.

    python dpo.py --model runs/sft/hf                          # one device
    torchrun --nproc_per_node=2 dpo.py --model runs/sft/hf     # two GPUs (or two CPU processes)
    python dpo.py --help                                       # every option

With h = log pi(y_w|x)/pi_ref(y_w|x) - log pi(y_l|x)/pi_ref(y_l|x), the log-probs summed over response tokens:
    sigmoid (DPO, eq. 7; cDPO with label smoothing eps): -(1-eps) log sigmoid(beta h) - eps log sigmoid(-beta h)
    ipo     (Azar et al. 2023, eq. 17):                   (h - 1/(2 beta))^2
The reference is a frozen copy of the starting policy (or --reference): its log-probs are computed under
torch.no_grad and it has no optimizer state. With --lora_rank r only LoRA adapters train (model/lora.py) and the
reference is the policy itself with its adapters switched off: the frozen base weights are the starting policy,
so no second copy is kept. Losses are summed over pairs and divided by the global batch
size in pairs, so the gradient is the same for any world size and micro-batch size. Logged: loss, implicit
reward accuracy (beta * log pi/pi_ref of chosen above rejected; ties count half), margins, chosen/rejected
rewards, and the validation preference accuracy with its bootstrap interval.
"""

import copy
import functools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from data.tldr import PREF_COLUMNS, PreferenceDataset, ShardedLoader, collate_pairs, load_rows
from data.tokenizer import get_tokenizer
from evaluation.preference import build_eval_set, evaluate_policy, policy_logps, response_logprobs
from model.lora import AdaptersOff, LoRAConfig, apply_lora, trainable_summary
from model.weights import build_policy, model_config, save_export

from utils.checkpoint import export_model, find_checkpoint, load_checkpoint, restore_loader, save_checkpoint, update_best
from utils.config import ConfigError, accumulation_steps, check_context, config_to_dict, parse_config, require_nonempty
from utils.dist import all_reduce_sum, cleanup_distributed, setup_distributed
from utils.fsdp import resolve_dtype, set_gradient_sync, shard_model
from utils.guard import NonFiniteGuard, StopSignal, exit_on_error
from utils.logging import Logger, progress
from rlhf.losses import dpo_loss, ipo_loss
from utils.optim import build_optimizer, build_scheduler, clip_grad_norm
from rlhf.stats import pair_outcomes


@dataclass
class Config(LoRAConfig):  # --lora_rank, --lora_alpha, --lora_dropout, --lora_targets (model/lora.py)
    model: str = "runs/sft/hf"
    """Starting policy: an SFT export (Hugging Face-format folder), a hub name (gpt2, ...), or with
    --random_init a preset (tiny, small, gpt2, ...)."""
    random_init: bool = False
    """Start from random GPT-2 initialisation of the preset named by --model instead of loading weights."""
    reference: str = ""
    """Frozen reference policy; empty: the starting policy (the usual choice): a frozen copy of it, or with LoRA the
    policy's own base weights (adapters off, no copy)."""
    loss: Literal["sigmoid", "ipo"] = "sigmoid"
    """sigmoid: DPO (with --label_smoothing, cDPO); ipo: IPO's squared loss."""
    beta: float = 0.1
    """KL strength beta (DPO's beta; IPO's tau, target margin 1/(2 beta))."""
    label_smoothing: float = 0.0
    """cDPO: probability that a preference label is flipped, in [0, 0.5) (sigmoid loss only)."""
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
    """Response tokens kept, including the "\\n" end token."""
    batch_size: int = 64
    """Global batch size in pairs per optimizer step, over all ranks."""
    micro_batch_size: int = 8
    """Pairs per forward/backward on each rank (2x rows: chosen and rejected in one pass)."""
    steps: int = 0
    """Optimizer steps; 0 means one epoch over the training pairs."""
    lr: float = 1e-6
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
    """Debugging: train every step on the first global batch (the loss should fall quickly)."""
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
    out_dir: str = "runs/dpo"
    """Run directory: checkpoints/, hf/ (the Hugging Face-format export), metrics.jsonl, wandb/."""
    resume: bool = True
    """Resume from the newest checkpoint in --out_dir when there is one (false refuses to start over on top of one)."""
    resume_from: str = ""
    """Start from this checkpoint (a checkpoint folder, or another run directory) when --out_dir has none yet."""
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """A non-finite loss or gradient norm: stop (nothing is stepped or saved; the newest checkpoint is the last
    good state) or skip the step (no optimizer or scheduler step; its batch is dropped)."""
    seed: int = 1
    """Seed for data order (and initialisation with --random_init)."""
    device: str = "auto"
    """auto, cuda or cpu."""
    dtype: str = "auto"
    """Policy compute dtype: bf16, fp32, or auto (bf16 on GPU, fp32 on CPU). Gradients are reduced in fp32."""
    reference_dtype: str = "auto"
    """Dtype the frozen reference is stored and run in: bf16, fp32, or auto (bf16 on GPU, fp32 on CPU). Unused with
    LoRA and no --reference (the reference is then the policy's base weights)."""
    reference_cpu_offload: bool = False
    """Keep the reference's FSDP shards in CPU memory between forward passes (needs a GPU). Unused with LoRA and no
    --reference."""
    activation_checkpointing: bool = False
    """Recompute the policy's block activations in backward to save memory."""
    wandb_mode: str = "auto"
    """online, offline, disabled, or auto (online with a wandb login, offline otherwise)."""
    wandb_project: str = "tldr-rlhf"
    """wandb project."""
    run_name: str = "dpo"
    """wandb run name."""

    def validate(self) -> None:
        require_nonempty(self, "model", "train_data", "out_dir")
        self.validate_lora()
        for name in ("batch_size", "micro_batch_size", "max_prompt_len", "max_response_len", "keep_last"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name} must be positive, got {getattr(self, name)}")
        for name in ("val_pairs", "steps", "save_every", "grad_clip", "warmup_steps", "weight_decay"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name} must be >= 0, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ConfigError(f"--lr must be positive, got {self.lr}")
        if self.beta <= 0:
            raise ConfigError(f"--beta must be positive, got {self.beta}")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"--label_smoothing must be in [0, 0.5), got {self.label_smoothing}")
        if self.reference_cpu_offload and (self.device == "cpu" or not torch.cuda.is_available()):
            raise ConfigError("--reference_cpu_offload needs a GPU (FSDP offloads shards from GPU to CPU memory); "
                              "on CPU leave it false: the reference already lives in CPU memory")
        if self.label_smoothing and self.loss != "sigmoid":
            raise ConfigError("--label_smoothing applies to --loss sigmoid only")
        if self.wandb_mode not in ("online", "offline", "disabled", "auto"):
            raise ConfigError(f"--wandb_mode must be online, offline, disabled or auto, got '{self.wandb_mode}'")
        if self.device not in ("auto", "cuda", "cpu"):
            raise ConfigError(f"--device must be auto, cuda or cpu, got '{self.device}'")
        for name in ("dtype", "reference_dtype"):
            if getattr(self, name) not in ("auto", "bf16", "fp32"):
                raise ConfigError(f"--{name} must be auto, bf16 or fp32, got '{getattr(self, name)}'")


def preference_loss_fn(cfg: Config):
    """The per-pair loss (policy_chosen, policy_rejected, ref_chosen, ref_rejected) -> (B,) chosen by --loss."""
    if cfg.loss == "ipo":
        return functools.partial(ipo_loss, beta=cfg.beta)
    return functools.partial(dpo_loss, beta=cfg.beta, label_smoothing=cfg.label_smoothing)


def pair_losses(policy, reference, batch: dict, loss_fn, beta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-pair losses (B,) of one collate_pairs batch, differentiable in the policy only, and per-pair
    statistics summed over the batch (6,): loss, implicit-reward accuracy, chosen reward, rejected reward,
    policy log-prob of chosen, of rejected (rewards are beta * log pi/pi_ref, summed over response tokens)."""
    B = batch["n_pairs"]
    # the reference first: with LoRA it is the policy's own FSDP modules (adapters off), whose no-grad forward
    # should not sit between the policy's forward and its backward
    with torch.no_grad():  # the reference is frozen: no graph, no gradient
        ref_logps = response_logprobs(reference, batch, device)  # (2B,)
    logps = response_logprobs(policy, batch, device)  # (2B,)
    policy_chosen, policy_rejected = logps[:B], logps[B:]
    ref_chosen, ref_rejected = ref_logps[:B], ref_logps[B:]
    losses = loss_fn(policy_chosen, policy_rejected, ref_chosen, ref_rejected)  # (B,)
    with torch.no_grad():
        reward_chosen = beta * (policy_chosen - ref_chosen).double()  # (B,)
        reward_rejected = beta * (policy_rejected - ref_rejected).double()
        stats = torch.stack([
            losses.double().sum(), pair_outcomes(reward_chosen, reward_rejected).sum(), reward_chosen.sum(),
            reward_rejected.sum(), policy_chosen.double().sum(), policy_rejected.double().sum(),
        ])
    return losses, stats


def accumulate_gradients(policy, reference, micro_batches: list[dict], world: int, n_pairs: int, loss_fn, beta: float, device) -> dict:
    """Forward and backward over this rank's micro-batches of one optimizer step; returns global metrics.

    Each rank's summed loss is divided by the global number of pairs and multiplied by the world size (FSDP
    averages gradients over ranks), so the reduced gradient is d(mean loss over the global batch)."""
    sums = torch.zeros(6, dtype=torch.float64, device=device)
    for i, batch in enumerate(micro_batches):
        set_gradient_sync(policy, i == len(micro_batches) - 1)
        losses, stats = pair_losses(policy, reference, batch, loss_fn, beta, device)
        (losses.sum() * world / n_pairs).backward()
        sums += stats
    loss, accuracy, chosen, rejected, logp_chosen, logp_rejected = (all_reduce_sum(sums) / n_pairs).tolist()
    return {
        "train/loss": loss, "train/accuracy": accuracy, "train/reward_chosen": chosen, "train/reward_rejected": rejected,
        "train/reward_margin": chosen - rejected, "train/logp_chosen": logp_chosen, "train/logp_rejected": logp_rejected,
    }


def main(cfg: Config) -> dict:
    # 1. distributed set-up and every check that needs no data and no weights: sizes, the models' configs, the run
    #    directory and the checkpoint to resume from (all before any model is built or put on a GPU)
    dist_info = setup_distributed(cfg.device)
    rank, world, device = dist_info.rank, dist_info.world_size, dist_info.device
    accum = accumulation_steps(cfg.batch_size, cfg.micro_batch_size, world)
    model_cfg = model_config(cfg.model, cfg.random_init)
    check_context(model_cfg, cfg.max_prompt_len, cfg.max_response_len, "policy")
    if cfg.reference:
        check_context(model_config(cfg.reference), cfg.max_prompt_len, cfg.max_response_len, "reference")
    meta = {"stage": "dpo", "model_config": model_cfg.to_dict(), "lora": cfg.lora_meta()}
    run_dir = Path(cfg.out_dir)
    ckpt = find_checkpoint(run_dir, cfg.resume, cfg.resume_from, meta)
    torch.manual_seed(cfg.seed)

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

    # 3. policy (with LoRA: frozen, plus trainable adapters) and frozen reference: --reference, or the starting
    #    policy, copied before sharding (so a random init is shared), or with LoRA the policy with adapters off;
    #    FSDP; optimizer over the trainable parameters
    policy = build_policy(cfg.model, cfg.random_init)
    if cfg.reference:
        reference = build_policy(cfg.reference)
    elif cfg.lora_enabled:
        reference = None  # AdaptersOff(policy), once the policy is sharded
    else:
        reference = copy.deepcopy(policy)
    if cfg.lora_enabled:
        apply_lora(policy, cfg)
    if rank == 0:
        print(f"dpo: {trainable_summary(policy)}")
    if reference is not None:
        reference.requires_grad_(False)
        reference.eval()
        ref_dtype = resolve_dtype(cfg.reference_dtype, device)
        if ref_dtype is not None:
            reference.to(ref_dtype)  # stored in bf16, not only computed in it: half the memory
        shard_model(reference, None, cpu_offload=cfg.reference_cpu_offload)
        if not cfg.reference_cpu_offload:
            reference.to(device)
    shard_model(policy, resolve_dtype(cfg.dtype, device), activation_checkpointing=cfg.activation_checkpointing)
    policy.to(device)
    if reference is None:
        reference = AdaptersOff(policy)
    optimizer = build_optimizer(policy, cfg.lr, cfg.weight_decay)
    scheduler = build_scheduler(optimizer, cfg.warmup_steps, total_steps, cfg.min_lr_ratio)
    loss_fn = preference_loss_fn(cfg)

    # 4. resume: weights, optimizer, schedule, every rank's RNG, data position, best validation so far
    step, best = 0, None
    if ckpt is not None:
        state = load_checkpoint(ckpt, policy, optimizer, scheduler, meta, rank)
        step, best = state["step"], state["extra"].get("best")
        restore_loader(loader, ckpt, state["extra"])
        if rank == 0:
            print(f"resumed from {ckpt} at step {step}")

    logger = Logger(run_dir, config_to_dict(cfg), cfg.wandb_project, cfg.run_name, cfg.wandb_mode, rank == 0, resume_step=step)
    if rank == 0:
        print(f"dpo ({cfg.loss}, beta {cfg.beta}): {len(train)} pairs, world {world}, {accum} accumulation steps, {total_steps} steps")
    ref_val = policy_logps(reference, val_set, device) if val_set is not None else None  # the reference never changes
    if val_set is not None and step == 0 and cfg.eval_every > 0:
        val = evaluate_policy(policy, ref_val, val_set, cfg.beta, device)
        logger.log({f"val/{k}": v for k, v in val.items()}, step=0)
    batches = iter(loader)
    # --overfit_batch: always the first global batch of epoch 0, drawn without moving the loader (so resume is exact)
    fixed = [collate(loader.batch_indices(0, i)) for i in range(accum)] if cfg.overfit_batch else None
    bar = progress(total_steps, step, rank == 0, "dpo")
    policy.train()
    metrics = {}
    guard = NonFiniteGuard("dpo", cfg.on_nonfinite, device)
    stopping = False
    with StopSignal() as stop:  # SIGTERM / SIGINT: finish the step, save, exit 0
        while step < total_steps:
            t0 = time.perf_counter()
            # 5. one optimizer step: per-pair loss summed / global number of pairs; a non-finite loss or gradient
            #    norm stops the run, or skips the step (--on_nonfinite)
            micro = fixed or [next(batches) for _ in range(accum)]
            metrics = accumulate_gradients(policy, reference, micro, world, cfg.batch_size, loss_fn, cfg.beta, device)
            metrics["train/grad_norm"] = clip_grad_norm(policy, cfg.grad_clip)
            finite = guard.ok(step + 1, {k: metrics[k] for k in ("train/loss", "train/grad_norm")})
            if finite:
                optimizer.step()
                scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            # 6. log; validation accuracy of the implicit reward with its bootstrap interval
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
                val = evaluate_policy(policy, ref_val, val_set, cfg.beta, device)
                metrics.update({f"val/{k}": v for k, v in val.items()})
            logger.log(metrics, step)
            bar.update(1)
            bar.set_postfix(loss=f"{metrics['train/loss']:.3f}", acc=f"{metrics['train/accuracy']:.3f}")

            # 7. checkpoint (the policy only: the reference is rebuilt from --model / --reference): on schedule, at
            #    the end, at a new best validation metric, or when a signal came
            best, improved = update_best(best, metrics, cfg.best_metric, cfg.best_mode, step)
            stopping = stop.requested(device)
            if stopping or improved or step == total_steps or (cfg.save_every > 0 and step % cfg.save_every == 0):
                save_checkpoint(
                    run_dir, step, policy, optimizer, scheduler, meta, extra={"loader": loader.state_dict(), "best": best},
                    keep_last=cfg.keep_last, rank=rank, best=best if improved else None,
                )
            if stopping:
                break
    bar.close()

    # 8. export a Hugging Face-format folder (not after a signal: the run is not finished)
    if stopping:
        stop.report(step, run_dir / "checkpoints", rank)
    else:
        export_model(policy, lambda sd: save_export(policy, sd, model_cfg, run_dir / "hf"), rank)
        if rank == 0:
            print(f"exported {run_dir / 'hf'}; final metrics: " + ", ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
    logger.finish()
    cleanup_distributed()
    return metrics


if __name__ == "__main__":
    with exit_on_error():
        main(parse_config(Config, description=__doc__.split("\n\n")[0]))
