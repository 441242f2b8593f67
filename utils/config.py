"""Typed dataclass configs from the command line.

Every field of a config dataclass becomes `--name VALUE`; the string literal written under a field is its
help text, so `--help` documents every option from the same place the code does. Booleans take
true/false/1/0/yes/no. A misspelled option, a value of the wrong type or a failed `validate()` ends the process
with exit code 2 and one line, `error: ...`, naming the option and what was expected (printed by rank 0 only, so a
torchrun launch does not repeat it once per process).

`--config FILE` (every script) reads options from a YAML or TOML file whose keys are the options' names; the command
line overrides the file. A string in the file is read as the command line reads it (so YAML's `lr: 1e-6`, a string to
a YAML 1.1 reader, is a number); any other value must have the option's type. An unknown key, a wrong type or a value
not among the option's choices ends the process with exit code 2 and one line naming the file and the key.

`--help` lists the options by section (SECTIONS; a comment line `# --- SECTION` among a config's fields starts
one), each section with the script's own options first, then the shared ones. The option tables in docs/ are the
same listing in markdown, generated from it and checked against it by tests/test_docs.py:

    python -m utils.config --markdown grpo     # print grpo.py's option tables
    python -m utils.config --update_docs       # rewrite every generated table in docs/*.md
"""

import argparse
import ast
import dataclasses
import difflib
import functools
import importlib
import importlib.util
import inspect
import os
import re
import sys
import textwrap
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """An option value, or a combination of options and world size, that cannot work; the message names the
    option(s) and what was expected."""

    exit_code = 2  # utils/guard.py: one line, exit code 2


def print_error(message: str) -> None:
    """`error: message` on one line, to stderr, from rank 0 only (RANK is set by torchrun; a plain run is rank 0)."""
    rank = os.environ.get("RANK", "0")
    if rank == "0":
        print("error: " + " ".join(str(message).split()), file=sys.stderr, flush=True)


# Sections of --help and of the option tables in docs/, in this order. A comment line `# --- SECTION` among a config
# class's fields starts a section; a field belongs to the nearest such line above it where it is first declared (a
# script that redeclares a shared option to change its default leaves it in its section). A field under none is
# listed last, under OTHER.
SECTIONS = (
    "models",
    "data",
    "sampling",
    "rewards and selection",
    "objective",
    "batch sizes and optimisation",
    "evaluation and logging",
    "run",
    "LoRA",
)
OTHER = "other"
_SECTION_LINE = re.compile(r"^\s*# --- ([^(:]+?)\s*(?:[(:].*)?$")  # a note may follow in parentheses or after ":"


@functools.cache
def _class_source(klass) -> tuple[list[str], list[ast.stmt]] | None:
    """A class's source lines and the statements of its body (None without source); read and parsed once: every
    parse of a script's options reads each of its option groups' docs and sections several times."""
    try:
        source = textwrap.dedent(inspect.getsource(klass))
    except (OSError, TypeError):
        return None
    return source.splitlines(), ast.parse(source).body[0].body


def _class_fields(cls):
    """(field name, its AnnAssign node, the next statement, the class's source lines) for each field written in the
    body of `cls` and of its dataclass bases, base classes first."""
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass) or (parsed := _class_source(klass)) is None:
            continue
        lines, body = parsed
        for node, nxt in zip(body, body[1:] + [None], strict=True):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                yield node.target.id, node, nxt, lines


def field_docs(cls) -> dict[str, str]:
    """Field name -> the string literal under its annotation, for a dataclass and its bases."""
    docs: dict[str, str] = {}
    for name, _, nxt, _ in _class_fields(cls):
        if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
            docs[name] = " ".join(nxt.value.value.split())
    return docs


