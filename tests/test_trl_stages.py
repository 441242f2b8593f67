"""bench/trl_stages.py: TRL's SFT, Reward and DPO trainers against our steps. Without trl (CI) the module imports,
our steps are measured and the table says why TRL's were not; with trl (PYTHONPATH to a side install) the quick
variant runs both sides and checks that they start from the same loss on the same weights and rows."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import run_all, trl_common, trl_stages
from bench.train import TrainConfig
from bench.trl_common import child_env
from data.tokenizer import END_ID
from tests.conftest import SHARED_DATA, shared_file
from utils import host

ROOT = Path(__file__).resolve().parents[1]
MICRO = TrainConfig(  # prompts of 96 tokens: room for the longest TL;DR header and "TL;DR:" suffix of these rows
    "test-trl-stages",
    "tiny",
    batch_rows=2,
    micro_rows=1,
    prompt_len=96,
    min_prompt_len=80,
    response_len=8,
    min_response_len=4,
    warmup=1,
    repeats=1,
)


@pytest.fixture
def fresh_process_group():
    from utils.dist import cleanup_distributed

    cleanup_distributed()
    yield
    cleanup_distributed()


def test_module_imports_without_trl():
    """Importing the benchmark (and run_all's registration of it) pulls in none of trl, datasets, accelerate."""
    code = (
        "import sys; import bench.trl_stages, bench.run_all; "
        "print([m for m in ('trl', 'datasets', 'accelerate') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_trl_available_names_what_is_missing(monkeypatch):
    monkeypatch.setattr(trl_common.importlib.util, "find_spec", lambda name: None if name == "trl" else object())
    ok, why = trl_common.trl_available("TRL step")
    assert not ok and why == "trl not installed (pip install trl) -- TRL step not measured"


def test_registered_named_only():
    assert "trl_stages" in run_all.NAMED_ONLY and "trl_stages" not in run_all.BENCHMARKS


def test_without_trl_our_steps_and_why_not(tmp_path, monkeypatch, fresh_process_group):
    """The path CI takes: run_all --only trl_stages measures our three steps and says why TRL's are missing."""
    monkeypatch.setattr(trl_stages, "configs", lambda quick: [MICRO])
    monkeypatch.setattr(trl_stages, "trl_available", lambda what: (False, "trl not installed (test)"))
    out = tmp_path / "r.json"
    threads = torch.get_num_threads()
    try:
        assert (
            run_all.main(
                ["--device", "cpu", "--quick", "--only", "trl_stages", "--out", str(out), "--threads", "1"]
                + ["--data", str(SHARED_DATA)]
            )
            == 0
        )
    finally:
        torch.set_num_threads(threads)
    rows = json.loads(out.read_text())["results"]
    by_name = {r["name"]: r for r in rows}
    for stage in ("sft", "reward model", "dpo"):
        assert by_name[f"test-trl-stages {stage}: ours step"]["value"] > 0
        trl = next(r for r in rows if r["name"].startswith(f"test-trl-stages {stage}: TRL"))
        assert trl["value"] is None and trl["note"] == "not measured: trl not installed (test)"
    for stage in ("reward model", "dpo"):
        assert by_name[f"test-trl-stages {stage}: ours, prefix sharing off step"]["value"] > 0
    assert not any(r["unit"] == "x" for r in rows)  # no ratio without TRL's step


def test_rows_synthetic_without_the_data_say_so():
    ids, where = trl_stages.stage_rows(MICRO, "sft", 50257, Path("/nonexistent"))
    assert where.startswith("synthetic rows (/nonexistent/tldr-validation-sample.jsonl not found)")
    assert [len(p) for p in ids["prompts"]][0] == MICRO.prompt_len and ids["responses"][0][-1] == END_ID
    ids, where = trl_stages.stage_rows(MICRO, "dpo", 50257, None)
    assert where.startswith("synthetic rows (no data folder)")
    assert len(ids["prompts"]) == len(ids["chosen"]) == len(ids["rejected"]) == MICRO.batch_rows
    assert all(r[-1] == END_ID for r in ids["chosen"] + ids["rejected"])


def test_rows_real_from_the_data_folder():
    ids, where = trl_stages.stage_rows(MICRO, "dpo", 50257, shared_file(trl_stages.PAIRS_FILE).parent)
    assert where.startswith("TL;DR rows: the first 2 of tldr-preference-validation-sample.jsonl")
    assert len(ids["prompts"]) == len(ids["chosen"]) == len(ids["rejected"]) == MICRO.batch_rows
    assert all(r[-1] == END_ID for r in ids["chosen"] + ids["rejected"])
    assert max(map(len, ids["prompts"])) <= MICRO.prompt_len


def test_stand_in_tokenizer_with_the_end_token_as_eos():
    pytest.importorskip("tokenizers")
    tok = trl_common.char_tokenizer(eos_id=END_ID)
    ids = [0, 198, 50255, 17]
    assert tok.eos_token_id == END_ID and tok.pad_token_id == 50256
    assert tok(trl_common.ids_to_text(ids) + tok.eos_token)["input_ids"] == ids + [END_ID]


def test_quick_against_trl(monkeypatch, fresh_process_group):
    """The quick variant, both sides: every stage has TRL's step and the ratio, and TRL's first-step loss is ours
    (the same weights, rows and loss)."""
    available, why = trl_common.trl_available("TRL side of bench/trl_stages.py")
    if not available:
        pytest.skip(why)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = trl_stages.run(torch.device("cpu"), quick=True, data=SHARED_DATA)
    finally:
        torch.set_num_threads(threads)
    ratios = [r for r in rows if r["unit"] == "x"]
    assert len(ratios) == 5  # SFT: ours; reward model and DPO: ours with and without prefix sharing
    for r in ratios:
        assert r["value"] > 0 and math.isfinite(r["value"])
        ours, theirs = r["first_step_loss_ours"], r["first_step_loss_trl"]
        assert theirs == pytest.approx(ours, rel=1e-4), r["name"]
    dpo = next(r for r in ratios if " dpo: " in r["name"])
    assert dpo["first_step_loss_ours"] == pytest.approx(math.log(2), abs=1e-6)  # policy = reference at step 0


def test_trl_children_run_without_the_projects_allocator_settings(monkeypatch):
    """The huge-pages setting utils/host.py puts in this process's environment is not handed to TRL's child (PyTorch
    there would read it): TRL runs with the system's defaults. A user's own setting is passed on."""
    monkeypatch.setattr(host, "SET_HERE", {"THP_MEM_ALLOC_ENABLE"})
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "1")
    assert "THP_MEM_ALLOC_ENABLE" not in child_env()
    monkeypatch.setattr(host, "SET_HERE", set())
    assert child_env()["THP_MEM_ALLOC_ENABLE"] == "1"
