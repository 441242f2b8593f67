"""GRPO: Group Relative Policy Optimization of a GPT-2 policy on Reddit TL;DR prompts, against a reward model, reward
functions of the text, or a weighted sum of both.

    torchrun --nproc_per_node=2 grpo.py                              # policy runs/sft/hf, reward model runs/rm/hf
    python grpo.py --model runs/sft/hf --reward_model runs/rm/hf     # one device
    python grpo.py --rewards "gold_reward + 0.5*format" --lora_rank 8 --policy_epochs 2   # no reward model at all
    python grpo.py --help                                            # every option (docs/grpo.md, docs/lora_rewards.md)

One step (DeepSeekMath, arXiv 2402.03300, section 4); main() runs 0, 1, 8 and 9, rollouts/step.py's train_step runs
2-7 (its docstring says what each does):

    0. refresh reference  every --ref_refresh_every steps the current policy becomes the reference
    1. sample prompts     prompts_per_step prompts, split over ranks
    2. generate           G = num_samples responses per prompt
    3. score              every reward source (--rewards) on the samples it applies to, their weighted sum the reward
    4. select             K = num_kept of G per prompt (RSO rejection sampling at temperature beta_rs, ...)
    5. advantages         --advantage's estimator over the K selected, then whitened over the batch across ranks
    6. reference          log-probs of the selected responses under the frozen reference policy
    7. update             clipped ratio + beta * KL estimate - entropy_coef * entropy; mu = --policy_epochs steps
    8. log, evaluate      one line of metrics per step; every --eval_every steps the evaluation
    9. checkpoint

The math (selection, advantages, loss, aggregation, reward sources) lives in rlhf/, one pure function per variant.
Sampling and selection draw from a torch.Generator seeded from (seed, step, rank), so a resumed run repeats the
same samples and losses bit for bit.
"""

import time
from dataclasses import dataclass
from functools import partial
from typing import Literal

from data.tldr import ShardedLoader
from data.tokenizer import get_tokenizer
from evaluation.frontier_declarations import FrontierConfig
from evaluation.measure import Frontier
from evaluation.preference import eval_set_logps, evaluate_policy
from evaluation.summaries import (
    EvalSetsConfig,
    SampleTableConfig,
    evaluate_summaries,
    evaluation_metric_names,
    load_eval_sets,
    sample_table,
)
from model.lora import LoRAConfig, trainable_summary
from model.weights import save_export
from rlhf.advantages import ADVANTAGES
from rollouts.batches import per_rank_sizes
from rollouts.metrics import gold_metrics, step_metrics
from rollouts.models import Models, build_models, check_models, check_step_fits, refresh_reference
from rollouts.options import (
    ObjectiveConfig,
    OffloadConfig,
    RewardConfig,
    SamplingConfig,
    SelectionConfig,
    StepBatchConfig,
)
from rollouts.prompts import prompt_set, training_prompts
from rollouts.sampling import RewardSpec
from rollouts.step import train_step
from utils.config import (
    ConfigError,
    DataConfig,
    DecodeConfig,
    OptimConfig,
    RunConfig,
    option,
    parse_config,
    require_nonempty,
    require_positive,
)
from utils.guard import exit_on_error
from utils.logging import perf_metrics
from utils.optim import build_optimizer, build_scheduler
from utils.run import check_best_metric, end_of_step, finish, log_row, resume, start_run


