"""The benchmark suite (bench/) on micro configurations: `python -m bench.run_all` runs every benchmark, prints the
table and writes the documented JSON; token and FLOP counts match hand computations; figures are finite and
positive. No timing thresholds: a shared machine makes any of them flaky."""

import dataclasses
import json
import math

import pytest
import torch

import rollouts.step
from bench import (
    common,
    decode_profile,
    grpo_step,
    lora_memory,
    prefix_sharing,
    profiling,
    run_all,
    sampler,
    train,
    trl_grpo,
)
from bench.common import random_prompts
from data.tldr import collate_pairs, collate_sft
from model.gpt2 import PRESETS, GPTConfig
from tests.conftest import SHARED_DATA, shared_file

SAMPLER = sampler.SamplerConfig(
    name="test-sampler",
    preset="tiny",
    dtype="fp32",
    prompt_len=12,
    min_prompt_len=8,
    new_tokens=3,
    group=2,
    rows=(4,),
    share_prompts=1,
    warmup=1,
    repeats=1,
    stage_steps=2,
)
TRAIN = train.TrainConfig(
    "test-train",
    "tiny",
    batch_rows=4,
    micro_rows=2,
    prompt_len=12,
    min_prompt_len=8,
    response_len=4,
    min_response_len=2,
    warmup=1,
    repeats=1,
)
GRPO = grpo_step.GRPOBenchConfig(
    "test-grpo",
    "tiny",
    prompts=2,
    num_samples=4,
    num_kept=2,
    selection="rso",
    max_new_tokens=3,
    prompt_len=12,
    min_prompt_len=8,
    gen_prompts=2,
    micro_batch_size=2,
    score_micro_batch_size=8,
    warmup=1,
    repeats=1,
)
TRL = dataclasses.replace(GRPO, name="test-trl", selection="all", num_kept=4)
PREFIX = prefix_sharing.PrefixBenchConfig(
    "test-prefix",
    "tiny",
    prompts=2,
    num_samples=4,
    num_kept=2,
    max_new_tokens=3,
    max_prompt_len=64,
    gen_prompts=1,
    micro_batch_size=4,
    score_micro_batch_size=3,
    repeats=1,
)
POSITIVE_UNITS = ("tok/s", "s", "ms", "MiB", "x", "%", "TFLOP/s", "rows/s", "pairs/s")


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def fresh_process_group():
    """The benchmarks set up a one-rank group for their device (gloo on CPU, NCCL on GPU): start and end with none,
    so a CPU test never hands a gloo group to a GPU test or the other way round."""
    from utils.dist import cleanup_distributed

    cleanup_distributed()
    yield
    cleanup_distributed()


@pytest.fixture
def micro_configs(monkeypatch, fresh_process_group):
    monkeypatch.setattr(sampler, "configs", lambda device, quick: [SAMPLER])
    monkeypatch.setattr(train, "configs", lambda device, quick: [TRAIN])
    monkeypatch.setattr(grpo_step, "configs", lambda device, quick: [GRPO])
    monkeypatch.setattr(trl_grpo, "configs", lambda device, quick: [TRL])
    monkeypatch.setattr(
        lora_memory, "configs", lambda device, quick: [lora_memory.LoRAMemoryConfig("test-lora", "tiny", 4)]
    )
    monkeypatch.setattr(prefix_sharing, "configs", lambda device, quick: [PREFIX])
    # the TRL run itself takes a minute of start-up; test_trl_child covers it where trl is installed
    monkeypatch.setattr(trl_grpo, "trl_available", lambda: (False, "trl is not installed (test)"))


def by_name(rows: list[dict], bench: str, suffix: str) -> dict:
    found = [r for r in rows if r["bench"] == bench and r["name"].endswith(suffix)]
    assert len(found) == 1, f"{bench} rows ending with '{suffix}': {[r['name'] for r in found]}"
    return found[0]


