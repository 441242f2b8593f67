"""GRPO's reward sources: the trained reward model and plain Python functions of (prompt, response) text.

The training reward is a weighted sum of sources, written as `--rewards`:

    reward_model                                   the trained reward model (--reward_model), the default
    data.synthetic:gold_reward                     any importable function f(prompt: str, response: str) -> number
    reward_model + 0.5*format + 0.25*length        terms joined by "+", each [WEIGHT*]SOURCE

A SOURCE is `reward_model`, a built-in function below (`format`, `length`, `gold_reward`), or a "module:function"
import path.
Each source has a short name, used in metric keys (`reward/<name>_mean`) and in a dataset's reward column: the
literal for the first two, the function's name for an import path (`gold_reward`). Without `reward_model` among
the sources grpo.py loads no reward model at all.

Functions see the response as generated: its text up to and including the first end token, "\\n" when the
model stopped by itself (grpo.decode_responses). A function that raises, or returns something other than a
finite real number, stops the run with an error naming the function and the dataset row.

A dataset row may name the sources that apply to it in a column (`--reward_column`, default `reward_fns`): a
comma-separated string or a list of names, e.g. "gold_reward,format". Rows without the column (or with null)
get every source. A source that does not apply to a row is not called on it and adds nothing to its reward, so
one run can mix tasks whose rewards cannot score each other's prompts.

Combining (`normalize_sources`, then `combine_sources`), per sampled response n and source s:

    reward model   x_ns = gain * (r_raw - missing_end_penalty * no_end) + bias   its own fitted normalization
    function       x_ns = (f_s - mean_s) / (std_s + eps)                         mean_s, std_s over every response
                                                                                 of the step's global batch (all
                                                                                 G samples, all ranks) that s
                                                                                 applies to; population std
    total          r_n  = sum_s weight_s * applies_ns * x_ns

so a weight reads as "this many standard deviations", whatever the function's own scale. A function whose values
are all equal in a batch contributes 0 to that step. `--normalize_reward_fns false` uses functions' raw values
instead. Selection (RSO, ...) and the GRPO advantages (group, then global normalization) work on r_n.
"""

import importlib
import math
import numbers
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

REWARD_MODEL = "reward_model"
END = "\n"  # the text of the end token (198)


class RewardSpecError(ValueError):
    """A --rewards string, or a dataset's reward column, that names no usable source; the message says which term
    or row and what was expected. Ends the run in one line with exit code 2 (utils/guard.py)."""

    exit_code = 2


class RewardFunctionError(RuntimeError):
    """A reward function raised or returned a non-number; the message names the function, the dataset row and, when
    it raised, where (the innermost frame), so the run ends in one line (utils/guard.py) that says what to fix."""

    exit_code = 2


# ----------------------------------------------------------------------------------------------------
# Built-in reward functions


def format_reward(prompt: str, response: str) -> float:
    """1 when the response is one line with at least one word, ended by the end token; else 0."""
    text, ended, _ = response.partition(END)
    return float(bool(ended) and bool(text.split()))


def length_reward(prompt: str, response: str, target_words: int = 24) -> float:
    """-|words - target| / target over the text before the end token: 0 at the target, -1 at 0 or 2x words."""
    words = len(response.partition(END)[0].split())
    return -abs(words - target_words) / target_words


# By name in --rewards; a script adds task functions of its own (grpo.py adds the embedded synthetic task's
# gold_reward, also reachable as data.synthetic:gold_reward; both have the short name gold_reward).
BUILTINS: dict[str, Callable[..., float]] = {"format": format_reward, "length": length_reward}


# ----------------------------------------------------------------------------------------------------
# Sources


@dataclass(frozen=True)
class RewardSource:
    name: str
    """Short name: reward_model, a built-in's name, or the function name of an import path."""
    spec: str
    """The source as written in --rewards."""
    weight: float
    fn: Callable[[str, str], float] | None
    """The function; None for the reward model."""


def load_function(path: str, option: str = "--rewards") -> Callable:
    """The function named by "module:function", with a clear error naming `option` when it cannot be found."""
    module_name, _, name = path.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise RewardSpecError(f"{option}: cannot load function '{path}' (expected module:function): {e}") from None
    if not callable(fn):
        raise RewardSpecError(f"{option}: '{path}' is not callable")
    return fn


def parse_rewards(spec: str, length_target: int = 24, extra: dict[str, Callable] | None = None) -> list[RewardSource]:
    """Sources of a --rewards string such as "reward_model + 0.5*format" (see the module docstring); `extra` adds
    named functions to the built-ins."""
    builtins = BUILTINS | (extra or {})
    sources = []
    for term in spec.split("+"):
        term = term.strip()
        weight_text, star, source = term.rpartition("*")
        source = source.strip()
        try:
            weight = float(weight_text) if star else 1.0
        except ValueError:
            raise RewardSpecError(f"--rewards term '{term}': the weight before '*' must be a number") from None
        if not source:
            raise RewardSpecError(f"--rewards '{spec}' has an empty term (expected e.g. 'reward_model + 0.5*format')")
        if source == REWARD_MODEL:
            name, fn = REWARD_MODEL, None
        elif source == "length":
            name, fn = "length", lambda p, r: length_reward(p, r, length_target)
        elif source in builtins:
            name, fn = source, builtins[source]
        elif ":" in source:
            name, fn = source.rpartition(":")[2], load_function(source)
        else:
            raise RewardSpecError(
                f"unknown reward source '{source}': use {REWARD_MODEL}, a built-in ({', '.join(builtins)}) or a "
                f"module:function import path"
            )
        sources.append(RewardSource(name, source, weight, fn))
    names = [s.name for s in sources]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise RewardSpecError(f"--rewards names {duplicates} more than once (sources are told apart by name: {names})")
    return sources


