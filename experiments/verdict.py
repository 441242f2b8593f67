"""A verdict as a file (TOML): its arms, each a stage of the demo (grpo or dpo) and the options it changes, the pairs
compared at matched KL, the seeds, the held-out posts every run is measured on and best-of-n's pool. `read_verdict`
reads and checks the file whole (ConfigError naming the file and the key: one line and exit 2 in demo.py, before any
run); `verdict_runs` turns it into the runs `experiments.runner.run_all` runs; `check_runs` gives each arm's options to
its script's own checks (its Config's validate) before any run. configs/verdict/embedded.toml is make verdict's;
docs/reporting.md describes the format.

Each run's options: the stage's demo options (experiments.embedded `grpo_options` / `dpo_options`, the same as
configs/demo/<stage>.yaml, with --out's SFT policy, reward model and pairs), then the file's [base.<stage>], then the
arm's own, then what the verdict sets: the measurement on the posts (--frontier_*), the seed, the folder
(--out/<name>/<arm>/seed<s>) and the wandb names. A value is passed as the command line writes it (a TOML boolean as
true/false), so a run's FINISHED record (experiments/runner.py) reads the same as the one the command line wrote."""

import difflib
import re
from dataclasses import dataclass, field
from pathlib import Path

from experiments.embedded import Demo, dpo_options, frontier_measured, grpo_options
from experiments.runner import ExperimentRun
from utils.config import ConfigError, build_parser, check_options, read_options_file, script_config

STAGE_OPTIONS = {"grpo": grpo_options, "dpo": dpo_options}
"""The stages an arm may take: the demo's options of each (its script is <stage>.py)."""

# The verdict's own top-level keys, each with its type and what it is (docs/reporting.md lists them)
KEYS = {
    "name": (str, "the verdict's folder in --out and its runs' name prefix"),
    "seeds": (int, "seeds of every arm"),
    "posts": (int, "held-out posts every run and best-of-n are measured on"),
    "samples": (int, "temperature-1 samples per post at each evaluation"),
    "pool": (int, "reference samples per post from which best-of-n is estimated"),
    "best_of": (int, "best-of-n's largest n, a power of 2"),
    "pairs": (list, "the pairs [A, B] compared at matched KL"),
    "base": (dict, "options every arm of a stage starts from: [base.grpo], [base.dpo]"),
    "arms": (dict, "the arms: [arms.NAME] with its stage and the options it changes"),
}
OPTIONAL = {"pairs": [], "base": {}}
TYPE_NAMES = {str: "a string", int: "an integer", list: "a list", dict: "a table"}

# Options the verdict sets for every run: the measurement on the same posts (what the pairs compare, post by post),
# the seed, the folder and the wandb names; --resume false is how every run of an experiment starts
VERDICTS_OWN = ("seed", "out_dir", "run_name", "wandb_group", "wandb_tags", "resume")
MEASUREMENT = "frontier_"

NAME = re.compile(r"[A-Za-z0-9_.-]+")  # a folder's name


@dataclass
class Verdict:
    """A verdict file, read and checked (`read_verdict`). `base`: stage -> options; `arms`: arm -> (stage, options),
    in the file's order; option values as the command line writes them."""

    path: str
    name: str
    seeds: int
    posts: int
    samples: int
    pool: int
    best_of: int
    pairs: list[tuple[str, str]] = field(default_factory=list)
    base: dict[str, dict] = field(default_factory=dict)
    arms: dict[str, tuple[str, dict]] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"--verdict {self.path}"


def read_verdict(path: str) -> Verdict:
    """The verdict in the TOML file `path`, every key and every arm's option checked: ConfigError starting with
    `--verdict PATH:` and naming the key for a missing or unknown key, a wrong type, a value out of range, an option
    its arm's script does not declare (or a value it does not take), an option the verdict sets itself, a pair naming
    a missing arm."""
    where = f"--verdict {path}"
    if Path(path).suffix.lower() != ".toml":
        raise ConfigError(f"{where}: expected a .toml file")
    data = read_options_file(path, where)
    unknown = [key for key in data if key not in KEYS]
    if unknown:
        close = difflib.get_close_matches(unknown[0], KEYS, n=3)
        hint = f"did you mean {' or '.join(close)}?" if close else f"expected some of {', '.join(KEYS)}"
        raise ConfigError(f"{where}: unknown key {unknown[0]!r}; {hint}")
    missing = [key for key in KEYS if key not in data and key not in OPTIONAL]
    if missing:
        raise ConfigError(f"{where}: missing key {missing[0]!r} ({KEYS[missing[0]][1]})")
    data = OPTIONAL | data
    for key, (kind, what) in KEYS.items():
        if not isinstance(data[key], kind) or isinstance(data[key], bool):  # True is an int to Python
            raise ConfigError(f"{where}: {key}: expected {TYPE_NAMES[kind]} ({what}), got {data[key]!r}")
    if not NAME.fullmatch(data["name"]):
        raise ConfigError(f"{where}: name: expected a folder name (letters, digits, _ . -), got {data['name']!r}")
    for key in ("seeds", "posts", "samples", "pool", "best_of"):
        if data[key] < 1:
            raise ConfigError(f"{where}: {key}: expected a positive integer, got {data[key]}")
    if data["best_of"] & (data["best_of"] - 1):
        raise ConfigError(f"{where}: best_of: expected a power of 2, got {data['best_of']}")
    if data["pool"] < data["best_of"]:
        raise ConfigError(f"{where}: pool: expected at least best_of = {data['best_of']}, got {data['pool']}")
    base, arms = read_stages(data, where)
    pairs = read_pairs(data["pairs"], arms, where)
    scalars = {key: data[key] for key in ("name", "seeds", "posts", "samples", "pool", "best_of")}
    return Verdict(path, **scalars, pairs=pairs, base=base, arms=arms)


