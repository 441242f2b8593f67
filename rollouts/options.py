"""GRPO's option groups (grpo.py composes them into its Config, as it composes utils/config.py's): rewards,
sampling, selection, objective and the step's batch sizes, each a dataclass whose fields are command-line options
(`--name VALUE`, help text the string under the field, `--help` section the `# --- SECTION` line above it) and whose
validate_* method checks its own fields; and the offload of the frozen models, which dpo.py composes too."""

from dataclasses import dataclass
from typing import Literal

from data.synthetic import gold_reward as synthetic_gold_reward
from rlhf.advantages import ADVANTAGES
from rlhf.policy_gradient import AGGREGATIONS, KL_ESTIMATORS, ROLLOUT_CORRECTIONS, Objective
from rlhf.rewards import RewardSource, load_function, parse_rewards
from rlhf.selection import SELECTIONS
from utils.config import ConfigError, declared, option, require_non_negative, require_nonempty, require_positive

TASK_REWARDS = {"gold_reward": synthetic_gold_reward}  # --rewards gold_reward: the embedded task's gold reward


def keeps_start(cfg) -> bool:
    """Whether a GRPO run keeps a frozen copy of its starting policy beside the reference (rollouts.models): a
    reference that --ref_refresh_every moves, and --frontier_prompts measuring eval/kl, the KL to the policy the run
    started from that the frontier compares across methods. One more frozen copy of the policy's weights (on the host
    with --frozen_cpu_offload; with LoRA the base weights, into which a refresh merges the adapters)."""
    return cfg.ref_refresh_every > 0 and cfg.frontier_prompts > 0


@dataclass
class OffloadConfig:
    # --- models
    frozen_cpu_offload: bool = option(False, free=True)
    """Keep the frozen models' sharded parameters (the reference; GRPO's reward model too) in CPU memory between uses
    (needs a GPU). Unused where the reference is the policy itself (LoRA, without dpo.py's --reference)."""


@dataclass
class RewardConfig:
    """The training reward (stage 3): its sources and their weights, where each applies, and how each is normalized;
    and a gold reward monitored beside it (logged, never trained on)."""

    # --- rewards and selection
    rewards: str = "reward_model"
    """The training reward, "+"-joined terms [WEIGHT*]SOURCE; a SOURCE is reward_model (--reward_model), a built-in
    function (format, length, gold_reward) or a "module:function" of (prompt text, response text) -> number, e.g.
    "reward_model + 0.5*format" or "gold_reward" (then no reward model is loaded). Each source is normalized on
    its own, then weighted and summed (rlhf/rewards.py, docs/lora_rewards.md)."""
    reward_column: str = "reward_fns"
    """Optional column of --train_data / --val_data naming, per row, the sources that apply to it ("gold_reward,
    format" or a list of names); rows without it, or a dataset without the column, get every source."""
    normalize_reward_fns: bool = True
    """Whiten each reward function's values over the step's global batch (all samples it applies to, all ranks)
    before weighting; false uses their raw values. The reward model keeps its own gain/bias normalization."""
    reward_length_target: int = 24
    """Words the built-in `length` reward function aims at (0 at the target, -1 at none or twice as many)."""
    missing_end_penalty: float = 1.0
    """Subtracted from the *raw* reward-model score of a response without an end token, before the gain/bias
    normalization (so gain * penalty in normalized units)."""
    # --- evaluation and logging
    gold_reward_fn: str = ""
    """Optional "module:function" of (prompt text, response text) -> float, logged (never trained on, unless it is
    also in --rewards) as reward/gold_mean over every step's samples, e.g. data.synthetic:gold_reward."""
    gold_parts_fn: str = ""
    """Optional "module:function" of (prompt text, response text) -> {name: number}, the parts of the gold reward,
    each logged as gold/<name> (its mean over every step's samples), e.g. data.synthetic:gold_parts."""

    def sources(self) -> list[RewardSource]:
        """The reward sources of --rewards (imports their functions: a typo fails here)."""
        return parse_rewards(self.rewards, self.reward_length_target, TASK_REWARDS)

    def gold_functions(self) -> tuple:
        """(--gold_reward_fn, --gold_parts_fn) imported (a typo fails here), None for each that is empty."""
        gold_reward = load_function(self.gold_reward_fn, "--gold_reward_fn") if self.gold_reward_fn else None
        return gold_reward, load_function(self.gold_parts_fn, "--gold_parts_fn") if self.gold_parts_fn else None

    def validate_rewards(self) -> None:
        require_nonempty(self, "rewards")
        require_positive(self, "reward_length_target")


