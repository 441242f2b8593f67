"""A verdict as a file (TOML): its arms, each a stage (grpo or dpo) and the options it changes, the pairs compared at
matched KL, the seeds, the held-out posts every run is measured on and best-of-n's pool; on the embedded task, or on a
task of one's own that a [task] table names (the stages' option files, the posts, the reference policy, the proxy and
the gold reward model). `read_verdict` reads and checks the file whole (ConfigError naming the file and the key: one
line and exit 2, before any run); `verdict_runs` (the embedded task's, demo.py --verdict) and `task_runs` (a [task]
table's, verdict.py) turn it into the runs `experiments.runner.run_all` runs; `check_runs` gives each arm's options to
its script's own checks (its Config's validate) and `posts_reading` finds how every arm reads the posts, before any
run; experiments/verdict_best_of_n.py draws best-of-n from the reference on the same posts (`kept_best_of_n`: kept in
the verdict's folder with its inputs, and with --reuse taken from there while they are the same), and `run_verdict` runs
the arms and writes the tables and pictures after each round of seeds. configs/verdict/embedded.toml is make verdict's,
configs/verdict/tldr.toml the verdict on real TL;DR; docs/reporting.md describes the format.

Each run's options: the stage's starting options (on the embedded task the demo's, experiments.embedded `grpo_options`
/ `dpo_options`, the same as configs/demo/<stage>.yaml, with --out's SFT policy, reward model and pairs; with [task]
its stage's option file, then --model the reference and grpo's --reward_model the proxy), then the file's
[base.<stage>], then the arm's own, then what the verdict sets: the measurement on the posts (--frontier_*), the seed,
the folder (--out/<name>/<arm>/seed<s>) and the wandb names. A value is passed as the command line writes it (a TOML
boolean as true/false), so a run's FINISHED record (experiments/runner.py) reads the same as the one the command line
wrote."""

import difflib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from evaluation.frontier_declarations import check_gold_model
from experiments.embedded import Demo, dpo_options, frontier_measured, grpo_options
from experiments.runner import ExperimentRun, run_all
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
    "pairs": (list, "the pairs [A, B] compared at matched KL: one family, Holm-adjusted"),
    "primary": (list, "pairs of `pairs` adjusted among themselves; the other pairs an exploratory family"),
    "margin": ((int, float), "the equivalence margin in gold: a row shown within +-margin is equal (default 0.05)"),
    "trends": (list, "ordered lists of pairs of `pairs`, each read as one trend over its order, seeds as blocks"),
    "base": (dict, "options every arm of a stage starts from: [base.grpo], [base.dpo]"),
    "arms": (dict, "the arms: [arms.NAME] with its stage and the options it changes"),
    "task": (dict, "a task of one's own instead of the embedded one: [task], its keys TASK_KEYS"),
}
OPTIONAL = {"pairs": [], "primary": [], "margin": 0.05, "trends": [], "base": {}, "task": {}}

# A [task] table's keys: what the demo gives a verdict on the embedded task (docs/reporting.md lists them)
TASK_KEYS = {
    "configs": (str, "the folder of the stages' option files (<stage>.yaml, .yml or .toml) every arm starts from"),
    "data": (str, "the held-out posts, split as the arms' --val_split (--frontier_data): a hub dataset or a file"),
    "reference": (str, "the policy every arm starts from (--model) and best-of-n samples (sft.py's hf/ folder)"),
    "proxy": (str, "the proxy reward model: grpo.py's --reward_model, --frontier_reward_model, best-of-n's ranking"),
    "gold_model": (str, "the gold reward model scoring every run's and best-of-n's samples (--frontier_gold_model)"),
    "max_new_tokens": (int, "tokens of each measured summary and of best-of-n's (--frontier_max_new_tokens)"),
}
TYPE_NAMES = {str: "a string", int: "an integer", list: "a list", dict: "a table", (int, float): "a number"}

# Options the verdict sets for every run: the measurement on the same posts (what the pairs compare, post by post),
# the seed, the folder and the wandb names; --resume false is how every run of an experiment starts
VERDICTS_OWN = ("seed", "out_dir", "run_name", "wandb_group", "wandb_tags", "resume")
MEASUREMENT = "frontier_"
REFERENCE = "model"  # every arm starts from the policy best-of-n samples, to which each run's KL is measured

