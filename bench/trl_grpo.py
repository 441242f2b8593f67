"""TRL's GRPOTrainer against our GRPO step on the same configuration (selection "all": TRL trains on every sample),
the same weights (save_hf, loaded by from_pretrained) and prompts (a stand-in tokenizer, one character per GPT-2 id).
TRL runs in a subprocess (`python -m bench.trl_grpo`), apart from the other benchmarks' process group and memory peak;
without trl, datasets or accelerate a row says so. Settings and method: docs/benchmarks.md, "trl".
"""

import argparse
import dataclasses
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from bench import common
from bench.common import ROOT, mib, result, skipped
from bench.grpo_step import CPU_TINY, CPU_TINY_QUICK, GPU_REFERENCE, GRPOBenchConfig, bench_config
from bench.trl_common import char_tokenizer, child_env, ids_to_text, trainer_basics, trl_available, version

BENCH = "trl"


def configs(device: torch.device, quick: bool) -> list[GRPOBenchConfig]:
    """Our step's, with selection "all" (K = G); on a GPU 16 prompts x 64 (TRL generates a step in one call), on a CPU
    REFERENCE.md's TRL figure: 128 samples of 16 tokens on the tiny GPT-2."""
    if device.type == "cuda":
        name, prompts, repeats = ("gpu-trl-comparison-quick", 4, 2) if quick else ("gpu-trl-comparison", 16, 3)
        return [replace(GPU_REFERENCE, name=name, prompts=prompts, num_kept=64, selection="all", repeats=repeats)]
    if quick:
        return [replace(CPU_TINY_QUICK, name="cpu-trl-comparison-quick", num_kept=8, selection="all")]
    return [replace(CPU_TINY, name="cpu-trl-comparison", num_kept=16, selection="all", score_micro_batch_size=128)]


# ----------------------------------------------------------------------------------------------------
# The TRL side (runs in the child process)


