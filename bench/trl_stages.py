"""TRL's SFTTrainer, RewardTrainer and DPOTrainer against our SFT, reward-model and DPO optimizer steps on the same
weights and rows, interleaved step by step (`python -m bench.run_all --device cpu --only trl_stages [--data DIR]`).

Method, the interleaving (TRL in a child process, `--child SPEC`, waiting in on_step_end for the parent's "go"),
settings and what differs: docs/benchmarks.md, "trl_stages". Rows: the caller's data folder (run_all --data), else
random ids of the same lengths. CPU only; without trl, datasets or accelerate a row says why TRL's were not measured.
"""

import argparse
import dataclasses
import json
import os
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench import common
from bench.common import ROOT, Timing, measure_interleaved, median_ratio, result, skipped
from bench.train import (
    TrainConfig,
    dpo_step,
    pair_micro_batches,
    random_pairs,
    random_rows,
    reward_model_step,
    sft_micro_batches,
    sft_step,
)
from bench.trl_common import char_tokenizer, child_env, ids_to_text, trainer_basics, trl_available, version
from data.tldr import PREF_COLUMNS, SFT_COLUMNS, PreferenceDataset, SFTDataset, load_rows
from data.tokenizer import END_ID, get_tokenizer
from model.gpt2 import PRESETS, GPT2LMHeadModel
from model.heads import RewardModel
from model.weights import save_hf
from utils.dist import setup_distributed

BENCH = "trl_stages"
SFT_FILE, PAIRS_FILE = "tldr-validation-sample.jsonl", "tldr-preference-validation-sample.jsonl"  # in run_all --data
STAGES = ("sft", "reward_model", "dpo")
TRAINERS = {"sft": "SFTTrainer", "reward_model": "RewardTrainer", "dpo": "DPOTrainer"}
DPO_BETA = 0.1
LEARNING_RATE = 1e-5  # bench/train.py's optimizer


def configs(quick: bool) -> list[TrainConfig]:
    """prompt_len / response_len: where real rows are cut (data.tldr) and the longest synthetic row; the minimums shape
    synthetic rows only (the first TL;DR prompts: 194-448 tokens after the cut at 448, summaries 25-48)."""
    if quick:
        return [TrainConfig("cpu-tiny-tldr-quick", "tiny", 4, 2, 128, 128, 32, 24, warmup=1, repeats=2)]
    # tiny holds 512 positions: 448 + 48 fit; gpt2 on 2 CPU cores: a short step (every real prompt here exceeds 192)
    return [
        TrainConfig("cpu-tiny-tldr", "tiny", 8, 4, 448, 192, 48, 24, warmup=1, repeats=3),
        TrainConfig("cpu-gpt2-tldr", "gpt2", 4, 2, 192, 192, 48, 24, warmup=1, repeats=3),
    ]


# ----------------------------------------------------------------------------------------------------
# Rows and weights (the parent's, shared by both sides)


