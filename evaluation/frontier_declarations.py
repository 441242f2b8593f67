"""The frontier's declarations, apart from evaluation/measure.py and evaluation/frontier.py so that
evaluation/compare.py reads them without importing the frontier (whose command line imports compare): its metrics
(LOGGED: what a training stage logs at an evaluation, with the direction in which each improves; POSTS_TABLE: the
per-post values) and its options (FrontierConfig: --frontier_prompts and the rest, which dpo.py and grpo.py compose
into their Config)."""

from dataclasses import dataclass
from pathlib import Path

from model.weights import model_config
from utils.config import ConfigError, option
from utils.metrics import metric

METRICS = ("kl", "gold", "proxy", "proxy_raw", "win_rate")
"""What measure() reports, each with its standard error (name + "_se"); gold and win_rate only when they apply."""
LOGGED = {  # summarize_posts' values -> the metric a training stage logs each as at an evaluation (its declaration);
    # the samples' win rate and length are named apart from grpo.py's eval/win_rate and eval/response_length (its
    # greedy summaries')
    "kl": metric("eval/kl", "min", "KL to the reference of the policy's temperature-1 samples (--frontier_prompts)"),
    "gold": metric(
        "eval/gold",
        "max",
        "mean gold reward of those samples (--frontier_gold_model, --frontier_gold_fn or the stage's)",
    ),
    "proxy": metric("eval/proxy", "max", "mean normalised proxy reward-model score of those samples"),
    "proxy_raw": metric("eval/proxy_raw", "max", "mean raw proxy reward-model score of those samples"),
    "win_rate": metric("eval/win_rate_sampled", "max", "share of those samples the proxy scores above the reference"),
    "response_length": metric("eval/sampled_length", "min", "mean response tokens of those samples"),
}
for _name in METRICS:
    LOGGED[_name + "_se"] = metric(LOGGED[_name] + "_se", "min", f"standard error over the posts of {LOGGED[_name]}")

POSTS_TABLE = "frontier_posts"
"""The table (utils.logging.Logger.table: frontier_posts.jsonl in the run directory) of every evaluation's per-post
values (evaluation/measure.py Frontier.evaluate writes it): the unit of the paired comparisons (evaluation/matched.py
frontier_points reads it back for verdict_rows)."""


@dataclass
class FrontierConfig:
    # --- evaluation and logging
    frontier_prompts: int = 0
    """Held-out prompts (the first N of --frontier_data) on which every evaluation also measures the policy's KL to
    its reference (grpo.py: the policy it started from, also when --ref_refresh_every moves the training reference)
    and the reward of its temperature-1 samples (eval/kl, eval/kl_se, eval/gold, eval/proxy, eval/win_rate_sampled,
    ...; per post in the run's frontier_posts.jsonl: docs/reporting.md); 0: not measured."""
    frontier_samples: int = 4
    """Summaries sampled at temperature 1 per prompt for --frontier_prompts."""
    frontier_data: str = ""
    """Prompts for --frontier_prompts (a prompt column; a completion column adds the win rate against it): a hub
    dataset name, a .jsonl/.parquet file or a folder; empty: the stage's --val_data (its distinct prompts)."""
    frontier_reward_model: str = option("", model="reward_model")
    """The proxy reward model (reward_model.py's hf/ folder) scoring the samples; empty: grpo.py's --reward_model,
    dpo.py's --judge, or none."""
    frontier_gold_fn: str = ""
    """A gold reward "module:function" of (prompt, summary) scoring the samples (the embedded task's:
    data.synthetic:gold_reward); empty: --frontier_gold_model, grpo.py's --gold_reward_fn, or none."""
    frontier_gold_model: str = option("", model="reward_model")
    """A gold reward model (reward_model.py's hf/ folder, e.g. a larger one than the proxy) scoring the samples as
    gold, its normalized score eval/gold: it only scores, never trains anything (real data's gold, Gao et al. 2022,
    arXiv 2210.10760; docs/reporting.md); not the proxy's folder; empty: --frontier_gold_fn's function."""
    frontier_max_new_tokens: int = 0
    """Tokens of each sampled summary at most, the end token included; 0: the stage's response length."""

    def frontier_limits(self, policy_cfg, response: str) -> list[tuple]:
        """utils.config.fit_context's limits of the frontier's sampled summaries (--frontier_max_new_tokens, else the
        stage's `response` option) in the policy, --frontier_reward_model and --frontier_gold_model; none without
        --frontier_prompts. Checks that each of the two is a reward model holding its normalisation
        (model.weights.model_config): its proxy, and its gold, are logged normalized."""
        if self.frontier_prompts <= 0:
            return []
        length = "frontier_max_new_tokens" if self.frontier_max_new_tokens else response
        limits = [(policy_cfg, length, "policy")]
        if self.frontier_reward_model:
            rm_cfg = model_config(self.frontier_reward_model, kind="reward_model", option="--frontier_reward_model")
            limits.append((rm_cfg, length, "frontier reward model"))
        if self.frontier_gold_model:
            gold_cfg = model_config(self.frontier_gold_model, kind="reward_model", option="--frontier_gold_model")
            limits.append((gold_cfg, length, "frontier gold model"))
        return limits

    def validate_frontier(self, stage_proxy: str = "") -> None:
        """`stage_proxy`: the stage's own proxy reward model (grpo.py's --reward_model when a reward source reads it,
        dpo.py's --judge), which the frontier scores with when --frontier_reward_model is empty."""
        for name in ("frontier_prompts", "frontier_max_new_tokens"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name} must be >= 0, got {getattr(self, name)}")
        if self.frontier_samples < 1:
            raise ConfigError(f"--frontier_samples must be >= 1, got {self.frontier_samples}")
        if self.frontier_gold_model and self.frontier_gold_fn:
            raise ConfigError(
                "--frontier_gold_model and --frontier_gold_fn both give the gold reward; give one of them"
            )
        proxy = self.frontier_reward_model or stage_proxy
        if self.frontier_gold_model:
            check_gold_model(self.frontier_gold_model, proxy, "--frontier_gold_model", "the frontier's proxy")


def check_gold_model(gold: str, proxy: str, option: str, proxy_name: str) -> None:
    """Refuses a gold reward model that is the proxy's folder (the same path once resolved): the proxy is what the
    policy was optimised against, so its score of the policy's samples rises however they fare in truth, and a gold
    column equal to it shows no over-optimisation, the gap the gold model is there to measure (Gao et al. 2022). A
    copy of the folder elsewhere is not caught."""
    if gold and proxy and same_folder(gold, proxy):
        raise ConfigError(
            f"{option} {gold} is {proxy_name} ({proxy}): gold must be a reward model the policy was not optimised "
            "against (a larger one, trained on other labels), or the gold column reads as the proxy"
        )


def same_folder(a: str, b: str) -> bool:
    """Whether two model names are the same folder, or the same hub name."""
    return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()
