"""What the TensorBoard writer (--tensorboard, utils/logging.py TensorBoardFile) costs a GRPO step, at the TRL
side-by-side configuration (bench/trl_grpo.py's cpu-trl-comparison: the tiny GPT-2 with the full vocabulary, 8 prompts
x 16 samples x 16 new tokens, grpo.train_step as bench/grpo_step.py runs it).

    python -m bench.tensorboard_cost --steps 20 --threads 2

Every step's metrics are built as grpo.main() builds them (rollouts.metrics.step_metrics, utils.logging.perf_metrics)
and logged by two Loggers in folders of their own, one writing metrics.jsonl and TensorBoard event files, one writing
metrics.jsonl alone, in alternating order (interleaved: the machine's load falls on both alike), each row followed by
the step's sample table (grpo.py writes one every --table_every steps; here every step, timed apart). The writer's
cost is the difference of the two Loggers' times, per row and per table; a row's is set against the step's own time.
Medians over the timed steps after --warmup untimed ones, with the range.
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

import grpo
from bench import grpo_step, trl_grpo
from data.tokenizer import get_tokenizer
from evaluation.summaries import sample_table
from rollouts.metrics import step_metrics
from rollouts.sampling import RewardSpec
from utils.config import config_to_dict
from utils.logging import Logger, perf_metrics
from utils.metrics import headlines


def spread(values: list[float], scale: float, unit: str) -> str:
    """median (min-max) of `values` x `scale`, in `unit`."""
    v = [x * scale for x in values]
    return f"{statistics.median(v):.3g} {unit} ({min(v):.3g}-{max(v):.3g})"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    (bcfg,) = trl_grpo.configs(device, quick=False)
    s = grpo_step.build(bcfg, device)
    spec = RewardSpec(s.spec.sources, s.cfg.normalize_reward_fns, get_tokenizer())  # the table decodes the text
    seconds: dict[str, list[float]] = {"step": []}
    with tempfile.TemporaryDirectory() as tmp:
        loggers = {
            name: Logger(
                Path(tmp) / name,
                config_to_dict(s.cfg),
                "bench",
                name,
                "disabled",
                True,
                resume_step=0,
                tensorboard=name == "with",
                hparam_metrics=headlines("grpo"),
            )
            for name in ("with", "without")
        }
        for step in range(1, args.warmup + args.steps + 1):
            t0 = time.perf_counter()
            result = grpo.train_step(s.models, s.optimizer, s.scheduler, s.prompts, spec, s.cfg, step)
            metrics = step_metrics(result, spec, s.cfg, per_row_sources=False)
            generated, step_seconds = metrics.pop("perf/generated_tokens"), time.perf_counter() - t0
            metrics.update(perf_metrics(result.seconds, step_seconds, generated, s.world))
            table = sample_table(spec, s.prompts, result, s.cfg.table_prompts)
            for name in ("with", "without") if step % 2 else ("without", "with"):
                t0 = time.perf_counter()
                loggers[name].log(metrics, step)
                t1 = time.perf_counter()
                loggers[name].table("samples", *table, step)
                if step > args.warmup:
                    seconds.setdefault(f"row {name}", []).append(t1 - t0)
                    seconds.setdefault(f"table {name}", []).append(time.perf_counter() - t1)
            if step > args.warmup:
                seconds["step"].append(step_seconds)
        events = sum(f.stat().st_size for f in (Path(tmp) / "with").glob("events.out.tfevents.*"))
        for logger in loggers.values():
            logger.finish()

    def cost(what: str) -> list[float]:
        return [a - b for a, b in zip(seconds[f"{what} with"], seconds[f"{what} without"], strict=True)]

    row_share = [c / t for c, t in zip(cost("row"), seconds["step"], strict=True)]
    print(f"{bcfg.name}: {len(metrics)} metrics a row, a table of {len(table[1])} samples, {args.threads} threads")
    print(f"  step (train_step and its metrics): {spread(seconds['step'], 1, 's')}")
    for what in ("row", "table"):
        print(f"  {what} with TensorBoard:   {spread(seconds[what + ' with'], 1e3, 'ms')}")
        print(f"  {what} without:            {spread(seconds[what + ' without'], 1e3, 'ms')}")
    print(f"  the writer, per row:   {spread(cost('row'), 1e3, 'ms')} = {spread(row_share, 100, '%')} of the step")
    print(f"  the writer, per table: {spread(cost('table'), 1e3, 'ms')} (grpo.py: one every --table_every steps)")
    print(f"  event file: {events / (args.warmup + args.steps) / 1024:.1f} KiB a step (a row and a table)")
    return seconds


if __name__ == "__main__":
    main()