def stage_rows(
    cfg: TrainConfig, stage: str, vocab_size: int, data: Path | None
) -> tuple[dict[str, list[list[int]]], str]:
    """The step's rows as token ids ({"prompts", "responses"} for SFT, {"prompts", "chosen", "rejected"} for the
    pair stages) from the TL;DR files in `data`, or random ones when they are not there, and which they are."""
    pairs = stage != "sft"
    file = Path(data or "") / (PAIRS_FILE if pairs else SFT_FILE)
    if data is None or not file.is_file():
        missing = f"{file} not found" if data else "no data folder"
        why = f"synthetic rows ({missing}), lengths {cfg.min_prompt_len}-{cfg.prompt_len} + "
        why += f"{cfg.min_response_len}-{cfg.response_len}"
        if pairs:
            prompts, chosen, rejected = random_pairs(cfg.batch_rows, cfg, vocab_size, 0)
            return {"prompts": prompts, "chosen": chosen, "rejected": rejected}, why
        prompts, responses = random_rows(cfg.batch_rows, cfg, vocab_size, 0)
        return {"prompts": prompts, "responses": responses}, why
    rows = load_rows(str(file), "validation", PREF_COLUMNS if pairs else SFT_COLUMNS)[: cfg.batch_rows]
    if len(rows) < cfg.batch_rows:
        raise ValueError(f"{file}: {len(rows)} rows, a step of {cfg.name} takes {cfg.batch_rows}")
    tok, name = get_tokenizer(), file.name
    if pairs:
        ds = PreferenceDataset(rows, tok, cfg.prompt_len, cfg.response_len, name=name)
        ids = {"prompts": ds.prompts, "chosen": ds.chosen, "rejected": ds.rejected}
    else:
        ds = SFTDataset(rows, tok, cfg.prompt_len, cfg.response_len, name=name)
        ids = {"prompts": ds.prompts, "responses": ds.responses}
    lengths = ", ".join(f"{k} {min(map(len, v))}-{max(map(len, v))}" for k, v in ids.items())
    return ids, f"TL;DR rows: the first {cfg.batch_rows} of {name}, {lengths}"


def seeded_model(stage: str, preset: str) -> torch.nn.Module:
    """bench/train.py's randomly initialised model for the stage (seed 0)."""
    torch.manual_seed(0)
    return RewardModel(PRESETS[preset]) if stage == "reward_model" else GPT2LMHeadModel(PRESETS[preset])


def our_steps(
    stage: str, cfg: TrainConfig, rows: dict, device: torch.device, world: int
) -> dict[str, Callable[[], object]]:
    """Our step(s) for the stage, each on its own copy of the seed-0 weights: SFT one; the pair stages with
    prefix sharing (the scripts' default) and without (TRL's layout)."""
    if stage == "sft":
        model = seeded_model(stage, cfg.preset)
        micro = sft_micro_batches(cfg, model.cfg.vocab_size, rows=(rows["prompts"], rows["responses"]))
        return {"ours": sft_step(model, micro, world, device)}
    steps = {}
    for label, sharing in (("ours", True), ("ours, prefix sharing off", False)):
        model = seeded_model(stage, cfg.preset)
        pair_rows = (rows["prompts"], rows["chosen"], rows["rejected"])
        micro = pair_micro_batches(cfg, model.cfg.vocab_size, rows=pair_rows)
        if stage == "reward_model":
            steps[label] = reward_model_step(model, micro, world, cfg.batch_rows, device, prefix_sharing=sharing)
        else:
            steps[label] = dpo_step(model, micro, world, cfg.batch_rows, device, DPO_BETA, prefix_sharing=sharing)
    return steps


def first_loss(out) -> float:
    """The loss an accumulate_gradients step returned (SFT: a float; the pair stages: a metrics dict)."""
    return float(out["train/loss"] if isinstance(out, dict) else out)


# ----------------------------------------------------------------------------------------------------
# The TRL side (runs in the child process)


def trl_dataset(stage: str, rows: dict, steps: int, fingerprint: str):
    """A datasets.Dataset of the rows as stand-in text, repeated once per step (every step trains on the same
    rows); built from a table with a fixed fingerprint, as bench/trl_grpo.py does (datasets 5.2's
    Dataset.from_dict fails to hash pyarrow's MonthDayNano type under Python 3.11; nothing here is cached)."""
    import datasets

    columns = {"prompt": [ids_to_text(p) for p in rows["prompts"]]}
    if stage == "sft":
        columns["completion"] = [ids_to_text(r) for r in rows["responses"]]
    else:
        columns["chosen"] = [ids_to_text(r) for r in rows["chosen"]]
        columns["rejected"] = [ids_to_text(r) for r in rows["rejected"]]
    table = datasets.table.InMemoryTable.from_pydict({k: v * steps for k, v in columns.items()})
    return datasets.Dataset(table, fingerprint=fingerprint)


