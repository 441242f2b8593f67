"""Checkpoints: a resumable training state, written atomically, and Hugging Face-format exports.

Layout under a run directory:
    checkpoints/step_00000100/sharded/    model and optimizer state (and any frozen model the stage names, e.g. GRPO's
                                          refreshed reference) as a torch.distributed.checkpoint (DCP) folder: every
                                          rank writes its own shards (__RANK_N.distcp), rank 0 the .metadata index
    checkpoints/step_00000100/state.pt    step, stage and model config, scheduler, data position and loop state,
                                          every rank's RNG state (small; rank 0)
    checkpoints/step_00000100/meta.json   stage and model config (read before any model is built), step
    checkpoints/step_00000100/digests.json  size and SHA-256 of every other file of the checkpoint, taken when it was
                                          written and checked before a resume reads anything
    checkpoints/latest                    name of the newest complete checkpoint
    checkpoints/best.json                 the checkpoint with the best validation metric: name, metric, value
    hf/                                   full Hugging Face-format export (rank 0; LoRA adapters merged)

No rank gathers the full model: each writes only the shards it holds (about 1/world of the fp32 weights and AdamW
moments, about 19 GB in all for gpt2-xl), so a save takes the time of one rank's share, not of the whole state
on rank 0 while the others wait in a collective against the process-group timeout. DCP records every tensor's
global shape and the slice each file holds, so a run resumes on another number of ranks (the shards are re-cut at
load; the per-rank RNG states cannot be matched then and are reseeded from the step). With several nodes, --out_dir
must be a folder every node sees (a shared filesystem): each rank writes its files into the same checkpoint folder.

With LoRA the model state holds the frozen base weights and the adapters (so a GRPO reference refresh, which
merges the adapters into the base, survives a resume); the optimizer state holds the adapters' only.

Every checkpoint is written into a temporary folder, its files flushed to disk, then renamed: a process killed
during a save leaves the previous checkpoint and the `latest` pointer intact. Pruning keeps the newest `keep_last`
checkpoints and the best one.

A resume checks every file against digests.json first (each rank hashes a share of the files): a checkpoint with a
missing, truncated or altered file, or an unreadable digests.json, is named in one warning line and the resume
falls back to the newest intact one (or stops with one line when none is). A save that cannot write (a full disk,
any OS error) removes its temporary folder and stops every rank with one line naming the folder, the error and the
bytes the checkpoint needs; the earlier checkpoints are untouched.
"""

import errno
import hashlib
import json
import os
import random
import shutil
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

# DCP's own reader of some of a checkpoint's keys, as full tensors, in one process (what its format tools use)
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

from utils.config import ConfigError
from utils.dist import stream_seed

SHARDED = "sharded"  # the DCP folder inside a checkpoint
DIGESTS = "digests.json"  # {file relative to the checkpoint: {"bytes", "sha256"}} of every other file in it
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, unreadable, or from another stage or model; the message names it."""

    exit_code = 2


class CheckpointWriteError(RuntimeError):
    """A checkpoint that could not be written (a full disk, or another OS error); the message names the folder."""

    exit_code = 4


def _warn(message: str) -> None:
    if os.environ.get("RANK", "0") == "0":
        print(f"warning: {message}", file=sys.stderr, flush=True)


def rng_state() -> dict:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _gather_objects(obj) -> list:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded model state on the CPU (a collective: every rank must call it)."""
    return get_model_state_dict(model, options=FULL)


