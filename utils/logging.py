"""Metrics on rank 0: a metrics.jsonl file in the run directory that tests and plots read, TensorBoard event files
beside it (--tensorboard), wandb (online, offline or disabled), and tqdm progress bars; publish_picture puts a picture
drawn from finished runs (the comparison, the frontier) in the same two places."""

import importlib.util
import itertools
import json
import math
import os
import socket
import struct
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

from tqdm import tqdm

from utils.metrics import DECLARED_FILE, EVALUATION_PREFIXES, declarations, headlines, metric, metric_direction
from utils.rundir import (
    RECORD,
    RunWriteError,
    drop_rows_after,
    stop_on_write_failure,
    write_record,
    write_text_atomic,
)


class Logger:
    def __init__(
        self,
        run_dir: str | Path,
        config: dict,
        project: str,
        name: str,
        mode: str,
        enabled: bool,
        resume_step: int | None = None,
        group: str = "",
        tags: str = "",
        record: bool = True,
        tensorboard: bool = False,
        hparam_metrics: tuple[str, ...] = (),
    ):
        """mode: "online", "offline", "disabled", or "auto" (online when a wandb login is found, else offline; disabled,
        with one line saying so, when wandb is not installed).

        resume_step: the step a training run starts from (0 for a fresh start). Lines that a killed run wrote
        after that checkpoint are removed from metrics.jsonl and the table files, so a resumed run's files read as
        one uninterrupted run: every line with a later step, and every line of that step after its first (the
        one logged before the checkpoint was saved). A fresh start empties them. None appends to what is there.

        group, tags: the wandb group and comma-separated tags (empty: none). With `record`, the config is also the
        run's record of options, config.json in the run directory (utils.rundir.write_record), which
        evaluation/compare.py reads.

        tensorboard: TensorBoard event files in the run directory as well (TensorBoardFile): every number of a row at
        its step, the tables as text, and with `record` the config's options as hyperparameters with `hparam_metrics`
        (the stage's headlines) as the HParams view's metric columns. Its writes fail as metrics.jsonl's do."""
        self.enabled = enabled
        self.run = None
        self.file = None
        self.resume_step = resume_step
        self.tables_opened: set[str] = set()
        self.offline = False
        self.started = time.perf_counter()
        self.logged = 0  # rows this process logged (0: a rerun of a finished run)
        self.write_failure: RunWriteError | None = None  # a table's failed write, raised by the next log()
        self.tensorboard: TensorBoardFile | None = None
        self.declared: dict[str, dict] = {}  # what DECLARED_FILE holds: the declarations of the metrics logged
        self.seen: set[str] = set()  # the metrics this process logged
        if not enabled:
            return
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with stop_on_write_failure(str(self.run_dir / "metrics.jsonl"), self.run_dir):
            self._truncate(self.run_dir / "metrics.jsonl")
            self.file = open(self.run_dir / "metrics.jsonl", "a")
        if resume_step != 0 and (self.run_dir / DECLARED_FILE).is_file():  # a resumed run's earlier metrics stay
            self.declared = read_declarations(self.run_dir)
        if record:
            with stop_on_write_failure(str(self.run_dir / RECORD), self.run_dir):
                write_record(self.run_dir, config)
        if tensorboard and tensorboard_installed():
            with stop_on_write_failure(str(self.run_dir / EVENT_FILES), self.run_dir):
                self.tensorboard = TensorBoardFile(self.run_dir, resume_step)
            if record:  # a run's own options; eval_preferences.py in a training run's folder leaves them alone
                with stop_on_write_failure(str(self.tensorboard.path), self.run_dir):
                    self.tensorboard.hparams(config, hparam_metrics)
                    self.tensorboard.flush()
        if mode == "auto" and importlib.util.find_spec("wandb") is None:
            say("wandb: --wandb_mode auto -> disabled (wandb is not installed): metrics.jsonl only")
            mode = "disabled"
        if mode == "auto":
            login = wandb_login()
            mode = "online" if login else "offline"
            say(f"wandb: --wandb_mode auto -> {mode} ({'a' if login else 'no'} login in WANDB_API_KEY or ~/.netrc)")
        if mode != "disabled":
            import wandb

            self.run = wandb.init(
                project=project,
                name=name,
                config=config,
                mode=mode,
                dir=str(self.run_dir),
                group=group or None,
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
        """Append a row to metrics.jsonl (and wandb). A write that fails here or in a table since the last row raises
        utils.rundir.RunWriteError (exit code 4, one line): the training scripts call this inside an agreement over
        ranks (utils.run.log_row), so every rank stops together."""
        if not self.enabled:
            return
        if self.write_failure is not None:
            raise self.write_failure
        clean = {k: (float(v) if isinstance(v, (int, float)) else v) for k, v in metrics.items()}
        self.logged += 1
        with stop_on_write_failure(str(self.run_dir / "metrics.jsonl"), self.run_dir):
            self.file.write(json.dumps({"step": step, **{k: v for k, v in clean.items() if _jsonable(v)}}) + "\n")
            self.file.flush()
        if new := clean.keys() - self.seen:  # a metric new to this process: its declaration beside the rows
            self.seen |= new
            self.declared |= declarations(sorted(new))
            with stop_on_write_failure(str(self.run_dir / DECLARED_FILE), self.run_dir):
                write_text_atomic(self.run_dir / DECLARED_FILE, json.dumps(self.declared, indent=1) + "\n")
        if self.tensorboard is not None:
            with stop_on_write_failure(str(self.tensorboard.path), self.run_dir):
                self.tensorboard.scalars(clean, step)
                self.tensorboard.flush()  # on disk now: a failure is this row's, inside the ranks' agreement
        if self.run is not None:
            self.run.log(clean, step=step)

    def table(self, key: str, columns: list[str], rows: list[list], step: int) -> None:
        if not self.enabled:
            return
        path = self.run_dir / f"{key.replace('/', '_')}.jsonl"
        try:  # on rank 0 alone, inside an evaluation: a failure waits for the next log(), which every rank agrees on
            with stop_on_write_failure(str(path), self.run_dir):
                if key not in self.tables_opened:
                    self.tables_opened.add(key)
                    self._truncate(path)
                with open(path, "a") as f:
                    f.write(json.dumps({"step": step, "columns": columns, "rows": rows}) + "\n")
            if self.tensorboard is not None:
                with stop_on_write_failure(str(self.tensorboard.path), self.run_dir):
                    self.tensorboard.text(key, markdown_table(columns, rows), step)
                    self.tensorboard.flush()
        except RunWriteError as e:
            self.write_failure = self.write_failure or e
            return
        if self.run is not None:
            import wandb

            self.run.log({key: wandb.Table(columns=columns, data=rows)}, step=step)

    def _truncate(self, path: Path) -> None:
        """Drop the lines logged after step resume_step's checkpoint (see __init__)."""
        if self.resume_step is not None:
            drop_rows_after(path, self.resume_step, self.enabled)

    def finish(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.tensorboard is not None:
            with stop_on_write_failure(str(self.tensorboard.path), self.run_dir):
                self.tensorboard.close()
        if self.run is not None:
            self.run.finish()
            if self.offline:
                say(self.offline_note())


# ----------------------------------------------------------------------------------------------------
# TensorBoard: event files in the run directory, so that `tensorboard --logdir runs/` shows every run side by side

EVENT_FILES = "events.out.tfevents.*"


def tensorboard_installed() -> bool:
    """Whether the tensorboard package is there; one line saying what goes without it when it is not."""
    if importlib.util.find_spec("tensorboard") is not None:
        return True
    say("tensorboard: not installed (pip install tensorboard, or --tensorboard false): no event files")
    return False


class TensorBoardFile:
    """One TensorBoard event file in `folder`, written by rank 0 in this thread: TensorBoard's record format (a length,
    the protobuf of one event, checksums) appended to a file opened here, so a failed write raises where the row is
    logged, as metrics.jsonl's does (torch's SummaryWriter writes from a thread of its own, whose error would surface
    one row later with a traceback of that thread). A row's numbers are one event of many values, not one each.

    resume_step: as Logger's. 0 (a fresh start) deletes the folder's earlier event files, as metrics.jsonl is emptied;
    a later step writes TensorBoard's purge marker at the step after it, so that what a killed run logged after that
    checkpoint is hidden and the folder reads as one run; None keeps everything (a later evaluation of a finished
    run)."""

    def __init__(self, folder: Path, resume_step: int | None = None):
        # imported here, not at the module's top: TensorBoard's protobufs are for rank 0 of a run that writes them
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.summary.writer.record_writer import RecordWriter

        if resume_step == 0:
            for old in folder.glob(EVENT_FILES):
                old.unlink()
        self.path = folder / f"events.out.tfevents.{time.time():.0f}.{socket.gethostname()}.{os.getpid()}"
        self.file = open(self.path, "ab")
        self.records = RecordWriter(self.file)
        self._write(Event(wall_time=time.time(), file_version="brain.Event:2"))
        if resume_step:
            purge = SessionLog(status=SessionLog.START)  # hides the earlier files' events at this step and later
            self._write(Event(wall_time=time.time(), step=resume_step + 1, session_log=purge))
        self.flush()

    def _write(self, event) -> None:
        self.records.write(event.SerializeToString())

    def add(self, summary, step: int = 0) -> None:
        from tensorboard.compat.proto.event_pb2 import Event

        self._write(Event(wall_time=time.time(), step=step, summary=summary))

    def scalars(self, metrics: dict, step: int) -> None:
        """Every finite number of `metrics` under its own name at `step` (strings are metrics.jsonl's alone)."""
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [
            Summary.Value(tag=k, simple_value=v)
            for k, v in metrics.items()
            if isinstance(v, (int, float)) and math.isfinite(v)
        ]
        if values:
            self.add(Summary(value=values), step)

    def text(self, tag: str, markdown: str, step: int) -> None:
        from torch.utils.tensorboard.summary import text

        summary = text(tag, markdown)
        summary.value[0].tag = tag  # torch names it TAG/text_summary
        self.add(summary, step)

    def image(self, tag: str, png: bytes, step: int) -> None:
        """A PNG file's bytes as they are (no decoding and re-encoding): TensorBoard shows an encoded image."""
        from tensorboard.compat.proto.summary_pb2 import Summary

        # the IHDR chunk, first after the 8-byte signature: width, height, bit depth, colour type
        width, height, _, colour = struct.unpack(">IIBB", png[16:26])
        channels = {0: 1, 4: 2, 2: 3, 6: 4}.get(colour, 0)  # grey, grey + alpha, RGB, RGBA (3: a palette)
        image = Summary.Image(height=height, width=width, colorspace=channels, encoded_image_string=png)
        self.add(Summary(value=[Summary.Value(tag=tag, image=image)]), step)

    def hparams(self, options: dict, metrics: tuple[str, ...]) -> None:
        """The options (numbers, strings, booleans; not the record's list of changes) as the run's hyperparameters,
        and `metrics` as the HParams view's columns (it reads their values from this run's scalars)."""
        from torch.utils.tensorboard.summary import hparams

        values = {k: v for k, v in options.items() if isinstance(v, (int, float, str))}
        values |= {k: str(v).lower() for k, v in values.items() if isinstance(v, bool)}  # true/false, not 1.0/0.0
        for summary in hparams(values, dict.fromkeys(metrics, 0.0)):
            self.add(summary)

    def flush(self) -> None:
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def markdown_table(columns: list[str], rows: list[list]) -> str:
    """A table as markdown (TensorBoard's text view renders it), every cell's text shown as it is: markdown's own
    characters escaped, "<" not taken for HTML, a line break a <br>."""

    def cell(value) -> str:
        text = str(value)
        for char in "\\`*_[]#|":
            text = text.replace(char, "\\" + char)
        return text.replace("<", "&lt;").replace("\n", "<br>")

    head = "| " + " | ".join(map(cell, columns)) + " |\n|" + "---|" * len(columns)
    return "\n".join([head] + ["| " + " | ".join(map(cell, row)) + " |" for row in rows])


def markdown_rows(text: str) -> tuple[list[str], list[list[str]]]:
    """The columns and rows of the first markdown table in `text` as evaluation/compare.py and evaluation/frontier.py
    print it (a head line, a |---| line, a line per row; no cell holds a "|"): the frontier's and the verdict's texts
    hold several tables and prose before and after it (the verdict's says first whether it is interim or final),
    which a table of one width (wandb's) cannot take."""
    lines = list(itertools.dropwhile(lambda line: not line.startswith("|"), text.strip().splitlines()))
    table = list(itertools.takewhile(lambda line: line.startswith("|"), lines))
    rows = [[cell.strip() for cell in line.strip()[1:-1].split("|")] for line in table]
    return rows[0], rows[2:]


def publish_picture(
    png: Path,
    folder: Path,
    tag: str,
    table: tuple[list[str], list[list]] | None = None,
    tensorboard: bool = True,
    wandb_mode: str = "disabled",
    wandb_project: str = "tldr-rlhf",
    wandb_group: str = "",
    run_name: str = "",
    beside: tuple[Path, ...] = (),
) -> None:
    """A picture drawn from finished runs (evaluation/compare.py's comparison, evaluation/frontier.py's frontier) and
    its table, where the runs' own curves are: TensorBoard events in `folder`, the runs' common folder, under `tag`
    (`tensorboard --logdir runs/` shows it beside them; the table as text under `tag`/table), and, with `wandb_mode`
    not disabled, a wandb run of its own (job type `tag`, its files in `folder`) in `wandb_group`, the group of the
    runs it draws, holding the picture and the table. The pictures `beside` it (a verdict's forest plot, compute and
    dose pictures) go with it, each under its file's name less .png. A failed write of the event file: one line, exit
    code 4."""
    folder = Path(folder)
    pictures = {tag: Path(png)} | {Path(p).stem: Path(p) for p in beside}
    if tensorboard and tensorboard_installed():
        with stop_on_write_failure(str(folder / EVENT_FILES), folder):
            writer = TensorBoardFile(folder)
            for name, path in pictures.items():
                writer.image(name, path.read_bytes(), 0)
            if table is not None:
                writer.text(f"{tag}/table", markdown_table(*table), 0)
            writer.close()
    if wandb_mode == "disabled" or importlib.util.find_spec("wandb") is None:
        return
    import wandb

    mode = wandb_mode if wandb_mode != "auto" else ("online" if wandb_login() else "offline")
    run = wandb.init(
        project=wandb_project,
        name=run_name or tag,
        group=wandb_group or None,
        job_type=tag,
        mode=mode,
        dir=str(folder),
        settings=wandb.Settings(silent=True),
    )
    logged = {name: wandb.Image(str(path)) for name, path in pictures.items()}
    if table is not None:
        logged[f"{tag}/table"] = wandb.Table(columns=table[0], data=table[1])
    run.log(logged)
    run.finish()
    if mode == "offline":
        say(f"wandb: offline run in {Path(run.dir).parent}; upload it with: wandb sync {Path(run.dir).parent}")


def wandb_login() -> bool:
    """A wandb login: WANDB_API_KEY or an entry in ~/.netrc (--wandb_mode auto goes online with one)."""
    return bool(os.environ.get("WANDB_API_KEY") or (Path.home() / ".netrc").is_file())


def _jsonable(v) -> bool:
    return isinstance(v, (int, str, bool)) or (isinstance(v, float) and math.isfinite(v))


def say(message: str) -> None:
    """A line to stderr that does not collide with a live progress bar (tqdm clears and redraws it; line progress
    writes whole lines, so a message is always a line of its own)."""
    tqdm.write(message, file=sys.stderr)


def tell(message: str) -> None:
    """A status line to stdout, flushed at once (so it keeps its place among the progress lines of a log that holds
    both streams); a live terminal bar is cleared first and redrawn under it, so the two never share a line."""
    tqdm.write(message, file=sys.stdout)
    sys.stdout.flush()


def close_progress_bars() -> None:
    """Close every live bar so that what is printed next starts on a line of its own."""
    for bar in list(getattr(tqdm, "_instances", [])) + list(LineProgress.live):
        bar.close()


LINE_EVERY_SECONDS = 30.0
"""Where stderr is not a terminal (a log file, a pipe), progress is one line every this many seconds."""


class LineProgress:
    """Progress for output that is not a terminal: a whole line at most every `every` seconds and one at the end,
    "desc: 40/512 rows (8%), 12.3 rows/s, 3s, loss=2.31", instead of tqdm's carriage-return frames that a log file
    keeps as one endless line. The part of tqdm's interface the scripts use (update, set_postfix, close)."""

    live: set = set()

    def __init__(self, total: int, initial: int, desc: str, unit: str, every: float = LINE_EVERY_SECONDS, file=None):
        self.total, self.n, self.start_n, self.desc, self.unit, self.every = total, initial, initial, desc, unit, every
        self.file = file or sys.stderr
        self.postfix: dict = {}
        self.started = self.last = time.perf_counter()
        self.written_at = None  # n when the last line was written
        LineProgress.live.add(self)

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.perf_counter()
        finished = self.total and self.n >= self.total and self.written_at != self.n
        if finished or (n and now - self.last >= self.every):
            self._write(now)

    def set_postfix(self, values: dict, refresh: bool = True) -> None:
        self.postfix = dict(values)

    def close(self) -> None:
        if self in LineProgress.live:
            LineProgress.live.discard(self)
            if self.written_at != self.n and self.n > self.start_n:
                self._write(time.perf_counter())

    def _write(self, now: float) -> None:
        self.last, self.written_at = now, self.n
        print(
            format_progress(
                self.desc, self.n, self.total, self.unit, self.n - self.start_n, now - self.started, self.postfix
            ),
            file=self.file,
            flush=True,
        )


def format_progress(desc: str, n: int, total: int, unit: str, done: int, seconds: float, postfix: dict) -> str:
    """One progress line: rows done of total, share, rate over this process's share of the work, elapsed time."""
    share = f" ({100 * n / total:.0f}%)" if total else ""
    rate = f", {done / seconds:.3g} {unit}/s" if seconds > 0 and done else ""
    extra = "".join(f", {k}={v}" for k, v in postfix.items())
    return f"{desc}: {n}/{total or '?'} {unit}{share}{rate}, {seconds:.0f}s{extra}"


class _NoProgress:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, values: dict, refresh: bool = True) -> None:
        pass

    def close(self) -> None:
        pass


def progress(total: int, initial: int, enabled: bool, desc: str, unit: str = "step", leave: bool = True):
    """A progress bar: tqdm's on a terminal, LineProgress elsewhere (stderr redirected to a file or a pipe), nothing
    when not `enabled` (ranks other than 0). `leave` False: a terminal bar is erased when it closes (an evaluation's
    bar under the training bar)."""
    if not enabled:
        return _NoProgress()
    if not sys.stderr.isatty():
        return LineProgress(total, initial, desc, unit)
    return tqdm(total=total, initial=initial, desc=desc, unit=unit, dynamic_ncols=True, leave=leave, file=sys.stderr)


class EvalProgress:
    """An evaluation's own progress, shown by rank 0: every rank advances by its own rows, and every rank holds about
    as many, so rank 0's count times the world size is the global progress (capped at `total`, the global rows).
    `split` False: every rank does all the rows (rank 0's count is the progress)."""

    def __init__(self, desc: str, total: int, unit: str = "rows", split: bool = True):
        from utils.dist import rank_and_world

        rank, world = rank_and_world()
        self.world = world if split else 1
        self.total, self.done = total, 0
        self.bar = progress(total, 0, rank == 0, desc, unit=unit, leave=False)

    def advance(self, local_rows: int) -> None:
        now = min(self.total, self.done + local_rows * self.world)
        self.bar.update(now - self.done)
        self.done = now

    def close(self) -> None:
        self.advance(self.total)  # the last rank's batches may hold fewer rows than rank 0's
        self.bar.close()


def track(items, desc: str, total: int, count, unit: str = "rows"):
    """Yield `items` (this rank's batches of an evaluation) while showing EvalProgress over `total` rows, advanced by
    `count(item)` rows after each."""
    bar = EvalProgress(desc, total, unit)
    try:
        for item in items:
            yield item
            bar.advance(count(item))
    finally:
        bar.close()


def step_postfix(metrics: dict) -> dict:
    """What the training bar shows beside its step count: the loss (or the reward and KL) and tokens per second."""
    names = {"train/loss": "loss", "reward/mean": "reward", "train/kl": "kl"}
    shown = {name: f"{metrics[k]:.4g}" for k, name in names.items() if k in metrics}
    if "perf/tokens_per_second" in metrics:
        shown["tok/s"] = f"{metrics['perf/tokens_per_second']:.3g}"
    return shown


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


metric("perf/step_seconds", "min", "wall-clock seconds of the step (per rank)")
metric("perf/tokens_per_second", "max", "tokens per second of the step over all ranks (GRPO: generated tokens)")
metric("perf/tokens_per_second_per_device", "max", "perf/tokens_per_second over the number of ranks")
metric("perf/{stage}_seconds", "min", "seconds of one stage of the GRPO step (generate, score, update, ...)")
metric("perf/{stage}_share", "max", "that stage's share of the step's seconds")


def perf_metrics(seconds: dict[str, float], step_seconds: float, generated_tokens: float, world: int) -> dict:
    """perf/ metrics of a step: its seconds, generated tokens per second (overall and per device), and each stage's
    seconds and share of the step."""
    out = {
        "perf/step_seconds": step_seconds,
        "perf/tokens_per_second": generated_tokens / step_seconds,
        "perf/tokens_per_second_per_device": generated_tokens / step_seconds / world,
    }
    for name, s in seconds.items():
        out[f"perf/{name}_seconds"], out[f"perf/{name}_share"] = s, s / step_seconds
    return out


# ----------------------------------------------------------------------------------------------------
# The summary at the end of a run: summary.json in the run directory and a short table on the terminal


def read_declarations(run_dir: str | Path) -> dict[str, dict]:
    """A run's DECLARED_FILE ({metric: {"direction", "help"}}); empty when it has none (a run logged before metrics
    were declared) or it cannot be read."""
    try:
        return json.loads((Path(run_dir) / DECLARED_FILE).read_text())
    except (OSError, ValueError):
        return {}


def read_rows(path: Path) -> list[dict]:
    """The rows of a metrics.jsonl file (a line cut short by a kill is skipped)."""
    rows = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def metric_summary(rows: list[dict], key: str) -> dict | None:
    """Final and best value of `key` with their steps over metrics rows (the last row at a step wins); best is the
    minimum or the maximum as metric_direction says; counts and interval bounds have no best."""
    by_step = {int(r["step"]): r[key] for r in rows if isinstance(r.get(key), (int, float))}
    if not by_step:
        return None
    steps = sorted(by_step)
    out = {"final": by_step[steps[-1]], "final_step": steps[-1]}
    direction = metric_direction(key)
    if direction is not None:
        lower = direction == "min"
        best = (min if lower else max)(steps, key=lambda s: (by_step[s], -s) if not lower else (by_step[s], s))
        out.update(best=by_step[best], best_step=best, mode="min" if lower else "max")
    return out


def run_summary(run_dir: str | Path, stage: str, wall_seconds: float) -> dict:
    """What summary.json holds: per evaluation metric its final and best value with their steps; the training
    seconds (summed over steps, every resumed part of the run included) and tokens per second over them; this
    process's wall time; the paths of the export, checkpoints, metrics and sample tables."""
    run_dir = Path(run_dir)
    rows = read_rows(run_dir / "metrics.jsonl")
    keys = sorted({k for r in rows for k in r if k.startswith(EVALUATION_PREFIXES)})
    evaluation = {k: s for k in keys if (s := metric_summary(rows, k)) is not None}
    training = {
        k: s
        for k in headlines(stage)
        if not k.startswith(EVALUATION_PREFIXES)
        if (s := metric_summary(rows, k)) is not None
    }
    timed = [r for r in rows if isinstance(r.get("perf/step_seconds"), (int, float))]
    seconds = sum(r["perf/step_seconds"] for r in timed)
    tokens = sum(r["perf/step_seconds"] * r.get("perf/tokens_per_second", 0.0) for r in timed)
    checkpoints = run_dir / "checkpoints"
    best = checkpoints / "best.json"
    return {
        "stage": stage,
        "steps": max((int(r["step"]) for r in rows), default=0),
        "evaluation": evaluation,
        "training": training,
        "wall_seconds": wall_seconds,
        "train_seconds": seconds,
        "tokens_per_second": tokens / seconds if seconds > 0 else None,
        "paths": {
            "export": str(run_dir / "hf") if (run_dir / "hf").is_dir() else None,
            "checkpoints": sorted(str(p) for p in checkpoints.glob("step_*")) if checkpoints.is_dir() else [],
            "best_checkpoint": json.loads(best.read_text()) if best.is_file() else None,
            "metrics": str(run_dir / "metrics.jsonl"),
            "config": str(run_dir / "config.json"),
            "samples": str(run_dir / "samples.jsonl") if (run_dir / "samples.jsonl").is_file() else None,
        },
    }


def format_summary(summary: dict) -> str:
    """The stage's headline metrics as an aligned table (final and best with their steps), then time, throughput
    and where the run's files are."""
    stage = summary["stage"]
    every = {**summary["training"], **summary["evaluation"]}
    keys = [k for k in headlines(stage) if k in every] or list(summary["evaluation"])[:8]
    width = max([len(k) for k in keys] + [6])
    steps = summary["steps"]
    lines = [
        f"{stage} summary after {steps} step{'' if steps == 1 else 's'}",
        f"  {'metric':<{width}}  {'final':>11} {'(step)':>7}  {'best':>11} {'(step)':>7}",
    ]
    for k in keys:
        s = every[k]
        best = f"{s['best']:>11.4g} {'(' + str(s['best_step']) + ')':>7}" if "best" in s else ""
        lines.append(f"  {k:<{width}}  {s['final']:>11.4g} {'(' + str(s['final_step']) + ')':>7}  {best}".rstrip())
    tps = summary["tokens_per_second"]
    lines.append(
        f"  training {summary['train_seconds']:.1f}s"
        + (f", {tps:.4g} tokens/s" if tps else "")
        + f"; wall {summary['wall_seconds']:.1f}s"
    )
    paths = summary["paths"]
    for name in ("export", "metrics", "samples"):
        if paths[name]:
            lines.append(f"  {name}: {paths[name]}")
    return "\n".join(lines)


def report_summary(run_dir: str | Path, stage: str, wall_seconds: float, new_steps: bool) -> dict:
    """Write summary.json in the run directory and print its table; a rerun of a finished run (`new_steps` False: it
    trained no step) prints the summary already written instead of replacing it."""
    path = Path(run_dir) / "summary.json"
    if not new_steps and path.is_file():
        summary = json.loads(path.read_text())
    else:
        summary = run_summary(run_dir, stage, wall_seconds)
        with stop_on_write_failure(str(path), run_dir):
            write_text_atomic(path, json.dumps(summary, indent=1) + "\n")
    tell(format_summary(summary) + f"\n  summary: {path}")
    return summary
