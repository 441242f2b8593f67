"""Metric declarations: what a metric measures, the direction in which it improves, and the stages whose end-of-run
summary shows it, declared with `metric(...)` beside the code that computes it (as an option's facts are declared
beside the option: utils/config.py `option`). The Logger writes the declarations of the metrics a run logs into the
run's folder (DECLARED_FILE), from which evaluation/compare.py reads each metric's direction; summary.json's best
values and the stage's headlines read them here. tests/test_metrics.py runs every stage and fails for a logged metric
without a declaration."""

import re
from dataclasses import dataclass

DECLARED_FILE = "metrics_declared.json"
"""In a run's folder: {metric: {"direction": ..., "help": ...}} for every metric the run logged."""

EVALUATION_PREFIXES = ("val/", "eval/")
"""Metrics logged at evaluations (the rest is logged every step)."""

DIRECTIONS = ("min", "max", None)


@dataclass
class Metric:
    """One metric, or a family of them: in `name`, a {part} stands for any one part of a name (no "/"), as in
    "reward/{source}_mean" for every reward source's mean.

    direction: "min" (lower is better: losses, KL, lengths, times, shares of what went wrong), "max" (rewards,
    accuracies, win rates, rates), or None (no best: counts, interval bounds). summary.json's best value and
    evaluation/compare.py's follow it.
    help: what it measures, one line (docs' metric tables say more).
    headline: the stages (utils/run.py's stage names: "sft", "grpo", ...) whose end-of-run table and TensorBoard
    HParams view show it."""

    name: str
    direction: str | None
    help: str
    headline: tuple[str, ...] = ()

    def __post_init__(self):
        self.pattern = re.compile("^" + re.sub(r"\\\{\w+\\\}", "[^/]+", re.escape(self.name)) + "$")
        self.literal = len(re.sub(r"\{\w+\}", "", self.name))  # a more specific pattern wins (find)


METRICS: dict[str, Metric] = {}
"""Every declaration imported so far, by name, in the order declared."""
HEADLINES: list[tuple[str, str]] = []
"""(stage, metric) of every headline in the order declared (filled by metric(); nothing to edit by hand)."""


def metric(name: str, direction: str | None, help: str, headline: tuple[str, ...] = ()) -> str:
    """Declare a metric (Metric) and return its name. A name declared again (a stage's own loss, its headline) must
    give the same direction; its headline stages are added to the first declaration's."""
    if direction not in DIRECTIONS:
        raise ValueError(f"metric {name}: direction must be one of {DIRECTIONS}, got {direction!r}")
    if not help:
        raise ValueError(f"metric {name}: declare what it measures (help)")
    if "{" in name and headline:
        raise ValueError(f"metric {name}: a headline is one metric, not a family")
    old = METRICS.setdefault(name, Metric(name, direction, help))
    if old.direction != direction:
        raise ValueError(f"metric {name} declared with direction {direction!r}, and elsewhere {old.direction!r}")
    for stage in headline:
        if stage not in old.headline:
            old.headline += (stage,)
            HEADLINES.append((stage, name))
    return name


def find(name: str) -> Metric | None:
    """The declaration of a logged metric: its own, else the most specific family whose pattern it fits; None when
    none is declared (in this process: the module that declares it was not imported)."""
    if name in METRICS:
        return METRICS[name]
    matches = [m for m in METRICS.values() if "{" in m.name and m.pattern.match(name)]
    return max(matches, key=lambda m: m.literal, default=None)


def metric_direction(name: str) -> str | None:
    """ "min", "max" or None (no best): the direction in which `name` improves, by its declaration; an undeclared
    metric's best is its maximum (tests/test_metrics.py fails for one the code logs)."""
    declared = find(name)
    return declared.direction if declared is not None else "max"


def headlines(stage: str) -> tuple[str, ...]:
    """The metrics declared headlines of `stage`: the per-step ones, then the evaluation ones; in each, the loss
    first, then the others in the order their headline was declared."""
    names = [name for s, name in HEADLINES if s == stage]
    return tuple(sorted(names, key=lambda n: (n.startswith(EVALUATION_PREFIXES), not n.endswith("/loss"))))


def declarations(names) -> dict[str, dict]:
    """{name: {"direction", "help"}} of those of `names` that are declared (what DECLARED_FILE holds)."""
    out = {}
    for name in names:
        declared = find(name)
        if declared is not None:
            out[name] = {"direction": declared.direction, "help": declared.help}
    return out