def field_sections(cls) -> dict[str, str]:
    """Field name -> its section (SECTIONS), from the `# --- SECTION` lines of a dataclass and its bases."""
    sections: dict[str, str] = {}
    for name, node, _, lines in _class_fields(cls):
        for line in reversed(lines[: node.lineno - 1]):
            if match := _SECTION_LINE.match(line):
                sections.setdefault(name, match.group(1))
                break
    return sections


def own_fields(cls) -> set[str]:
    """Fields that `cls` declares and none of its dataclass bases does: the script's own options."""
    inherited = {f.name for base in cls.__mro__[1:] if dataclasses.is_dataclass(base) for f in dataclasses.fields(base)}
    return set(inspect.get_annotations(cls)) - inherited


def option(default, *, choices=None, free: bool = False, recorded: bool = True, model: str = "", objective=False):
    """A config field whose facts are declared beside it, in its metadata, for the parser and the checks to read
    (`declared`):

        choices    the values it takes, e.g. a registry of rlhf/registry.py (read when the parser is built, so it
                   lists whatever is registered then; a mapping with a `help` dict of {name: phrase} has each phrase
                   listed in --help)
        free       a resume may change it without --resume_changes allow, the change recorded (it changes no number:
                   the run's length, cadences and names, memory savers; utils/rundir.py options_record); compare.py
                   groups runs that differ in it
        recorded   false: where or how the run is started, never compared on resume nor recorded (--out_dir, ...)
        model      the kind of model it names, "policy" or "reward_model" (model/weights.py KINDS): its script checks
                   it through model_config(..., kind=, option=) before building anything (tests/test_errors.py)
        objective  a field of the GRPO loss's Objective (rlhf/policy_gradient.py), bound from this option
                   (rollouts/options.py)
    """
    facts = {"choices": choices, "free": free or None, "recorded": None if recorded else False}
    facts |= {"model": model or None, "objective": objective or None}
    return dataclasses.field(default=default, metadata={k: v for k, v in facts.items() if v is not None})


def declared(cls, fact: str) -> dict[str, Any]:
    """{option name: its declared `fact`} for the fields of the config class (or instance) `cls` that declare it
    (`option`), merged over its dataclass bases: a script that redeclares a shared option to give it another default
    keeps what the shared declaration says."""
    cls = cls if isinstance(cls, type) else type(cls)
    out: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            out |= {f.name: f.metadata[fact] for f in dataclasses.fields(klass) if fact in f.metadata}
    return out


def option_groups(*modules) -> list[type]:
    """The config dataclasses defined in `modules` (each a module object), in order: what a package that cannot
    import the scripts (evaluation/compare.py) reads the declarations of."""
    return [
        v
        for m in modules
        for v in vars(m).values()
        if isinstance(v, type) and dataclasses.is_dataclass(v) and v.__module__ == m.__name__
    ]


def choices_help(choices) -> str:
    """What --help appends for a field's `choices` that carry a phrase for each (a registry): "One of: name: phrase;
    ..."; empty for plain choices, which argparse and the docs list by name."""
    described = getattr(choices, "help", None)
    if not described:
        return ""
    return "One of: " + "; ".join(f"{name}: {described[name]}" for name in choices) + "."


