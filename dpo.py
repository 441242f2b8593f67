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

import time
from dataclasses import dataclass
from typing import Literal

import torch

from data.tldr import PREF_COLUMNS, load_rows
from data.tokenizer import get_tokenizer
from evaluation.frontier_declarations import FrontierConfig
from evaluation.measure import Frontier
from evaluation.preference import eval_set_logps, evaluate_policy, pair_logprobs, preference_metric_names
from evaluation.samples import Judge, JudgeConfig, SampleLog
from model.lora import LoRAConfig
from model.weights import model_config, save_export
from rlhf.losses import preference_loss
from rlhf.stats import pair_outcomes
from rollouts.options import OffloadConfig
from training.pairs import PairConfig, load_pairs
from training.reference import build_policy_and_reference, reference_logps
from utils.config import ConfigError, OptimConfig, RunConfig, accumulation_steps, fit_context, option, parse_config
from utils.dist import all_reduce_sum
from utils.guard import exit_on_error
from utils.optim import accumulate_micro_batches, build_optimization, guarded_step, step_throughput
from utils.run import check_best_metric, end_of_step, epoch_steps, finish, log_row, resume, start_run


@dataclass
# shared options; --judge: win rate; --frontier_prompts: KL to the reference and rewards of samples
class Config(RunConfig, OptimConfig, PairConfig, LoRAConfig, JudgeConfig, FrontierConfig, OffloadConfig):
    # --- models
    model: str = option("runs/sft/hf", model="policy")
    """Starting policy: an SFT export (Hugging Face-format folder), a hub name (gpt2, ...), or with
    --random_init a preset (tiny, small, gpt2, ...)."""
    random_init: bool = False
    """Start from random GPT-2 initialisation of the preset named by --model instead of loading weights."""
    reference: str = option("", model="policy")
    """Frozen reference policy; empty: the starting policy (the usual choice): a frozen copy of it, or with LoRA the
    policy's own base weights (adapters off, no copy)."""
    # --- objective
    loss: Literal["sigmoid", "ipo"] = "sigmoid"
    """sigmoid: DPO (with --label_smoothing, cDPO); ipo: IPO's squared loss."""
    beta: float = 0.1
    """KL strength beta (DPO's beta; IPO's tau, target margin 1/(2 beta))."""
    label_smoothing: float = 0.0
    """cDPO: probability that a preference label is flipped, in [0, 0.5) (sigmoid loss only)."""
    # --- models
    reference_dtype: Literal["auto", "bf16", "fp32"] = "auto"
    """Dtype the frozen reference is stored and run in: bf16, fp32, or auto (the policy's compute dtype, --dtype: then
    the policy and its reference compute alike, the implicit reward is 0 at step 0 and the first sigmoid loss is log
    2). Unused with LoRA and no --reference (the reference is then the policy's base weights)."""
    # shared options, with this stage's defaults
    lr: float = 1e-6
    eval_every: int = 100
    """Validation preference accuracy of the implicit reward every N steps, before the first step and after the last;
    0: only after the last; -1: never."""
    eval_samples: int = 4
    """Validation prompts whose greedy summaries are logged at every evaluation (samples.jsonl, a wandb table, beside
    each prompt's chosen response); 0: none."""
    best_metric: str = "val/accuracy"
    best_mode: Literal["min", "max"] = "max"
    out_dir: str = "runs/dpo"
    run_name: str = "dpo"

    def validate(self) -> None:
        if self.beta <= 0:
            raise ConfigError(f"--beta must be positive, got {self.beta}")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"--label_smoothing must be in [0, 0.5), got {self.label_smoothing}")
        if self.label_smoothing and self.loss != "sigmoid":
            raise ConfigError("--label_smoothing applies to --loss sigmoid only")
        if self.frozen_cpu_offload and (self.device == "cpu" or not torch.cuda.is_available()):
            raise ConfigError(
                "--frozen_cpu_offload needs a GPU (FSDP offloads shards from GPU to CPU memory); "
                "on CPU leave it false: the reference already lives in CPU memory"
            )
        self.validate_shared()  # --model, data, run, optimisation (and LoRA) options
        if self.eval_samples < 0:
            raise ConfigError(f"--eval_samples must be >= 0, got {self.eval_samples}")
        self.validate_judge()
        self.validate_frontier(self.judge)