def read_stages(data: dict, where: str) -> tuple[dict[str, dict], dict[str, tuple[str, dict]]]:
    """The file's [base.STAGE] tables and [arms.NAME] tables, each option checked (`stage_changes`)."""
    base = {}
    for stage, options in data["base"].items():
        if stage not in STAGE_OPTIONS:
            raise ConfigError(f"{where}: base: unknown stage {stage!r}; expected some of {', '.join(STAGE_OPTIONS)}")
        if not isinstance(options, dict):
            raise ConfigError(f"{where}: base.{stage}: expected a table of {stage}.py's options, got {options!r}")
        base[stage] = stage_changes(options, stage, f"{where}: base.{stage}")
    arms = {}
    for arm, table in data["arms"].items():
        at = f"{where}: arms.{arm}"
        if not NAME.fullmatch(arm):
            raise ConfigError(f"{at}: expected a folder name (letters, digits, _ . -) for the arm")
        if not isinstance(table, dict):
            raise ConfigError(f"{at}: expected a table (stage = ..., then the options it changes), got {table!r}")
        if "stage" not in table:
            raise ConfigError(f"{at}: missing key 'stage' (one of {', '.join(STAGE_OPTIONS)})")
        stage = table["stage"]
        if stage not in STAGE_OPTIONS:
            raise ConfigError(f"{at}: stage: expected one of {', '.join(STAGE_OPTIONS)}, got {stage!r}")
        arms[arm] = (stage, stage_changes({k: v for k, v in table.items() if k != "stage"}, stage, at))
    if not arms:
        raise ConfigError(f"{where}: arms: expected at least one arm ([arms.NAME])")
    return base, arms


def read_pairs(given: list, arms: dict, where: str) -> list[tuple[str, str]]:
    """The file's pairs, each two names of `arms`."""
    pairs = []
    for pair in given:
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(a, str) for a in pair)):
            raise ConfigError(f"{where}: pairs: expected pairs of arm names [A, B], got {pair!r}")
        absent = [a for a in pair if a not in arms]
        if absent:
            raise ConfigError(f"{where}: pairs: {pair!r} names {absent[0]!r}, which is not an arm ({', '.join(arms)})")
        if pair[0] == pair[1]:
            raise ConfigError(f"{where}: pairs: {pair!r} compares an arm with itself")
        pairs.append((pair[0], pair[1]))
    return pairs


def stage_changes(options: dict, stage: str, where: str) -> dict:
    """`options` checked against <stage>.py's declared options (utils.config check_options: the name, the type, the
    registered choices), as the command line writes them; ConfigError for one the verdict sets itself."""
    for key in options:
        if key in VERDICTS_OWN or key.startswith(MEASUREMENT):
            raise ConfigError(
                f"{where}: {key} is set by the verdict (each run's seed, folder and names, and the measurement on "
                "the same posts: posts, samples); remove it"
            )
    values = check_options(options, script_config(stage), where)
    return {k: ("true" if v else "false") if isinstance(v, bool) else v for k, v in values.items()}


def verdict_posts(demo: Demo, verdict: Verdict) -> Path:
    """The verdict's held-out posts: the SFT validation rows of the task written with `posts` of them, in
    --out/<name>/data (the training splits are drawn first, so they are the demo's, and every validation post is
    disjoint from them)."""
    from data.synthetic import write_task

    folder = demo.out / verdict.name / "data"
    return write_task(folder, seed=demo.args.seed, n_sft_val=verdict.posts)["sft_validation"]


def verdict_runs(demo: Demo, verdict: Verdict, posts: Path) -> list[ExperimentRun]:
    """Every arm, `seeds` seeds each (every arm's seed 0 first, then seed 1, ...: a verdict cut short has every arm at
    its first seeds), each measured at every evaluation on `posts` (all of them, per-post values in its
    frontier_posts.jsonl). Each run's name is its arm."""
    measured = frontier_measured(demo) | {
        "frontier_data": posts,
        "frontier_prompts": verdict.posts,
        "frontier_samples": verdict.samples,
    }
    runs = []
    for seed in range(verdict.seeds):
        for arm, (stage, changes) in verdict.arms.items():
            options = STAGE_OPTIONS[stage](demo) | verdict.base.get(stage, {}) | changes | measured
            options |= {"seed": seed, "out_dir": demo.out / verdict.name / arm / f"seed{seed}"}
            options |= {"run_name": f"{verdict.name}-{arm}-{seed}", "wandb_group": f"{verdict.name}-{arm}"}
            runs.append(ExperimentRun(arm, f"{stage}.py", options | {"wandb_tags": arm}))
    return runs


def check_runs(verdict: Verdict, runs: list[ExperimentRun]) -> None:
    """Each arm's first run through its script's parser and checks (its Config's validate: sizes that do not divide,
    more samples kept than drawn, ...), without running it; ConfigError naming the arm."""
    first: dict[str, ExperimentRun] = {}
    for run in runs:
        first.setdefault(run.name, run)
    for run in first.values():
        cls = script_config(run.script)
        argv = [f"--{k}={v}" for k, v in run.options.items()]
        args = vars(build_parser(cls).parse_args(argv))  # names, types and choices: checked by read_verdict
        del args["config"]
        try:
            cls(**args).validate()
        except ValueError as e:  # ConfigError, or a plain ValueError from a validate() written elsewhere
            raise ConfigError(f"{verdict.where}: arms.{run.name}: {e}") from None
