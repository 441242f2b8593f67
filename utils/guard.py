"""Guards shared by every stage: bad input ends in one line, a signal ends in a checkpoint, a non-finite step
never reaches the weights.

    if __name__ == "__main__":
        with exit_on_error():                       # bad input: `error: ...`, exit code 2, no traceback
            main(parse_config(Config, ...))

    guard = NonFiniteGuard("sft", cfg.on_nonfinite, device)
    with StopSignal() as stop:                      # SIGTERM / SIGINT set a flag instead of killing the process
        while step < total_steps:
            ... forward, backward, clip ...
            if guard.ok(step + 1, {"train/loss": loss, "train/grad_norm": grad_norm}):
                optimizer.step(); scheduler.step()
            optimizer.zero_grad()
            ...
            stopping = stop.requested(device)       # collective: every rank gets the same answer
            if stopping or due: save_checkpoint(...)
            if stopping: break

    with all_ranks_agree("reward functions", device):  # may raise on one rank only: every rank raises together
        values = score_functions(...)

Exit codes: 0 done (or stopped by a signal after saving), 2 bad input (config, data, model, checkpoint,
tokenizer, a GRPO reward function that raises or returns a non-number), 3 numerical fault (non-finite loss or
gradient norm, a reward model returning NaN or a constant), 130 interrupted before training started. A real bug
keeps its traceback.
"""

import math
import signal
import sys
from contextlib import contextmanager

import torch
import torch.distributed as dist

from utils.config import ConfigError, print_error
from utils.logging import close_progress_bars, say
from utils.rundir import release_all

EXIT_BAD_INPUT = 2
EXIT_NUMERICAL = 3
EXIT_INTERRUPTED = 130


class NumericalError(RuntimeError):
    """A non-finite loss or gradient norm, or rewards that are NaN or constant; names the stage and step."""

    exit_code = EXIT_NUMERICAL


