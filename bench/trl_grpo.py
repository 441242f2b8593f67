"""TRL's GRPOTrainer against our GRPO step on the same configuration, side by side in one run.

TRL has no rejection sampling and trains on every sample, so the comparison configuration uses our selection
"all" (K = G): both sides generate prompts x G responses, score all of them with the same reward model, compute
reference log-probs (beta 0.04) and take one optimizer step over all of them, in micro-batches of the same size.
The same weights on both sides: our randomly initialised policy and reward model (same seed as
bench/grpo_step.py) exported with model.weights.save_hf, which TRL loads with from_pretrained.

TRL works on text. So that its prompts are exactly our token ids, it gets a stand-in tokenizer that maps each
GPT-2 id to one character (id i -> chr(0x20000 + i), "<|endoftext|>" = 50256): text round trips keep every id,
with no tokenizer download. TRL settings: loss_type "grpo", scale_rewards "group", beta 0.04, epsilon 0.2,
one iteration per batch, temperature 1, no top-k/top-p, gradient checkpointing off (TRL's default is on; ours is
off), bf16 mixed precision on GPU (TRL's default: fp32 weights under autocast), fp32 on CPU; generation with
transformers' generate over the whole batch of prompts x G in one call (TRL's path without vLLM), stopping at
<|endoftext|> only (ours also at "\\n"; with random weights either stops in ~0.2% of rows).

A TRL step is the wall-clock time between consecutive optimizer steps (callback on_step_end): generation,
scoring, reference log-probs, forward/backward over the micro-batches and the optimizer step, plus the trainer's
own bookkeeping. It runs in a subprocess (`python -m bench.trl_grpo`) so that the trainer, accelerate and its
memory peak are kept apart from the other benchmarks. When trl, datasets or accelerate is not installed
(importlib.util.find_spec), the table says so; when they are, a TRL run that fails fails the benchmark.
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
    """The comparison configuration: our step's, with selection "all" (K = G). TRL generates a whole step's prompts x
    G in one generate call, so on the GPU it is 16 prompts x 64 samples (a 1,024-row KV cache), not the 256 prompts of
    the reference step. On the CPU, REFERENCE.md's figure for TRL: 128 samples of 16 tokens on a 2-layer, 64-wide
    GPT-2."""
    if device.type == "cuda":
        name, prompts, repeats = ("gpu-trl-comparison-quick", 4, 2) if quick else ("gpu-trl-comparison", 16, 3)
        return [replace(GPU_REFERENCE, name=name, prompts=prompts, num_kept=64, selection="all", repeats=repeats)]
    if quick:
        return [replace(CPU_TINY_QUICK, name="cpu-trl-comparison-quick", num_kept=8, selection="all")]
    return [replace(CPU_TINY, name="cpu-trl-comparison", num_kept=16, selection="all", score_micro_batch_size=128)]


# ----------------------------------------------------------------------------------------------------
# The TRL side (runs in the child process)


def trl_child(bcfg: GRPOBenchConfig, device_name: str, out_file: Path) -> None:
    """Build the same models and prompts as bench/grpo_step.py, run GRPOTrainer for warmup + repeats optimizer
    steps, write step times and peak memory as JSON."""
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
    prompt_ids, prompt_mask = random_prompts(
        bcfg.prompts, bcfg.prompt_len, bcfg.min_prompt_len, policy.cfg.vocab_size, seed=0
    )
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
    out_file.write_text(
        json.dumps(
            {
                "step_seconds": step_seconds,
                "completion_mean_length": lengths,
                "sequences": N,
                "peak_memory_bytes": peak,
                "peak_memory_what": peak_what,
                "trl": version("trl"),
                "transformers": transformers.__version__,
            }
        )
    )


# ----------------------------------------------------------------------------------------------------
# The parent side


def run_trl(bcfg: GRPOBenchConfig, device: torch.device, timeout_s: int = 1800) -> list[dict]:
    name = f"{bcfg.name} TRL GRPOTrainer"
    with tempfile.TemporaryDirectory(prefix="bench-trl-") as tmp:
        out_file = Path(tmp) / "trl.json"
        cmd = [
            sys.executable,
            "-m",
            "bench.trl_grpo",
            "--device",
            str(device),
            "--config",
            json.dumps(dataclasses.asdict(bcfg)),
            "--out",
            str(out_file),
            "--threads",
            str(torch.get_num_threads()),
        ]
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
    return [
        result(
            BENCH,
            f"{name}: step",
            step,
            "s",
            note=f"median of {len(m['step_seconds'])} steps after {bcfg.warmup} warm-up; trl {m['trl']}, "
            f"transformers {m['transformers']}",
            config=bcfg,
            measurements=m,
        ),
        result(
            BENCH,
            f"{name}: generated tokens/s per device",
            generated / step,
            "tok/s",
            note=f"{m['sequences']:,} sequences x {mean_len:.1f} mean completion tokens per step",
            config=bcfg,
        ),
        result(
            BENCH, f"{name}: peak memory", mib(m["peak_memory_bytes"]), "MiB", note=m["peak_memory_what"], config=bcfg
        ),
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
            rows.append(
                result(
                    BENCH,
                    f"{bcfg.name}: TRL step / our step",
                    theirs[0]["value"] / ours[0]["value"],
                    "x",
                    note="ratio of medians (the two run one after the other, not interleaved)",
                    config=bcfg,
                )
            )
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