@dataclass
class SamplingConfig:
    # --- sampling
    num_samples: int = 64
    """G: responses sampled per prompt."""
    max_new_tokens: int = 53
    """Response tokens sampled at most, the end token included."""
    temperature: float = 1.0
    """Sampling temperature (> 0); the ratio's and KL's log-probs use the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass; 1 disables. The loss's log-probs use the same masking."""
    top_k: int = 0
    """Top-k sampling; 0 disables. The loss's log-probs use the same masking."""
    gen_prompts: int = 16
    """Prompts per generation call on each rank (x num_samples sequences in the KV cache). Checked against the
    device's free memory before the first step (rollouts/memory.py)."""
    prefix_sharing: bool = True
    """Compute and store each prompt once per group: one copy of its KV cache for its G samples while generating,
    and packed rows with the prompt once for its responses in the reward model, the reference and the update
    (same numbers up to float rounding); false gives every sample its own copy of the prompt."""

    def validate_sampling(self) -> None:
        require_positive(self, "num_samples", "max_new_tokens", "gen_prompts")
        if not self.temperature > 0:
            raise ConfigError(f"--temperature must be > 0 (greedy evaluation: --eval_greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ConfigError(f"--top_p must be in (0, 1] and --top_k >= 0, got {self.top_p}, {self.top_k}")


@dataclass
class SelectionConfig:
    """K of each prompt's G samples kept for the update (G: SamplingConfig's num_samples, which this group reads)."""

    # --- rewards and selection
    selection: str = option("rso", choices=SELECTIONS)
    """How K of the G samples are kept (rlhf/selection.py SELECTIONS)."""
    num_kept: int = 8
    """K: samples kept per prompt for the update (ignored by --selection all)."""
    beta_rs: float = 2.0
    """RSO temperature: acceptance probability exp((r - r_max) / beta_rs) on normalized rewards."""
    min_group_std: float = 0.0
    """Dynamic sampling (DAPO, arXiv 2503.14476): drop the groups whose K kept rewards have a std (float64) below
    this, measured after selection; they would have advantage ~0 and only dilute the batch. The batch shrinks (the
    share dropped is logged as sample/dropped_group_fraction); no other prompts are drawn. 0 keeps every group."""

    @property
    def kept(self) -> int:
        """K actually kept per prompt."""
        return self.num_samples if SELECTIONS.facts.get(self.selection, {}).get("keeps_all") else self.num_kept

    def validate_selection(self) -> None:
        require_positive(self, "num_kept")
        require_non_negative(self, "min_group_std")
        if self.kept > self.num_samples:
            raise ConfigError(
                f"--num_kept {self.num_kept} exceeds --num_samples {self.num_samples}: the group of "
                f"samples per prompt must be at least as large as the number kept from it"
            )
        if self.selection == "top_bottom" and self.kept % 2:
            raise ConfigError(f"--selection top_bottom needs an even --num_kept, got {self.num_kept}")
        if self.selection == "rso" and not self.beta_rs > 0:
            raise ConfigError(f"--beta_rs must be > 0, got {self.beta_rs}")
        if self.min_group_std > 0 and self.kept < 2:
            raise ConfigError(
                f"--min_group_std measures the spread of each group's kept rewards: it needs at least 2 "
                f"kept samples per prompt, got {self.kept}"
            )


@dataclass
class ObjectiveConfig:
    # --- objective
    advantage: str = option("grpo", choices=ADVANTAGES)
    """Advantage estimator over each group's K kept samples (rlhf/advantages.py ADVANTAGES); the estimators that
    use batch statistics take them over every kept sample of every rank."""
    global_norm: bool = True
    """After the advantage estimator, whiten the advantages over the whole batch across all ranks."""
    loss_type: str = option("grpo", choices=AGGREGATIONS)
    """Aggregation of the per-token loss (rlhf/policy_gradient.py AGGREGATIONS); every normaliser is global over ranks
    and micro-batches."""
    eps_low: float = option(0.2, objective=True)
    """Clip the ratio below at 1 - eps_low."""
    eps_high: float = option(0.2, objective=True)
    """Clip the ratio above at 1 + eps_high (DAPO's clip-higher uses 0.28)."""
    importance_level: Literal["token", "sequence"] = option("token", objective=True)
    """token: one ratio pi/pi_old per token (GRPO); sequence: GSPO's (arXiv 2507.18071) one ratio per response,
    exp(mean over its tokens of the log-ratio), clipped per sequence, each sequence counting once whatever its
    length under every --loss_type. GSPO clips much tighter (eps_low 3e-4, eps_high 4e-4 in the paper)."""
    rollout_correction: str = option("none", choices=ROLLOUT_CORRECTIONS, objective=True)
    """Correct the policy loss for the sampler / trainer mismatch, rho = exp(training-forward log-prob - sampler
    log-prob) at the sampling weights, by weights from rho and --rollout_correction_cap (rlhf/policy_gradient.py
    ROLLOUT_CORRECTIONS); per token, or per sequence with --importance_level sequence. The mismatch is logged
    whatever this is (train/mismatch/*)."""
    rollout_correction_cap: float = option(3.0, objective=True)
    """The cap of --rollout_correction (> 0)."""
    beta: float = option(0.04, objective=True)
    """Weight of the KL to the reference policy (also the beta of the implicit reward in evaluation)."""
    kl_estimator: str = option("k3", choices=KL_ESTIMATORS, objective=True)
    """Per-token estimator of KL(pi || pi_ref), log r = ref - logp (rlhf/policy_gradient.py KL_ESTIMATORS). As a loss
    term k2's gradient is unbiased, k3's is the forward KL's and k1's is 0 in expectation (arXiv 2512.21852;
    docs/grpo.md)."""
    kl_in: Literal["loss", "reward"] = "loss"
    """Where beta x KL goes: loss (a per-token term of the loss) or reward (beta x the response's summed estimate,
    detached, subtracted from its reward before group normalization; with k1 the unbiased policy-gradient choice).
    Selection uses the reward without it."""
    kl_ratio: bool = option(False, objective=True)
    """Multiply the loss's KL estimate by the ratio pi/pi_old (pi_old detached, value 1 when on-policy): the
    gradient-corrected estimator, whose gradient is unbiased for k1 and k3 (--kl_in loss only)."""
    policy_epochs: int = 1
    """mu: optimizer steps over each batch of rollouts. The ratio's old log-probs are the sampling policy's,
    computed once before the first step (ratio exactly 1 there); 1: the detached current ones (ratio 1 in value)."""
    ref_refresh_every: int = 0
    """Make the current policy the new reference every N steps (with LoRA: merge the adapters into the base
    weights); the KL term is exactly 0 right after. 0 keeps the starting policy as reference. With
    --frontier_prompts, a frozen copy of the starting policy is kept too (one more copy of its weights), so that
    eval/kl stays the KL to the policy the run started from."""
    entropy_coef: float = option(0.0, objective=True)
    """Entropy bonus: subtract entropy_coef x the token entropy of the (temperature / top-k / top-p processed)
    policy from the loss, aggregated like the loss; 0 disables. Negative: an entropy penalty, which sharpens the
    policy towards its own most likely tokens (entropy minimisation)."""
    entropy_every: int = 1
    """Log train/entropy every N steps (1: every step; 0: never). It comes from the log-softmax the log-probs
    already compute, but still costs a multiply-sum over the vocabulary at every response token (the update's
    backward needs the probabilities anyway); a step that does not log it skips that. With --entropy_coef != 0 it
    is computed (and logged) every step."""

    def objective(self) -> Objective:
        """The loss's options bound once (rlhf/policy_gradient.py Objective: its terms then take tensors only): the
        options that declare `objective=True`, each the Objective field of its name; its beta is 0 with --kl_in reward
        (the KL is then in the reward, not the loss)."""
        bound = {name: getattr(self, name) for name in declared(self, "objective")}
        return Objective(**bound | {"beta": self.beta if self.kl_in == "loss" else 0.0})

    def validate_objective(self) -> None:
        require_non_negative(self, "ref_refresh_every", "entropy_every", "eps_low", "eps_high", "beta")
        require_positive(self, "policy_epochs")
        if not self.rollout_correction_cap > 0:
            raise ConfigError(f"--rollout_correction_cap must be > 0, got {self.rollout_correction_cap}")
        if self.kl_ratio and self.kl_in != "loss":
            raise ConfigError("--kl_ratio weights the loss's KL term: it needs --kl_in loss, got --kl_in reward")
        if ADVANTAGES.facts.get(self.advantage, {}).get("pool") and self.kl_in == "reward":
            raise ConfigError(
                f"--advantage {self.advantage} takes its group statistics from every scored sample, but --kl_in "
                f"reward takes the KL from the kept samples' rewards only (the others have no reference log-probs): "
                f"use --kl_in loss"
            )


@dataclass
class StepBatchConfig:
    """The step's batch sizes: prompts per step over all ranks and each model's micro-batches on a rank."""

    # --- batch sizes and optimisation
    prompts_per_step: int = 256
    """Global prompts per step, over all ranks (x num_kept sequences in the update)."""
    micro_batch_size: int = 32
    """Sequences per forward/backward of the policy and reference on each rank."""
    score_micro_batch_size: int = 128
    """Sequences per reward-model forward on each rank."""
    group_by_length: bool = True
    """Each rank's prompt groups ordered by prompt length, longest first, before they are cut into micro-batches (the
    update's, the reference's and the reward model's, evaluation too): each prompt's samples stay together, less
    padding computed, the same gradient and scores up to float summation order. false: the groups in loader order."""

    def validate_step_batches(self) -> None:
        require_positive(self, "prompts_per_step", "micro_batch_size", "score_micro_batch_size")