def trl_child(bcfg: GRPOBenchConfig, device_name: str, out_file: Path) -> None:
    """GRPOTrainer on bench/grpo_step.py's models and prompts for warmup + repeats steps: step times, peak memory."""
    import datasets
    import transformers
    from trl import GRPOConfig, GRPOTrainer

    from bench.common import random_prompts
    from model.weights import build_policy, build_reward_model, save_hf

    transformers.logging.set_verbosity_error()
    device = torch.device(device_name)
    N = bcfg.prompts * bcfg.num_samples
    if N % bcfg.micro_batch_size:
        raise ValueError(f"{N} sequences per step not divisible by micro-batch {bcfg.micro_batch_size}")
    work = Path(tempfile.mkdtemp(prefix="bench-trl-"))
    tok = char_tokenizer()
    torch.manual_seed(0)  # as bench/grpo_step.build: the same random weights
    policy = build_policy(bcfg.preset, True)
    reward_model = build_reward_model(bcfg.preset, True)
    for model, folder in ((policy, work / "policy"), (reward_model, work / "reward_model")):
        save_hf(model.state_dict(), model.cfg, folder)
        tok.save_pretrained(folder)
    vocab_size = policy.cfg.vocab_size
    prompt_ids, prompt_mask = random_prompts(bcfg.prompts, bcfg.prompt_len, bcfg.min_prompt_len, vocab_size, seed=0)
    texts = [ids_to_text(ids[mask].tolist()) for ids, mask in zip(prompt_ids, prompt_mask, strict=True)]
    assert [len(tok(t)["input_ids"]) for t in texts] == prompt_mask.sum(1).tolist(), "stand-in tokenizer lost ids"
    steps = bcfg.warmup + bcfg.repeats
    # the same prompts every step, as ours; a fixed fingerprint, since datasets 5.2's hash of a new table fails to
    # pickle pyarrow's MonthDayNano type under Python 3.11 (Dataset.from_dict raises), and nothing here is cached
    table = datasets.table.InMemoryTable.from_pydict({"prompt": texts * steps})
    dataset = datasets.Dataset(table, fingerprint="bench-trl-grpo-prompts")

    args = GRPOConfig(
        output_dir=str(work / "out"),
        max_steps=steps,
        per_device_train_batch_size=bcfg.micro_batch_size,
        gradient_accumulation_steps=N // bcfg.micro_batch_size,
        num_generations=bcfg.num_samples,
        max_completion_length=bcfg.max_new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.04,
        epsilon=0.2,
        num_iterations=1,
        loss_type="grpo",
        scale_rewards="group",
        learning_rate=3e-6,
        bf16=device.type == "cuda" if bcfg.trl_bf16 is None else bcfg.trl_bf16,
        shuffle_dataset=False,
        log_completions=False,
        **trainer_basics(device),
    )
    ends, logged = [], []
    was_reset = [True]

    class Timer(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            common.synchronize(device)
            ends.append(time.perf_counter())
            if len(ends) == bcfg.warmup:  # the peak of the timed steps only
                was_reset[0] = common.reset_peak_memory(device)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs:
                logged.append(dict(logs))

    trainer = GRPOTrainer(
        model=str(work / "policy"),
        reward_funcs=str(work / "reward_model"),
        args=args,
        train_dataset=dataset,
        processing_class=tok,
        reward_processing_classes=tok,
        callbacks=[Timer()],
    )
    common.synchronize(device)
    ends.append(time.perf_counter())  # before the first step (the warm-up step includes the set-up of train())
    trainer.train()
    peak, peak_what = common.peak_memory(device, was_reset[0])
    step_seconds = [b - a for a, b in itertools.pairwise(ends)][bcfg.warmup :]
    lengths = [log["completions/mean_length"] for log in logged if "completions/mean_length" in log]
    out = dict(step_seconds=step_seconds, completion_mean_length=lengths, sequences=N)
    out.update(peak_memory_bytes=peak, peak_memory_what=peak_what)
    out_file.write_text(json.dumps(out | {"trl": version("trl"), "transformers": transformers.__version__}))


# ----------------------------------------------------------------------------------------------------
# The parent side


def run_trl(bcfg: GRPOBenchConfig, device: torch.device, timeout_s: int = 1800) -> list[dict]:
    name = f"{bcfg.name} TRL GRPOTrainer"
    with tempfile.TemporaryDirectory(prefix="bench-trl-") as tmp:
        out_file = Path(tmp) / "trl.json"
        cmd = [sys.executable, "-m", "bench.trl_grpo", "--device", str(device), "--out", str(out_file)]
        cmd += ["--config", json.dumps(dataclasses.asdict(bcfg)), "--threads", str(torch.get_num_threads())]
        env = child_env()
        print(f"[{BENCH}] {name}: {bcfg.warmup} warm-up + {bcfg.repeats} timed steps in a subprocess", flush=True)
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return [skipped(BENCH, name, f"timed out after {timeout_s} s", config=bcfg)]
        if proc.returncode != 0 or not out_file.is_file():  # trl is installed (run() checked): a failure is a bug
            tail = (proc.stdout[-1500:] + proc.stderr[-3000:]).strip()
            print(tail, flush=True)
            last = tail.splitlines()[-1] if tail else "no output"
            raise RuntimeError(f"{name}: python -m bench.trl_grpo failed (exit {proc.returncode}): {last}")
        m = json.loads(out_file.read_text())
    step = statistics.median(m["step_seconds"])
    mean_len = statistics.median(m["completion_mean_length"]) if m["completion_mean_length"] else bcfg.max_new_tokens
    generated = mean_len * m["sequences"]
    print(f"  TRL step {step:.3f} s ({time.perf_counter() - t0:.0f} s with start-up), trl {m['trl']}", flush=True)
    steps = f"median of {len(m['step_seconds'])} steps after {bcfg.warmup} warm-up; trl {m['trl']}, "
    steps += f"transformers {m['transformers']}"
    tokens = f"{m['sequences']:,} sequences x {mean_len:.1f} mean completion tokens per step"
    return [
        result(BENCH, f"{name}: step", step, "s", note=steps, config=bcfg, measurements=m),
        result(BENCH, f"{name}: generated tokens/s per device", generated / step, "tok/s", note=tokens, config=bcfg),
        result(BENCH, f"{name}: peak memory", mib(m["peak_memory_bytes"]), "MiB", m["peak_memory_what"], bcfg),
    ]


def run(device: torch.device, quick: bool, cfgs: list[GRPOBenchConfig] | None = None) -> list[dict]:
    rows = []
    available, why = trl_available()
    for bcfg in cfgs or configs(device, quick):
        ours = bench_config(bcfg, device, bench=BENCH, label="ours")
        rows += ours
        if not available:
            rows.append(skipped(BENCH, f"{bcfg.name} TRL GRPOTrainer", why, config=bcfg))
            continue
        theirs = run_trl(bcfg, device)
        rows += theirs
        if theirs[0]["value"] is not None:
            note = "ratio of medians (the two run one after the other, not interleaved)"
            ratio = theirs[0]["value"] / ours[0]["value"]
            rows.append(result(BENCH, f"{bcfg.name}: TRL step / our step", ratio, "x", note=note, config=bcfg))
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description="Child process of the TRL comparison (see the module docstring).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--device", required=True, help="cpu or cuda")
    parser.add_argument("--config", required=True, help="GRPOBenchConfig as JSON")
    parser.add_argument("--out", required=True, help="JSON file for the measurements")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    trl_child(GRPOBenchConfig(**json.loads(args.config)), args.device, Path(args.out))


if __name__ == "__main__":
    main()
