"""rlhf/rewards.py: parsing --rewards, built-in functions, per-row sources, errors naming the function and the row,
per-source normalization over the global batch, and the optional reward column of a dataset."""

import json
import math

import pytest
import torch

from data.synthetic import best_summary, gold_reward, make_post
from data.tldr import load_optional_column
from rlhf.rewards import (
    RewardFunctionError,
    combine_sources,
    format_reward,
    function_rewards,
    length_reward,
    normalize_sources,
    parse_rewards,
    row_sources,
    score_functions,
    source_stats,
)
from rollouts.options import TASK_REWARDS


def test_parse_rewards_weights_names_and_functions():
    sources = parse_rewards("reward_model + 0.5*format + -0.25 * length + data.synthetic:gold_reward", length_target=4)
    assert [(s.name, s.weight) for s in sources] == [
        ("reward_model", 1.0),
        ("format", 0.5),
        ("length", -0.25),
        ("gold_reward", 1.0),
    ]
    assert sources[0].fn is None and sources[3].fn is gold_reward
    assert sources[2].fn("p", " a b c d\n") == 0.0 and sources[2].fn("p", " a b\n") == -0.5  # target 4 words
    # grpo.py's name for the same function (rlhf/rewards.py knows only format and length)
    assert parse_rewards("gold_reward", extra=TASK_REWARDS)[0].fn is gold_reward


@pytest.mark.parametrize(
    "spec, match",
    [
        ("reward_model + bogus", "unknown reward source 'bogus'"),
        ("x*format", "weight before"),
        ("format + ", "empty term"),
        ("format + 2*format", "more than once"),
        ("gold_reward + data.synthetic:gold_reward", "more than once"),
        ("data.synthetic:no_such_fn", "cannot load function 'data.synthetic:no_such_fn'"),
        ("no_such_module:fn", "cannot load function"),
    ],
)
def test_parse_rewards_errors(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_rewards(spec, extra=TASK_REWARDS)


def test_builtin_functions():
    assert format_reward("p", " my sister sold my car\n") == 1.0
    assert format_reward("p", " my sister sold my car") == 0.0  # no end token: ran out of tokens
    assert format_reward("p", "\n") == 0.0  # ended but empty
    assert length_reward("p", " one two three\n", target_words=3) == 0.0
    assert length_reward("p", " one\n", target_words=3) == pytest.approx(-2 / 3)
    assert length_reward("p", " " + "w " * 6 + "\n", target_words=3) == -1.0
    post = make_post(__import__("random").Random(0))
    assert gold_reward(post["prompt"], " " + best_summary(post) + "\n") == 4.0


def test_row_sources_from_the_reward_column():
    sources = parse_rewards("reward_model + format + data.synthetic:gold_reward")
    applies = row_sources(
        [None, "gold_reward, format", ["reward_model"], "data.synthetic:gold_reward"], sources, "rows.jsonl"
    )
    assert applies.tolist() == [[True, True, True], [False, True, True], [True, False, False], [False, False, True]]
    with pytest.raises(ValueError, match="rows.jsonl: row 1: reward source 'length' is not in --rewards"):
        row_sources([None, "length"], sources, "rows.jsonl")
    with pytest.raises(ValueError, match="row 0: the reward column names no reward source"):
        row_sources([" , "], sources, "rows.jsonl")
    with pytest.raises(ValueError, match="row 0: the reward column must be a string or a list"):
        row_sources([3], sources, "rows.jsonl")


def raises_on_short(prompt, response):
    if len(response) < 3:
        raise KeyError("too short")
    return 1.0


@pytest.mark.parametrize("returned", [None, "1.0", float("nan"), math.inf, True, torch.tensor(1.0)])
def test_a_function_returning_a_non_number_stops_naming_function_and_row(returned):
    source = parse_rewards("format")[0]
    bad = type(source)("bad", "tests.test_rewards:bad", 1.0, lambda p, r: 0.5 if r == " ok\n" else returned)
    with pytest.raises(
        RewardFunctionError, match=r"reward function 'tests.test_rewards:bad' returned .* on row 7 of train.jsonl"
    ):
        function_rewards(bad, ["p", "p"], [" ok\n", " wrong\n"], [3, 7], "train.jsonl")


def test_a_function_that_raises_stops_naming_function_and_row():
    source = parse_rewards("tests.test_rewards:raises_on_short")[0]
    assert function_rewards(source, ["p"], [" long enough\n"], [0], "w") == [1.0]
    with pytest.raises(
        RewardFunctionError, match=r"'tests.test_rewards:raises_on_short' raised on row 12 of w .*KeyError"
    ):
        function_rewards(source, ["p", "p"], [" long enough\n", " \n"], [11, 12], "w")


def test_functions_are_called_only_on_the_rows_they_apply_to():
    sources = parse_rewards("reward_model + tests.test_rewards:raises_on_short + format")
    applies = torch.tensor([[True, True, True], [True, False, True]])  # row 1 would make the function raise
    values = score_functions(sources, applies, ["p", "p"], [" long enough\n", " \n"], [0, 1], "w")
    assert values.tolist() == [[0.0, 1.0, 1.0], [0.0, 0.0, 0.0]]  # reward-model column left to grpo.py


def test_normalization_per_source_then_weighted_sum_by_hand():
    # columns: reward model (already normalized by its gain/bias), a function on rows 0-3, a function on rows 2-5
    values = torch.tensor(
        [
            [0.5, 1.0, 0.0],
            [-1.0, 3.0, 0.0],
            [2.0, 1.0, 10.0],
            [0.0, 3.0, 20.0],
            [1.0, 0.0, 10.0],
            [1.5, 0.0, 20.0],
        ],
        dtype=torch.float64,
    )
    applies = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 1], [1, 1, 1], [1, 0, 1], [1, 0, 1]], dtype=torch.bool)
    normalize = torch.tensor([False, True, True])
    count, mean, std = source_stats(values, applies)
    assert count.tolist() == [6, 4, 4] and mean[1:].tolist() == [2.0, 15.0] and std[1:].tolist() == [1.0, 5.0]
    x = normalize_sources(values, applies, normalize, eps=0.0)
    assert x[:, 0].tolist() == values[:, 0].tolist()  # the reward model keeps its own normalization
    assert x[:, 1].tolist() == [-1, 1, -1, 1, 0, 0]  # (v - 2) / 1 where it applies, 0 elsewhere
    assert x[:, 2].tolist() == [0, 0, -1, 1, -1, 1]  # (v - 15) / 5
    r = combine_sources(x, torch.tensor([1.0, 0.5, 2.0]))
    assert r.tolist() == pytest.approx([0.5 - 0.5, -1.0 + 0.5, 2.0 - 0.5 - 2, 0.0 + 0.5 + 2, 1.0 - 2, 1.5 + 2])
    # a constant function contributes nothing (not NaN)
    flat = normalize_sources(torch.ones(3, 1), torch.ones(3, 1, dtype=torch.bool), torch.tensor([True]))
    assert flat.tolist() == [[0.0], [0.0], [0.0]]