def check_tokenized(stage: str, dataset, rows: dict) -> None:
    """TRL's tokenized rows are exactly our prompt + response ids (nothing appended, nothing merged)."""
    n = len(rows["prompts"])
    for i in range(n):
        row, prompt = dataset[i], rows["prompts"][i]
        if stage == "sft":
            want = {"input_ids": prompt + rows["responses"][i]}
        elif stage == "reward_model":
            want = {"chosen_ids": prompt + rows["chosen"][i], "rejected_ids": prompt + rows["rejected"][i]}
        else:
            want = {"prompt_ids": prompt, "chosen_ids": rows["chosen"][i], "rejected_ids": rows["rejected"][i]}
        for key, ids in want.items():
            got = list(row[key])
            if stage == "dpo" and key != "prompt_ids" and got[: len(prompt)] == prompt and len(got) > len(ids):
                got = got[len(prompt) :]  # a trl that stores prompt + completion
            if got != ids:
                raise RuntimeError(f"TRL {TRAINERS[stage]} row {i} {key}: {len(got)} ids, not our {len(ids)}")


def trl_trainer(stage: str, cfg: TrainConfig, rows: dict, model_dir: str, work: Path, device: torch.device, callback):
    """The TRL trainer for the stage, with our step's settings (docs/benchmarks.md, "trl_stages")."""
    import trl

    steps = cfg.warmup + cfg.repeats
    tok = char_tokenizer(eos_id=END_ID)
    common_args = dict(
        output_dir=str(work / "out"),
        max_steps=steps,
        per_device_train_batch_size=cfg.micro_rows,
        gradient_accumulation_steps=cfg.batch_rows // cfg.micro_rows,
        train_sampling_strategy="sequential",
        optim="adamw_torch_fused",  # torch.optim.AdamW(fused=True), as utils.optim.build_optimizer
        adam_beta1=0.9,
        adam_beta2=0.95,
        adam_epsilon=1e-8,
        learning_rate=LEARNING_RATE,
        lr_scheduler_type="constant",
        bf16=False,
        max_length=None,
        model_init_kwargs={"dtype": "float32"},
        **trainer_basics(device),
    )
    dataset = trl_dataset(stage, rows, steps, f"bench-trl-stages-{stage}")
    if stage == "sft":
        args = trl.SFTConfig(**common_args, completion_only_loss=True, packing=False, loss_type="nll")
        trainer = trl.SFTTrainer(model_dir, args=args, train_dataset=dataset, processing_class=tok)
    elif stage == "reward_model":
        args = trl.RewardConfig(**common_args, center_rewards_coefficient=None, disable_dropout=True)
        trainer = trl.RewardTrainer(model_dir, args=args, train_dataset=dataset, processing_class=tok)
    else:
        dpo_args = dict(loss_type=["sigmoid"], beta=DPO_BETA, label_smoothing=0.0, precompute_ref_log_probs=False)
        args = trl.DPOConfig(**common_args, **dpo_args, disable_dropout=True)
        trainer = trl.DPOTrainer(model_dir, args=args, train_dataset=dataset, processing_class=tok)
    check_tokenized(stage, trainer.train_dataset, rows)
    trainer.add_callback(callback)
    return trainer