def pair_losses(
    policy,
    reference,
    batch: dict,
    loss_fn,
    beta: float,
    device,
    prefix_sharing: bool = True,
    ref_logps: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-pair losses (B,) of one collate_pairs batch, differentiable in the policy only, and per-pair
    statistics summed over the batch (6,): loss, implicit-reward accuracy, chosen reward, rejected reward,
    policy log-prob of chosen, of rejected (rewards are beta * log pi/pi_ref, summed over response tokens).
    `ref_logps`: the reference's (reference_logps), else computed here."""
    B = batch["n_pairs"]
    if ref_logps is None:
        ref_logps = reference_logps(reference, [batch], device, prefix_sharing)[0]  # (2B,)
    logps = pair_logprobs(policy, batch, device, prefix_sharing)  # (2B,); packed rows, each prompt once
    policy_chosen, policy_rejected = logps[:B], logps[B:]
    ref_chosen, ref_rejected = ref_logps[:B], ref_logps[B:]
    losses = loss_fn(policy_chosen, policy_rejected, ref_chosen, ref_rejected)  # (B,)
    with torch.no_grad():
        reward_chosen = beta * (policy_chosen - ref_chosen).double()  # (B,)
        reward_rejected = beta * (policy_rejected - ref_rejected).double()
        outcomes = pair_outcomes(reward_chosen, reward_rejected)  # (B,) 1, 1/2 or 0
        parts = (losses, outcomes, reward_chosen, reward_rejected, policy_chosen, policy_rejected)  # (B,) each
        stats = torch.stack([t.double().sum() for t in parts])  # (6,)
    return losses, stats


def accumulate_gradients(
    policy,
    reference,
    micro_batches: list[dict],
    world: int,
    n_pairs: int,
    loss_fn,
    beta: float,
    device,
    prefix_sharing: bool = True,
) -> dict:
    """Forward and backward over this rank's micro-batches of one optimizer step; returns global metrics.

    Each rank's summed loss is divided by the global number of pairs (utils/optim.py accumulate_micro_batches), so
    the gradient is d(mean loss over the global batch). The reference's log-probs come first, for every micro-batch
    at once (reference_logps)."""
    ref_logps = reference_logps(reference, micro_batches, device, prefix_sharing)

    def loss_of(micro: tuple[dict, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        batch, ref = micro
        losses, stats = pair_losses(policy, reference, batch, loss_fn, beta, device, prefix_sharing, ref)
        return losses.sum(), stats

    stats = accumulate_micro_batches(policy, list(zip(micro_batches, ref_logps, strict=True)), loss_of, world, n_pairs)
    sums = sum(stats, torch.zeros(6, dtype=torch.float64, device=device))
    loss, accuracy, chosen, rejected, logp_chosen, logp_rejected = (all_reduce_sum(sums) / n_pairs).tolist()
    return {
        "train/loss": loss,
        "train/accuracy": accuracy,
        "train/reward_chosen": chosen,
        "train/reward_rejected": rejected,
        "train/reward_margin": chosen - rejected,
        "train/logp_chosen": logp_chosen,
        "train/logp_rejected": logp_rejected,
    }


def validate(policy, ref_val, val_set, cfg: Config, device, judge, samples, logger, step: int) -> dict:
    """Validation at step `step` (a collective): the implicit reward's preference accuracy with its bootstrap interval
    (against the reference's log-probs `ref_val`), with --judge the win rate of the greedy summaries; the table of
    sample summaries is logged."""
    val = evaluate_policy(policy, ref_val, val_set, cfg.beta, device, prefix_sharing=cfg.prefix_sharing)
    out = {f"val/{k}": v for k, v in val.items()} | (judge.evaluate(policy, "val/") if judge is not None else {})
    if samples is not None:
        samples.log(logger, policy, step)
    return out


def main(cfg: Config) -> dict:
    # 1. distributed set-up and every check that needs no data and no weights: sizes, the models' configs, the run
    #    directory and the checkpoint to resume from (all before any model is built or put on a GPU)
    model_cfg = model_config(cfg.model, cfg.random_init, kind="policy")
    limits = [(model_cfg, "max_response_len", "policy")]
    if cfg.reference:
        reference_cfg = model_config(cfg.reference, kind="policy", option="--reference")
        limits.append((reference_cfg, "max_response_len", "reference"))
    fit_context(cfg, *limits, *cfg.judge_limits(model_cfg), *cfg.frontier_limits(model_cfg, "max_response_len"))
    run = start_run(cfg, {"stage": "dpo", "model_config": model_cfg.to_dict(), "lora": cfg.lora_meta()})
    world, device = run.world, run.device
    accum = accumulation_steps(cfg.batch_size, cfg.micro_batch_size, world)

    # 2. data: tokenize, shard per rank, shuffle per epoch; validation pairs split disjointly over ranks
    tok = get_tokenizer()
    data = load_pairs(cfg, tok, run.rank, world, cfg.seed, validate=cfg.eval_every >= 0)
    total_steps = epoch_steps(cfg.steps, data.loader.n_examples, data.loader.batches_per_epoch, accum, cfg.batch_size)

    # 3. policy and frozen reference (training/reference.py), optimizer over the policy's trainable parameters
    policy, reference = build_policy_and_reference(cfg, run)
    optimizer, scheduler = build_optimization(policy, cfg, total_steps)
    loss_fn = preference_loss(cfg)
    judge = None  # --judge: its reward model and posts, for the win rate at every evaluation
    if cfg.judge:
        judge = Judge(cfg, tok, cfg.max_prompt_len, run.dtype, device, 2 * cfg.micro_batch_size, cfg.seed)

    # 4. resume: the policy's weights, optimizer, schedule, every rank's RNG, data position, best validation so far
    #    (the reference is rebuilt from --model / --reference); validation of the reference once, it never changes
    step = resume(run, cfg, policy, optimizer, scheduler, data.loader, total_steps)
    run.say(
        f"dpo ({cfg.loss}, beta {cfg.beta}): {len(data.train)} pairs, world {world}, {accum} accumulation steps, "
        f"{total_steps} steps"
    )
    ref_val = eval_set_logps(reference, data.val_set, device, cfg.prefix_sharing) if data.val_set is not None else None
    samples = None
    if ref_val is not None and cfg.eval_samples > 0:
        rows = load_rows(cfg.val_data, cfg.val_split, PREF_COLUMNS)[: cfg.eval_samples]
        samples = SampleLog(rows, "chosen", tok, cfg.max_prompt_len, cfg.max_response_len, cfg.seed)
    # --frontier_prompts: eval/kl and rewards of temperature-1 samples at each evaluation (else None)
    frontier = Frontier.build(cfg, tok, run, cfg.max_response_len, judge.model if judge else None)
    evaluated = frontier.metric_names() if frontier else set()
    if ref_val is not None:
        evaluated |= preference_metric_names("val/") | (judge.metric_names("val/") if judge else set())
    check_best_metric(cfg, evaluated)
    first = frontier.evaluate(policy, reference, 0) if frontier and step == 0 and cfg.eval_every > 0 else {}
    if ref_val is not None and step == 0 and cfg.eval_every > 0:
        first |= validate(policy, ref_val, data.val_set, cfg, device, judge, samples, run.logger, 0)
    if first:
        log_row(run, first, 0)
    batches = data.step_batches(accum, cfg.overfit_batch)
    policy.train()
    metrics, stopping = {}, False
    with run.stop:  # SIGTERM / SIGINT: finish the step, save, exit 0
        while step < total_steps and not stopping:
            t0 = time.perf_counter()
            # 5. one optimizer step: per-pair loss summed / global number of pairs; a non-finite loss or gradient
            #    norm stops the run, or skips the step (--on_nonfinite)
            micro = next(batches)
            metrics = accumulate_gradients(
                policy, reference, micro, world, cfg.batch_size, loss_fn, cfg.beta, device, cfg.prefix_sharing
            )
            guarded_step(policy, optimizer, scheduler, run.guard, step + 1, metrics, cfg.grad_clip)
            step += 1

            # 6. log, validation accuracy of the implicit reward with its bootstrap interval, checkpoint of the policy
            #    (on schedule, at the end, at a new best, or when a signal came)
            metrics.update(step_throughput(micro, time.perf_counter() - t0, world, device))
            if ref_val is not None and cfg.eval_due(step, total_steps):
                metrics.update(validate(policy, ref_val, data.val_set, cfg, device, judge, samples, run.logger, step))
            if frontier is not None and cfg.eval_due(step, total_steps):
                metrics.update(frontier.evaluate(policy, reference, step))
            stopping = end_of_step(run, cfg, step, total_steps, metrics, policy, optimizer, scheduler, data.loader)

    # 7. export a Hugging Face-format folder (not after a signal: the run is not finished)
    finish(run, policy, step, metrics, stopping, lambda sd: save_export(policy, sd, model_cfg, run.dir / "hf"))
    return metrics


if __name__ == "__main__":
    with exit_on_error():
        main(parse_config(Config, description=__doc__.split("\n\n")[0]))
