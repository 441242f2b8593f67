"""Run plumbing every training script calls from its own visible loop: plain functions, no trainer, no hooks.

    run = start_run(cfg, meta)                          # process group, run directory (lock, options), checkpoint, seed
    ... data, models, optimizer, scheduler ...
    step = resume(run, cfg, model, optimizer, scheduler, loader, total_steps)   # then the logger and progress bar
    metrics, stopping = {}, False
    with run.stop:                                      # SIGTERM / SIGINT: finish the step, save, leave
        while step < total_steps:
            ... one step ...
            step += 1
            stopping = end_of_step(run, cfg, step, total_steps, metrics, model, optimizer, scheduler, loader)
            if stopping:
                break                                   # a signal came: the checkpoint is saved
    finish(run, model, step, metrics, stopping, lambda sd: save_export(model, sd, model_cfg, run.dir / "hf"))

Random streams: every random draw of a run that is not the model's initialisation comes from a torch.Generator
seeded by utils.dist.stream(seed, step, rank, stream name), so streams are independent of each other and of the
ranks, and a resumed run rebuilds them bit for bit from the step alone. The global torch RNG (what draws without a
generator use: LoRA's dropout masks) is seeded with the same seed on every rank until the models are built, so they
start identical before sharding; resume() then reseeds it per rank from stream_seed(seed, step, rank, "global"), so
no two ranks draw the same masks (a resumed run restores each rank's own RNG state instead).
"""

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from utils.checkpoint import CheckpointError, find_checkpoint, load_checkpoint, read_options, save_checkpoint
from utils.config import ConfigError, RunConfig, config_to_dict, declared
from utils.dist import DistInfo, cleanup_distributed, setup_distributed, stream_seed
from utils.fsdp import full_model_state, resolve_dtype
from utils.guard import NonFiniteGuard, StopSignal, all_ranks_agree
from utils.logging import Logger, progress, report_summary, step_postfix, tell
from utils.metrics import headlines
from utils.rundir import (
    check_run_dir,
    check_shared_dir,
    check_wandb_login,
    lock_run_dir,
    options_record,
    refuse_start_over,
    release_run_dir,
    stop_on_write_failure,
    warn,
)


@dataclass
class Run:
    """What a started run knows: its ranks and device, directory, the checkpoint it resumes from, its checkpoint
    identity (`meta`), and, once resume() has run, its logger, progress bar and best evaluation so far."""

    dist: DistInfo
    dir: Path
    meta: dict
    checkpoint: Path | None
    dtype: torch.dtype | None
    guard: NonFiniteGuard
    stop: StopSignal = field(default_factory=StopSignal)
    logger: Logger | None = None
    bar: object = None
    best: dict | None = None
    loop_state: dict = field(default_factory=dict)
    """The resumed checkpoint's loop state (data position, best, what end_of_step's loop_state_fn added); empty on a
    fresh start."""
    init_rng: torch.Tensor | None = None
    """The global CPU RNG state every rank shared when resume() was called (after the models were built from the
    common seed), before it was made per-rank: a model built later from random weights (reward_model.py's
    normalisation policy with --random_init) is drawn from it, so it is the same on every rank."""
    record: dict = field(default_factory=dict)
    """The run's options as config.json records them: the ones it started with and every change since, with its step
    (utils/rundir.py)."""

    @property
    def rank(self) -> int:
        return self.dist.rank

    @property
    def world(self) -> int:
        return self.dist.world_size

    @property
    def device(self) -> torch.device:
        return self.dist.device

    @property
    def is_main(self) -> bool:
        return self.dist.rank == 0

    def say(self, message: str) -> None:
        if self.is_main:
            tell(message)  # never glued to a live bar's line