def test_run_all_prints_table_and_writes_json(tmp_path, micro_configs, capsys):
    out = tmp_path / "results.json"
    args = ["--device", "cpu", "--quick", "--out", str(out), "--threads", "1", "--data", str(SHARED_DATA)]
    assert run_all.main(args) == 0
    doc = json.loads(out.read_text())  # strict JSON: no NaN or infinity
    env = doc["environment"]
    for key in ("date", "device", "device_name", "torch", "cpu", "torch_threads", "command", "git_commit"):
        assert env[key] not in (None, ""), key
    assert env["device"] == "cpu" and env["torch"] == torch.__version__
    assert doc["errors"] == []
    rows = doc["results"]
    assert {r["bench"] for r in rows} == set(run_all.BENCHMARKS)
    for r in rows:
        assert {"bench", "name", "value", "unit", "note"} <= r.keys()
        if r["value"] is None:
            assert r["note"].startswith("not measured") or "not reported" in r["note"], r
            continue
        assert math.isfinite(r["value"]), r
        assert r["config_name"] in {
            "test-sampler",
            "test-train",
            "test-grpo",
            "test-trl",
            "test-lora",
            "test-prefix",
        }, r
        if r["unit"] in POSITIVE_UNITS and not r["name"].endswith(": other"):
            assert r["value"] > 0, r
    # no silent gaps: the missing TRL step and the CPU MFU say why
    assert "not installed" in by_name(rows, "trl", "TRL GRPOTrainer")["note"]
    assert "not reported on CPU" in by_name(rows, "train", ": MFU")["note"]
    if not (SHARED_DATA / prefix_sharing.PROMPTS_FILE).is_file():  # without the real rows, a row says so
        assert "tldr-validation-sample.jsonl not found" in by_name(rows, "prefix_sharing", ": prefix sharing")["note"]
    printed = capsys.readouterr().out
    assert "bench" in printed and "figure" in printed and f"wrote {out}" in printed
    for r in rows:
        assert r["name"] in printed