def trl_child(spec_file: Path) -> None:
    """Build the TRL trainer of the spec, say "ready", then run one optimizer step per "go" read from stdin,
    answering each with its seconds; protocol lines go to the original stdout, everything printed to stderr."""
    import transformers

    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # the trainer's own prints must not interleave with the protocol

    def send(message: dict) -> None:
        protocol.write(json.dumps(message) + "\n")

    def wait_go() -> None:
        if sys.stdin.readline().strip() != "go":
            raise SystemExit("parent closed the pipe")

    spec = json.loads(spec_file.read_text())
    cfg, stage = TrainConfig(**spec["config"]), spec["stage"]
    device = torch.device(spec["device"])
    if spec["threads"] > 0:
        torch.set_num_threads(spec["threads"])
    transformers.logging.set_verbosity_error()
    steps, started, losses = cfg.warmup + cfg.repeats, [0.0, 0.0], []

    def start_clocks() -> None:
        started[:] = [time.perf_counter(), time.process_time()]

    class Pause(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            common.synchronize(device)
            seconds, cpu = time.perf_counter() - started[0], time.process_time() - started[1]
            send({"step": state.global_step, "seconds": seconds, "cpu_seconds": cpu})
            if state.global_step < steps:
                wait_go()
                start_clocks()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    trainer = trl_trainer(stage, cfg, spec["rows"], spec["model_dir"], Path(spec["work"]), device, Pause())
    send({"ready": True})
    wait_go()
    start_clocks()
    trainer.train()
    send({"done": True, "losses": losses, "trl": version("trl"), "transformers": transformers.__version__})


# ----------------------------------------------------------------------------------------------------
# The parent side


class TRLChild:
    """A TRL trainer in a child process, stepped one optimizer step at a time (see trl_child)."""

    def __init__(self, spec: dict, work: Path, timeout_s: float):
        self.timeout_s, self.name = timeout_s, f"TRL {TRAINERS[spec['stage']]}"
        spec_file = work / "spec.json"
        spec_file.write_text(json.dumps(spec))
        self.log = (work / "child.log").open("w+")
        cmd = [sys.executable, "-m", "bench.trl_stages", "--child", str(spec_file)]
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=child_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True
        )
        self.child_seconds: list[float] = []
        self.child_cpu_seconds: list[float] = []

    def message(self) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.proc.kill()
            self.proc.wait()
            self.log.seek(0)
            tail = self.log.read()[-3000:].strip()
            print(tail, flush=True)
            what = "no answer in {:.0f} s".format(self.timeout_s) if not ready else f"exit {self.proc.returncode}"
            last = tail.splitlines()[-1] if tail else "no output"
            raise RuntimeError(f"{self.name}: python -m bench.trl_stages --child failed ({what}): {last}")
        return json.loads(line)

    def step(self) -> float:
        """One optimizer step; returns the child's own seconds for it."""
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        m = self.message()
        self.child_seconds.append(m["seconds"])
        self.child_cpu_seconds.append(m["cpu_seconds"])
        return m["seconds"]

    def own_cpu(self, timing: Timing) -> None:
        """The timed steps' CPU time is the child's, not the parent's: count it as TRL's own, not as another
        process's load (measure_interleaved saw only the parent, which waited)."""
        cpu = self.child_cpu_seconds[-len(timing.times) :]
        if timing.others_cores:  # empty without /proc/stat
            others = zip(timing.others_cores, cpu, timing.times, strict=True)
            timing.others_cores = [max(0.0, o - c / t) for o, c, t in others]
        timing.cpu_times = cpu

    def close(self) -> dict:
        """The child's last message (losses, versions) after its final step."""
        done = self.message()
        self.proc.wait(timeout=self.timeout_s)
        self.log.close()
        return done

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def bench_stage(
    stage: str, cfg: TrainConfig, device: torch.device, world: int, trl_missing: str | None, timeout_s: float, data
) -> list[dict]:
    """Our step(s) and TRL's (unless `trl_missing` says why not) of `stage`, interleaved, and the ratios."""
    name = f"{cfg.name} {stage.replace('_', ' ')}"
    rows, where = stage_rows(cfg, stage, PRESETS[cfg.preset].vocab_size, data)
    print(f"[{BENCH}] {name}: {where}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-trl-stages-") as tmp:
        work = Path(tmp)
        child = None
        if trl_missing is None:
            exported = seeded_model(stage, cfg.preset)  # the weights every side starts from
            save_hf(exported.state_dict(), exported.cfg, work / "model")
            spec = dict(stage=stage, config=dataclasses.asdict(cfg), rows=rows, model_dir=str(work / "model"))
            spec.update(work=str(work), device=str(device), threads=torch.get_num_threads())
            child = TRLChild(spec, work, timeout_s)
        try:
            sides = our_steps(stage, cfg, rows, device, world)
            if child is not None:
                t0 = time.perf_counter()
                child.message()  # "ready": nothing is timed while the child starts
                print(f"  TRL {TRAINERS[stage]} ready after {time.perf_counter() - t0:.0f} s", flush=True)
            losses = {label: first_loss(fn()) for label, fn in sides.items()}  # the first step: untimed warm-up
            for _ in range(cfg.warmup - 1):
                for fn in sides.values():
                    fn()
            if child is not None:
                sides["TRL"] = child.step
                for _ in range(cfg.warmup):
                    child.step()
            timings = measure_interleaved(sides, device, repeats=cfg.repeats)
            done = None
            if child is not None:
                child.own_cpu(timings["TRL"])
                done = child.close()
        except BaseException:
            if child is not None:
                child.kill()
            raise
    out = []
    for label, t in timings.items():
        trainer = f" {TRAINERS[stage]}" if label == "TRL" else ""
        note = f"median of {len(t.times)} interleaved steps after {cfg.warmup} warm-up; {where}{t.interference}"
        details = {"timing": t.to_dict()}
        if label == "TRL":
            note += f"; trl {done['trl']}, transformers {done['transformers']}"
            details.update(child_seconds=child.child_seconds, losses=done["losses"], trl=done["trl"])
        else:
            details["first_step_loss"] = losses[label]
        out.append(result(BENCH, f"{name}: {label}{trainer} step", t.median, "s", note=note, config=cfg, **details))
    if child is None:
        out.append(skipped(BENCH, f"{name}: TRL {TRAINERS[stage]} step", trl_missing, config=cfg))
        return out
    trl_loss = done["losses"][0] if done["losses"] else None
    for label in (k for k in timings if k != "TRL"):
        theirs = "not logged" if trl_loss is None else f"{trl_loss:.6f}"
        note = f"median of per-repeat ratios (interleaved); first-step loss ours {losses[label]:.6f}, TRL {theirs}"
        ratio = median_ratio(timings[label], timings["TRL"])
        losses_ = dict(first_step_loss_ours=losses[label], first_step_loss_trl=trl_loss)
        out.append(result(BENCH, f"{name}: TRL step / {label} step", ratio, "x", note=note, config=cfg, **losses_))
    for r in out:
        if r["value"] is not None:
            print(f"  {r['name']}: {r['value']:.3f} {r['unit']}", flush=True)
    return out


