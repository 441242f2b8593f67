"""Checkpoints: a resumable training state, written atomically, verified before it is read.

Layout under a run directory:
    checkpoints/step_00000100/sharded/    model and optimizer state (and any frozen model the stage names, e.g. GRPO's
                                          refreshed reference) as a torch.distributed.checkpoint (DCP) folder: every
                                          rank writes its own shards (__RANK_N.distcp), rank 0 the .metadata index
    checkpoints/step_00000100/state.pt    step, stage and model config, scheduler, data position and loop state,
                                          every rank's RNG state (small; rank 0): tensors and plain values only, read
                                          with torch.load(weights_only=True), so a resume runs no code it carries
    checkpoints/step_00000100/meta.json   stage and model config, step and the run's options (read first)
    checkpoints/step_00000100/digests.json  size and SHA-256 of every other file of the checkpoint, taken when it was
                                          written and checked before a resume reads anything
    checkpoints/latest                    name of the newest complete checkpoint
    checkpoints/best.json                 the checkpoint with the best validation metric: name, metric, value

Every rank writes only the shards it holds into a temporary folder, flushed to disk before it is renamed: a process
killed during a save leaves the previous checkpoint and `latest` intact; a save that cannot write (a full disk)
removes it and stops every rank with one line. DCP records every tensor's global shape, so a run resumes on another
number of ranks. A resume checks every file against digests.json first (utils/digests.py; the ranks hash a share
each): a damaged checkpoint is named in one warning line and the next older one is tried. A checkpoint of an older
format of this project is refused with one line. docs/distributed.md and docs/errors.md describe the format and its
guarantees.
"""

import json
import os
import pickle
import re
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

# DCP's own reader of some of a checkpoint's keys, as full tensors, in one process (what its format tools use)
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys
from torch.utils._pytree import tree_leaves

from utils.digests import DIGESTS, file_digests, listing_digest, read_digests, sha256, size_problem
from utils.dist import barrier, broadcast_object, gather_objects, rank_and_world, reseed, rng_state, set_rng_state
from utils.rundir import RunWriteError, describe_write_failure, read_best, save_torch_synced, warn, write_text_atomic