NAME = re.compile(r"[A-Za-z0-9_.-]+")  # a folder's name


@dataclass
class Task:
    """A verdict's [task] table (TASK_KEYS), read and checked; `stages`: stage -> the options of its file in
    `configs`, as the command line writes them."""

    configs: str
    data: str
    reference: str
    proxy: str
    gold_model: str
    max_new_tokens: int
    stages: dict[str, dict] = field(default_factory=dict)


@dataclass
class Verdict:
    """A verdict file, read and checked (`read_verdict`). `base`: stage -> options; `arms`: arm -> (stage, options),
    in the file's order; option values as the command line writes them; `task`: its [task] table, None on the
    embedded task."""

    path: str
    name: str
    seeds: int
    posts: int
    samples: int
    pool: int
    best_of: int
    pairs: list[tuple[str, str]] = field(default_factory=list)
    primary: list[tuple[str, str]] | None = None  # None: every pair in one family
    margin: float = 0.05
    trends: list[list[tuple[str, str]]] = field(default_factory=list)
    base: dict[str, dict] = field(default_factory=dict)
    arms: dict[str, tuple[str, dict]] = field(default_factory=dict)
    task: Task | None = None

    @property
    def where(self) -> str:
        return f"--verdict {self.path}"


def read_verdict(path: str) -> Verdict:
    """The verdict in the TOML file `path`, every key and every arm's option checked: ConfigError starting with
    `--verdict PATH:` and naming the key for a missing or unknown key, a wrong type, a value out of range, an option
    its arm's script does not declare (or a value it does not take), an option the verdict sets itself, a pair naming
    a missing arm; in [task], a missing or unknown key, a stage without its option file (or one whose options its
    script does not take), a gold model that is the proxy."""
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
    given, data = data, OPTIONAL | data
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
    primary = read_pairs(data["primary"], arms, f"{where}: primary") or None
    absent = [p for p in primary or [] if p not in pairs]
    if absent:
        raise ConfigError(f"{where}: primary: {list(absent[0])!r} is not one of the pairs")
    trends = [read_trend(trend, pairs, arms, f"{where}: trends") for trend in data["trends"]]
    if not data["margin"] > 0:
        raise ConfigError(f"{where}: margin: expected a positive number (gold), got {data['margin']}")
    task = read_task(data["task"], {stage for stage, _ in arms.values()}, where) if "task" in given else None
    scalars = {key: data[key] for key in ("name", "seeds", "posts", "samples", "pool", "best_of")}
    margin = float(data["margin"])
    return Verdict(
        path, **scalars, pairs=pairs, primary=primary, margin=margin, trends=trends, base=base, arms=arms, task=task
    )


def read_trend(given, pairs: list[tuple[str, str]], arms: dict, where: str) -> list[tuple[str, str]]:
    """One of the file's trends: two or more of its pairs, in the order the trend reads them (rank 0, 1, ...)."""
    if not isinstance(given, list):
        raise ConfigError(f"{where}: expected lists of pairs [[A, B], [C, D], ...] in the trend's order, got {given!r}")
    trend = read_pairs(given, arms, where)
    if len(trend) < 2:
        raise ConfigError(f"{where}: {given!r}: a trend needs two or more pairs")
    absent = [p for p in trend if p not in pairs]
    if absent:
        raise ConfigError(f"{where}: {list(absent[0])!r} is not one of the pairs")
    return trend


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
        if key == REFERENCE:
            raise ConfigError(
                f"{where}: {key} is set by the verdict: every arm starts from the policy best-of-n samples (the demo's "
                "SFT policy, or [task]'s reference), to which each run's KL is measured; remove it"
            )
    return command_line_values(check_options(options, script_config(stage), where))


def command_line_values(values: dict) -> dict:
    """Option values as the command line writes them: a boolean as true/false, anything else as it is."""
    return {k: ("true" if v else "false") if isinstance(v, bool) else v for k, v in values.items()}


