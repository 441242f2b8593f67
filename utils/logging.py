"""Metrics on rank 0: wandb (online, offline or disabled), a metrics.jsonl file in the run directory that
tests and plots read, and tqdm progress bars."""

import json
import math
import os
from pathlib import Path

from tqdm import tqdm


class Logger:
    def __init__(self, run_dir: str | Path, config: dict, project: str, name: str, mode: str, enabled: bool):
        """mode: "online", "offline", "disabled", or "auto" (online when a wandb login is found, else offline)."""
        self.enabled = enabled
        self.run = None
        self.file = None
        if not enabled:
            return
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.file = open(self.run_dir / "metrics.jsonl", "a")
        if mode == "auto":
            mode = "online" if (os.environ.get("WANDB_API_KEY") or (Path.home() / ".netrc").is_file()) else "offline"
        if mode != "disabled":
            import wandb

            self.run = wandb.init(
                project=project, name=name, config=config, mode=mode, dir=str(self.run_dir),
                settings=wandb.Settings(silent=True),
            )

    def log(self, metrics: dict, step: int) -> None:
        if not self.enabled:
            return
        clean = {k: (float(v) if isinstance(v, (int, float)) else v) for k, v in metrics.items()}
        self.file.write(json.dumps({"step": step, **{k: v for k, v in clean.items() if _jsonable(v)}}) + "\n")
        self.file.flush()
        if self.run is not None:
            self.run.log(clean, step=step)

    def table(self, key: str, columns: list[str], rows: list[list], step: int) -> None:
        if not self.enabled:
            return
        with open(self.run_dir / f"{key.replace('/', '_')}.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "columns": columns, "rows": rows}) + "\n")
        if self.run is not None:
            import wandb

            self.run.log({key: wandb.Table(columns=columns, data=rows)}, step=step)

    def finish(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.run is not None:
            self.run.finish()


def _jsonable(v) -> bool:
    return isinstance(v, (int, str, bool)) or (isinstance(v, float) and math.isfinite(v))


def progress(total: int, initial: int, enabled: bool, desc: str):
    return tqdm(total=total, initial=initial, disable=not enabled, desc=desc, dynamic_ncols=True)
