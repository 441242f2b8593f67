"""A checkpoint's digests: the size and SHA-256 of every file of a checkpoint, listed in its digests.json with the
list's own SHA-256 when the checkpoint is written (utils/checkpoint.py save_checkpoint), and read back and compared
before a resume reads anything (utils/checkpoint.py checkpoint_problem), so that a damaged file is named, not loaded.
"""

import hashlib
import json
from pathlib import Path

DIGESTS = "digests.json"  # {file relative to the checkpoint: {"bytes", "sha256"}} of every other file in it


def sha256(file: Path) -> str:
    """SHA-256 of the file's bytes, read in chunks of 4 MiB."""
    h = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def file_digests(folder: Path, names: list[str]) -> dict[str, dict]:
    """{name: {"bytes", "sha256"}} of files inside `folder` (names relative to it)."""
    return {name: {"bytes": (folder / name).stat().st_size, "sha256": sha256(folder / name)} for name in names}


def listing_digest(files: dict) -> str:
    """SHA-256 of digests.json's own list, so that an edit of the list itself is found too."""
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def read_digests(path: Path) -> tuple[dict, str | None]:
    """({file name: {"bytes", "sha256"}} as digests.json lists them, None), or ({}, what is wrong)."""
    if not (path / "state.pt").is_file():
        return {}, f"{path / 'state.pt'} is missing"
    try:
        record = json.loads((path / DIGESTS).read_bytes().decode("utf-8"))
        if listing_digest(record["files"]) != record["sha256"]:
            return {}, f"{path / DIGESTS} was altered (its list does not match its own SHA-256)"
        if not all({"bytes", "sha256"} <= set(entry) for entry in record["files"].values()):
            raise ValueError("an entry lacks its bytes or sha256")
        return record["files"], None
    except FileNotFoundError:
        return {}, f"{path / DIGESTS} is missing"
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
        return {}, f"{path / DIGESTS} cannot be read ({type(e).__name__}: {e})"


def size_problem(file: Path, want: int) -> str | None:
    """What this rank's view of the file system says is wrong with `file`'s size; None when it is as written."""
    try:
        size = file.stat().st_size
    except FileNotFoundError:
        return f"{file} is missing"
    except OSError as e:
        return f"{file} cannot be checked ({type(e).__name__}: {e})"
    return f"{file} has {size:,} bytes, {want:,} were written" if size != want else None