SHARDED = "sharded"  # the DCP folder inside a checkpoint


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, unreadable, or from another stage or model; the message names it."""

    exit_code = 2


class CheckpointWriteError(RunWriteError):
    """A checkpoint that could not be written (a full disk, or another OS error); the message names the folder."""


def _step_folders(ckpt_root: Path) -> list[Path]:
    """Complete checkpoints (a state.pt inside), oldest first."""
    return sorted(p for p in ckpt_root.glob("step_*") if (p / "state.pt").is_file())


def _state_bytes(state: dict) -> int:
    """Bytes of every tensor in a (nested) state dict, at their global shapes: what a checkpoint of it needs on disk."""
    return sum(t.numel() * t.element_size() for t in tree_leaves(state) if isinstance(t, torch.Tensor))


def _agree_on_write(error: str | None, tmp: Path, final: Path, rank: int) -> None:
    """After a phase of a save: when any rank failed to write, rank 0 removes the temporary folder and every rank
    raises the first failure (a collective), so no rank waits for a peer that left."""
    first = next((e for e in gather_objects(error) if e is not None), None)
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
    options: dict | None = None,
) -> Path:
    """Save a resumable checkpoint (a collective: every rank writes its own shards). `meta` identifies what was
    trained (stage, model config) so a wrong checkpoint is refused at load; `extra` holds loop state (data position,
    metrics); `frozen` names models without an optimizer whose weights change during the run (GRPO's refreshed
    reference), saved sharded beside the model. `best`: this checkpoint is the new best by a validation metric; the
    record (metric, mode, value) goes to best.json. `options`: the run's record of options (utils.rundir), kept in
    meta.json: a resume checks its options against the checkpoint's own copy. A write that fails on any rank raises
    CheckpointWriteError on every rank, after the temporary folder is removed."""
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
            error = describe_write_failure(e, ckpt_root, needed)
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
        written_here = sorted(p.name for p in (tmp / SHARDED).glob(f"__{rank}_*"))
        written_here += [".metadata"] if rank == 0 else []
        digests = {f"{SHARDED}/{k}": v for k, v in file_digests(tmp / SHARDED, written_here).items()}
    except (Exception, dcp.CheckpointException) as e:  # DCP raises on every rank when any rank failed to write (its
        # CheckpointException is a BaseException)
        error = describe_write_failure(e, ckpt_root, needed)
    _agree_on_write(error, tmp, final, rank)
    rngs = gather_objects(rng_state())
    all_digests = gather_objects(digests)
    if rank == 0:
        try:
            state = {
                "step": step,
                "meta": meta,
                "scheduler": scheduler.state_dict() if scheduler is not None else None,
                "rng": rngs,
                "extra": extra or {},
                "frozen": sorted(frozen or {}),
            }
            save_torch_synced(state, tmp / "state.pt")
            write_text_atomic(
                tmp / "meta.json",
                json.dumps({**meta, "step": step, "digests": DIGESTS, "options": options}, default=str),
            )
            files = {k: v for d in all_digests for k, v in d.items()} | file_digests(tmp, ["state.pt", "meta.json"])
            files = dict(sorted(files.items()))
            write_text_atomic(tmp / DIGESTS, json.dumps({"files": files, "sha256": listing_digest(files)}, indent=1))
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            write_text_atomic(ckpt_root / "latest", final.name)
            if best is not None:
                record = {"checkpoint": final.name, "step": step, **best}
                write_text_atomic(ckpt_root / "best.json", json.dumps(record))
        except Exception as e:
            error = describe_write_failure(e, ckpt_root, needed)
    _agree_on_write(error, tmp, final, rank)
    if rank == 0:
        # prune: the newest keep_last, the best, and nothing half-written by a killed save
        record, complete = read_best(run_dir), _step_folders(ckpt_root)
        keep = {p.name for p in complete[-max(1, keep_last) :]} | ({record["checkpoint"]} if record else set())
        for p in [p for p in complete if p.name not in keep] + list(ckpt_root.glob(".step_*.tmp")):
            shutil.rmtree(p, ignore_errors=True)
    barrier()
    return final


def _read_pointer(ckpt_root: Path) -> str | None:
    """The checkpoint name `latest` holds, None when there is no such file; a warning when it cannot be read."""
    pointer = ckpt_root / "latest"
    if not pointer.is_file():
        return None
    try:
        return pointer.read_bytes().decode("utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        warn(f"{pointer} cannot be read ({type(e).__name__}: {e}); looking for the newest complete checkpoint")
        return ""


def check_format(path: Path, rank: int = 0) -> None:
    """CheckpointError when the checkpoint at `path` is of an older format of this project: a state.pt without a
    digests.json, and a meta.json that is missing or names none (a collective: rank 0 reads). One whose meta.json
    names digests.json, or cannot be read, is of this format: checkpoint_problem finds what is wrong with it."""
    older = False
    if rank == 0 and (path / "state.pt").is_file() and not (path / DIGESTS).is_file():
        try:
            older = "digests" not in json.loads((path / "meta.json").read_bytes().decode("utf-8"))
        except FileNotFoundError:
            older = True
        except (OSError, ValueError, TypeError):  # unreadable: a damaged checkpoint of this format
            pass
    if broadcast_object(older):
        raise CheckpointError(
            f"checkpoint {path} is from an older checkpoint format of this project (no {DIGESTS}) and cannot be "
            f"loaded; move it away (or use another --out_dir) to start the run over"
        )


def checkpoint_problem(path: str | Path, rank: int = 0, world: int = 1) -> str | None:
    """None when the checkpoint at `path` is intact, else what is wrong with it, naming the file: state.pt or
    digests.json missing or unreadable, or a file it lists missing, of another size or with another SHA-256 (a
    collective when world > 1: every rank gets the same answer). Rank 0 reads digests.json; every rank checks that
    it sees every listed file at its size (ranks whose views of a shared file system differ: CheckpointError, one
    line naming the first file and the ranks); rank r hashes files r, r + world, ..."""
    path = Path(path)
    recorded, problem = broadcast_object(read_digests(path) if rank == 0 else None)
    names = sorted(recorded)
    views = gather_objects({name: size_problem(path / name, recorded[name]["bytes"]) for name in names})
    for name in names:
        if any(view[name] != views[0][name] for view in views):
            sees = "; ".join(f"rank {r}: {view[name] or 'as written'}" for r, view in enumerate(views))
            raise CheckpointError(
                f"the ranks see checkpoint {path} differently ({sees}): --out_dir must show every node the same "
                f"files (a shared file system whose caches have settled); rerun when they agree"
            )
    altered = "was altered (its SHA-256 differs from the one recorded when it was written)"
    hashed_here = [n for n in names[rank::world] if views[0][n] is None]  # files r, r + world, ... seen whole
    problems_here = {n: f"{path / n} {altered}" for n in hashed_here if sha256(path / n) != recorded[n]["sha256"]}
    problems = {k: v for d in gather_objects(problems_here) for k, v in d.items()}
    problems |= {name: views[0][name] for name in names if views[0][name] is not None}
    if problem is None and problems:
        problem = problems[min(problems, key=names.index)]
    return problem


def newest_intact(run_dir: str | Path, rank: int = 0, world: int = 1) -> Path | None:
    """The checkpoint to resume from, as rank 0 chooses it (a collective): the one `latest` names (a warning when it
    cannot be read or names no folder), else the newest, if it is intact (see checkpoint_problem: every rank checks
    it); a damaged one is named in a warning line and the next older one is tried. None when there is no checkpoint;
    CheckpointError (one line naming each) when none is intact, or when one is of an older format (check_format)."""
    ckpt_root = Path(run_dir) / "checkpoints"
    candidates = []
    if rank == 0 and ckpt_root.is_dir():
        folders = sorted((p for p in ckpt_root.glob("step_*") if p.is_dir()), reverse=True)
        name = _read_pointer(ckpt_root)
        if name and ckpt_root / name not in folders:
            warn(f"{ckpt_root / 'latest'} names {name!r}, which is missing; looking for the newest checkpoint")
        candidates = sorted(folders, key=lambda p: p.name != name)  # stable: the named one first, then newest first
    candidates = broadcast_object(candidates)
    damaged = []
    for i, path in enumerate(candidates):
        check_format(path, rank)
        problem = checkpoint_problem(path, rank, world)
        if problem is None:
            return path
        older = candidates[i + 1].name if i + 1 < len(candidates) else None
        warn(
            f"checkpoint {path.name} is damaged: {problem}; "
            + (f"trying the one before it, {older}" if older else "no older checkpoint is left")
        )
        damaged.append(f"{path.name}: {problem}")
    if damaged:
        raise CheckpointError(
            f"no intact checkpoint in {ckpt_root} ({'; '.join(damaged)}); restore the files, or move {ckpt_root} "
            f"away to start the run over"
        )
    return None


def check_meta(path: Path, saved: dict, meta: dict) -> None:
    """CheckpointError unless the checkpoint's meta (stage, model config) equals this run's, naming what differs."""
    for key, want in meta.items():
        if (got := saved.get(key)) == want:
            continue
        what = "was written by another stage" if key == "stage" else "holds another model"
        if isinstance(got, dict) and isinstance(want, dict):
            keys = [k for k in sorted(set(got) | set(want)) if got.get(k) != want.get(k)]
            mismatch = ", ".join(f"{k}={got.get(k)!r}" for k in keys) + " but this run's model has "
            mismatch += ", ".join(f"{k}={want.get(k)!r}" for k in keys)
        else:
            mismatch = f"{key}={got!r} but this run expects {key}={want!r}"
        raise CheckpointError(f"checkpoint {path} {what}: {mismatch}")


def _read_meta(path: Path) -> dict:
    file = path / "meta.json"
    try:
        return json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {file} ({e})") from None


def read_options(path: Path) -> dict | None:
    """The record of options the checkpoint at `path` was saved with (see save_checkpoint), None when it holds none."""
    return _read_meta(path).get("options")


def _numpy_values() -> list:
    """What numpy arrays and scalars unpickle from: checkpoints written before utils.dist.rng_state kept plain values
    hold numpy's RNG state as an array. Data constructors only; the values inside still go through torch's restricted
    unpickler."""
    import numpy as np

    multiarray = np._core.multiarray if hasattr(np, "_core") else np.core.multiarray
    dtypes = [type(np.dtype(t)) for t in ("uint32", "int64", "float64", "float32", "bool")]
    return [multiarray._reconstruct, multiarray.scalar, np.ndarray, np.dtype, *dtypes]


def _load_state(path: Path) -> dict:
    """The small training state (state.pt), read with torch.load(weights_only=True): tensors, plain Python values and
    numpy arrays only, so that a resume runs no code a checkpoint carries; anything else is refused in one line."""
    file = path / "state.pt"
    if not file.is_file():
        raise CheckpointError(f"no checkpoint at {path} (expected {file})")
    try:
        with torch.serialization.safe_globals(_numpy_values()):
            return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:  # a global that is not a tensor or a plain value: code would run
        found = re.search(r"GLOBAL (\S+)", str(e))
        what = f"it names {found.group(1)}" if found else str(e).splitlines()[0]
        raise CheckpointError(
            f"checkpoint {file} holds more than tensors and plain values ({what}) and is not loaded: a resume runs "
            f"no code a checkpoint carries; resume from a checkpoint this project wrote"
        ) from None
    except Exception as e:  # truncated, or not a checkpoint
        raise CheckpointError(
            f"cannot read checkpoint {file} ({type(e).__name__}: {e}); delete that folder to resume from an older one"
        ) from None


def find_checkpoint(run_dir: str | Path, resume_from: str, meta: dict) -> Path | None:
    """The checkpoint this run starts from, checked for damage (see checkpoint_problem) and against `meta`, before any
    model is built.

    The run directory's own newest intact checkpoint comes first (so rerunning the same command after a crash
    continues where it stopped; a damaged newer one is named in a warning and skipped); otherwise --resume_from: a
    checkpoint folder (holding state.pt; damaged: an error) or a run directory (its newest intact checkpoint), as rank
    0 sees it (a collective: ranks that took it differently would run different collectives). With --resume false the
    run directory holds no checkpoint (utils.rundir.refuse_start_over)."""
    rank, world = rank_and_world()
    path = newest_intact(run_dir, rank, world)
    if path is None and resume_from:
        source = Path(resume_from)
        if broadcast_object((source / "state.pt").is_file() if rank == 0 else None):
            path = source
            check_format(path, rank)
            problem = checkpoint_problem(path, rank, world)
            if problem is not None:
                raise CheckpointError(f"--resume_from {resume_from}: checkpoint is damaged: {problem}")
        elif (path := newest_intact(source, rank, world)) is None:
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
    seed: int = 0,
) -> dict:
    """Restore a checkpoint written by save_checkpoint into a sharded model and optimizer (a collective: every rank
    reads the slices of the shards it holds, whatever the world size that wrote them), and the `frozen` models it
    holds; returns the state's `step` and `extra`. Refuses a checkpoint whose `meta` (stage, model config) differs.
    Every rank's RNG state (torch, numpy, `random`) is restored; on another world size, where they cannot be
    matched, each is reseeded from (`seed`: the run's --seed, step, rank), with a warning."""
    path = Path(path)
    check_format(path, rank)
    state = _load_state(path)
    check_meta(path, state["meta"], meta)
    saved_frozen = {name: m for name, m in (frozen or {}).items() if name in state["frozen"]}
    try:
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
    rngs, world = state["rng"], rank_and_world()[1]
    if len(rngs) == world:
        set_rng_state(rngs[rank])
    else:  # per-rank streams cannot be matched: each rank's are reseeded from the run's seed, the step and the rank
        warn(
            f"checkpoint {path} was written by {len(rngs)} processes and resumes on {world}: the random streams "
            f"after it are reseeded from --seed {seed}, the step and the rank, so the run does not repeat bit for bit "
            f"one that kept {len(rngs)}"
        )
        reseed(seed, state["step"], rank, "resume")
    return {"step": state["step"], "extra": state["extra"]}


def read_tensors(path: str | Path, part: str = "model") -> dict[str, torch.Tensor]:
    """Full (unsharded) tensors of one part of a checkpoint ("model", "optimizer" or a frozen model's name), read in
    this process alone (no process group): for inspecting a checkpoint, not for resuming."""
    path = Path(path)
    check_format(path)
    with warnings.catch_warnings():  # DCP warns that it runs without a process group: that is the intent here
        warnings.simplefilter("ignore", UserWarning)
        return _load_state_dict_from_keys({part}, checkpoint_id=path / SHARDED)[part]