def test_sampler_same_weights_and_token_counts(tmp_path, one_thread):
    rows = sampler.bench_config(SAMPLER, torch.device("cpu"), tmp_path)
    assert by_name(rows, "sampler", "max |logit diff| ours vs transformers")["value"] < 1e-4
    N = SAMPLER.rows[0]
    for engine in ("ours", "transformers"):
        r = by_name(rows, "sampler", f"N={N} ({N // SAMPLER.group} prompts x G={SAMPLER.group}): {engine}")
        assert r["generated_tokens"] == N * SAMPLER.new_tokens  # nothing stops a row in either engine
        assert r["value"] == pytest.approx(r["generated_tokens"] / r["seconds"])
        assert r["seconds"] == pytest.approx(sorted(r["timing"]["times_s"])[len(r["timing"]["times_s"]) // 2])
    shared = by_name(rows, "sampler", "ours, prefix shared")
    assert shared["generated_tokens"] == SAMPLER.share_prompts * SAMPLER.group * SAMPLER.new_tokens
    stages = [r for r in rows if "decode step:" in r["name"] and not r["name"].endswith(("prefill", "total"))]
    total = by_name(rows, "sampler", "decode step: total")["value"]
    assert sum(r["value"] for r in stages) == pytest.approx(total)


def test_grpo_step_stages_and_token_counts(one_thread, fresh_process_group, monkeypatch):
    results = []  # every train_step call of the benchmark: it times the step main() runs, not a copy of it

    def recording_train_step(*args, **kwargs):
        results.append(real_train_step(*args, **kwargs))
        return results[-1]

    real_train_step = rollouts.step.train_step
    monkeypatch.setattr(rollouts.step, "train_step", recording_train_step)
    m = grpo_step.measure_steps(GRPO, torch.device("cpu"))
    assert len(results) == GRPO.warmup + GRPO.repeats
    assert set(results[-1].seconds) == set(grpo_step.STAGES)
    assert m["stage_seconds"] == {k: [r.seconds[k] for r in results[GRPO.warmup :]] for k in grpo_step.STAGES}
    rows = grpo_step.step_rows(GRPO, m)
    step = by_name(rows, "grpo", "ours: step")["value"]
    stage_sum = sum(by_name(rows, "grpo", f"ours: {k}")["value"] for k in grpo_step.STAGES)
    assert 0 < stage_sum <= step
    assert by_name(rows, "grpo", "ours: other")["value"] == pytest.approx(step - stage_sum)
    c = m["counts"]
    _, prompt_mask = random_prompts(GRPO.prompts, GRPO.prompt_len, GRPO.min_prompt_len, 50257, seed=0)
    assert c["sequences"] == GRPO.prompts * GRPO.num_samples
    assert 0 < c["generated_tokens"] <= c["sequences"] * GRPO.max_new_tokens
    assert c["total_tokens"] == int(prompt_mask.sum()) * GRPO.num_samples + c["generated_tokens"]
    assert c["trained_sequences"] == GRPO.prompts * GRPO.num_kept
    assert c["generated_tokens"] == int(results[-1].samples.response_mask.sum())
    assert by_name(rows, "grpo", "generated tokens/s per device")["value"] == pytest.approx(
        c["generated_tokens"] / step
    )
    assert m["peak_memory_bytes"] > 2**20


def test_changed_signature_fails_the_run(tmp_path, micro_configs, monkeypatch):
    """A script function whose signature changed is an error of the run (exit 1, error in the JSON), never a
    "not measured" row."""
    monkeypatch.setattr(train.sft, "accumulate_gradients", lambda model, micro_batches: 0.0)
    out = tmp_path / "results.json"
    assert run_all.main(["--device", "cpu", "--only", "train", "--out", str(out), "--threads", "1"]) == 1
    doc = json.loads(out.read_text())
    assert len(doc["errors"]) == 1 and doc["errors"][0].startswith("train: TypeError"), doc["errors"]
    assert not any((r["note"] or "").startswith("not measured") for r in doc["results"])


def test_flops_formula_by_hand():
    c = GPTConfig(vocab_size=100, n_positions=16, n_layer=2, n_head=2, n_embd=8)
    batch = collate_sft([[1, 2, 3], [4, 5]], [[6, 198], [7]])  # width T = 3 + 2 = 5; 8 real tokens
    n, head = 1000, 800
    model, executed = train.flops_per_step(c, n, head, [batch])
    assert model == 8 * (6 * n + 12 * 2 * 8 * 5)  # 6N + 12 L d T per real token
    # padded positions through the body (2 rows x 5), the head only at the 2 x 2 response positions
    assert executed == 2 * 5 * (6 * (n - head) + 12 * 2 * 8 * 5) + 2 * 2 * 6 * head
    dpo_model, _ = train.flops_per_step(c, n, head, [batch], forward_passes=4.0)
    assert dpo_model == 8 * (8 * n + 16 * 2 * 8 * 5)
    # packed pairs: prompt [1, 2, 3] once (3 tokens) + 2 responses of width 2 through the body; model FLOPs as padded
    pairs = collate_pairs([[1, 2, 3]], [[6, 198]], [[7]])  # 2 rows of width 5; 5 + 4 = 9 real tokens
    packed_model, packed = train.flops_per_step(c, n, head, [pairs], packed_pairs=True)
    assert packed_model == 9 * (6 * n + 12 * 2 * 8 * 5)
    assert packed == (3 + 2 * 2) * (6 * (n - head) + 12 * 2 * 8 * 5) + 2 * 2 * 6 * head
    # GPT-2 124M: 124,439,808 unique parameters; N drops the 1024 x 768 position table (and wte without a head)
    gpt2 = PRESETS["gpt2"]
    assert train.matmul_params(gpt2, 124_439_808, lm_head=True) == (124_439_808 - 786_432, 50257 * 768)
    assert (
        train.matmul_params(gpt2, 124_439_808 - 50257 * 768, lm_head=False)[0]
        == 124_439_808 - 786_432 - 2 * 50257 * 768
    )


def test_table_and_result_rules():
    cfg = SAMPLER
    rows = [common.result("a", "x", 1234.5, "tok/s", config=cfg), common.skipped("b", "y", "why not", config=cfg)]
    table = common.format_table(rows)
    assert "1,234" in table and "not measured: why not" in table and rows[0]["config_name"] == "test-sampler"
    with pytest.raises(ValueError, match="non-finite"):
        common.result("a", "nan", float("nan"), "s")


def test_char_tokenizer_keeps_token_ids():
    pytest.importorskip("tokenizers")
    tok = trl_grpo.char_tokenizer()
    ids = [0, 198, 50255, 17, 17, 40000]
    text = trl_grpo.ids_to_text(ids)
    assert tok(text)["input_ids"] == ids
    assert tok.decode(ids) == text
    assert tok(text + "<|endoftext|>")["input_ids"] == ids + [50256]


@pytest.mark.slow
def test_trl_child(one_thread):
    pytest.importorskip("trl")
    rows = trl_grpo.run_trl(TRL, torch.device("cpu"))
    assert rows[0]["value"] is not None, rows[0]["note"]
    assert rows[0]["value"] > 0 and len(rows[0]["measurements"]["step_seconds"]) == TRL.repeats


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_benchmarks_on_gpu(tmp_path, fresh_process_group):
    device = torch.device("cuda")
    rows = sampler.bench_config(dataclasses.replace(SAMPLER, dtype="bf16"), device, tmp_path)
    assert by_name(rows, "sampler", "max |logit diff| ours vs transformers")["value"] < 0.1  # bf16 rounding
    m = grpo_step.measure_steps(GRPO, device)
    assert m["peak_memory_what"] == "torch.cuda.max_memory_allocated" and m["peak_memory_bytes"] > 0
    for r in train.run(device, quick=True, cfgs=[TRAIN]):
        assert r["value"] is None or math.isfinite(r["value"])


def test_prefix_sharing_counts_each_prompt_once_per_group(fresh_process_group, one_thread):
    bcfg = dataclasses.replace(PREFIX, data=str(shared_file(prefix_sharing.PROMPTS_FILE)))
    m = prefix_sharing.measure(bcfg, torch.device("cpu"))
    lengths, G, K, new = m["prompt_lengths"], PREFIX.num_samples, PREFIX.num_kept, PREFIX.max_new_tokens
    shared, unshared = m["shared"]["tokens"], m["unshared"]["tokens"]
    # one prompt per generate call: the cache holds the prompt once and G response parts, or G copies of both
    assert shared["generate"] == sum(p + G * new for p in lengths)
    assert unshared["generate"] == sum(G * (p + new) for p in lengths)
    # the update's micro-batch of 4 rows holds both prompts' K = 2 kept samples: each prompt once instead of K times
    assert unshared["reference"] - shared["reference"] == (K - 1) * sum(lengths)
    assert unshared["update"] == unshared["reference"] and shared["update"] == shared["reference"]
    assert unshared["score"] > shared["score"]
    assert shared["kv_cache_bytes"] == sum(2 * 2 * 64 * 4 * (lengths[0] + G * new) for _ in [0])  # first call: prompt 0
    rows = prefix_sharing.rows_of(bcfg, m)
    assert by_name(rows, "prefix_sharing", "shared / unshared, KV cache")["value"] == pytest.approx(
        (lengths[0] + G * new) / (G * (lengths[0] + new))
    )


def test_decode_ops_per_token_and_per_layer(one_thread):
    """bench/decode_profile.py's count of the host work per decoded token: a decode step of the shared-prefix path
    dispatches at most 30 ops per layer and a tiny model's whole token at most 100 (docs/benchmarks.md has the
    counts); the count does not depend on the weights or the rows."""
    from model.gpt2 import GPT2LMHeadModel

    counts = {}
    for n_layer in (2, 3):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPTConfig(vocab_size=512, n_layer=n_layer, n_head=2, n_embd=64, n_positions=128)).eval()
        ids, mask = random_prompts(2, 16, 10, model.cfg.vocab_size, seed=0, pad_id=0)
        counts[n_layer] = sum(
            decode_profile.ops_per_token(model, ids, mask, 4, share=True, check_every=8, short=2, long=5).values()
        )
    assert counts[2] <= 100 and 0 < counts[3] - counts[2] <= 30, counts


def test_decode_floor_counts_by_hand_and_scoring_reads_each_prompt_once():
    """bench/stage_floors.py's GPU floor of a decode step on a tiny config, against the count by hand: the weights once
    (12 L C^2 + V C + positions x C values), each prompt's keys and values once per group (2 L C values per position),
    each row's own ones at new_tokens / 2 positions on average; FLOPs of the body and head for every row. And the
    scoring stage's products count each prompt once (prefix sharing), not once per sample."""
    from bench.grpo_step import GRPOBenchConfig
    from bench.stage_floors import body_flops_per_token, decode_floor, gpu_stage_floors, stage_products
    from model.gpt2 import GPTConfig

    cfg = GPTConfig(vocab_size=100, n_positions=16, n_layer=2, n_head=2, n_embd=8)
    f = decode_floor(cfg, prompts=2, prompt_len=5, group=3, new_tokens=4, bytes_per_value=2)
    assert f["weights_bytes"] == (12 * 2 * 64 + 100 * 8 + 16 * 8) * 2 == 4928
    assert (f["prompt_kv_bytes"], f["own_kv_bytes"], f["bytes"]) == (2 * 5 * 64, 6 * 2 * 64, 4928 + 640 + 768)
    assert body_flops_per_token(cfg, 7) == 2 * (24 * 64 + 4 * 7 * 8)
    assert f["flops"] == 6 * (2 * (24 * 64 + 4 * 7 * 8) + 2 * 8 * 100)

    b = GRPOBenchConfig(
        "t",
        "gpt2",
        prompts=4,
        num_samples=8,
        num_kept=2,
        selection="rso",
        max_new_tokens=10,
        prompt_len=20,
        min_prompt_len=20,
        gen_prompts=2,
        micro_batch_size=4,
        score_micro_batch_size=8,
    )
    counts = {
        "sequences": 32,
        "generated_tokens": 320,
        "total_tokens": 4 * 20 * 8 + 320,
        "trained_sequences": 8,
        "trained_tokens": 8 * 30,
    }
    gpt2 = __import__("model.gpt2", fromlist=["PRESETS"]).PRESETS["gpt2"]
    score = stage_products(b, counts)["score"]["body"]
    assert score == (4 * 20 + 320) * body_flops_per_token(gpt2, 20 + 10 / 2)
    floors = gpu_stage_floors(b, counts)
    per_step = decode_floor(gpt2, 2, 20, 8, 10)["bytes"] / 3.35e12
    assert floors["generate"] >= 2 * 9 * per_step * (1 - 1e-12) and floors["score"] == pytest.approx(score / 989e12)


def test_host_syncs_counts_reads_of_device_tensors_only():
    """bench.profiling.HostSyncs on a CPU run: a host tensor (the batch) and what is computed from it alone are read for
    free; a .to(device) of it, a parameter, and what is computed from them are device tensors, whose reads a GPU run
    waits for."""
    batch = torch.tensor([1.0, 0.0, 2.0])
    weight = torch.nn.Parameter(torch.ones(3))
    with profiling.HostSyncs(torch.device("cpu"), [batch]) as h:
        float(batch.sum())  # host
        batch.nonzero()  # host
        moved = batch.to("cpu")
        assert moved is not batch and torch.equal(moved, batch)  # a new view: on the device from here
        float(moved.sum())  # 1 __float__
        (moved * weight).nonzero()  # 1 nonzero
        moved[moved > 0]  # 1 boolean index
        torch.zeros(2, device="cpu").tolist()  # created on the device: 1 tolist
        torch.zeros(2).tolist()  # created on the host: free
    assert dict(h.counts) == {"__float__": 1, "nonzero": 1, "__getitem__ with a boolean index": 1, "tolist": 1}


@pytest.mark.parametrize("stage", train.STAGES)
def test_a_training_step_waits_for_the_device_the_same_times_whatever_its_micro_batches(
    stage, one_thread, fresh_process_group
):
    """SFT, reward-model and DPO steps read device values on the host only at the end of the step (the loss and
    statistics, the clipped norm), not per micro-batch: the head's positions are found on the host
    (utils.dist.true_positions), not by nonzero on the device."""
    from utils.dist import setup_distributed

    world, device = setup_distributed("cpu").world_size, torch.device("cpu")
    counts = {}
    for micro_rows in (2, 1):  # 2 and 4 micro-batches
        s = train.build_stage(stage, dataclasses.replace(TRAIN, micro_rows=micro_rows), device, world)
        batches = [v for b in s.micro for v in b.values() if isinstance(v, torch.Tensor)]
        with profiling.HostSyncs(device, batches) as h:
            s.step()
        counts[micro_rows] = dict(h.counts)
    once = {"__float__": 2} if stage == "SFT" else {"__float__": 1, "tolist": 1}  # loss / statistics, clipped norm
    assert counts == {2: once, 1: once}


def test_profile_summary_and_the_profile_rows_on_cpu(one_thread, fresh_process_group):
    from utils.dist import setup_distributed

    assert profiling._busy_us([(5, 6), (0, 2), (1, 3)]) == 4  # the union of the intervals
    world = setup_distributed("cpu").world_size
    rows = train.profile_stage("SFT", "micro-batch x2", TRAIN, torch.device("cpu"), world, steps=1)
    assert by_name(rows, "train_profile", "host synchronisations per step")["value"] == 2
    wall = by_name(rows, "train_profile", "wall per step, profiled")
    k = wall["profile"]
    assert 0 < k["kernel_ms"] <= wall["value"]  # the ops' self time is part of the wall
    assert k["launches"]["ATen ops"] == by_name(rows, "train_profile", "ATen ops per step")["value"] > 100
    assert sum(t["us"] for t in k["top_host_ops"]) <= k["kernel_ms"] * 1e3 + 1e-6
    assert wall["config"]["micro_rows"] == 2 * TRAIN.micro_rows  # the variant's configuration


def test_memory_rows_flag_a_gap_over_ten_percent():
    m = {
        "peak_memory_bytes": 115 * 2**20,
        "estimated_peak_bytes": 100 * 2**20,
        "device_type": "cuda",
        "peak_memory_what": "-",
    }
    m["estimated_bytes"] = {"weights": 60 * 2**20, "update": 40 * 2**20}
    rows = grpo_step.memory_rows(GRPO, m, "grpo", "x")
    assert by_name(rows, "grpo", "measured / estimated")["value"] == pytest.approx(1.15)
    assert by_name(rows, "grpo", "measured / estimated")["note"] == "GAP over 10%"
    m["peak_memory_bytes"] = 91 * 2**20
    assert by_name(grpo_step.memory_rows(GRPO, m, "grpo", "x"), "grpo", "measured / estimated")["note"] == "within 10%"


def test_memory_fit_finds_the_largest_preset_that_runs_trying_few():
    presets = grpo_step.FIT_PRESETS
    for largest in range(-1, len(presets)):  # -1: none runs
        for first in range(len(presets)):
            calls = []

            def runs(p, largest=largest, calls=calls):
                calls.append(p)
                return {"outcome": "ran" if presets.index(p) <= largest else "out of memory"}

            best, tried = grpo_step.largest_that_runs(presets, runs, first)
            assert best == (presets[largest] if largest >= 0 else None)
            assert len(calls) == len(set(calls)) <= abs(first - largest) + 2 and set(tried) == set(calls)


def test_memory_fit_goes_on_after_an_out_of_memory_error(monkeypatch):
    def out_of_memory(bcfg, device):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore")

    monkeypatch.setattr(grpo_step, "measure_steps", out_of_memory)
    r = grpo_step.fit_child("small", False, 24.0, torch.device("cpu"))
    assert r == {"outcome": "out of memory", "error": "CUDA out of memory. Tried to allocate 2.00 GiB"}
    # on a CPU the search tries small (both estimates fit), which runs out of memory, then tiny
    outcomes = {"tiny": {"outcome": "ran", "step_seconds": 0.5, "peak_bytes": 3 * 2**20, "estimated_peak_bytes": 2**21}}
    outcomes["small"] = r
    rows = grpo_step.memory_fit(torch.device("cpu"), True, runs=lambda p, offload, timeout_s: outcomes[p])
    answer = by_name(rows, "memory_fit", "without offload: largest GPT-2 in 24 GiB")
    assert answer["largest"] == "tiny" and answer["value"] == PRESETS["tiny"].n_layer
    assert by_name(rows, "memory_fit", "small: GRPO step")["note"].startswith("not measured: out of memory")
    assert by_name(rows, "memory_fit", "tiny: GRPO step")["value"] == 0.5
    assert "needs a GPU" in by_name(rows, "memory_fit", "with --frozen_cpu_offload")["note"]