def parse_bool(s: str) -> bool:
    v = s.strip().lower()
    if v in ("1", "true", "yes", "y", "on"):
        return True
    if v in ("0", "false", "no", "n", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean (true/false), got '{s}'")


def _converter(tp) -> tuple[Any, list | None]:
    """(function from string, allowed choices or None) for a field type."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = list(typing.get_args(tp))
        kind = type(choices[0])
        return kind, choices
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        inner, choices = _converter(args[0])
        return (lambda s: None if s.lower() in ("none", "null", "") else inner(s)), choices
    if tp is bool:
        return parse_bool, None
    if tp in (int, float, str):
        return tp, None
    raise TypeError(f"config type {tp} is not supported")


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, valid: list[str], **kwargs):
        super().__init__(*args, **kwargs)
        self.valid = valid

    def error(self, message: str):
        """One line instead of argparse's usage block: the usage of these configs runs to dozens of lines and
        would bury the message."""
        if message.startswith("unrecognized arguments"):
            hints = []
            for tok in message.split(":", 1)[1].split():
                if tok.startswith("--"):
                    close = difflib.get_close_matches(tok[2:].split("=")[0].replace("-", "_"), self.valid, n=3)
                    if close:
                        hints.append(f"{tok}: did you mean {' or '.join('--' + c for c in close)}?")
            message = message + (" (" + "; ".join(hints) + ")" if hints else "")
        print_error(f"{message} (python {self.prog} --help lists every option)")
        self.exit(2)


def build_parser(cls, description: str | None = None) -> argparse.ArgumentParser:
    """The parser of `cls`'s fields: one argument group per section (SECTIONS order, then any other), in each the
    fields `cls` declares itself first, then the inherited ones, each in declaration order."""
    hints = typing.get_type_hints(cls)
    docs, sections, own = field_docs(cls), field_sections(cls), own_fields(cls)
    fields = [f for f in dataclasses.fields(cls) if f.init]
    parser = _Parser(
        description=description,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        valid=[f.name for f in fields],
        usage="%(prog)s [--OPTION VALUE ...] (every option below, grouped by what it sets)",  # argparse's own lists
    )  # every option: dozens of lines above the first group
    parser.add_argument(
        "--config",
        default="",
        metavar="FILE",
        help="a YAML (.yaml, .yml) or TOML (.toml) file of options, its keys the options' names (configs/ holds the "
        "reference runs); the command line overrides it",
    )
    order = list(SECTIONS) + sorted({sections.get(f.name, OTHER) for f in fields} - set(SECTIONS) - {OTHER}) + [OTHER]
    groups = {}
    for f in sorted(fields, key=lambda f: (order.index(sections.get(f.name, OTHER)), f.name not in own)):
        section = sections.get(f.name, OTHER)
        if section not in groups:
            groups[section] = parser.add_argument_group(section if section != OTHER else "other options")
        conv, choices = _converter(hints[f.name])
        metavar = hints[f.name].__name__.upper() if isinstance(hints[f.name], type) else None
        declared = f.metadata.get("choices")  # option(..., choices=REGISTRY)
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        text = " ".join(filter(None, (docs.get(f.name, ""), choices_help(declared)))) or " "
        groups[section].add_argument(
            f"--{f.name}",
            type=conv,
            choices=list(declared) if declared is not None else choices,
            default=default,
            help=text.replace("%", "%%"),
            metavar=None if declared is not None else metavar,
        )
    return parser


def parse_config(cls: type[T], argv: list[str] | None = None, description: str | None = None) -> T:
    """Build `cls` from its defaults, overridden by the options of a --config file, overridden by `--field value`
    arguments."""
    parser = build_parser(cls, description)
    argv = sys.argv[1:] if argv is None else list(argv)
    path = config_file_argument(argv)
    if path:
        try:
            parser.set_defaults(**read_config_file(path, cls))
        except ConfigError as e:
            parser.error(str(e))
    args = vars(parser.parse_args(argv))
    del args["config"]  # its options are in args: config.json records the merged options, not the file's name
    cfg = cls(**args)
    if hasattr(cfg, "validate"):
        try:
            cfg.validate()
        except ValueError as e:  # ConfigError, or a plain ValueError from a validate() written elsewhere
            parser.error(str(e))
    return cfg


def config_file_argument(argv: list[str]) -> str:
    """The FILE of `--config FILE` (or `--config=FILE`) in `argv`, read before the other options so that theirs
    override the file's; "" without one."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default="")
    known, _ = pre.parse_known_args(argv)
    return known.config


def read_config_file(path: str, cls) -> dict:
    """Option name -> value of a --config file (YAML or TOML by its suffix) for `cls`'s fields, each checked against
    the field's type (_file_value). ConfigError naming the file and the key: an unknown key, a wrong type, a file that
    is missing, unreadable or not a mapping of names to values."""
    where = f"--config {path}"
    return check_options(read_options_file(path, where), cls, where)


def read_options_file(path: str, where: str) -> dict:
    """The mapping a YAML or TOML file (by its suffix) holds; ConfigError starting with `where` for a file that is
    missing, unreadable, not valid YAML or TOML, or not a mapping."""
    suffix = Path(path).suffix.lower()
    if suffix not in (".yaml", ".yml", ".toml"):
        raise ConfigError(f"{where}: expected a .yaml, .yml or .toml file")
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"{where}: cannot be read ({e.strerror or e})") from None
    try:
        if suffix == ".toml":
            try:
                import tomllib
            except ImportError:  # Python 3.10: the same parser as the package tomli (pyproject.toml)
                import tomli as tomllib
            options = tomllib.loads(text)
        else:
            import yaml

            options = yaml.safe_load(text)
    except Exception as e:  # yaml.YAMLError, tomllib.TOMLDecodeError: a syntax error, with its line
        raise ConfigError(f"{where}: not valid {suffix[1:].upper()}: {' '.join(str(e).split())}") from None
    options = {} if options is None else options  # an empty YAML file
    if not isinstance(options, dict):
        raise ConfigError(f"{where}: expected a mapping of option names to values, got a {type(options).__name__}")
    return options


