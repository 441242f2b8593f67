"""The run directory: a writable folder every rank sees, one writer at a time, the options it was started with, its
metrics files repaired on a resume, and writes into it that are atomic or fail in one line.

    check_run_dir(run_dir); lock_run_dir(run_dir)   # rank 0, at start: a second run on the folder stops with one line
    refuse_start_over(run_dir, resume)        # --resume false over checkpoints
    check_shared_dir(run_dir)                 # every rank: the same folder on every node
    record = options_record(run_dir, options, step, allow)   # on a resume: changed options stop the run, or are
                                                             # appended to config.json with their step

The lock is `run_dir/.lock`, held with flock(2) for the life of the process (the kernel drops it when the process
dies, whatever kills it), and holding the holder's pid, host and start time for the message a second run prints.
A lock file that names a holder but is not locked was left by a run that was killed: it is taken over with one
warning line. flock works across machines on NFS (Linux 2.6.12 and later) and Lustre mounted with -o flock.

config.json (what evaluation/compare.py groups runs by) holds the options the run was started with, written
atomically and only when it changes, with a copy in every checkpoint that a resume checks against; every later
change is appended to its "option_changes" list as {"step", "options": {name: [old, new]}}: free options
(FREE_OPTIONS: the length of the run, evaluation, logging and checkpoint cadence, memory savers) without asking,
the others only with --resume_changes allow; where the run is and how it was started (NOT_RECORDED: --out_dir,
--resume, --resume_from, --resume_changes) are neither compared nor recorded.

drop_rows_after repairs metrics.jsonl and the table files of a resumed run; write_text_atomic writes a file whole or
not at all; describe_write_failure says in one line why a write failed (a full disk: the bytes needed and free).
"""

import atexit
import errno
import json
import os
import re
import shutil
import socket
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from utils.config import ConfigError
from utils.dist import barrier, broadcast_object, gather_objects, rank_and_world

try:
    import fcntl
except ImportError:  # not POSIX: no lock
    fcntl = None

LOCK = ".lock"
RECORD = "config.json"
RESUME_CHANGES = "option_changes"

# Options that may differ on a resume without --resume_changes allow (each change is still recorded): how long the
# run goes on, when it evaluates, logs and saves, the wandb names, and memory savers that compute the same numbers.
# --steps also moves the end of the cosine schedule, so the steps after the resume follow the new one. Every other
# option changes what a step computes.
FREE_OPTIONS = frozenset(
    {
        "steps",
        "eval_every",
        "save_every",
        "keep_last",
        "best_metric",
        "best_mode",
        "table_every",
        "table_prompts",
        "dist_timeout_minutes",
        "activation_checkpointing",
        "frozen_cpu_offload",
        "wandb_mode",
        "wandb_project",
        "run_name",
        "wandb_group",
        "wandb_tags",
        "tensorboard",
    }
)

# How a run is started or where it is, not what it is: never compared, never recorded as a change
NOT_RECORDED = frozenset({"out_dir", "resume", "resume_from", "resume_changes"})

_held: dict[str, int] = {}  # lock file -> open descriptor, for this process's runs


def warn(message: str) -> None:
    """`warning: message` on one line, to stderr, from rank 0 only."""
    if os.environ.get("RANK", "0") == "0":
        print(f"warning: {message}", file=sys.stderr, flush=True)


def check_run_dir(run_dir: str | Path) -> None:
    """ConfigError unless --out_dir is (or can be created as) a writable directory."""
    path = Path(run_dir)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"--out_dir {path} is a file; expected a directory for checkpoints, exports and metrics")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--out_dir {path} cannot be created ({type(e).__name__}: {e})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"--out_dir {path} is not writable")


def check_shared_dir(run_dir: str | Path, wait_s: float = 30.0) -> None:
    """ConfigError on every rank unless every rank sees the same --out_dir (a collective): rank 0 writes a file there
    and every rank looks for it, for up to `wait_s` seconds (a network filesystem may show another machine's new
    file only after its attribute cache expires). Every rank writes its checkpoint shards into --out_dir and rank 0
    renames the folder they are in, so with several nodes it must be on a filesystem they share: found here rather
    than at the first resume, when the checkpoint would lack the other nodes' shards."""
    rank, world = rank_and_world()
    if world == 1:
        return
    token = broadcast_object(os.urandom(8).hex())
    marker = Path(run_dir) / f".shared_check_{token}"
    if rank == 0:
        marker.write_text("")
    barrier()
    deadline = time.monotonic() + wait_s
    while not marker.is_file() and time.monotonic() < deadline:
        time.sleep(0.5)
    seen = gather_objects(marker.is_file())
    if rank == 0:
        marker.unlink()
    blind = [r for r, ok in enumerate(seen) if not ok]
    if blind:
        raise ConfigError(
            f"--out_dir {run_dir} is not the same folder on every rank: ranks {blind} do not see the file rank 0 "
            f"wrote there; with several nodes --out_dir must be on a filesystem they all share (every rank writes its "
            f"checkpoint shards into it)"
        )