def run(device: torch.device, quick: bool, data: Path | None = None, timeout_s: float = 1800) -> list[dict]:
    """`data`: the folder of the TL;DR files (random rows without it); `timeout_s`: a TRL child's, per message."""
    if device.type != "cpu":
        return [skipped(BENCH, "TRL stages", "a CPU benchmark (fp32 on both sides): run it with --device cpu")]
    world = setup_distributed(device.type).world_size  # a one-process group, as bench/train.py
    available, why = trl_available("TRL step")
    rows = []
    for cfg in configs(quick):
        rows_per_step = f"{cfg.batch_rows} rows/pairs per step in micro-batches of {cfg.micro_rows}"
        steps = f"{cfg.warmup} warm-up + {cfg.repeats} interleaved steps per side"
        print(f"[{BENCH}] {cfg.name}: {cfg.preset}, {rows_per_step}; {steps}", flush=True)
        for stage in STAGES:
            rows += bench_stage(stage, cfg, device, world, None if available else why, timeout_s, data)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description="Child process of the TRL stage comparison (see the module docstring); "
        "python -m bench.run_all --only trl_stages runs the benchmark.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--child", required=True, help="JSON spec written by the parent (stage, rows, weights)")
    args = parser.parse_args(argv)
    trl_child(Path(args.child))


if __name__ == "__main__":
    main()