@dataclass
class Config(
    RunConfig,
    OptimConfig,
    DataConfig,
    LoRAConfig,
    DecodeConfig,
    SamplingConfig,
    SelectionConfig,
    RewardConfig,
    ObjectiveConfig,
    StepBatchConfig,
    OffloadConfig,
    FrontierConfig,
    SampleTableConfig,
    EvalSetsConfig,
):
    """utils/config.py's option groups, GRPO's (rollouts/options.py: sampling, selection, rewards, objective, the
    step's batch sizes, offload), the frontier's (evaluation/frontier_declarations.py), the evaluation sets' and the
    sample tables' (evaluation/summaries.py), with the script's own options below."""

    # --- models
    model: str = option("runs/sft/hf", model="policy")
    """Starting policy, also the frozen reference (with LoRA: the policy's own base weights, adapters off): a
    Hugging Face-format folder (sft.py's hf/), a hub name, or with --random_init a preset (tiny, small, ...)."""
    random_init: bool = False
    """Random GPT-2 initialisation of the preset named by --model (tests and smoke runs)."""
    reward_model: str = option("runs/rm/hf", model="reward_model")
    """Reward model: reward_model.py's hf/ folder (its gain/bias come from reward_normalization.json), or with
    --reward_random_init a preset. Loaded only when --rewards names reward_model."""
    reward_random_init: bool = False
    """Random reward model of the preset named by --reward_model, gain 1 and bias 0 (tests and smoke runs)."""
    # --- data
    val_rows: int = 256
    # --- batch sizes and optimisation
    lr: float = 3e-6
    warmup_steps: int = 10
    # --- evaluation and logging
    eval_every: int = 50
    """Evaluate before the first step, every N steps and after the last; 0: only after the last; -1: never."""
    eval_greedy: bool = True
    """Greedy summaries in evaluation; false samples at --temperature / --top_p / --top_k."""
    save_every: int = 50
    best_metric: str = "eval/reward"
    """Evaluation metric whose best value keeps its checkpoint (named in checkpoints/best.json, never pruned);
    a new best is saved when it appears. Empty disables. The default needs the summary evaluation (--val_data);
    without it, eval/pref_accuracy (or nothing, without --pref_data either)."""
    best_mode: Literal["min", "max"] = "max"
    out_dir: str = "runs/grpo"
    run_name: str = "grpo"

    def keep_best_by(self, summaries: bool, preferences: bool) -> str:
        """--best_metric; its default eval/reward needs the summary evaluation, else eval/pref_accuracy or none."""
        if self.best_metric != "eval/reward" or summaries:
            return self.best_metric
        return "eval/pref_accuracy" if preferences else ""

    def validate(self) -> None:
        self.validate_rewards()
        reads_reward_model = any(s.fn is None for s in self.sources())
        if reads_reward_model:
            require_nonempty(self, "reward_model")
        self.validate_shared()  # --model, data, run, optimisation and LoRA options
        self.validate_sampling()
        self.validate_selection()
        self.validate_objective()
        self.validate_step_batches()
        self.validate_frontier(self.reward_model if reads_reward_model else "")
        self.validate_eval_sets()
        require_positive(self, "table_prompts")
        if self.kept < (need := ADVANTAGES.facts.get(self.advantage, {}).get("min_kept", 1)):
            raise ConfigError(
                f"--advantage {self.advantage} needs at least {need} kept samples per prompt, got {self.kept}"
            )
        if ADVANTAGES.facts.get(self.advantage, {}).get("pool") and self.num_samples < 2:
            raise ConfigError(
                f"--advantage {self.advantage} takes a standard deviation over each group's scored samples: it needs "
                f"--num_samples >= 2, got {self.num_samples}"
            )


# ----------------------------------------------------------------------------------------------------
# Set-up and the loop (stage 8's metrics: rollouts/metrics.py)


def evaluate(
    models: Models, spec: RewardSpec, val, pref, ref_pref, cfg: Config, step: int, device, *, frontier=None
) -> dict:
    """Stage 8's evaluation (a collective): the policy's summaries of this rank's --val_data prompts (`val`) and the
    implicit reward's accuracy on its --pref_data pairs (`pref`, against the reference's log-probs `ref_pref`); with
    --frontier_prompts (`frontier`) the KL to the policy the run started from (a frozen copy of it when
    --ref_refresh_every refreshes the reference) and rewards of temperature-1 samples."""
    out = evaluate_summaries(models.policy, models.reward_model, spec, val, cfg, step) if val is not None else {}
    out |= frontier.evaluate(models.policy, models.starting_policy, step) if frontier is not None else {}
    if not pref:
        return out
    acc = evaluate_policy(models.policy, ref_pref, pref, cfg.beta, device, prefix_sharing=cfg.prefix_sharing)
    return out | {f"eval/pref_{k}": v for k, v in acc.items()}


