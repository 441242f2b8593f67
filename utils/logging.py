"""Metrics on rank 0: wandb (online, offline or disabled), a metrics.jsonl file in the run directory that
tests and plots read, and tqdm progress bars."""

import importlib.util
import json
import time
from collections import defaultdict
from contextlib import contextmanager
import math
import os
import sys
from pathlib import Path

from tqdm import tqdm


class Logger:
    def __init__(
        self, run_dir: str | Path, config: dict, project: str, name: str, mode: str, enabled: bool,
        resume_step: int | None = None, group: str = "", tags: str = "",
    ):
        """mode: "online", "offline", "disabled", or "auto" (online when a wandb login is found, else offline; disabled,
        with one line saying so, when wandb is not installed).

        resume_step: the step a training run starts from (0 for a fresh start). Lines that a killed run wrote
        after that checkpoint are removed from metrics.jsonl and the table files, so a resumed run's files read as
        one uninterrupted run: every line with a later step, and every line of that step after its first (the
        one logged before the checkpoint was saved). A fresh start empties them. None appends to what is there.

        group, tags: the wandb group and comma-separated tags (empty: none). The config is also written to
        config.json in the run directory, which evaluation/compare.py reads."""
        self.enabled = enabled
        self.run = None
        self.file = None
        self.resume_step = resume_step
        self.tables_opened: set[str] = set()
        self.offline = False
        if not enabled:
            return
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._truncate(self.run_dir / "metrics.jsonl")
        self.file = open(self.run_dir / "metrics.jsonl", "a")
        (self.run_dir / "config.json").write_text(json.dumps(config, indent=1, default=str) + "\n")
        if mode == "auto" and importlib.util.find_spec("wandb") is None:
            say("wandb: --wandb_mode auto -> disabled (wandb is not installed): metrics.jsonl only")
            mode = "disabled"
        if mode == "auto":
            login = bool(os.environ.get("WANDB_API_KEY") or (Path.home() / ".netrc").is_file())
            mode = "online" if login else "offline"
            say(f"wandb: --wandb_mode auto -> {mode} ({'a' if login else 'no'} login in WANDB_API_KEY or ~/.netrc)")
        if mode != "disabled":
            import wandb

            self.run = wandb.init(
                project=project, name=name, config=config, mode=mode, dir=str(self.run_dir), group=group or None,
                tags=[t.strip() for t in tags.split(",") if t.strip()] or None,
                settings=wandb.Settings(silent=True),
            )
            self.offline = mode == "offline"
            if self.offline:
                say(self.offline_note())

    def offline_note(self) -> str:
        """Where an offline wandb run is and how to upload it (its folder holds files/, logs/ and the .wandb file)."""
        folder = Path(self.run.dir).parent
        return f"wandb: offline run in {folder}; upload it with: wandb sync {folder}"

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
        path = self.run_dir / f"{key.replace('/', '_')}.jsonl"
        if key not in self.tables_opened:
            self.tables_opened.add(key)
            self._truncate(path)
        with open(path, "a") as f:
            f.write(json.dumps({"step": step, "columns": columns, "rows": rows}) + "\n")
        if self.run is not None:
            import wandb

            self.run.log({key: wandb.Table(columns=columns, data=rows)}, step=step)

    def _truncate(self, path: Path) -> None:
        """Drop the lines logged after step resume_step's checkpoint (see __init__); atomic rewrite."""
        if self.resume_step is None or not path.is_file():
            return
        kept, seen_resume_step = [], False
        for line in path.read_text().splitlines(keepends=True):
            try:
                step = json.loads(line)["step"]
            except (json.JSONDecodeError, KeyError, TypeError):
                continue  # a line cut short by the kill
            if step < self.resume_step or (step == self.resume_step > 0 and not seen_resume_step):
                kept.append(line if line.endswith("\n") else line + "\n")
                seen_resume_step |= step == self.resume_step
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, path)

    def finish(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.run is not None:
            self.run.finish()
            if self.offline:
                say(self.offline_note())


def _jsonable(v) -> bool:
    return isinstance(v, (int, str, bool)) or (isinstance(v, float) and math.isfinite(v))


def say(message: str) -> None:
    """A line to stderr that does not collide with a live progress bar (tqdm clears and redraws it)."""
    tqdm.write(message, file=sys.stderr)


def close_progress_bars() -> None:
    """Close every live bar so that what is printed next starts on a line of its own."""
    for bar in list(getattr(tqdm, "_instances", [])):
        bar.close()


def progress(total: int, initial: int, enabled: bool, desc: str):
    return tqdm(total=total, initial=initial, disable=not enabled, desc=desc, dynamic_ncols=True)


class StageTimer:
    """Wall-clock seconds per named stage; synchronises the GPU so a stage is charged for its own kernels."""

    def __init__(self, device):
        self.device = device
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, name: str):
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.seconds[name] += time.perf_counter() - t0


def perf_metrics(seconds: dict[str, float], step_seconds: float, generated_tokens: float, world: int) -> dict:
    """perf/ metrics of a step: its seconds, generated tokens per second (overall and per device), and each stage's
    seconds and share of the step."""
    out = {"perf/step_seconds": step_seconds, "perf/tokens_per_second": generated_tokens / step_seconds,
           "perf/tokens_per_second_per_device": generated_tokens / step_seconds / world}
    for name, s in seconds.items():
        out[f"perf/{name}_seconds"], out[f"perf/{name}_share"] = s, s / step_seconds
    return out