def row_sources(values: Sequence, sources: list[RewardSource], where: str) -> torch.Tensor:
    """applies (n_rows, S) bool from each row's reward column: None means every source; otherwise a comma-separated
    string or a list of source names (short names or as written in --rewards)."""
    by_name = {s.name: i for i, s in enumerate(sources)} | {s.spec: i for i, s in enumerate(sources)}
    applies = torch.zeros(len(values), len(sources), dtype=torch.bool)
    for row, value in enumerate(values):
        if value is None:
            applies[row] = True
            continue
        names = value.split(",") if isinstance(value, str) else value
        if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
            raise RewardSpecError(
                f"{where}: row {row}: the reward column must be a string or a list of names, got {value!r}"
            )
        names = [n.strip() for n in names if n.strip()]
        if not names:
            raise RewardSpecError(f"{where}: row {row}: the reward column names no reward source")
        for n in names:
            if n not in by_name:
                raise RewardSpecError(
                    f"{where}: row {row}: reward source '{n}' is not in --rewards "
                    f"(sources: {[s.name for s in sources]})"
                )
            applies[row, by_name[n]] = True
    return applies


def function_rewards(
    source: RewardSource, prompts: Sequence[str], responses: Sequence[str], rows: Sequence[int], where: str
) -> list[float]:
    """source.fn on every (prompt, response); `rows` are the dataset rows, for the error message."""
    out = []
    for prompt, response, row in zip(prompts, responses, rows, strict=True):
        try:
            value = source.fn(prompt, response)
        except Exception as e:
            frame = traceback.extract_tb(e.__traceback__)[-1]
            raise RewardFunctionError(
                f"reward function '{source.spec}' raised on row {row} of {where} (response {response!r}): "
                f"{type(e).__name__}: {e} (at {frame.filename}:{frame.lineno})"
            ) from e
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise RewardFunctionError(
                f"reward function '{source.spec}' returned {value!r} ({type(value).__name__}) on row {row} of {where} "
                f"(response {response!r}); expected a finite real number"
            )
        out.append(float(value))
    return out


def score_functions(
    sources: list[RewardSource],
    applies_NS: torch.Tensor,
    prompts: Sequence[str],
    responses: Sequence[str],
    rows: Sequence[int],
    where: str,
) -> torch.Tensor:
    """Values (N, S) of every function source on the responses it applies to; 0 elsewhere and in the reward-model
    column (grpo.py fills that one). prompts[n], responses[n], rows[n] belong to response n."""
    values = torch.zeros(applies_NS.shape, dtype=torch.float64)
    for s, source in enumerate(sources):
        if source.fn is None:
            continue
        idx = applies_NS[:, s].nonzero().flatten().tolist()
        scores = function_rewards(
            source, [prompts[n] for n in idx], [responses[n] for n in idx], [rows[n] for n in idx], where
        )
        values[idx, s] = torch.tensor(scores, dtype=torch.float64)
    return values


# ----------------------------------------------------------------------------------------------------
# Combining sources


def source_stats(
    values_NS: torch.Tensor,
    applies_NS: torch.Tensor,
    reduce_sum: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(count, mean, population std), each (S,) fp64, of every source over the responses it applies to, across
    ranks: `reduce_sum` sums a tensor over ranks (utils.dist.all_reduce_sum). Sources applying to no response get
    count 0, mean 0 and std 0."""
    m = applies_NS.double()
    x = values_NS.double() * m
    stats = reduce_sum(torch.stack([m.sum(0), x.sum(0), (x * x).sum(0)]))  # (3, S)
    count, total, total_sq = stats[0], stats[1], stats[2]
    mean = total / count.clamp(min=1.0)
    var = (total_sq / count.clamp(min=1.0) - mean * mean).clamp(min=0.0)
    return count, mean, var.sqrt()


def normalize_sources(
    values_NS: torch.Tensor,
    applies_NS: torch.Tensor,
    normalize_S: torch.Tensor,
    reduce_sum: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
    eps: float = 1e-6,
) -> torch.Tensor:
    """x (N, S): (v - mean_s) / (std_s + eps) for the sources with normalize_S True (statistics over the global
    batch, see source_stats), v unchanged for the others (the reward model's gain/bias is its normalization);
    0 wherever a source does not apply."""
    _, mean, std = source_stats(values_NS, applies_NS, reduce_sum)
    v = values_NS.double()
    x = torch.where(normalize_S.to(v.device)[None, :], (v - mean[None, :]) / (std[None, :] + eps), v)
    return torch.where(applies_NS, x, 0.0)


def combine_sources(x_NS: torch.Tensor, weights_S: torch.Tensor) -> torch.Tensor:
    """The training reward r (N,) = sum_s weight_s * x_ns (x is 0 where a source does not apply)."""
    return (x_NS.double() * weights_S.double().to(x_NS.device)[None, :]).sum(1)