def main(cfg: Config) -> dict:
    # set-up: every check that needs no data and no weights (sizes, the models' configs and context lengths), then
    # the process group, run directory and checkpoint to resume from, before any model is built or put on a GPU
    sources = cfg.sources()  # the reward model and/or functions
    gold_reward, gold_parts = cfg.gold_functions()  # monitored, never trained on; or None
    model_cfg = check_models(cfg, sources)
    run = start_run(cfg, {"stage": "grpo", "model_config": model_cfg.to_dict(), "lora": cfg.lora_meta()})
    rank, world, device = run.rank, run.world, run.device
    prompts_per_rank, n_micro = per_rank_sizes(cfg, world)
    check_step_fits(cfg, sources, model_cfg, run.dtype, world, device)

    # set-up: data (training prompts sharded per rank, with the reward sources that apply to each row; evaluation
    # sets split over ranks), models, optimizer, resume
    tok = get_tokenizer()
    train, train_applies, train_name = training_prompts(cfg, tok, sources)  # applies (rows, S)
    loader = ShardedLoader(len(train), prompts_per_rank, rank, world, cfg.seed, collate=lambda idx: idx)
    total_steps = cfg.steps or loader.batches_per_epoch
    val, pref = load_eval_sets(cfg, tok, sources, rank, world, device)
    models = build_models(cfg, sources, run.dtype, device)
    run.say(
        f"grpo: {trainable_summary(models.policy)}; rewards: " + " + ".join(f"{s.weight:g}*{s.name}" for s in sources)
    )
    spec = RewardSpec(sources, cfg.normalize_reward_fns, tok)
    save_reference = cfg.ref_refresh_every > 0 and not cfg.lora_enabled  # with LoRA the model state holds it
    optimizer = build_optimizer(models.policy, cfg.lr, cfg.weight_decay)
    scheduler = build_scheduler(optimizer, cfg.warmup_steps, total_steps * cfg.policy_epochs, cfg.min_lr_ratio)
    frozen = {"reference": models.reference} if save_reference else None  # a refreshed reference (full fine-tuning)
    step = resume(run, cfg, models.policy, optimizer, scheduler, loader, total_steps, frozen=frozen)
    # what end_of_step saves beside the policy: the best evaluation's checkpoint, a refreshed reference
    keep = {"best_metric": cfg.keep_best_by(val is not None, pref is not None), "frozen": frozen}
    run.say(
        f"grpo: {len(train)} prompts, world {world}, {prompts_per_rank} prompts x {cfg.num_samples} samples -> "
        f"{cfg.kept} kept per rank, {n_micro} micro-batches, {total_steps} steps"
    )
    ref_pref = eval_set_logps(models.reference, pref, device, cfg.prefix_sharing) if pref is not None else None
    # --frontier_prompts: KL to the reference and rewards of temperature-1 samples (eval/kl, ...); else None
    frontier = Frontier.build(cfg, tok, run, cfg.max_new_tokens, models.reward_model, gold_reward)
    check_best_metric(cfg, evaluation_metric_names(spec, val, pref, frontier), keep["best_metric"])
    if step == 0 and cfg.eval_every > 0:
        evaluated = evaluate(models, spec, val, pref, ref_pref, cfg, 0, device, frontier=frontier)
        log_row(run, evaluated, 0)
    batches_iter, metrics, stopping = iter(loader), {}, False
    models.policy.train()
    with run.stop:  # SIGTERM / SIGINT: finish the step, save, exit 0
        while step < total_steps and not stopping:
            t_step = time.perf_counter()
            # 0. iterative GRPO: every ref_refresh_every steps the current policy becomes the reference
            if cfg.ref_refresh_every > 0 and step > 0 and step % cfg.ref_refresh_every == 0:
                refresh_reference(models)
                if pref is not None:  # the implicit reward beta * log(pi / pi_ref) is relative to the new reference
                    ref_pref = eval_set_logps(models.reference, pref, device, cfg.prefix_sharing)
            # 1. sample prompts (this rank's slice of the global batch)
            t_sample = time.perf_counter()
            prompts = prompt_set(train, list(next(batches_iter)), train_applies, device, train_name)
            seconds = {"sample": time.perf_counter() - t_sample}
            # 2.-7. generate, score, select, advantages, reference, update
            result = train_step(models, optimizer, scheduler, prompts, spec, cfg, step + 1, run.guard)
            step += 1

            # 8. log and evaluate
            metrics = step_metrics(result, spec, cfg, per_row_sources=not bool(train_applies.all()))
            if gold_reward is not None or gold_parts is not None:  # a monitored reward, e.g. the synthetic task's
                metrics.update(gold_metrics(gold_reward, gold_parts, tok, prompts, result.samples, cfg.num_samples))
            generated, step_seconds = metrics.pop("perf/generated_tokens"), time.perf_counter() - t_step
            metrics.update(perf_metrics(seconds | result.seconds, step_seconds, generated, world))
            if cfg.eval_due(step, total_steps):
                metrics.update(evaluate(models, spec, val, pref, ref_pref, cfg, step, device, frontier=frontier))
            if cfg.table_every > 0 and step % cfg.table_every == 0:
                run.logger.table("samples", *sample_table(spec, prompts, result, cfg.table_prompts), step)

            # 9. checkpoint: on schedule, at the end, at a new best evaluation metric, or when a signal came
            stopping = end_of_step(
                run, cfg, step, total_steps, metrics, models.policy, optimizer, scheduler, loader, **keep
            )

    # 10. export a Hugging Face-format folder (not after a signal: the run is not finished)
    export = partial(save_export, models.policy, cfg=model_cfg, folder=run.dir / "hf")  # the Hugging Face folder
    finish(run, models.policy, step, metrics, stopping, export)
    return metrics


if __name__ == "__main__":
    with exit_on_error():
        main(parse_config(Config, description=__doc__.split("\n\n")[0]))
