"""Run under 2 processes: a training script whose writes to one file of the run directory fail on rank 0 as on a full
disk (ENOSPC; rank 0 writes the run's files), to check that every rank stops together with exit code 4.

    python -m torch.distributed.run --nproc_per_node=2 tests/scripts/full_disk.py OUT_DIR FILE TRIGGER SCRIPT ARGS...

FILE: the name of the file whose writes fail (metrics.jsonl, samples.jsonl, metrics.jsonl.tmp, config.json.tmp), or a
pattern of names (events.out.tfevents.*: TensorBoard's event file);
TRIGGER: only a write whose text holds it fails ("": every write). Each rank writes OUT_DIR/rank{r}.json: the exception
that ends its main() (class, message, exit code) and the time it was raised, before exit_on_error prints and exits.
"""

import builtins
import importlib
import io
import json
import os
import sys
import time
from fnmatch import fnmatch
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.helpers import FullDiskFile  # noqa: E402
from utils.config import parse_config  # noqa: E402
from utils.guard import exit_on_error  # noqa: E402


def fill_disk(name: str, trigger: str) -> None:
    """builtins.open and io.open (Path.write_text's) give a FullDiskFile for a file whose name matches `name` (a name or
    a pattern) opened to write."""
    real_open = io.open

    def full_open(path, mode="r", *args, **kwargs):
        file = real_open(path, mode, *args, **kwargs)
        writes = any(c in mode for c in "wax+")
        return FullDiskFile(file, trigger) if writes and fnmatch(Path(os.fsdecode(path)).name, name) else file

    builtins.open = io.open = full_open


def main(out_dir: str, name: str, trigger: str, script: str, *args: str) -> None:
    rank = int(os.environ["RANK"])
    if rank == 0:
        fill_disk(name, trigger)
    module = importlib.import_module(Path(script).stem)

    def record(error) -> None:
        ended = None if error is None else [type(error).__name__, str(error), getattr(error, "exit_code", None)]
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"error": ended, "time": time.time()}))

    with exit_on_error():
        try:
            module.main(parse_config(module.Config, list(args)))
        except Exception as e:
            record(e)
            raise
        record(None)


if __name__ == "__main__":
    main(*sys.argv[1:])
