"""Config parsing, the learning-rate schedule, and the Logger's wandb modes."""

import dataclasses
import json
import math

import pytest

import sft
from utils.config import field_docs, parse_config
from utils.logging import Logger
from utils.optim import cosine_with_warmup


def test_every_sft_option_is_documented(capsys):
    docs = field_docs(sft.Config)
    assert set(docs) == {f.name for f in dataclasses.fields(sft.Config)}
    with pytest.raises(SystemExit):
        parse_config(sft.Config, ["--help"])
    out = " ".join(capsys.readouterr().out.split())
    for f in dataclasses.fields(sft.Config):
        assert f"--{f.name}" in out


def test_overrides_types_and_booleans():
    cfg = parse_config(sft.Config, ["--lr", "1e-4", "--batch_size", "16", "--resume", "false", "--model", "tiny"])
    assert cfg.lr == 1e-4 and cfg.batch_size == 16 and cfg.resume is False and cfg.model == "tiny"


def test_misspelled_option_names_the_closest(capsys):
    with pytest.raises(SystemExit):
        parse_config(sft.Config, ["--micro_batchsize", "4"])
    assert "did you mean --micro_batch_size" in capsys.readouterr().err


def test_bad_value_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse_config(sft.Config, ["--batch_size", "0"])
    assert "--batch_size must be positive" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_config(sft.Config, ["--resume", "maybe"])
    assert "expected a boolean" in capsys.readouterr().err


def test_batch_that_does_not_divide_is_refused():
    with pytest.raises(ValueError, match="divisible"):
        sft.accumulation_steps(batch_size=10, micro_batch_size=4, world_size=2)
    assert sft.accumulation_steps(64, 8, 2) == 4


def test_cosine_with_warmup_by_hand():
    assert cosine_with_warmup(0, 4, 100, 0.1) == 0.25
    assert cosine_with_warmup(3, 4, 100, 0.1) == 1.0
    assert cosine_with_warmup(4, 4, 100, 0.1) == 1.0
    mid = 4 + 48  # half-way through the decay: cos(pi/2) = 0
    assert math.isclose(cosine_with_warmup(mid, 4, 100, 0.1), 0.1 + 0.9 * 0.5)
    assert math.isclose(cosine_with_warmup(100, 4, 100, 0.1), 0.1)


@pytest.mark.parametrize("mode", ["offline", "disabled"])
def test_logger_writes_metrics_in_every_wandb_mode(tmp_path, mode):
    log = Logger(tmp_path, {"a": 1}, "test", "run", mode, enabled=True)
    log.log({"loss": 1.5, "nan": float("nan")}, step=3)
    log.finish()
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert rows == [{"step": 3, "loss": 1.5}]
    assert (tmp_path / "wandb").exists() == (mode == "offline")