def read_task(table: dict, stages: set[str], where: str) -> Task:
    """The [task] table (TASK_KEYS, each required), with the option file of each stage in `stages` read from its
    `configs` folder and checked as a --config file is (utils.config check_options); ConfigError naming the key."""
    at = f"{where}: task"
    unknown = [key for key in table if key not in TASK_KEYS]
    if unknown:
        close = difflib.get_close_matches(unknown[0], TASK_KEYS, n=3)
        hint = f"did you mean {' or '.join(close)}?" if close else f"expected some of {', '.join(TASK_KEYS)}"
        raise ConfigError(f"{at}: unknown key {unknown[0]!r}; {hint}")
    missing = [key for key in TASK_KEYS if key not in table]
    if missing:
        raise ConfigError(f"{at}: missing key {missing[0]!r} ({TASK_KEYS[missing[0]][1]})")
    for key, (kind, what) in TASK_KEYS.items():
        value = table[key]
        if not isinstance(value, kind) or isinstance(value, bool) or (kind is str and not value.strip()):
            raise ConfigError(f"{at}.{key}: expected {TYPE_NAMES[kind]} ({what}), got {value!r}")
    if table["max_new_tokens"] < 1:
        raise ConfigError(f"{at}.max_new_tokens: expected a positive integer, got {table['max_new_tokens']}")
    check_gold_model(table["gold_model"], table["proxy"], f"{at}.gold_model", "task.proxy")
    task = Task(**table)
    for stage in sorted(stages):
        files = [Path(task.configs) / f"{stage}{suffix}" for suffix in (".yaml", ".yml", ".toml")]
        found = [f for f in files if f.is_file()]
        if len(found) != 1:
            names = ", ".join(f.name for f in files)
            held = "holds none of" if not found else "holds more than one of"
            raise ConfigError(f"{at}.configs: {task.configs} {held} {names} (the {stage} arms' starting options)")
        file = f"{at}.configs: {found[0]}"
        options = check_options(read_options_file(str(found[0]), file), script_config(stage), file)
        task.stages[stage] = command_line_values(options)
    return task


def arm_runs(verdict: Verdict, starts: dict[str, dict], measured: dict, out: Path) -> list[ExperimentRun]:
    """Every arm, `seeds` seeds each (every arm's seed 0 first, then seed 1, ...: a verdict cut short has every arm at
    its first seeds): its stage's `starts` options, [base.<stage>], the arm's own (in a string, {out} reads as `out`),
    then `measured` (the measurement on the posts), the seed, the folder --out/<name>/<arm>/seed<s> and the wandb
    names. Each run's name is its arm."""
    runs = []
    for seed in range(verdict.seeds):
        for arm, (stage, changes) in verdict.arms.items():
            given = verdict.base.get(stage, {}) | changes  # a string's {out} is --out (the demo's proxies)
            given = {k: v.replace("{out}", str(out)) if isinstance(v, str) else v for k, v in given.items()}
            options = starts[stage] | given | measured
            options |= {"seed": seed, "out_dir": out / verdict.name / arm / f"seed{seed}"}
            options |= {"run_name": f"{verdict.name}-{arm}-{seed}", "wandb_group": f"{verdict.name}-{arm}"}
            runs.append(ExperimentRun(arm, f"{stage}.py", options | {"wandb_tags": arm}))
    return runs


@dataclass
class Measurement:
    """How every run of a verdict and best-of-n are measured on its posts: the reference policy (every arm's start,
    best-of-n's sampler), the proxy reward model, the gold reward (a function "module:fn" or a reward model's folder),
    the posts' source and the summaries' length."""

    reference: str | Path
    proxy: str | Path
    data: str | Path
    max_new_tokens: int
    gold_fn: str = ""
    gold_model: str = ""

    def options(self, verdict: Verdict) -> dict:
        """The runs' --frontier_* options: measured at every evaluation on the verdict's posts."""
        gold = {"frontier_gold_model": self.gold_model} if self.gold_model else {"frontier_gold_fn": self.gold_fn}
        return {
            "frontier_prompts": verdict.posts,
            "frontier_samples": verdict.samples,
            "frontier_data": self.data,
            "frontier_reward_model": self.proxy,
            **gold,
            "frontier_max_new_tokens": self.max_new_tokens,
        }


