"""Reward model on Reddit TL;DR comparisons (trl-lib/tldr-preference): GPT-2 with a scalar head.

    python reward_model.py --model runs/sft/hf                         # one device
    torchrun --nproc_per_node=2 reward_model.py --model runs/sft/hf    # two GPUs (or two CPU processes)
    python reward_model.py --help                                      # every option

r(x, y) is the body's hidden state at the last real token of prompt + response (the response's "\\n" end
token) projected to a scalar, or with --pooling sum that projection summed over the response tokens
(model/heads.py). The loss is Bradley-Terry, -log sigmoid(r(x, y_w) - r(x, y_l))
(Stiennon et al. 2020, eq. 1), summed over pairs and divided by the global batch size in pairs, so the gradient
is the same for any world size and micro-batch size.

After training, a gain and bias are fitted so that the rewards of responses sampled from the SFT policy on
training prompts have mean 0 and standard deviation 1 (GRPO reads normalised rewards); they are saved with the
model as the RewardModel's gain/bias buffers and in hf/reward_normalization.json.
"""

import time
from dataclasses import dataclass
from typing import Literal

import torch

from data.tldr import PromptDataset
from data.tokenizer import get_tokenizer
from evaluation.preference import evaluate_reward_model, preference_metric_names, reward_scores
from model.weights import build_policy, build_reward_model, model_config, resolve_pooling, save_export
from rlhf.losses import bradley_terry_loss
from rlhf.stats import pair_outcomes
from training.pairs import PairConfig, load_pairs
from training.reward_normalization import fit_normalization, normalization_prompts
from utils.config import (
    ConfigError,
    DecodeConfig,
    OptimConfig,
    RunConfig,
    accumulation_steps,
    fit_context,
    option,
    parse_config,
)
from utils.dist import all_reduce_sum
from utils.fsdp import shard_model
from utils.guard import exit_on_error
from utils.optim import accumulate_micro_batches, build_optimization, guarded_step, step_throughput
from utils.run import check_best_metric, end_of_step, epoch_steps, finish, log_row, resume, start_run


@dataclass
class Config(RunConfig, OptimConfig, PairConfig, DecodeConfig):  # run, optimisation, preference-pair, decode options
    # --- models
    model: str = option("runs/sft/hf", model="policy")
    """Starting weights: an SFT export (Hugging Face-format folder; a new scalar head is added), a reward-model
    folder (its head is kept), a hub name (gpt2, ...), or with --random_init a preset (tiny, small, gpt2, ...)."""
    random_init: bool = False
    """Start from random GPT-2 initialisation of the preset named by --model instead of loading weights."""
    pooling: Literal["", "last", "sum"] = ""
    """How the head reads the body (model/heads.py RewardModel): "last", the hidden state at the last real token
    (transformers' GPT2ForSequenceClassification); "sum", the head at every response token, summed (a per-token
    reward, which can check each word against the post); empty: a reward-model --model folder's own, else
    "last"."""
    # shared options, with this stage's defaults
    max_response_len: int = 64
    """Response tokens kept, including the "\\n" end token (also the sampling length of the normalisation)."""
    lr: float = 1e-5
    # --- sampling (of the SFT responses that fit the reward normalisation)
    sft_policy: str = option("", model="policy")
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
    # shared options, with this stage's defaults
    eval_every: int = 100
    """Validation preference accuracy every N steps, before the first step and after the last; 0: only after the
    last; -1: never."""
    best_metric: str = "val/accuracy"
    best_mode: Literal["min", "max"] = "max"
    out_dir: str = "runs/rm"
    run_name: str = "reward_model"

    def validate(self) -> None:
        self.validate_shared()  # --model, data, run, optimisation (and LoRA) options
        for name in ("norm_samples_per_prompt", "norm_batch_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name} must be positive, got {getattr(self, name)}")
        if self.norm_prompts < 0:
            raise ConfigError(f"--norm_prompts must be >= 0, got {self.norm_prompts}")
        if self.norm_prompts == 1 and self.norm_samples_per_prompt == 1:
            raise ConfigError("the normalisation needs at least 2 samples (--norm_prompts x --norm_samples_per_prompt)")


