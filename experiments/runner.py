"""One runner for every experiment: an experiment is a list of `ExperimentRun`s (a script with its options, run as a
user would run it, or a step in this process), run in order."""

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class ExperimentRun:
    """One run of an experiment: `script` with `options` (--name value each; a subprocess, under torchrun with more
    than one process) or `call` in this process. `name` says what it makes (and is the method's name in a grid's
    table); `done` is what exists once it has run, which `run_all(..., reuse=True)` keeps instead of running it."""

    name: str
    script: str = ""
    options: dict = field(default_factory=dict)
    call: Callable[[], object] | None = None
    done: Path | None = None

    @property
    def out_dir(self) -> Path:
        return Path(self.options["out_dir"])


def run_all(
    runs: list[ExperimentRun],
    nproc: int,
    reuse: bool = False,
    after: Callable[[ExperimentRun], object] | None = None,
    keep_finished: bool = False,
) -> None:
    """Each run in order, then `after(run)`. With `reuse`, a run whose `done` exists is kept, until the first run that
    is not: every run after one that was redone is redone too (a pipeline: each stage reads the one before). With
    `keep_finished` (a grid of independent runs), a script run that finished with exactly these options (its
    FINISHED record) is kept and `after(run)` still called on it, whatever came before it."""
    for run in runs:
        reuse = reuse and run.done is not None and found(run.name, run.done)
        if reuse:
            continue
        if keep_finished and finished(run):
            print(f"reusing {run.name}: {run.out_dir} (finished with these options)", flush=True)
        elif run.call is not None:
            run.call()
        else:
            run_script(run.script, run.options, nproc)
        if after is not None:
            after(run)


FINISHED = "experiment_run.json"
"""What run_script writes in a run's out_dir once its script has exited 0: the script and its options."""


NOT_RESULTS = ("wandb_mode", "run_name", "wandb_group", "wandb_tags", "out_dir")
"""Options that change where a run is logged or kept, not what it computes: a run that finished with other values of
them is still the same run (a verdict run with --wandb_mode disabled is kept by one started with the default, auto; a
run whose arm was renamed, its folder moved to the new name, is kept under it)."""


def finished(run: ExperimentRun) -> bool:
    """Whether `run` (a script run) finished with its script and options (its FINISHED record), NOT_RESULTS aside."""
    if not run.script:
        return False
    try:
        record = json.loads((run.out_dir / FINISHED).read_text())
    except (OSError, ValueError):
        return False

    def results(rec: dict) -> dict:
        return {**rec, "options": {k: v for k, v in rec.get("options", {}).items() if k not in NOT_RESULTS}}

    return results(record) == results(finished_record(run.script, run.options))


def finished_record(script: str, options: dict) -> dict:
    return {"script": script, "options": {k: str(v) for k, v in options.items()}}


def found(what: str, path: Path) -> bool:
    """Whether `path` exists; says that it is reused when it does."""
    if path.exists():
        print(f"reusing {what}: {path}", flush=True)
    return path.exists()


def run_script(script: str, options: dict, nproc: int) -> None:
    """`python script --k v ...` (torchrun with `nproc` > 1) from the repository's root, after emptying its out_dir:
    every run of an experiment starts from scratch (the scripts refuse --resume false on top of existing checkpoints,
    which they would overwrite). OMP_NUM_THREADS: the caller's, else the cores shared among the processes."""
    shutil.rmtree(options["out_dir"], ignore_errors=True)
    cmd = (
        [sys.executable, script]
        if nproc == 1
        else [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", script]
    )
    for k, v in options.items():
        cmd += [f"--{k}", str(v)]
    print("\n$ " + " ".join(cmd[1:] if nproc == 1 else ["torchrun", *cmd[3:]]), flush=True)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // nproc))),
    }
    launch(cmd, env)
    (Path(options["out_dir"]) / FINISHED).write_text(json.dumps(finished_record(script, options), indent=1) + "\n")


def launch(cmd: list[str], env: dict) -> None:
    """Run `cmd` from the repository's root and wait for it; CalledProcessError when it exits with another code than 0.
    (tests/test_gold_model.py runs a verdict's scripts in its own process instead, on the same command lines.)"""
    subprocess.run(cmd, cwd=ROOT, check=True, env=env)