def set_full_model_state(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Load a full (unsharded) state dict, present on every rank, into a sharded model (a collective)."""
    set_model_state_dict(model, state_dict, options=StateDictOptions(full_state_dict=True))


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _step_folders(ckpt_root: Path) -> list[Path]:
    """Complete checkpoints (a state.pt inside), oldest first."""
    return sorted(p for p in ckpt_root.glob("step_*") if (p / "state.pt").is_file())


def read_best(run_dir: str | Path) -> dict | None:
    """The best-checkpoint record {"checkpoint", "step", "metric", "mode", "value"}, or None."""
    file = Path(run_dir) / "checkpoints" / "best.json"
    try:
        return json.loads(file.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _save_file(obj, path: Path) -> None:
    """torch.save, flushed to disk before returning."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _sha256(file: Path) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _digests(folder: Path, names: list[str]) -> dict[str, dict]:
    """{name: {"bytes", "sha256"}} of files inside `folder` (names relative to it)."""
    return {name: {"bytes": (folder / name).stat().st_size, "sha256": _sha256(folder / name)} for name in names}


def _listing_digest(files: dict) -> str:
    """SHA-256 of digests.json's own list, so that an edit of the list itself is found too."""
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def _state_bytes(obj) -> int:
    """Bytes of every tensor in a (nested) state dict, at their global shapes: what a checkpoint of it needs on disk."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_state_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_state_bytes(v) for v in obj)
    return 0


def _os_error(e: BaseException) -> OSError | None:
    """The OSError behind `e` (DCP and torch.save wrap it), if any."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError):
            return e
        if isinstance(e, dcp.CheckpointException):  # failures: rank -> (exception, stack)
            causes = [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]
            found = next((o for o in map(_os_error, causes) if isinstance(o, OSError)), None)
            if found is not None:
                return found
        e = e.__cause__ or e.__context__
    return None


def _write_failure(e: BaseException, folder: Path, needed: int) -> str:
    """One line on a failed write: the folder, the OS error ("no space left on device" for ENOSPC), the bytes needed."""
    oserr = _os_error(e)
    if isinstance(e, dcp.CheckpointException):  # the first rank's own exception says more than DCP's wrapper
        e = next((f[0] if isinstance(f, tuple) else f for f in e.failures.values()), e)
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        free = None
    if oserr is not None and oserr.errno == errno.ENOSPC:
        why = "no space left on device"
    elif oserr is not None:
        why = f"{oserr.strerror or oserr}" + (f" ({oserr.filename})" if oserr.filename else "")
    elif free is not None and free < needed:  # torch.save's zip writer reports a full disk as a bad file position
        why = f"no space left on device ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    else:
        why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    sizes = f"it needs about {needed:,} bytes" + (f", {free:,} are free there" if free is not None else "")
    return f"{why}; {sizes}"


def _agree_on_write(error: str | None, tmp: Path, final: Path, rank: int) -> None:
    """After a phase of a save: when any rank failed to write, rank 0 removes the temporary folder and every rank
    raises the first failure (a collective), so no rank waits for a peer that left."""
    errors = _gather_objects(error)
    first = next((e for e in errors if e is not None), None)
    if first is None:
        return
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    older = _step_folders(final.parent)
    kept = f"the earlier checkpoints are intact (newest: {older[-1].name})" if older else "no earlier checkpoint exists"
    raise CheckpointWriteError(
        f"cannot write checkpoint {final.name} in {final.parent}: {first}; its temporary folder is removed and {kept}; "
        f"free space there (or use another --out_dir) and rerun the same command to continue"
    )


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    meta: dict,
    extra: dict | None = None,
    keep_last: int = 2,
    rank: int = 0,
    best: dict | None = None,
    frozen: dict[str, nn.Module] | None = None,
) -> Path:
    """Save a resumable checkpoint (a collective: every rank writes its own shards). `meta` identifies what was
    trained (stage, model config) so a wrong checkpoint is refused at load; `extra` holds loop state (data position,
    metrics); `frozen` names models without an optimizer whose weights change during the run (GRPO's refreshed
    reference), saved sharded beside the model. `best`: this checkpoint is the new best by a validation metric; the
    record (metric, mode, value) goes to best.json. A write that fails on any rank raises CheckpointWriteError on
    every rank, after the temporary folder is removed."""
    ckpt_root = Path(run_dir) / "checkpoints"
    final = ckpt_root / f"step_{step:08d}"
    tmp = ckpt_root / f".step_{step:08d}.tmp"
    sharded = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
    sharded |= {name: get_model_state_dict(m) for name, m in (frozen or {}).items()}
    needed = _state_bytes(sharded)
    error = None
    if rank == 0:
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / SHARDED).mkdir(parents=True)
        except OSError as e:
            error = _write_failure(e, ckpt_root, needed)
    # the folder exists (and holds nothing of an earlier, killed save) before any rank writes into it
    _agree_on_write(error, tmp, final, rank)
    digests = {}
    try:
        # each rank writes its shards, fsynced (FileSystemWriter's sync_files); rank 0 then writes the .metadata index
        dcp.save(
            sharded,
            storage_writer=dcp.FileSystemWriter(tmp / SHARDED, sync_files=True),
            no_dist=not dist.is_initialized(),
        )
        # each rank hashes the shard files it wrote (DCP names them __RANK_N.distcp), rank 0 also the index
        mine = sorted(p.name for p in (tmp / SHARDED).glob(f"__{rank}_*"))
        mine += [".metadata"] if rank == 0 else []
        digests = {f"{SHARDED}/{k}": v for k, v in _digests(tmp / SHARDED, mine).items()}
    except (Exception, dcp.CheckpointException) as e:  # DCP raises on every rank when any rank failed to write (its
        # CheckpointException is a BaseException)
        error = _write_failure(e, ckpt_root, needed)
    _agree_on_write(error, tmp, final, rank)
    rngs = _gather_objects(rng_state())
    all_digests = _gather_objects(digests)
    if rank == 0:
        try:
            state = {
                "step": step,
                "meta": meta,
                "scheduler": scheduler.state_dict() if scheduler is not None else None,
                "rng": rngs,
                "extra": extra or {},
                "frozen": sorted(frozen or {}),
                "digests": DIGESTS,  # this checkpoint records digests: without the file it is damaged
            }
            _save_file(state, tmp / "state.pt")
            _atomic_write_text(tmp / "meta.json", json.dumps({**meta, "step": step, "digests": DIGESTS}))
            files = {k: v for d in all_digests for k, v in d.items()} | _digests(tmp, ["state.pt", "meta.json"])
            files = dict(sorted(files.items()))
            _atomic_write_text(tmp / DIGESTS, json.dumps({"files": files, "sha256": _listing_digest(files)}, indent=1))
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            _atomic_write_text(ckpt_root / "latest", final.name)
            if best is not None:
                record = {"checkpoint": final.name, "step": step, **best}
                _atomic_write_text(ckpt_root / "best.json", json.dumps(record))
        except Exception as e:
            error = _write_failure(e, ckpt_root, needed)
    _agree_on_write(error, tmp, final, rank)
    if rank == 0:
        # prune: the newest keep_last, the best, and nothing half-written by a killed save
        record = read_best(run_dir)
        keep = {record["checkpoint"]} if record else set()
        done = _step_folders(ckpt_root)
        keep |= {p.name for p in done[-max(1, keep_last) :]}
        for p in done:
            if p.name not in keep:
                shutil.rmtree(p, ignore_errors=True)
        for p in ckpt_root.glob(".step_*.tmp"):
            shutil.rmtree(p, ignore_errors=True)
    _barrier()
    return final