def accumulate_gradients(
    model, micro_batches: list[dict], world: int, n_pairs: int, device, prefix_sharing: bool = True
) -> dict[str, float]:
    """Forward and backward over this rank's micro-batches of one optimizer step; returns global metrics.

    Each rank's summed loss is divided by the global number of pairs (utils/optim.py accumulate_micro_batches), so
    the gradient is d(mean loss over the global batch)."""

    def loss_of(batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        B = batch["n_pairs"]
        rewards = reward_scores(model, batch, device, prefix_sharing)  # (2B,)
        r_chosen, r_rejected = rewards[:B], rewards[B:]  # (B,), (B,)
        losses = bradley_terry_loss(r_chosen, r_rejected)  # (B,)
        r_chosen, r_rejected = r_chosen.detach().double(), r_rejected.detach().double()
        # sums over pairs: loss, correct (ties 1/2), chosen reward, rejected reward
        return losses.sum(), torch.stack(
            [
                losses.detach().double().sum(),
                pair_outcomes(r_chosen, r_rejected).sum(),
                r_chosen.sum(),
                r_rejected.sum(),
            ]
        )

    stats = accumulate_micro_batches(model, micro_batches, loss_of, world, n_pairs)
    sums = sum(stats, torch.zeros(4, dtype=torch.float64, device=device))
    loss, accuracy, chosen, rejected = (all_reduce_sum(sums) / n_pairs).tolist()
    return {
        "train/loss": loss,
        "train/accuracy": accuracy,
        "train/reward_chosen": chosen,
        "train/reward_rejected": rejected,
        "train/reward_margin": chosen - rejected,
    }


def main(cfg: Config) -> dict:
    # 1. distributed set-up and every check that needs no data and no weights: sizes, the models' configs (the
    #    normalisation's SFT policy too, so a wrong folder fails now and not after training), the run directory and
    #    the checkpoint to resume from (all before any model is built or put on a GPU)
    model_cfg = model_config(cfg.model, cfg.random_init)
    resolve_pooling(cfg.model, cfg.pooling, cfg.random_init)  # --pooling against a reward-model folder's own
    limits = [(model_cfg, "max_response_len", "reward model")]
    policy_name, policy_random_init = cfg.sft_policy or cfg.model, cfg.random_init and not cfg.sft_policy
    if cfg.norm_prompts > 0:
        option = "--sft_policy" if cfg.sft_policy else "--model (the normalisation's SFT policy without --sft_policy)"
        policy_cfg = model_config(policy_name, policy_random_init, kind="policy", option=option)
        limits.append((policy_cfg, "max_response_len", "SFT policy"))
    fit_context(cfg, *limits)
    run = start_run(cfg, {"stage": "reward_model", "model_config": model_cfg.to_dict()})
    world, device = run.world, run.device
    accum = accumulation_steps(cfg.batch_size, cfg.micro_batch_size, world)

    # 2. data: tokenize, shard per rank, shuffle per epoch; validation pairs split disjointly over ranks
    tok = get_tokenizer()
    data = load_pairs(cfg, tok, run.rank, world, cfg.seed, validate=cfg.eval_every >= 0)
    total_steps = epoch_steps(cfg.steps, data.loader.n_examples, data.loader.batches_per_epoch, accum, cfg.batch_size)

    # 3. model, FSDP, optimizer. Training changes the rewards, so a loaded normalisation no longer holds.
    model = build_reward_model(cfg.model, cfg.random_init, cfg.pooling, new_head=True)  # a policy: a new head
    model.gain.fill_(1.0)
    model.bias.fill_(0.0)
    shard_model(model, run.dtype, activation_checkpointing=cfg.activation_checkpointing, compile_blocks=cfg.compile)
    model.to(device)
    optimizer, scheduler = build_optimization(model, cfg, total_steps)

    # 4. resume: weights, optimizer, schedule, every rank's RNG, data position, best validation so far
    step = resume(run, cfg, model, optimizer, scheduler, data.loader, total_steps)
    run.say(f"reward model: {len(data.train)} pairs, world {world}, {accum} accumulation steps, {total_steps} steps")
    batches = data.step_batches(accum, cfg.overfit_batch)
    model.train()
    check_best_metric(cfg, preference_metric_names("val/") if data.val_set is not None else set())
    if data.val_set is not None and step == 0 and cfg.eval_every > 0:
        val = evaluate_reward_model(model, data.val_set, device, prefix_sharing=cfg.prefix_sharing)
        val = {f"val/{k}": v for k, v in val.items()}
        log_row(run, val, 0)
    metrics, stopping = {}, False
    with run.stop:  # SIGTERM / SIGINT: finish the step, save, exit 0
        while step < total_steps and not stopping:
            t0 = time.perf_counter()
            # 5. one optimizer step: Bradley-Terry loss summed over pairs / global number of pairs; a non-finite loss
            #    or gradient norm stops the run, or skips the step (--on_nonfinite)
            micro = next(batches)
            metrics = accumulate_gradients(model, micro, world, cfg.batch_size, device, cfg.prefix_sharing)
            guarded_step(model, optimizer, scheduler, run.guard, step + 1, metrics, cfg.grad_clip)
            step += 1

            # 6. log, validation accuracy with its bootstrap interval, checkpoint (on schedule, at the end, at a new
            #    best, or when a signal came)
            metrics.update(step_throughput(micro, time.perf_counter() - t0, world, device))
            if data.val_set is not None and cfg.eval_due(step, total_steps):
                val = evaluate_reward_model(model, data.val_set, device, prefix_sharing=cfg.prefix_sharing)
                metrics.update({f"val/{k}": v for k, v in val.items()})
            stopping = end_of_step(run, cfg, step, total_steps, metrics, model, optimizer, scheduler, data.loader)

    # 7. reward normalisation on samples of the SFT policy (GRPO reads gain * r + bias); not after a signal
    if cfg.norm_prompts > 0 and not stopping:
        with torch.random.fork_rng(devices=[]):  # a random init from the state every rank shares, not the per-rank one
            torch.set_rng_state(run.init_rng)
            policy = build_policy(policy_name, policy_random_init)
        shard_model(policy, run.dtype).to(device)
        prompt_rows = normalization_prompts(data.rows, cfg.norm_prompts, cfg.seed)
        prompts = PromptDataset(prompt_rows, tok, cfg.max_prompt_len, name="normalisation prompts").prompts
        norm = fit_normalization(model, policy, prompts, cfg, run.rank, world, device, step)
        del policy
        log_row(run, norm, step)
        metrics.update(norm)
        run.say(
            f"reward normalisation over {int(norm['norm/samples'])} samples of {policy_name}: raw mean "
            f"{norm['norm/raw_mean']:.4f}, std {norm['norm/raw_std']:.4f} -> gain {norm['norm/gain']:.4f}, "
            f"bias {norm['norm/bias']:.4f}"
        )

    # 8. export a Hugging Face-format folder (gain and bias go to reward_normalization.json; not after a signal)
    finish(run, model, step, metrics, stopping, lambda sd: save_export(model, sd, model_cfg, run.dir / "hf"))
    return metrics


if __name__ == "__main__":
    with exit_on_error():
        main(parse_config(Config, description=__doc__.split("\n\n")[0]))