def verdict_posts(demo: Demo, verdict: Verdict) -> Path:
    """The verdict's held-out posts on the embedded task: the SFT validation rows of the task written with `posts` of
    them, in --out/<name>/data (the training splits are drawn first, so they are the demo's, and every validation post
    is disjoint from them)."""
    from data.synthetic import write_task

    folder = demo.out / verdict.name / "data"
    return write_task(folder, seed=demo.args.seed, n_sft_val=verdict.posts)["sft_validation"]


def embedded_measurement(demo: Demo, posts: Path) -> Measurement:
    """The embedded task's measurement (the demo's frontier: experiments.embedded frontier_measured) on `posts`, from
    the demo's SFT policy."""
    frontier = frontier_measured(demo)
    return Measurement(
        demo.out / "sft" / "hf",
        frontier["frontier_reward_model"],
        posts,
        frontier["frontier_max_new_tokens"],
        gold_fn=frontier["frontier_gold_fn"],
    )


def verdict_runs(demo: Demo, verdict: Verdict, posts: Path) -> list[ExperimentRun]:
    """The runs of a verdict on the embedded task (demo.py --verdict): each arm from the demo's options of its stage
    (STAGE_OPTIONS), measured at every evaluation on `posts` (all of them, per-post values in its
    frontier_posts.jsonl) as the demo's frontier is, in --out."""
    starts = {stage: options(demo) for stage, options in STAGE_OPTIONS.items()}
    return arm_runs(verdict, starts, embedded_measurement(demo, posts).options(verdict), demo.out)


def task_measurement(task: Task) -> Measurement:
    """A [task] table's measurement: gold from its gold reward model."""
    return Measurement(task.reference, task.proxy, task.data, task.max_new_tokens, gold_model=task.gold_model)


def task_runs(verdict: Verdict, out: Path, wandb_mode: str) -> list[ExperimentRun]:
    """The runs of a verdict with a [task] table (verdict.py), in `out`: each arm from its stage's option file, with
    --model the reference (and grpo.py's --reward_model the proxy, which [base.grpo] or the arm may change), measured
    at every evaluation on the task's posts with gold from its gold model."""
    task = verdict.task
    starts = {}
    for stage, options in task.stages.items():
        proxy = {"reward_model": task.proxy} if stage == "grpo" else {}
        starts[stage] = options | {REFERENCE: task.reference} | proxy | {"wandb_mode": wandb_mode, "resume": "false"}
    return arm_runs(verdict, starts, task_measurement(task).options(verdict), out)


def check_runs(verdict: Verdict, runs: list[ExperimentRun]) -> dict:
    """Each arm's first run through its script's parser and checks (its Config's validate: sizes that do not divide,
    more samples kept than drawn, ...), without running it; ConfigError naming the arm. Returns arm -> its Config."""
    first: dict[str, ExperimentRun] = {}
    for run in runs:
        first.setdefault(run.name, run)
    configs = {}
    for run in first.values():
        cls = script_config(run.script)
        argv = [f"--{k}={v}" for k, v in run.options.items()]
        args = vars(build_parser(cls).parse_args(argv))  # names, types and choices: checked by read_verdict
        del args["config"]
        try:
            configs[run.name] = cls(**args)
            configs[run.name].validate()
        except ValueError as e:  # ConfigError, or a plain ValueError from a validate() written elsewhere
            raise ConfigError(f"{verdict.where}: arms.{run.name}: {e}") from None
    return configs


def posts_reading(verdict: Verdict, configs: dict) -> tuple[str, int]:
    """The split and prompt length with which every arm reads the posts (its --val_split and --max_prompt_len:
    evaluation.measure Frontier.build), which best-of-n reads them with too; ConfigError naming an arm that reads them
    otherwise than the first arm: the pairs compare the same prompts, post by post."""
    readings = {arm: (cfg.val_split, cfg.max_prompt_len) for arm, cfg in configs.items()}
    first, reading = next(iter(readings.items()))
    for arm, other in readings.items():
        if other != reading:
            raise ConfigError(
                f"{verdict.where}: arms.{arm}: reads the posts with --val_split {other[0]} --max_prompt_len "
                f"{other[1]}, arms.{first} with --val_split {reading[0]} --max_prompt_len {reading[1]}: every arm "
                "and best-of-n measure the same prompts (set them in [base.<stage>])"
            )
    return reading