def _read_pointer(ckpt_root: Path) -> str | None:
    """The checkpoint name `latest` holds, None when there is no such file; a warning when it cannot be read."""
    pointer = ckpt_root / "latest"
    if not pointer.is_file():
        return None
    try:
        return pointer.read_bytes().decode("utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        _warn(f"{pointer} cannot be read ({type(e).__name__}: {e}); looking for the newest complete checkpoint")
        return ""


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The checkpoint `latest` names; when that is missing or incomplete (a folder deleted by hand), the newest
    complete one, with a warning; None when there is none. Checks no file's contents (see newest_intact)."""
    ckpt_root = Path(run_dir) / "checkpoints"
    name = _read_pointer(ckpt_root)
    if name:
        path = ckpt_root / name
        if (path / "state.pt").is_file():
            return path
    done = _step_folders(ckpt_root) if ckpt_root.is_dir() else []
    if done and name:
        _warn(f"{ckpt_root / 'latest'} names {name!r}, which is missing or incomplete; using {done[-1]}")
    return done[-1] if done else None


def _records_digests(path: Path) -> bool:
    """Whether the checkpoint was written with a digests.json (meta.json, else state.pt, says so); an unreadable
    meta.json or state.pt counts as yes: such a checkpoint cannot be trusted either way."""
    try:
        if (path / "meta.json").is_file():
            return "digests" in json.loads((path / "meta.json").read_bytes().decode("utf-8"))
        return "digests" in torch.load(path / "state.pt", map_location="cpu", weights_only=False)
    except Exception:  # unreadable: not to be trusted
        return True


def damage(path: str | Path, rank: int = 0, world: int = 1) -> str | None:
    """None when the checkpoint at `path` is intact, else what is wrong with it, naming the file: state.pt missing,
    digests.json unreadable, or a file it lists missing, of another size or with another SHA-256. Rank r hashes
    files r, r + world, ... and the ranks share what they found (a collective when world > 1, every rank gets the
    same answer). A checkpoint without digests.json (written by code that did not record them) is not checked."""
    path = Path(path)
    found = None
    listed: dict = {}
    if not (path / "state.pt").is_file():
        found = f"{path / 'state.pt'} is missing"
    elif not (path / DIGESTS).is_file():
        if _records_digests(path):
            found = f"{path / DIGESTS} is missing"
    else:
        try:
            record = json.loads((path / DIGESTS).read_bytes().decode("utf-8"))
            listed = record["files"]
            if _listing_digest(listed) != record["sha256"]:
                found, listed = f"{path / DIGESTS} was altered (its list does not match its own SHA-256)", {}
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
            found, listed = f"{path / DIGESTS} cannot be read ({type(e).__name__}: {e})", {}
    names = sorted(listed)
    mine = {}
    for name in names[rank::world]:
        file, want = path / name, listed[name]
        try:
            size = file.stat().st_size
            if size != want["bytes"]:
                mine[name] = f"{file} has {size:,} bytes, {want['bytes']:,} were written"
            elif _sha256(file) != want["sha256"]:
                mine[name] = f"{file} was altered (its SHA-256 differs from the one recorded when it was written)"
        except FileNotFoundError:
            mine[name] = f"{file} is missing"
        except (OSError, KeyError, TypeError) as e:
            mine[name] = f"{file} cannot be checked ({type(e).__name__}: {e})"
    problems = {k: v for d in _gather_objects(mine) for k, v in d.items()} if world > 1 else mine
    if found is None and problems:
        found = problems[min(problems, key=names.index)]
    return found


def newest_intact(run_dir: str | Path, rank: int = 0, world: int = 1) -> Path | None:
    """The checkpoint to resume from: the one `latest` names (a warning when it cannot be read or names no folder),
    else the newest, if it is intact (see damage); a damaged one is named in a warning line and the next older one is
    tried. None when there is no checkpoint; CheckpointError (one line naming each) when none is intact."""
    ckpt_root = Path(run_dir) / "checkpoints"
    if not ckpt_root.is_dir():
        return None
    folders = sorted((p for p in ckpt_root.glob("step_*") if p.is_dir()), reverse=True)
    name = _read_pointer(ckpt_root)
    if name and ckpt_root / name not in folders:
        _warn(f"{ckpt_root / 'latest'} names {name!r}, which is missing; looking for the newest checkpoint")
    candidates = sorted(folders, key=lambda p: p.name != name)  # stable: the named one first, then newest first
    damaged = []
    for i, path in enumerate(candidates):
        why = damage(path, rank, world)
        if why is None:
            return path
        older = candidates[i + 1].name if i + 1 < len(candidates) else None
        _warn(
            f"checkpoint {path.name} is damaged: {why}; "
            + (f"trying the one before it, {older}" if older else "no older checkpoint is left")
        )
        damaged.append(f"{path.name}: {why}")
    if damaged:
        raise CheckpointError(
            f"no intact checkpoint in {ckpt_root} ({'; '.join(damaged)}); restore the files, or move {ckpt_root} "
            f"away to start the run over"
        )
    return None


def _describe_mismatch(key: str, got, want) -> str:
    if isinstance(got, dict) and isinstance(want, dict):
        keys = [k for k in sorted(set(got) | set(want)) if got.get(k) != want.get(k)]
        return (
            ", ".join(f"{k}={got.get(k)!r}" for k in keys)
            + " but this run's model has "
            + ", ".join(f"{k}={want.get(k)!r}" for k in keys)
        )
    return f"{key}={got!r} but this run expects {key}={want!r}"


def check_meta(path: Path, saved: dict, meta: dict) -> None:
    """CheckpointError unless the checkpoint's meta (stage, model config) equals this run's."""
    for key, want in meta.items():
        got = saved.get(key)
        if got != want:
            what = "was written by another stage" if key == "stage" else "holds another model"
            raise CheckpointError(f"checkpoint {path} {what}: {_describe_mismatch(key, got, want)}")


def _read_meta(path: Path) -> dict:
    file = path / "meta.json"
    if file.is_file():
        try:
            return json.loads(file.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"cannot read {file} ({e})") from None
    return _load_state(path)["meta"]  # a checkpoint from before meta.json existed


def _load_state(path: Path) -> dict:
    file = path / "state.pt"
    if not file.is_file():
        raise CheckpointError(f"no checkpoint at {path} (expected {file})")
    try:
        return torch.load(file, map_location="cpu", weights_only=False)
    except Exception as e:  # truncated, or not a checkpoint
        raise CheckpointError(
            f"cannot read checkpoint {file} ({type(e).__name__}: {e}); delete that folder to resume from an older one"
        ) from None


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
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    rank = dist.get_rank()
    token = [os.urandom(8).hex() if rank == 0 else None]
    dist.broadcast_object_list(token, src=0)
    marker = Path(run_dir) / f".shared_check_{token[0]}"
    if rank == 0:
        marker.write_text("")
    _barrier()
    deadline = time.monotonic() + wait_s
    while not marker.is_file() and time.monotonic() < deadline:
        time.sleep(0.5)
    seen = _gather_objects(marker.is_file())
    if rank == 0:
        marker.unlink()
    blind = [r for r, ok in enumerate(seen) if not ok]
    if blind:
        raise ConfigError(
            f"--out_dir {run_dir} is not the same folder on every rank: ranks {blind} do not see the file rank 0 "
            f"wrote there; with several nodes --out_dir must be on a filesystem they all share (every rank writes its "
            f"checkpoint shards into it)"
        )


def find_checkpoint(run_dir: str | Path, resume: bool, resume_from: str, meta: dict) -> Path | None:
    """The checkpoint this run starts from, checked for damage (see damage) and against `meta`, before any model is
    built.

    The run directory's own newest intact checkpoint comes first (so rerunning the same command after a crash
    continues where it stopped; a damaged newer one is named in a warning and skipped); otherwise --resume_from: a
    checkpoint folder (holding state.pt; damaged: an error) or a run directory (its newest intact checkpoint). With
    --resume false and checkpoints in --out_dir, refuses to start over on top of them. Checks first that --out_dir
    is a writable directory that every rank sees."""
    check_run_dir(run_dir)
    check_shared_dir(run_dir)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    ckpt_root = Path(run_dir) / "checkpoints"
    own = sorted(p for p in ckpt_root.glob("step_*") if p.is_dir()) if ckpt_root.is_dir() else []
    if own and not resume:
        raise ConfigError(
            f"--out_dir {run_dir} already holds checkpoints (newest: {own[-1].name}) and --resume is false: starting "
            f"over would overwrite them; use --resume true to continue, another --out_dir, or delete {ckpt_root}"
        )
    path = newest_intact(run_dir, rank, world)
    if path is None and resume_from:
        source = Path(resume_from)
        if (source / "state.pt").is_file():
            path = source
            why = damage(path, rank, world)
            if why is not None:
                raise CheckpointError(f"--resume_from {resume_from}: checkpoint is damaged: {why}")
        elif (source / "checkpoints").is_dir() and latest_checkpoint(source) is not None:
            path = newest_intact(source, rank, world)
        else:
            raise CheckpointError(
                f"--resume_from {resume_from}: no checkpoint there (expected a checkpoint folder holding state.pt, "
                f"or a run directory with checkpoints/)"
            )
    if path is not None:
        check_meta(path, _read_meta(path), meta)
    return path


def load_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizer,
    scheduler,
    meta: dict,
    rank: int = 0,
    frozen: dict[str, nn.Module] | None = None,
) -> dict:
    """Restore a checkpoint written by save_checkpoint into a sharded model and optimizer (a collective: every rank
    reads the slices of the shards it holds, whatever the world size that wrote them), and the `frozen` models it
    holds; returns the state's `step` and `extra`. Refuses a checkpoint whose `meta` (stage, model config) differs."""
    path = Path(path)
    state = _load_state(path)
    check_meta(path, state["meta"], meta)
    saved_names = state.get("frozen", state["extra"])  # before checkpoints were sharded, frozen models sat in extra
    saved_frozen = {name: m for name, m in (frozen or {}).items() if name in saved_names}
    try:
        if "model" in state:  # written before checkpoints were sharded: full tensors in state.pt
            full = StateDictOptions(full_state_dict=True)
            set_model_state_dict(model, state["model"], options=full)
            set_optimizer_state_dict(model, optimizer, state["optimizer"], options=full)
            for name, m in saved_frozen.items():
                set_model_state_dict(m, state["extra"][name], options=full)
        else:
            sharded = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
            sharded |= {name: get_model_state_dict(m) for name, m in saved_frozen.items()}
            dcp.load(
                sharded,
                storage_reader=dcp.FileSystemReader(path / SHARDED),  # in place, into this rank's shards
                no_dist=not dist.is_initialized(),
            )
            set_model_state_dict(model, sharded["model"])
            set_optimizer_state_dict(model, optimizer, sharded["optimizer"])
            for name, m in saved_frozen.items():
                set_model_state_dict(m, sharded[name])
        if scheduler is not None and state["scheduler"] is not None:
            scheduler.load_state_dict(state["scheduler"])
    except (RuntimeError, KeyError, ValueError, dcp.CheckpointException) as e:  # written by other code, edited, cut
        if isinstance(e, dcp.CheckpointException):  # raised on every rank (DCP gathers the failures): the first cause
            e = next(iter(e.failures.values()))[0]
        raise CheckpointError(
            f"checkpoint {path} does not fit this run's model and optimizer ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''})"
        ) from None
    rngs = state["rng"]
    world = dist.get_world_size() if dist.is_initialized() else 1
    if len(rngs) == world:
        set_rng_state(rngs[rank])
    else:  # resumed on another world size: per-rank streams cannot be matched, reseed deterministically
        torch.manual_seed(stream_seed(state["step"], rank, "resume"))
    return {"step": state["step"], "extra": state["extra"]}


def read_tensors(path: str | Path, part: str = "model") -> dict[str, torch.Tensor]:
    """Full (unsharded) tensors of one part of a checkpoint ("model", "optimizer" or a frozen model's name), read in
    this process alone (no process group): for inspecting a checkpoint, not for resuming."""
    path = Path(path)
    if "model" in (state := _load_state(path)):  # written before checkpoints were sharded
        return state[part] if part in state else state["extra"][part]
    with warnings.catch_warnings():  # DCP warns that it runs without a process group: that is the intent here
        warnings.simplefilter("ignore", UserWarning)
        return _load_state_dict_from_keys({part}, checkpoint_id=path / SHARDED)[part]


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


def export_model(model: nn.Module, write: Callable[[dict[str, torch.Tensor]], None], rank: int = 0) -> None:
    """Gather the full weights (a collective) and hand them to `write` on rank 0 (model.weights.save_export writes a
    Hugging Face-format folder, LoRA adapters merged); every rank waits until it has written."""
    sd = full_model_state(model)
    if rank == 0:
        write(sd)
    if dist.is_initialized():
        dist.barrier()