def make_deterministic(device: str) -> None:
    """--deterministic: the same numbers bit for bit on a GPU (CPU runs already repeat bit for bit). Called before
    CUDA is initialised: cuBLAS reads CUBLAS_WORKSPACE_CONFIG when it makes its first handle, and repeats its results
    bit for bit only with a fixed workspace per stream when several streams run (FSDP gathers and reduces on streams
    of its own).

    Attention runs on SDPA's math kernel (two matmuls and a softmax). The flash and cuDNN kernels' backward is not
    deterministic; the memory-efficient kernel's is only under strict deterministic mode, which would stop the run
    at the sampler's float cumsum (torch flags every float cumsum on CUDA, although the batched innermost-dimension
    scan it runs has a fixed order). Hence warn_only: an op without a deterministic implementation warns once,
    naming itself, instead of stopping the run; tests/test_gpu.py (bench/gpu_all.sh) checks that two identical runs
    agree bit for bit. On a CPU run (`device`: --device) the attention kernel is left alone: these flags steer the
    CPU's SDPA too, and its kernels already repeat bit for bit."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return  # the flags below also steer SDPA on the CPU, whose flash kernel is deterministic already
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.backends.cuda.enable_cudnn_sdp(False)
    torch.backends.cuda.enable_math_sdp(True)


def start_run(cfg: RunConfig, meta: dict) -> Run:
    """Distributed set-up, the run directory (a wandb login when --wandb_mode online; the directory's lock, taken by
    rank 0: one run writes it at a time), the checkpoint to resume from (checked for damage and against `meta`:
    stage, model config, LoRA), the options against the run's record when it resumes its own checkpoint, the global
    seed (the same on every rank: models are initialised identically before sharding) and the compute dtype.
    Everything here runs before any data is read or any model is built."""
    if cfg.deterministic:
        make_deterministic(cfg.device)
    info = setup_distributed(cfg.device, cfg.dist_timeout_minutes)
    run_dir = Path(cfg.out_dir)
    with all_ranks_agree("the run directory's checks", info.device):
        if info.rank == 0:
            check_wandb_login(cfg.wandb_mode)
            check_run_dir(run_dir)
            lock_run_dir(run_dir)
            refuse_start_over(run_dir, cfg.resume)
    check_shared_dir(run_dir)
    checkpoint = find_checkpoint(run_dir, cfg.resume_from, meta)
    record = config_to_dict(cfg)
    if checkpoint is not None and checkpoint.parent.parent.resolve() == run_dir.resolve():  # its own: a resume
        step, allow = int(checkpoint.name.split("_")[-1]), cfg.resume_changes == "allow"
        defaults = config_to_dict(type(cfg)())  # what an option the record lacks was, before it could be set
        free, unrecorded = declared(cfg, "free"), declared(cfg, "recorded")  # declared beside each option
        record = options_record(
            run_dir, record, step, allow, read_options(checkpoint), defaults, free=free, unrecorded=unrecorded
        )
    torch.manual_seed(cfg.seed)
    guard = NonFiniteGuard(meta["stage"], cfg.on_nonfinite, info.device)
    return Run(info, run_dir, meta, checkpoint, resolve_dtype(cfg.dtype, info.device), guard, record=record)


def epoch_steps(steps: int, rows: int, batches_per_epoch: int, accum: int, batch_size: int) -> int:
    """--steps, or when it is 0 one epoch: the optimizer steps that `batches_per_epoch` micro-batch rounds fill
    (`accum` per step), at least one. A warning when that one step repeats rows (fewer rows than --batch_size)."""
    if steps:
        return steps
    if batches_per_epoch < accum:
        warn(
            f"--steps 0 runs one epoch, but {rows} rows fill less than one global batch of --batch_size "
            f"{batch_size}: the one step repeats rows about {batch_size / rows:.1f} times; give more rows, a smaller "
            f"--batch_size, or --steps"
        )
    return max(1, batches_per_epoch // accum)


def restore_loader(loader, path: Path, extra: dict) -> None:
    """Put a ShardedLoader back at the checkpoint's data position (CheckpointError when it cannot fit)."""
    try:
        loader.load_state_dict(extra["loader"])
    except (KeyError, ValueError) as e:
        raise CheckpointError(
            f"checkpoint {path}: its data position does not fit this run's training data ({e}); resume with the "
            f"data it was trained on"
        ) from None


def update_best(best: dict | None, metrics: dict, metric: str, mode: str, step: int) -> tuple[dict | None, bool]:
    """(best record, improved): `metrics[metric]` against the best so far, lower is better for mode "min".
    Steps without that metric (no validation) change nothing. A record from another metric is replaced."""
    if not metric:
        return best, False
    if metric not in metrics:
        group = metric.split("/")[0] + "/"
        logged = sorted(k for k in metrics if k.startswith(group))
        if logged:  # this step did validate, so the name is wrong
            raise ConfigError(f"--best_metric {metric} is not logged by this stage; its {group} metrics are {logged}")
        return best, False
    value = float(metrics[metric])
    if value != value:  # NaN is never best
        return best, False
    if best is not None and best.get("metric") == metric and best.get("mode") == mode:
        if (value >= best["value"]) if mode == "min" else (value <= best["value"]):
            return best, False
    return {"metric": metric, "mode": mode, "value": value, "step": step}, True


def check_best_metric(cfg: RunConfig, evaluated: Iterable[str], best_metric: str | None = None) -> None:
    """--best_metric (or `best_metric`, as end_of_step takes it) against the names of the metrics an evaluation logs
    (`evaluated`; a dict of metrics gives its names), before any training step: ConfigError when that evaluation logs
    metrics of its group but not it (update_best's check, which would otherwise stop the run at its first
    evaluation, before that step's checkpoint). Every stage calls it before its first step whatever --eval_every is
    (with 0 the first evaluation comes after training and a failure there would leave no checkpoint) and on resume
    (a free option may change), with the names its evaluation code declares."""
    metric = cfg.best_metric if best_metric is None else best_metric
    update_best(None, dict.fromkeys(evaluated, 0.0), metric, cfg.best_mode, 0)