class RankFailure(RuntimeError):
    """Raised on every rank when some rank raised inside an `all_ranks_agree` block: the message and exit code of the
    lowest rank that failed (exit code 1 when that was a bug, whose traceback that rank prints)."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


@contextmanager
def all_ranks_agree(where: str, device):
    """Run a block that may raise on one rank only (a user's reward function on the rows this rank holds), then agree
    over ranks, so no rank is left waiting in a collective for a peer that is gone (gloo fails the peer with a
    connection error, NCCL leaves it waiting out the process-group timeout).

    Every rank all-reduces one flag after the block (a collective; call it on every rank). When some rank raised,
    every rank raises: a user error (an exception whose class sets `exit_code`) becomes a RankFailure with the
    lowest failing rank's message and code on every rank, so exit_on_error prints one line (rank 0) and every rank
    exits with the same code; a bug re-raises on its own rank (its traceback) and is a RankFailure naming it, code
    1, on the others."""
    error = None
    try:
        yield
    except Exception as e:  # every exception is shared with the other ranks, then raised again
        error = e
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        if error is not None:
            raise error
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    code = 0 if error is None else (getattr(error, "exit_code", None) or 1)
    codes = torch.zeros(world, dtype=torch.int64, device=device)
    codes[rank] = code
    dist.all_reduce(codes, op=dist.ReduceOp.SUM)
    failed = codes.nonzero().flatten().tolist()
    if not failed:
        return
    errors = [None] * world  # (exception class name, message) of every rank; objects only on the failure path
    dist.all_gather_object(errors, None if error is None else (type(error).__name__, str(error)))
    first = failed[0]
    if error is not None and getattr(error, "exit_code", None) is None:
        raise error  # a bug on this rank: its own traceback
    name, message = errors[first]
    if int(codes[first]) == 1:
        raise RankFailure(f"rank {first} failed in {where} ({name}: {message}); its traceback is in its output", 1)
    raise RankFailure(message, int(codes[first])) from error


def _all_ranks_max(values: list[float], device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


@contextmanager
def exit_on_error():
    """Around a script's main(): a user error or numerical fault prints one `error: ...` line (rank 0) and exits
    with its code instead of a traceback; any other exception propagates with its traceback (a bug).

    A user error is any exception whose class sets `exit_code` (ConfigError, DataError, TokenizerError,
    ModelLoadError, CheckpointError, RewardSpecError, RewardFunctionError: 2; NumericalError: 3; RankFailure: the
    code of the rank that failed), so the packages that raise them need not be imported here."""
    try:
        yield
    except KeyboardInterrupt:
        _exit(
            "interrupted outside the training loop (start-up or export); the newest checkpoint, if any, is intact",
            EXIT_INTERRUPTED,
        )
    except Exception as e:
        code = getattr(e, "exit_code", None)
        if code is None:
            raise
        _exit(str(e), code, agreed=isinstance(e, RankFailure))


def _exit(message: str, code: int, agreed: bool = False) -> None:
    """Print the line, tear the process group down, exit. `agreed`: every rank is here with the same error
    (all_ranks_agree), so a barrier lets them leave together: torchrun stops the workers still running once one
    has exited, and its report then names SIGTERM for a rank that was only slower to get out."""
    close_progress_bars()
    print_error(message)
    release_all()  # the run directory's lock, when this rank took it
    if dist.is_initialized():
        if agreed:
            dist.barrier()
        dist.destroy_process_group()
    sys.exit(code)


class StopSignal:
    """While active, SIGTERM (a preemption: SLURM, Kubernetes and torchrun's own shutdown send it) and SIGINT
    (Ctrl-C) set a flag instead of ending the process; the loop reads it with requested() once per step, saves
    a checkpoint and leaves. A third signal restores the default handlers and re-sends itself (a stuck run can
    still be stopped; under torchrun Ctrl-C reaches each worker twice, from the terminal and from the agent).

    torchrun gives its workers --shutdown_timeout seconds (default 30) after forwarding SIGTERM before it sends
    SIGKILL: a model whose checkpoint takes longer to write needs a larger value."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.received: str | None = None
        self.count = 0
        self.previous: dict = {}

    def __enter__(self) -> "StopSignal":
        for sig in self.SIGNALS:
            self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}

    def _handle(self, signum, frame) -> None:
        self.count += 1
        name = signal.Signals(signum).name
        if self.received is None:
            self.received = name
            say(f"received {name}: finishing this step, then saving a checkpoint and exiting")
        if self.count >= 3:
            self.__exit__()
            signal.raise_signal(signum)

    def requested(self, device) -> bool:
        """True on every rank when any rank has received a signal (a collective: call it on every rank)."""
        return _all_ranks_max([1.0 if self.received else 0.0], device)[0] > 0

    def report(self, step: int, checkpoint_dir, rank: int) -> None:
        """Rank 0 says where the stopped run's checkpoint is and how to continue."""
        if rank == 0:
            print(
                f"stopped by {self.received or 'a signal on another rank'} after step {step}; checkpoint saved in "
                f"{checkpoint_dir}; rerun the same command to continue"
            )


class NonFiniteGuard:
    """Checks a step's loss and gradient norm before the optimizer step, on every rank together.

    on_nonfinite "stop": raise NumericalError naming the stage, step and values; nothing is stepped or saved, so
    the newest checkpoint is the last good state. "skip": ok() returns False and the caller drops the step: zero
    the gradients, no optimizer or scheduler step (the learning-rate schedule does not advance), the batch is
    consumed and the step counts. After max_consecutive_skips skipped steps in a row the run stops anyway."""

    def __init__(self, stage: str, on_nonfinite: str, device, max_consecutive_skips: int = 10):
        if on_nonfinite not in ("stop", "skip"):
            raise ConfigError(f"--on_nonfinite must be stop or skip, got '{on_nonfinite}'")
        self.stage, self.policy, self.device = stage, on_nonfinite, device
        self.max_consecutive_skips = max_consecutive_skips
        self.skipped = 0  # steps skipped in this process
        self.consecutive = 0

    def ok(self, step: int, values: dict[str, float]) -> bool:
        """True when every value is finite on every rank (a collective)."""
        bad = _all_ranks_max([0.0 if math.isfinite(float(v)) else 1.0 for v in values.values()], self.device)
        names = [k for k, b in zip(values, bad, strict=True) if b > 0]
        if not names:
            self.consecutive = 0
            return True
        shown = ", ".join(f"{k}={float(v):.4g}" for k, v in values.items())
        where = f"{self.stage}: non-finite {' and '.join(names)} at step {step} ({shown} on rank 0)"
        if self.policy == "stop":
            raise NumericalError(
                f"{where}; stopped before the optimizer step, so the newest checkpoint holds the last good weights. "
                f"Lower --lr, keep --grad_clip on, or pass --on_nonfinite skip to drop such steps"
            )
        self.skipped += 1
        self.consecutive += 1
        if self.consecutive >= self.max_consecutive_skips:
            raise NumericalError(f"{where}; {self.consecutive} steps in a row were non-finite and skipped, stopping")
        say(f"warning: {where}; step skipped (--on_nonfinite skip)")
        return False


def check_rewards(raw_N: torch.Tensor, stage: str, step: int, device) -> None:
    """NumericalError when the reward model returned a non-finite score on any rank, or the same score for every
    sample of every rank (an untrained, collapsed or broken reward model: every advantage would be 0). A collective."""
    raw = raw_N.double().flatten()
    finite = torch.isfinite(raw)
    n_bad = float((~finite).sum())
    lo = float(raw[finite].min()) if bool(finite.any()) else float("inf")
    hi = float(raw[finite].max()) if bool(finite.any()) else float("-inf")
    n_bad, neg_lo, hi = _all_ranks_max([n_bad, -lo, hi], device)  # n_bad: max over ranks, enough to detect
    if n_bad > 0:
        raise NumericalError(
            f"{stage}: the reward model returned non-finite scores at step {step} (on at least one rank: "
            f"{int(n_bad)} of its {raw.numel()} samples); check --reward_model"
        )
    if hi - (-neg_lo) <= 1e-6 * max(1.0, abs(hi)):
        raise NumericalError(
            f"{stage}: the reward model gave every sample the same score ({hi:.6g}) at step {step}: it is constant, "
            f"so every advantage would be 0; check --reward_model (untrained, collapsed, or the wrong folder)"
        )