def refuse_start_over(run_dir: str | Path, resume: bool) -> None:
    """ConfigError when --resume is false and --out_dir already holds checkpoints: starting over would overwrite
    them."""
    ckpt_root = Path(run_dir) / "checkpoints"
    existing = sorted(p for p in ckpt_root.glob("step_*") if p.is_dir()) if ckpt_root.is_dir() else []
    if existing and not resume:
        raise ConfigError(
            f"--out_dir {run_dir} already holds checkpoints (newest: {existing[-1].name}) and --resume is false: "
            f"starting over would overwrite them; use --resume true to continue, another --out_dir, or delete "
            f"{ckpt_root}"
        )


def write_text_atomic(path: Path, text: str) -> None:
    """Write `text` to a temporary file beside `path`, flush it to disk, then rename it over `path`: a reader (or a
    run killed half way) sees the old file or the new one, never a part."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_best(run_dir: str | Path) -> dict | None:
    """The best-checkpoint record checkpoints/best.json: {"checkpoint", "step", "metric", "mode", "value"}, or None."""
    try:
        return json.loads((Path(run_dir) / "checkpoints" / "best.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None


def save_torch_synced(obj, path: Path) -> None:
    """torch.save, flushed to disk before returning."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def os_error_behind(e: BaseException) -> OSError | None:
    """The OSError behind `e` (DCP, torch.save and safetensors wrap it), if any."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError):
            return e
        if isinstance(e, dcp.CheckpointException):  # failures: rank -> (exception, stack)
            causes = [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]
            cause = next((o for o in map(os_error_behind, causes) if isinstance(o, OSError)), None)
            if cause is not None:
                return cause
        if code := re.search(r"Os \{ code: (\d+)", str(e)):  # safetensors' Rust writer: "IoError(Os { code: 28, ..."
            return OSError(int(code.group(1)), os.strerror(int(code.group(1))))
        e = e.__cause__ or e.__context__
    return None


def describe_write_failure(e: BaseException, folder: Path, needed: int | None = None) -> str:
    """One line on a failed write: the OS error ("no space left on device" for ENOSPC), the bytes needed when known,
    the bytes free in `folder`."""
    cause = os_error_behind(e)
    if isinstance(e, dcp.CheckpointException):  # the first rank's own exception says more than DCP's wrapper
        e = next((f[0] if isinstance(f, tuple) else f for f in e.failures.values()), e)
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        free = None
    first_line = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    if cause is not None and cause.errno == errno.ENOSPC:
        why = "no space left on device"
    elif cause is not None:
        why = f"{cause.strerror or cause}" + (f" ({cause.filename})" if cause.filename else "")
    elif free is not None and needed is not None and free < needed:  # torch.save's zip writer reports a full disk
        why = f"no space left on device ({first_line})"  # as a bad file position
    else:
        why = first_line
    sizes = [f"it needs about {needed:,} bytes"] if needed is not None else []
    sizes += [f"{free:,} are free there"] if free is not None else []
    return "; ".join([why, ", ".join(sizes)] if sizes else [why])


class RunWriteError(RuntimeError):
    """A file of the run directory that could not be written (a full disk, or another OS error); exit code 4."""

    exit_code = 4


@contextmanager
def stop_on_write_failure(what: str, folder: str | Path, leftover: Path | None = None):
    """Around a write into the run directory: an OS error (or one a writer wraps: safetensors, torch.save) becomes
    RunWriteError, one line naming `what`, the error and the bytes free in `folder`, after `leftover` (a temporary
    folder or file the write leaves) is removed. Any other exception passes unchanged."""
    try:
        yield
    except Exception as e:
        if os_error_behind(e) is None:
            raise
        if leftover is not None and leftover.is_dir():
            shutil.rmtree(leftover, ignore_errors=True)
        elif leftover is not None:
            leftover.unlink(missing_ok=True)
        raise RunWriteError(
            f"cannot write {what}: {describe_write_failure(e, Path(folder))}; what was written before is intact: free "
            f"space there (or use another --out_dir) and rerun the same command to continue from the newest checkpoint"
        ) from None


def _holder(text: str) -> str:
    try:
        d = json.loads(text)
        return f"pid {d['pid']} on {d['host']}, started {d['started']}"
    except (json.JSONDecodeError, KeyError, TypeError):
        return "a process that left no name"


def lock_run_dir(run_dir: str | Path) -> None:
    """Take the run directory's lock for this process (rank 0 only), or ConfigError naming the folder and the live
    process that holds it; a lock left by a killed run is taken over with a warning. Released at exit (and by
    release_run_dir). A process that holds it already (an earlier run in the same Python process) keeps it."""
    if fcntl is None:
        return
    file = Path(run_dir) / LOCK
    key = str(file.resolve())
    if key in _held:
        return
    fd = os.open(file, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # another process holds it
        text = os.pread(fd, 4096, 0).decode("utf-8", "replace")
        os.close(fd)
        raise ConfigError(
            f"--out_dir {run_dir} is in use by another run ({_holder(text)}; it holds {file}); wait for it to end, "
            f"or use another --out_dir"
        ) from None
    except OSError as e:  # a filesystem without locks (an NFS mount without lockd): run, but say what is not guarded
        os.close(fd)
        warn(
            f"cannot lock {file} ({e.strerror or e}): a second run started on --out_dir {run_dir} would not be stopped"
        )
        return
    left = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
    if left:
        warn(f"took over the lock {file} left by a run that is no longer running ({_holder(left)})")
    holder = json.dumps(
        {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S %z")}
    )
    os.ftruncate(fd, 0)
    os.pwrite(fd, holder.encode(), 0)
    os.fsync(fd)
    _held[key] = fd
    atexit.register(release_run_dir, run_dir)


def release_run_dir(run_dir: str | Path) -> None:
    """Empty and release the lock this process holds on `run_dir` (nothing when it holds none)."""
    fd = _held.pop(str((Path(run_dir) / LOCK).resolve()), None)
    if fd is not None:
        os.ftruncate(fd, 0)  # an empty lock file is one nobody holds: the next run takes it without a warning
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def release_all() -> None:
    """Release every run-directory lock this process holds (a run leaving on an error: in a test process that goes
    on, the folder is free again)."""
    for file in list(_held):
        release_run_dir(Path(file).parent)


def _same(a, b) -> bool:
    return json.dumps(a, default=str, sort_keys=True) == json.dumps(b, default=str, sort_keys=True)


def _read_record(file: Path) -> tuple[dict | None, str]:
    """(config.json's record, "") or (None, what is wrong with the file)."""
    try:
        record = json.loads(file.read_text())
        if not isinstance(record, dict):
            raise ValueError("not a JSON object")
        return record, ""
    except FileNotFoundError:
        return None, "is missing"
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return None, f"cannot be read ({type(e).__name__}: {e})"


def options_record(
    run_dir: str | Path, options: dict, step: int, allow: bool, saved: dict | None = None, defaults: dict | None = None
) -> dict:
    """The record (what config.json holds) of a run resumed from its own checkpoint at `step`: the options it was
    started with, and its list of changes. The checkpoint's own copy (`saved`, see utils.checkpoint.save_checkpoint)
    is the record compared against, so a config.json deleted, emptied or edited cannot let a change through (a
    config.json that is missing or unreadable is named in a warning and written again from it); a checkpoint without
    one is compared against config.json. Options that differ from the recorded ones (started with, after the changes
    so far) are appended with the step; a change outside FREE_OPTIONS is a ConfigError listing each (old -> new)
    unless `allow`. An option the record lacks (added to the code after the run started) compares against its value
    in `defaults` and joins the record with it. With no record at all, `options`, with a warning."""
    file = Path(run_dir) / RECORD
    on_disk, problem = _read_record(file)
    if saved is not None:
        record = saved
        if on_disk is None:
            warn(f"{file} {problem}; it is written again from the record of options in the checkpoint of step {step}")
    elif on_disk is not None:
        record = on_disk
    else:
        warn(
            f"{file} {problem} and the checkpoint of step {step} holds no record of options: this run's options are "
            f"recorded as the run's, unchecked"
        )
        return options
    defaults = defaults or {}
    lacking = {k: defaults[k] for k in options if k not in record and k in defaults and k not in NOT_RECORDED}
    history = record.get(RESUME_CHANGES, [])
    current = {k: v for k, v in record.items() if k != RESUME_CHANGES} | lacking
    record = {**current, RESUME_CHANGES: history} if history else current
    current = dict(current)  # the options in force at `step`: started with, then each change
    for change in history:
        current |= {k: new for k, (_, new) in change["options"].items()}
    changed = {
        k: [current[k], v]
        for k, v in options.items()
        if k in current and k not in NOT_RECORDED and not _same(current[k], v)
    }
    refused = {k: v for k, v in changed.items() if k not in FREE_OPTIONS}
    if refused and not allow:
        changes = ", ".join(f"--{k} {old} -> {new}" for k, (old, new) in refused.items())
        raise ConfigError(
            f"--out_dir {run_dir} holds a run started with other options ({changes}): resuming would train one run "
            f"under two configurations while {file} names one; rerun with the recorded options, use another --out_dir "
            f"for a new run, or pass --resume_changes allow to continue from step {step} with these (the change and "
            f"its step are appended to {file})"
        )
    if changed:
        record = {**record, RESUME_CHANGES: record.get(RESUME_CHANGES, []) + [{"step": step, "options": changed}]}
        if refused:
            warn(
                f"continuing from step {step} with changed options ("
                + ", ".join(f"--{k} {old} -> {new}" for k, (old, new) in refused.items())
                + f"), recorded in {file}"
            )
    return json.loads(json.dumps(record, default=str))


def write_record(run_dir: str | Path, record: dict) -> None:
    """Write config.json (the run's record of options) atomically, and only when its content changes: a run killed
    while writing it leaves the previous record whole."""
    file = Path(run_dir) / RECORD
    text = json.dumps(record, indent=1, default=str) + "\n"
    try:
        if file.read_text() == text:
            return
    except (OSError, UnicodeDecodeError):
        pass
    write_text_atomic(file, text)


def drop_rows_after(path: Path, resume_step: int, loud: bool = True) -> None:
    """Repair a metrics file (metrics.jsonl, a table's .jsonl) of a run resumed at `resume_step`: keep the rows of
    earlier steps and the first row of that step (logged before its checkpoint was saved), drop every later one (a
    killed run wrote them; their steps run again) and any line that is not a whole JSON row (cut short by a kill or a
    full disk), each with one warning line when `loud`. A fresh start (`resume_step` 0) empties the file. Rewritten
    atomically."""
    if not path.is_file():
        return
    kept, seen_resume_step, dropped = [], False, 0
    for number, line in enumerate(path.read_bytes().decode("utf-8", "replace").splitlines(keepends=True), 1):
        try:
            step = json.loads(line)["step"]
        except (json.JSONDecodeError, KeyError, TypeError):
            if loud:
                print(
                    f"warning: {path}: line {number} is not a whole JSON row ({line.strip()[:60]!r}); dropped",
                    file=sys.stderr,
                    flush=True,
                )
            continue
        if step < resume_step or (step == resume_step > 0 and not seen_resume_step):
            kept.append(line if line.endswith("\n") else line + "\n")
            seen_resume_step |= step == resume_step
        else:
            dropped += 1
    if dropped and loud:
        print(
            f"warning: {path}: {dropped} line(s) logged after the checkpoint of step {resume_step} dropped (their "
            f"steps run again)",
            file=sys.stderr,
            flush=True,
        )
    write_text_atomic(path, "".join(kept))


def check_wandb_login(mode: str) -> None:
    """ConfigError for --wandb_mode online without a wandb login (WANDB_API_KEY, or the API host in ~/.netrc), found
    at start instead of in a traceback from wandb.init."""
    if mode != "online" or os.environ.get("WANDB_API_KEY"):
        return
    host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://")[-1].split("/")[0].split(":")[0]
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        logged_in = f"machine {host}" in " ".join(netrc.read_text().split())
    except OSError:
        logged_in = False
    if not logged_in:
        raise ConfigError(
            f"--wandb_mode online needs a wandb login, and none was found (WANDB_API_KEY is unset and {netrc} has no "
            f"entry for {host}); run `wandb login` or set WANDB_API_KEY, or use --wandb_mode offline (upload later "
            f"with `wandb sync`) or disabled"
        )