def resume(
    run: Run, cfg: RunConfig, model, optimizer, scheduler, loader, total_steps: int, frozen: dict | None = None
) -> int:
    """Seed the global RNG per rank, restore the checkpoint start_run found, if any (weights, optimizer, schedule, every
    rank's RNG, data position, best evaluation so far; its loop state in run.loop_state; the `frozen` models it holds,
    see end_of_step), then open the logger and the progress bar at that step. Returns the step to continue from (0 on
    a fresh start)."""
    step = 0
    run.init_rng = torch.get_rng_state()
    torch.manual_seed(stream_seed(cfg.seed, step, run.rank, "global"))  # per rank; a checkpoint's own state replaces it
    if run.checkpoint is not None:
        state = load_checkpoint(
            run.checkpoint, model, optimizer, scheduler, run.meta, run.rank, frozen=frozen, seed=cfg.seed
        )
        step, run.loop_state = state["step"], state["extra"]
        run.best = run.loop_state.get("best")
        restore_loader(loader, run.checkpoint, run.loop_state)
        run.say(f"resumed from {run.checkpoint} at step {step}")
    # rank 0 drops the rows logged after the checkpoint and writes the option record: a full disk stops every rank
    with all_ranks_agree("opening metrics.jsonl", run.device):
        run.logger = Logger(
            run.dir,
            run.record or config_to_dict(cfg),
            cfg.wandb_project,
            cfg.run_name,
            cfg.wandb_mode,
            run.is_main,
            resume_step=step,
            group=cfg.wandb_group,
            tags=cfg.wandb_tags,
            tensorboard=cfg.tensorboard,
            hparam_metrics=headlines(run.meta["stage"]),
        )
    run.bar = progress(total_steps, step, run.is_main, run.meta["stage"])
    return step


def log_row(run: Run, metrics: dict, step: int) -> None:
    """Log a row of metrics.jsonl (a collective: call it on every rank): rank 0 writes, and a failed write, of this
    row or of a table since the last one, stops every rank together with one line and exit code 4."""
    with all_ranks_agree("writing metrics.jsonl", run.device):
        run.logger.log(metrics, step)


def end_of_step(
    run: Run,
    cfg: RunConfig,
    step: int,
    total_steps: int,
    metrics: dict,
    model,
    optimizer,
    scheduler,
    loader,
    best_metric: str | None = None,
    loop_state_fn: Callable[[], dict] | None = None,
    frozen: dict | None = None,
) -> bool:
    """Log the step's metrics, keep the best by --best_metric (or `best_metric`), and save a checkpoint on schedule,
    at the end, at a new best, or when a signal came. `loop_state_fn()` adds loop state to the checkpoint (called on
    every rank, only when saving: it may be a collective; resume() gives it back in run.loop_state). `frozen`: models
    without an optimizer whose weights the run changes (GRPO's refreshed reference), saved sharded with the model.
    Returns True when the run must stop (a signal came)."""
    log_row(run, metrics, step)
    run.bar.set_postfix(step_postfix(metrics), refresh=False)
    run.bar.update(1)
    metric = cfg.best_metric if best_metric is None else best_metric
    run.best, improved = update_best(run.best, metrics, metric, cfg.best_mode, step)
    stopping = run.stop.requested(run.device)
    if stopping or improved or step == total_steps or (cfg.save_every > 0 and step % cfg.save_every == 0):
        state = {"loader": loader.state_dict(), "best": run.best, **(loop_state_fn() if loop_state_fn else {})}
        save_checkpoint(
            run.dir,
            step,
            model,
            optimizer,
            scheduler,
            run.meta,
            extra=state,
            keep_last=cfg.keep_last,
            rank=run.rank,
            best=run.best if improved else None,
            frozen=frozen,
            options=run.record or config_to_dict(cfg),
        )
    return stopping


def finish(run: Run, model, step: int, metrics: dict, stopped: bool, export: Callable[[dict], None]) -> None:
    """After the loop: a stopped run says where its checkpoint is; a finished one gathers the full weights and hands
    them to `export` on rank 0 (model.weights.save_export: the Hugging Face-format folder) and writes summary.json with
    its table on the terminal (utils/logging.report_summary; a rerun of a finished run prints the one written); a
    failed write of either stops every rank with one line, exit code 4, and no hf.tmp left. Then the logger closes
    and the process group is torn down."""
    run.bar.close()
    if stopped:
        run.stop.report(step, run.dir / "checkpoints", run.rank)
    else:
        # rank 0 writes the export and summary.json; every rank waits, and a failed write (exit 4) stops every rank
        with all_ranks_agree("the export", run.device):
            state = full_model_state(model)
            if run.is_main:
                with stop_on_write_failure(f"the export {run.dir / 'hf'}", run.dir, leftover=run.dir / "hf.tmp"):
                    export(state)
                run.say(f"exported {run.dir / 'hf'}")
                wall_seconds = time.perf_counter() - run.logger.started
                report_summary(run.dir, run.meta["stage"], wall_seconds, run.logger.logged > 0)
    run.logger.finish()
    if run.is_main:
        release_run_dir(run.dir)
    cleanup_distributed()