def check_options(options: dict, cls, where: str) -> dict:
    """`options` (name -> value, as a file gives them) as values of `cls`'s fields, each checked against the field's
    type (_file_value) and its declared choices (`option(choices=...)`, a registry). ConfigError starting with
    `where` and naming the key: an unknown name (with the closest names), a wrong type, a value not among the
    choices."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    choices = declared(cls, "choices")
    values = {}
    for key, value in options.items():
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=3)
            hint = f"; did you mean {' or '.join(close)}?" if close else ""
            raise ConfigError(f"{where}: unknown option {key!r}{hint}")
        try:
            values[key] = _file_value(value, hints[key])
        except ValueError as e:
            raise ConfigError(f"{where}: {key}: {e}") from None
        if key in choices and values[key] not in choices[key]:
            raise ConfigError(f"{where}: {key}: expected one of {', '.join(map(str, choices[key]))}, got {value!r}")
    return values


def _type_name(tp) -> str:
    """What a value of type `tp` is, in words, for an error message."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(map(str, typing.get_args(tp)))
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)][0]
        return _type_name(inner) + " or null"
    return {bool: "a boolean (true/false)", int: "an integer", float: "a number", str: "a string"}[tp]


def _file_value(value, tp):
    """A config file's `value` for a field of type `tp`: a string is read as the command line reads it; any other
    value must be of the field's type (an integer for a number, a number for an integer only when whole is refused:
    `steps: 1.5` is a mistake, not 1). ValueError saying what was expected."""
    conv, choices = _converter(tp)
    expected = f"expected {_type_name(tp)}, got {value!r}"
    if isinstance(value, str):
        try:
            out = conv(value)
        except (ValueError, TypeError, argparse.ArgumentTypeError):
            raise ValueError(expected) from None
    else:
        out = _typed(value, tp)
        if out is _WRONG:
            raise ValueError(f"{expected} ({type(value).__name__})")
    if choices is not None and out is not None and out not in choices:
        raise ValueError(expected)
    return out


_WRONG = object()