def test_normalization_statistics_are_those_of_the_global_batch():
    """Two 'ranks' holding uneven halves: with reduce_sum adding the other half's local sums, each half is
    normalized exactly as the concatenated batch (not by its own statistics)."""
    g = torch.Generator().manual_seed(0)
    values = torch.randn(10, 2, generator=g, dtype=torch.float64) * 3 + 1
    applies = torch.rand(10, 2, generator=g) < 0.8
    normalize = torch.tensor([True, True])
    full = normalize_sources(values, applies, normalize)
    other = []
    normalize_sources(values[3:], applies[3:], normalize, reduce_sum=lambda t: other.append(t) or t)
    first = normalize_sources(values[:3], applies[:3], normalize, reduce_sum=lambda t: t + other[0])
    assert torch.allclose(first, full[:3], atol=1e-12)
    assert not torch.allclose(normalize_sources(values[:3], applies[:3], normalize), full[:3], atol=1e-3)


def test_optional_reward_column_of_a_dataset(tmp_path):
    with_column = tmp_path / "mixed.jsonl"
    rows = [
        {"prompt": "a", "reward_fns": "gold_reward"},
        {"prompt": "b"},
        {"prompt": "c", "reward_fns": ["format", "length"]},
    ]
    with_column.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert load_optional_column(str(with_column), "train", "reward_fns") == ["gold_reward", None, ["format", "length"]]
    without = tmp_path / "plain.jsonl"
    without.write_text(json.dumps({"prompt": "a"}) + "\n")
    assert load_optional_column(str(without), "train", "reward_fns") is None
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["a", "b"], "reward_fns": ["format", None]}), tmp_path / "train.parquet")
    assert load_optional_column(str(tmp_path), "train", "reward_fns") == ["format", None]
    assert load_optional_column(str(tmp_path), "train", "other") is None