def check_task_models(verdict: Verdict) -> None:
    """Each of [task]'s models is a folder of its kind (model.weights.model_config: a policy, reward models that hold
    their normalisation), before any run; ModelLoadError naming the key."""
    from model.weights import model_config

    task, where = verdict.task, verdict.where
    model_config(task.reference, kind="policy", option=f"{where}: task.reference")
    model_config(task.proxy, kind="reward_model", option=f"{where}: task.proxy")
    model_config(task.gold_model, kind="reward_model", option=f"{where}: task.gold_model")


# ----------------------------------------------------------------------------------------------------
# Running a verdict: the arms, the tables and the pictures (best-of-n: experiments/verdict_best_of_n.py)


def run_verdict(
    verdict: Verdict, runs: list[ExperimentRun], curve: list[dict], out: Path, assets: Path, *, nproc: int, reuse: bool
) -> str:
    """A verdict's runs (`verdict_runs` or `task_runs`), each kept when `reuse` finds it finished with the same options
    (experiments.runner run_all keep_finished), beside best-of-n's `curve` on the same posts; then in --out/<name>
    (`out` / verdict.name): verdict.md (evaluation.verdict_report report: interim or final; each of its pairs, at
    matched KL and at the common KL, and each arm against best-of-n, with intervals over posts and with seeds and
    family-wise decisions; a dose's trend; the frontier's table; what each GRPO arm's selection kept,
    evaluation.compare step_means_table), verdict.json, verdict_record.json (the record the tables and pictures
    rebuild from without the runs) and in `assets` the pictures (evaluation.verdict_plots verdict_pictures:
    verdict.png, each arm's mean path over its seeds against KL; verdict_forest.png, the rows; verdict_compute.png,
    gold against generated tokens and seconds), rewritten after every round of seeds. Returns the text."""
    from evaluation import matched
    from evaluation.compare import step_means_table
    from evaluation.frontier import frontier_table
    from evaluation.verdict_plots import verdict_pictures
    from evaluation.verdict_report import report, verdict_record, write_record

    root, title = out / verdict.name, "embedded task" if verdict.task is None else str(verdict.task.data)
    methods: dict[str, list[list[dict]]] = {}
    dirs: dict[str, list[Path]] = {}
    arms = len(verdict.arms)

    def record(run: ExperimentRun) -> str:
        methods.setdefault(run.name, []).append(matched.frontier_points(run.out_dir))
        dirs.setdefault(run.name, []).append(run.out_dir)
        # the tables after each round of seeds (every arm's seed s), the last round's the verdict's: their bootstraps
        # grow with the runs (36 s for 6 seeds of 7 arms on 400 posts, one thread), too much to redo after every run
        if sum(map(len, methods.values())) % arms:
            return ""
        pairs = [(a, b) for a, b in verdict.pairs if a in methods and b in methods]
        common = matched.common_kl(methods, {arm for pair in pairs for arm in pair})
        rows = matched.verdict_rows(methods, curve, pairs + [(n, matched.BEST_OF_N) for n in methods], common=common)
        tables = frontier_table(curve, methods, [row for row in rows if row["b"] == matched.BEST_OF_N])
        kept = step_means_table(dirs)
        if kept:
            how = "per run the mean over its training steps, then mean ± standard deviation over seeds"
            tables += f"\n\nWhat each GRPO arm's selection kept, {how} (docs/grpo.md, Selection diagnostics):\n\n{kept}"
        rounds, primary, margin, trends = verdict.seeds, verdict.primary, verdict.margin, verdict.trends
        saved = verdict_record(
            curve, methods, rows, dirs, rounds=rounds, primary=primary, margin=margin, trends=trends, tables=tables
        )
        text, decided = report(saved)
        (root / "verdict.md").write_text(text + "\n")
        (root / "verdict.json").write_text(json.dumps({"best_of_n": curve, "methods": methods, "rows": decided}))
        write_record(root, saved)
        verdict_pictures(saved, decided, assets, title, verdict.name)
        return text

    root.mkdir(parents=True, exist_ok=True)
    assets.mkdir(parents=True, exist_ok=True)
    tables = []
    run_all(runs, nproc, after=lambda run: tables.append(record(run)), keep_finished=reuse)
    return tables[-1]  # every arm's last seed ends the last round
