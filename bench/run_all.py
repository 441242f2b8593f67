"""Every benchmark in one command; prints a table at the end and writes the figures as JSON.

    python -m bench.run_all                          # the device present (cuda if available, else cpu)
    python -m bench.run_all --quick                  # smaller configurations: a smoke test
    python -m bench.run_all --device cpu --out runs/bench/cpu.json
    python -m bench.run_all --only sampler grpo      # a subset
    python -m bench.run_all --data DIR               # the real TL;DR rows from DIR (default ../shared/data)
    bash bench/gpu_all.sh OUT_DIR                    # on a GPU machine: GPU tests + this, logs in OUT_DIR

Benchmarks (one module each, docs/benchmarks.md explains every figure):
    sampler  bench/sampler.py    our sampler vs transformers generate(num_return_sequences=G), same weights
    train    bench/train.py      SFT, reward-model and DPO optimizer steps: tokens/s, TFLOP/s, MFU on GPU
    grpo     bench/grpo_step.py  one GRPO step: time and share per stage, tokens/s, peak memory
    trl      bench/trl_grpo.py   TRL's GRPOTrainer vs our step on the same configuration (or why it was not run)
    prefix_sharing  bench/prefix_sharing.py  GRPO step on --data's TL;DR prompts, prefix sharing on vs off, per stage
    compile  bench/compiled.py   --compile vs eager on a GRPO step, compile time apart (named only)
    trl_stages  bench/trl_stages.py  TRL's SFT, Reward and DPO trainers vs our steps, same weights and rows (named only)
    train_profile  bench/train.py    torch.profiler over SFT / reward-model / DPO steps: kernels, launches (named only)
    memory_fit  bench/grpo_step.py   the largest GPT-2 whose GRPO step 64 -> 8 fits 24 GiB of GPU (named only)

Every timed figure is the median of repeats after warm-up. A figure not measured is listed with the reason; a
benchmark that fails is listed with its error and the others still run (exit status 1). docs/benchmarks.md: the JSON.
"""

import argparse
import importlib
import json
import sys
import time
import traceback
from pathlib import Path

import torch

from bench import common
from utils.host import cpu_memory_settings

BENCHMARKS = ("sampler", "train", "grpo", "lora", "trl", "prefix_sharing")
# run only when --only names them: compile and the memory search take minutes and are GPU checks (bench/gpu_all.sh),
# as is the profile; trl_stages takes minutes of CPU and needs trl
NAMED_ONLY = ("compile", "trl_stages", "train_profile", "memory_fit")
RUNS = {  # benchmark -> (module of bench/, its function of (device, quick))
    "sampler": ("sampler", "run"),
    "train": ("train", "run"),
    "grpo": ("grpo_step", "run"),
    "lora": ("lora_memory", "run"),
    "trl": ("trl_grpo", "run"),
    "prefix_sharing": ("prefix_sharing", "run"),
    "compile": ("compiled", "run"),
    "trl_stages": ("trl_stages", "run"),
    "train_profile": ("train", "profile"),
    "memory_fit": ("grpo_step", "memory_fit"),
}
READS_DATA = ("prefix_sharing", "trl_stages")  # take data=the folder of the real TL;DR rows (--data)
DATA = common.ROOT.parent / "shared" / "data"


def run_benchmark(name: str, device: torch.device, quick: bool, data: Path = DATA) -> list[dict]:
    module, function = RUNS[name]
    run = getattr(importlib.import_module(f"bench.{module}"), function)
    return run(device, quick, data=data) if name in READS_DATA else run(device, quick)


def write_results(path: Path, env: dict, args: dict, rows: list[dict], errors: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"environment": env, "args": args, "results": rows, "errors": errors}
    # allow_nan=False: a NaN or infinity is a bug to see here, not a token that breaks JSON readers later
    path.write_text(json.dumps(doc, indent=2, allow_nan=False, default=str))


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and each option's default."""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter, epilog=__doc__
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="where to measure (cuda when available)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="smaller configurations (a smoke test): under ~2 minutes on a 2-core CPU"
    )
    parser.add_argument("--out", default=None, help="JSON file; None: runs/bench/results-{device}[-quick].json")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=BENCHMARKS + NAMED_ONLY,
        default=list(BENCHMARKS),
        help=f"run only these ({', '.join(NAMED_ONLY)}: only when named)",
    )
    parser.add_argument(
        "--data",
        type=Path,
        default=DATA,
        help="folder of the real TL;DR rows (tldr-validation-sample.jsonl, tldr-preference-validation-sample.jsonl): "
        "without them prefix_sharing is not measured and trl_stages times random rows",
    )
    parser.add_argument(
        "--threads",
        default="auto",
        help="torch CPU threads: a number, 0 for torch's default (every core), or auto: "
        "the cores other processes leave idle, measured over 2 s at start -- on a shared machine "
        "more threads than idle cores makes every figure several times slower and noisy",
    )
    parser.add_argument(
        "--wait_quiet",
        type=float,
        default=0.0,
        help="CPU: before every timed call wait up to this many seconds for other processes to go "
        "idle (a shared machine); the cores they used during each call are recorded either way",
    )
    args = parser.parse_args(argv)

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch.cuda.is_available() is False")
    threads_why = "GPU run"
    if args.device == "cpu":
        threads, threads_why = common.choose_threads(args.threads)
        torch.set_num_threads(threads)
        print(f"torch threads: {threads} ({threads_why})", flush=True)
    common.QUIET_WAIT_S = args.wait_quiet
    out = Path(args.out or f"runs/bench/results-{args.device}{'-quick' if args.quick else ''}.json")
    device = torch.device(args.device)
    env = common.environment(device)
    env["torch_threads_choice"] = threads_why
    if args.device == "cpu":  # as every stage's CPU run does (utils/host.py), before any benchmark
        env.update(cpu_memory_settings())
    env["command"] = " ".join(
        [Path(sys.executable).name, "-m", "bench.run_all", *(argv if argv is not None else sys.argv[1:])]
    )
    print("environment: " + ", ".join(f"{k}={v}" for k, v in env.items()), flush=True)

    if set(args.only) & set(READS_DATA) and not args.data.is_dir():
        print(f"--data {args.data}: no such folder (the real TL;DR rows): prefix_sharing is not measured", flush=True)
    rows, errors = [], []
    t_start = time.perf_counter()
    for name in args.only:
        t0 = time.perf_counter()
        try:
            rows += run_benchmark(name, device, args.quick, args.data)
        except Exception as e:  # one broken benchmark must not hide the others' figures
            traceback.print_exc()
            errors.append(f"{name}: {type(e).__name__}: {e}")
            rows.append(common.result(name, f"{name} (failed)", None, "", note=f"error: {type(e).__name__}: {e}"))
        print(f"[{name}] {time.perf_counter() - t0:.1f} s", flush=True)
    env["load_average_at_end"] = common.load_average()
    env["total_seconds"] = round(time.perf_counter() - t_start, 1)

    from utils.dist import cleanup_distributed

    cleanup_distributed()
    write_results(out, env, vars(args), rows, errors)
    print()
    print(
        f"{env['device_name']} ({env['device']}, {env['torch_threads']} threads), torch {env['torch']}, "
        f"transformers {env['transformers']}, {env['date']}, commit {env['git_commit']}"
        f"{' (dirty)' if env['git_dirty'] else ''}, load average {env['load_average_at_start']} -> "
        f"{env['load_average_at_end']}"
    )
    print(common.format_table(rows))
    if errors:
        print("\nfailed: " + "; ".join(errors))
    print(f"\nwrote {out} ({env['total_seconds']} s)")
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