def _typed(value, tp):
    """`value` (not a string) as a value of type `tp`, or _WRONG. Null is the empty string for a string option."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return None
        tp = [a for a in typing.get_args(tp) if a is not type(None)][0]
        origin = typing.get_origin(tp)
    if origin is Literal:
        tp = type(typing.get_args(tp)[0])
    if tp is str and value is None:  # YAML's `key:` with nothing after it: the empty string, as `--key ""` gives
        return ""
    if tp is bool:
        return value if isinstance(value, bool) else _WRONG
    if isinstance(value, bool):  # True is an int to Python, never a number of steps
        return _WRONG
    if tp is int:
        return value if isinstance(value, int) else _WRONG
    if tp is float:
        return float(value) if isinstance(value, (int, float)) else _WRONG
    return _WRONG


def require_positive(cfg, *names: str) -> None:
    """ConfigError naming the first of `names` whose value is not > 0."""
    for name in names:
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"--{name} must be positive, got {getattr(cfg, name)}")


def require_non_negative(cfg, *names: str) -> None:
    """ConfigError naming the first of `names` whose value is < 0."""
    for name in names:
        if getattr(cfg, name) < 0:
            raise ConfigError(f"--{name} must be >= 0, got {getattr(cfg, name)}")


def require_nonempty(cfg, *names: str) -> None:
    """ConfigError for the first of `names` whose value is an empty string (an option that must be given)."""
    hints = field_docs(type(cfg))
    for name in names:
        if not str(getattr(cfg, name)).strip():
            expected = hints.get(name, "a value").split(". ")[0].rstrip(".")
            raise ConfigError(f"--{name} is empty; expected {expected[0].lower() + expected[1:]}")


def config_to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def accumulation_steps(batch_size: int, micro_batch_size: int, world_size: int) -> int:
    """Micro-batches per rank in one optimizer step, with the exact-division check."""
    if batch_size % (micro_batch_size * world_size):
        raise ConfigError(
            f"--batch_size {batch_size} must be divisible by --micro_batch_size {micro_batch_size} x "
            f"world size {world_size} = {micro_batch_size * world_size}"
        )
    return batch_size // (micro_batch_size * world_size)


def fit_context(cfg, *limits: tuple) -> None:
    """Make --max_prompt_len plus each response length fit each model's positions (GPT-2's positions are a learned
    table). `limits`: (model config, response option, what) triples, e.g. (policy_cfg, "max_new_tokens", "policy").
    A --max_prompt_len left at its default is lowered to the largest that fits, with one line saying so (a preset
    with fewer positions than GPT-2's runs at the default lengths); one given that does not fit is an error naming
    the largest value that does."""
    room, (model_cfg, response, what) = min(
        ((m.n_positions - getattr(cfg, r), (m, r, w)) for m, r, w in limits), key=lambda x: x[0]
    )
    prompt = cfg.max_prompt_len
    if prompt <= room:
        return
    exceeds = (
        f"--max_prompt_len {prompt} + --{response} {getattr(cfg, response)} exceeds the {what}'s "
        f"{model_cfg.n_positions} positions"
    )
    if room <= 0:
        fits = model_cfg.n_positions - prompt
        hint = (
            f"beside --max_prompt_len {prompt} the largest --{response} that fits is {fits}"
            if fits > 0
            else f"--{response} must be below {model_cfg.n_positions}"
        )
        raise ConfigError(
            f"--{response} {getattr(cfg, response)} leaves no room for a prompt in the {what}'s "
            f"{model_cfg.n_positions} positions; {hint}"
        )
    default = next(f.default for f in dataclasses.fields(cfg) if f.name == "max_prompt_len")
    if prompt != default:
        raise ConfigError(f"{exceeds}; the largest --max_prompt_len that fits is {room}")
    cfg.max_prompt_len = room
    if os.environ.get("RANK", "0") == "0":
        print(f"{exceeds}: using --max_prompt_len {room}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------------
# Options every training stage shares, composed into each script's Config (a script redeclares a field to give it
# another default or another docstring)


@dataclasses.dataclass
class DataConfig:
    # --- data
    train_data: str = "trl-lib/tldr"
    """Training rows: a hub dataset name, a .jsonl/.parquet file, or a folder of them; columns prompt, completion
    (sft.py), prompt, chosen, rejected (reward_model.py, dpo.py), prompt (grpo.py)."""
    train_split: str = "train"
    """Split of --train_data (hub datasets and folders)."""
    val_data: str = "trl-lib/tldr"
    """Held-out rows, the same columns as --train_data (grpo.py: prompts whose summaries are scored); empty string to
    skip this evaluation."""
    val_split: str = "validation"
    """Split of --val_data."""
    val_rows: int = 512
    """Held-out rows used (the first N); 0 for all."""
    max_prompt_len: int = 512
    """Prompt tokens kept; longer posts are cut so subreddit, title and "TL;DR:" survive."""

    def validate_data(self) -> None:
        require_nonempty(self, "train_data")
        if self.val_rows < 0:
            raise ConfigError(f"--val_rows must be >= 0, got {self.val_rows}")
        if self.max_prompt_len <= 0:
            raise ConfigError(f"--max_prompt_len must be positive, got {self.max_prompt_len}")


@dataclasses.dataclass
class OptimConfig:
    # --- batch sizes and optimisation
    steps: int = option(0, free=True)
    """Optimizer steps (GRPO: steps of rollouts and updates); 0 means one epoch over the training rows."""
    lr: float = 3e-5
    """Peak learning rate (AdamW)."""
    warmup_steps: int = 20
    """Linear warmup (optimizer steps) before cosine decay."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak."""
    weight_decay: float = 0.0
    """AdamW weight decay on weight matrices."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 disables clipping)."""

    def validate_optim(self) -> None:
        if not self.lr > 0:
            raise ConfigError(f"--lr must be positive, got {self.lr}")
        for name in ("steps", "grad_clip", "warmup_steps", "weight_decay"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"--min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")


@dataclasses.dataclass
class DecodeConfig:
    # --- sampling
    compile: bool = False
    """Decode on static shapes (model/sampler.py: on a GPU each decode step and its draw recorded once per shape as a
    CUDA graph and replayed, 1.9-4.6x eager's tokens/s on an H100; on a CPU the step compiled by inductor), and
    compile each transformer block of the trained model's forward with torch.compile (utils/fsdp.py); the same
    tokens, log-probs and gradients as eager up to float rounding. The first calls pay the recording (milliseconds)
    and the blocks' compilation (tens of seconds); docs/benchmarks.md has the figures with and without."""


# Metric groups whose values each rank measures for itself (wall-clock seconds and rates): every other logged metric
# is reduced over ranks, so each rank sees the same number
PER_RANK_METRICS = ("perf/",)


@dataclasses.dataclass
class RunConfig:
    # --- evaluation and logging
    eval_every: int = option(100, free=True)
    """Evaluate every N steps and after the last; 0: only after the last; -1: never."""
    # --- run
    save_every: int = option(500, free=True)
    """Resumable checkpoint every N steps (and at the end); 0 saves only at the end."""
    keep_last: int = option(2, free=True)
    """Resumable checkpoints kept (the best one is kept as well)."""
    best_metric: str = option("val/loss", free=True)
    """Evaluation metric whose best value keeps its checkpoint (named in checkpoints/best.json, never pruned); a new
    best is saved when it appears. Empty disables."""
    best_mode: Literal["min", "max"] = option("min", free=True)
    """min: a lower --best_metric is better; max: a higher one."""
    out_dir: str = option("runs/stage", recorded=False)
    """Run directory: checkpoints/, hf/ (the Hugging Face-format export), metrics.jsonl, wandb/."""
    resume: bool = option(True, recorded=False)
    """Resume from the newest checkpoint in --out_dir when there is one (false refuses to start over on top of one)."""
    resume_from: str = option("", recorded=False)
    """Start from this checkpoint (a checkpoint folder, or another run directory) when --out_dir has none yet."""
    resume_changes: Literal["refuse", "allow"] = option("refuse", recorded=False)
    """A resume whose options differ from the run's record (--out_dir/config.json) in one that changes the result:
    refuse (stop, listing each change) or allow (continue, the change and its step appended to the record).
    docs/errors.md lists the options that may change freely."""
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """A non-finite loss or gradient norm: stop (nothing is stepped or saved; the newest checkpoint is the last good
    state) or skip the step (no optimizer or scheduler step; its batch is dropped)."""
    seed: int = 1
    """Seed of initialisation, data order and every random stream (streams derived from seed, step and rank)."""
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """auto (cuda when available), cuda or cpu."""
    dtype: Literal["auto", "bf16", "fp32"] = "auto"
    """Compute dtype: bf16, fp32, or auto (bf16 on GPU, fp32 on CPU). Gradients are reduced in fp32."""
    activation_checkpointing: bool = option(False, free=True)
    """Recompute block activations in backward to save memory."""
    deterministic: bool = False
    """Bit-exact on GPU: the same command on the same machine (GPU model, world size, versions) gives the same numbers
    bit for bit, so a resumed run equals an uninterrupted one there too. Deterministic algorithms,
    CUBLAS_WORKSPACE_CONFIG=:4096:8, and attention on the math kernel (flash, memory-efficient and cuDNN attention
    backward accumulate in a nondeterministic order); slower, and attention keeps its (T, T) scores. CPU runs are
    bit-exact without it."""
    dist_timeout_minutes: float = option(30.0, free=True)
    """Process-group timeout: a collective that waits longer than this for another rank fails the run (NCCL and gloo
    alike) instead of hanging. Raise it when one rank alone does something slow while the others wait (the
    rank-0 Hugging Face export of a large model on a slow disk)."""
    # --- evaluation and logging
    wandb_mode: Literal["auto", "online", "offline", "disabled"] = option("auto", free=True)
    """online, offline, disabled, or auto (online with a wandb login, offline otherwise, disabled when wandb is not
    installed). metrics.jsonl is written in every mode."""
    wandb_project: str = option("tldr-rlhf", free=True)
    """wandb project."""
    run_name: str = option("run", free=True)
    """wandb run name."""
    wandb_group: str = option("", free=True)
    """wandb group (runs that differ only in seed share one, e.g. "selection=rso,global_norm=true"); empty: none."""
    wandb_tags: str = option("", free=True)
    """Comma-separated wandb tags, e.g. the options that set this run apart ("selection=rso,global_norm=false")."""
    tensorboard: bool = option(True, free=True)
    """TensorBoard event files in --out_dir beside metrics.jsonl (`tensorboard --logdir runs/` shows every run): each
    metric at its step, the sample tables as text, the options as hyperparameters. Needs the tensorboard package
    (without it, one line says so and the run goes on); changes no number."""

    def validate_run(self) -> None:
        require_nonempty(self, "out_dir")
        if self.wandb_mode in ("online", "offline") and importlib.util.find_spec("wandb") is None:
            raise ConfigError(
                f"--wandb_mode {self.wandb_mode} needs the wandb package, which is not installed: "
                f"pip install wandb, or --wandb_mode disabled (or auto: no wandb, metrics.jsonl only)"
            )
        if self.keep_last <= 0:
            raise ConfigError(f"--keep_last must be positive, got {self.keep_last}")
        if self.save_every < 0:
            raise ConfigError(f"--save_every must be >= 0, got {self.save_every}")
        if self.eval_every < -1:
            raise ConfigError(f"--eval_every must be >= -1 (-1 never evaluates), got {self.eval_every}")
        if self.best_metric.startswith(PER_RANK_METRICS):
            raise ConfigError(
                f"--best_metric {self.best_metric} is measured on each rank separately (timings), so the ranks would "
                f"disagree about saving a new best; name a metric reduced over ranks (val/..., eval/..., train/...)"
            )

    def validate_shared(self) -> None:
        """Check the model name and every shared option group the script's Config composes (data, preference pairs,
        run, optimisation, LoRA); each script's validate() calls this, then checks its own options."""
        require_nonempty(self, "model")
        for group in ("validate_data", "validate_pairs", "validate_run", "validate_optim", "validate_lora"):
            if hasattr(self, group):
                getattr(self, group)()

    def eval_due(self, step: int, total_steps: int) -> bool:
        """--eval_every: after step `step` (1-based) of `total_steps`, every N steps and after the last."""
        return self.eval_every >= 0 and (step == total_steps or (self.eval_every > 0 and step % self.eval_every == 0))


# ----------------------------------------------------------------------------------------------------
# Option tables in docs/, generated from the same parser as --help

# A generated block in a docs/*.md file: `<!-- options: SCRIPT -->` (every section, each under a ### heading) or
# `<!-- options: SCRIPT | SECTION -->` (that section's table alone), up to `<!-- end options -->`
DOCS_BLOCK = re.compile(r"(<!-- options: (\w+)(?: \| ([^>]+?))? -->\n)(.*?)(<!-- end options -->)", re.S)
REGENERATE = "python -m utils.config --update_docs"


def _markdown_default(value) -> str:
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    return '`""`' if value == "" else f"`{value}`"


def options_markdown(cls, section: str | None = None) -> str:
    """`cls`'s options as `--help` lists them, in markdown: per section a ### heading and a table (option, default,
    help); with `section`, that section's table alone."""
    out = []
    for group in build_parser(cls)._action_groups:
        actions = [a for a in group._group_actions if a.dest not in ("help", "config")]  # docs: --config in prose
        if not actions or section not in (None, group.title):
            continue
        if section is None:
            out += [f"### {group.title[0].upper()}{group.title[1:]}", ""]
        out += ["| option | default | |", "|---|---|---|"]
        for a in actions:
            text = " ".join(a.help.replace("%%", "%").split())
            if a.choices and "One of: " not in text:
                text += " One of: " + ", ".join(map(str, a.choices)) + "."
            out.append(
                f"| `{a.option_strings[0]}` | {_markdown_default(a.default)} | {text.replace('|', chr(92) + '|')} |"
            )
        out.append("")
    if not out:
        raise ValueError(f"{cls.__module__}.{cls.__name__} has no section {section!r}; sections: {', '.join(SECTIONS)}")
    return "\n".join(out)


def script_config(script: str):
    """The Config class of a script in the repository root (sft, reward_model, dpo, grpo, eval_preferences)."""
    return importlib.import_module(script.removesuffix(".py")).Config


def render_docs(text: str) -> str:
    """`text` with every generated option block rewritten from the scripts' configs."""

    def block(m: re.Match) -> str:
        return m.group(1) + "\n" + options_markdown(script_config(m.group(2)), m.group(3)) + "\n" + m.group(5)

    return DOCS_BLOCK.sub(block, text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m utils.config",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="The option tables of the training scripts, in markdown, as their --help lists them.",
    )
    p.add_argument(
        "--markdown",
        metavar="SCRIPT",
        default="",
        help="print the option tables of SCRIPT (sft, reward_model, dpo, grpo, eval_preferences)",
    )
    p.add_argument(
        "--update_docs",
        action="store_true",
        help="rewrite every generated block (<!-- options: SCRIPT -->) in the *.md files of --docs",
    )
    p.add_argument(
        "--docs",
        default=str(Path(__file__).resolve().parents[1] / "docs"),
        help="folder of the markdown files --update_docs rewrites",
    )
    args = p.parse_args(argv)
    if not (args.markdown or args.update_docs):
        p.error("give --markdown SCRIPT or --update_docs")
    if args.markdown:
        try:
            cls = script_config(args.markdown)
        except (ImportError, AttributeError) as e:
            p.error(f"--markdown {args.markdown}: no script with a Config class by that name ({e})")
        print(options_markdown(cls), end="")
    if args.update_docs:
        for path in sorted(Path(args.docs).glob("*.md")):
            text = path.read_text()
            if (new := render_docs(text)) != text:
                path.write_text(new)
                print(f"rewrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
