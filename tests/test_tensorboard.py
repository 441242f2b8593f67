"""TensorBoard beside metrics.jsonl (utils/logging.py TensorBoardFile, --tensorboard): what tiny runs' event files hold,
read back through the tensorboard server's HTTP API and drawn by its dashboard in headless Chromium; a resumed run that
reads as one; a missing package, a full disk; a run without it computes the same numbers; publish_picture's image."""

import html
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest

import sft
from tests import helpers
from tests.conftest import free_port
from utils.config import parse_config
from utils.logging import EVENT_FILES, Logger, markdown_rows, publish_picture
from utils.metrics import headlines

pytest.importorskip("tensorboard", reason="the tensorboard package is not installed (pip install tensorboard)")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

TENSORBOARD = Path(sys.executable).parent / "tensorboard"  # the package's command, beside this interpreter
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
LINE_RGB = (0x12, 0xB5, 0xCB)  # TensorBoard's colour of the second run (the first's is close to its text colour)
STEPS = 12


def sft_args(rows, out, *extra) -> list[str]:
    """A tiny SFT run from random weights whose loss falls within a few steps, evaluated with a sample table."""
    return [
        "--model",
        "tiny",
        "--random_init",
        "true",
        "--train_data",
        str(rows),
        "--val_data",
        str(rows),
        "--val_rows",
        "8",
        "--eval_samples",
        "2",
        "--max_prompt_len",
        "64",
        "--max_response_len",
        "16",
        "--batch_size",
        "4",
        "--micro_batch_size",
        "4",
        "--warmup_steps",
        "2",
        "--wandb_mode",
        "disabled",
        "--out_dir",
        str(out),
        *extra,
    ]


def run_sft(rows, out, *extra) -> list[dict]:
    sft.main(parse_config(sft.Config, sft_args(rows, out, *extra)))
    return helpers.read_metrics(out)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two runs side by side, as `tensorboard --logdir runs/` shows them: run name -> its --lr."""
    root = tmp_path_factory.mktemp("runs")
    rows = helpers.write_sft_rows(root / "rows.jsonl", n=32)
    lrs = {"sft_lr1e-2": 1e-2, "sft_lr3e-3": 3e-3}
    for name, lr in lrs.items():
        run_sft(rows, root / name, "--lr", str(lr), "--steps", str(STEPS), "--eval_every", "6")
    return root, lrs


def get(base: str, path: str, body: dict | None = None):
    """A JSON answer of the tensorboard server (POST when `body`)."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} if body is not None else {}
    with urllib.request.urlopen(urllib.request.Request(base + path, data=data, headers=headers), timeout=30) as r:
        return json.loads(r.read())


@contextmanager
def tensorboard_server(logdir: Path, runs: list[str]):
    """`tensorboard --logdir LOGDIR` on a free loopback port, once it serves train/loss of every run: its address."""
    port = free_port()
    cmd = [str(TENSORBOARD), "--logdir", str(logdir), "--host", "127.0.0.1", "--port", str(port)]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline, tags = time.monotonic() + 90, {}
        while time.monotonic() < deadline:
            try:
                tags = get(base, "/data/plugin/scalars/tags")
                if all("train/loss" in tags.get(run, {}) for run in runs):
                    break
            except OSError:  # not listening yet
                pass
            if server.poll() is not None:
                raise AssertionError(f"tensorboard exited {server.returncode}: {server.stderr.read()[-3000:]}")
            time.sleep(0.5)
        else:
            raise AssertionError(f"tensorboard served no train/loss of {runs} within 90 s: {tags}")
        yield base
    finally:
        server.terminate()
        server.wait(timeout=30)


def visible_text(markup: str) -> str:
    """The text a browser shows of HTML: tags dropped, entities read, white space collapsed."""
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", markup)).split())


# ----------------------------------------------------------------------------------------------------
# 1. What a run writes, read through the tensorboard server's HTTP API


def test_tensorboard_serves_every_metric_at_its_step_the_options_and_the_sample_tables(runs):
    root, lrs = runs
    with tensorboard_server(root, list(lrs)) as base:
        tags = get(base, "/data/plugin/scalars/tags")
        groups = get(
            base,
            "/data/plugin/hparams/session_groups",
            {
                "experimentName": "",
                "allowedStatuses": ["STATUS_UNKNOWN", "STATUS_SUCCESS", "STATUS_FAILURE", "STATUS_RUNNING"],
                "colParams": [],
                "startIndex": 0,
                "sliceSize": 100,
            },
        )["sessionGroups"]
        experiment = get(base, "/data/plugin/hparams/experiment", {"experimentName": ""})
        sessions = {group["sessions"][0]["name"]: group for group in groups}
        for name, lr in lrs.items():
            rows = helpers.read_metrics(root / name)
            numbers = {k for r in rows for k, v in r.items() if k != "step" and isinstance(v, (int, float))}
            assert set(tags[name]) == numbers
            for key in ("train/loss", "train/lr", "val/loss", "perf/step_seconds"):
                served = get(base, f"/data/plugin/scalars/scalars?run={name}&tag={key}")
                logged = [(r["step"], r[key]) for r in rows if key in r]
                assert [step for _, step, _ in served] == [step for step, _ in logged], key
                # TensorBoard holds float32
                assert [v for _, _, v in served] == pytest.approx([v for _, v in logged], rel=1e-6), key

            # the options as hyperparameters, booleans as true/false, and the stage's headlines as metric columns
            options = sessions[name]["hparams"]
            record = json.loads((root / name / "config.json").read_text())
            assert options["lr"] == lr and options["model"] == "tiny" and options["random_init"] == "true"
            assert options["steps"] == STEPS and options["out_dir"] == record["out_dir"]
            shown = {m["name"]["tag"]: m["value"] for m in sessions[name]["metricValues"]}
            assert shown["val/loss"] == pytest.approx([r["val/loss"] for r in rows if "val/loss" in r][-1], rel=1e-6)

            # the sample tables as text, one per evaluation, every cell as it is
            tables = [json.loads(line) for line in (root / name / "samples.jsonl").read_text().splitlines()]
            texts = get(base, f"/data/plugin/text/text?run={name}&tag=samples")
            assert [t["step"] for t in texts] == [t["step"] for t in tables] == [6, 12]
            for table, text in zip(tables, texts, strict=True):
                shown_text = visible_text(text["text"])
                assert all(column in shown_text for column in table["columns"])
                for row in table["rows"]:
                    for cell in row:
                        assert " ".join(str(cell).split()) in shown_text, (cell, shown_text[:2000])
        assert [m["name"]["tag"] for m in experiment["metricInfos"]] == list(headlines("sft"))


# ----------------------------------------------------------------------------------------------------
# 2. The dashboard in a browser


def chromium(*args: str, user_data: Path) -> subprocess.CompletedProcess:
    """Headless Chromium, offline apart from the loopback server, with a profile of its own."""
    cmd = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={user_data}",
        "--hide-scrollbars",
        "--window-size=1200,800",
        "--run-all-compositor-stages-before-draw",
        "--virtual-time-budget=30000",
        *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180)


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (Debian: apt-get install chromium)")
def test_the_dashboard_draws_the_train_loss_chart_in_headless_chromium(runs, tmp_path):
    import numpy as np
    from PIL import Image

    root, lrs = runs
    with tensorboard_server(root, list(lrs)) as base:
        # the Time Series dashboard, cards filtered to train/loss, drawn as SVG (its WebGL lines are not in a
        # software-rendered screenshot): the page a user opens, with its lines in the DOM
        url = f"{base}/?forceSVG=true&darkMode=false&tagFilter=train%2Floss#timeseries"
        for attempt in range(6):  # a chart drawn after the virtual time ran out: the next try draws it
            dom = chromium("--dump-dom", url, user_data=tmp_path / f"profile-dom{attempt}").stdout
            cards = [c for c in dom.split("<scalar-card ")[1:] if 'title="train/loss"' in c.split("</scalar-card>")[0]]
            chart = cards[0].split("</scalar-card>")[0].split("<line-chart ")[-1] if cards else ""
            lines = re.findall(r'<path d="M([-\d.,eL]+)"', chart)  # a series: M x,y L x,y ... (icons are paths too)
            if lines:
                break
        assert len(cards) == 1, dom[-3000:]
        # one line per run and its smoothed twin, each with a point per step
        assert sorted(len(line.split("L")) for line in lines) == [STEPS] * 2 * len(lrs), lines

        png = tmp_path / "tensorboard_train_loss.png"
        # a screenshot taken before the chart's data arrived shows an empty card (seen once in a full suite run on a
        # 2-core machine, after the DOM above held both lines): the next try draws it
        for attempt in range(6):
            chromium(f"--screenshot={png}", url, user_data=tmp_path / f"profile-shot{attempt}")
            pixels = np.asarray(Image.open(png).convert("RGB")).astype(int)  # (H, W, 3)
            line = int((np.abs(pixels - np.array(LINE_RGB)) <= 40).all(axis=-1).sum())
            if line >= 600:
                break
        print(f"\nscreenshot of the train/loss chart: {png}")
        # the second run's colour: its two legend dots alone are ~300 pixels, its lines ~600 more
        assert pixels.shape == (800, 1200, 3) and line >= 600, (line, png)
        assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 50  # not a blank page


# ----------------------------------------------------------------------------------------------------
# 3. Resume, a missing package, a full disk, and the numbers with it off


def scalars(folder: Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) of `tag` as TensorBoard reads the folder (purge markers applied)."""
    events = EventAccumulator(str(folder))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def test_a_resumed_run_reads_as_one_run_and_a_fresh_start_as_a_new_one(tmp_path):
    def logged(resume_step: int, steps: range, scale: float) -> None:
        logger = Logger(tmp_path, {"lr": 0.1}, "p", "n", "disabled", True, resume_step=resume_step, tensorboard=True)
        for step in steps:
            logger.log({"x": scale * step, "name": "text is metrics.jsonl's alone"}, step)
        logger.finish()

    logged(0, range(1, 6), 1.0)  # a run killed after step 5, its checkpoint at step 3
    time.sleep(1.1)  # event files are named by the second: the resumed part writes a file of its own
    logged(3, range(4, 7), 10.0)
    assert len(list(tmp_path.glob(EVENT_FILES))) == 2
    assert scalars(tmp_path, "x") == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0), (6, 60.0)]
    assert [(r["step"], r["x"]) for r in helpers.read_metrics(tmp_path)] == scalars(tmp_path, "x")
    logged(0, range(1, 2), 7.0)  # a fresh start: metrics.jsonl emptied, the event files too
    assert len(list(tmp_path.glob(EVENT_FILES))) == 1 and scalars(tmp_path, "x") == [(1, 7.0)]


def test_a_later_evaluation_in_a_runs_folder_adds_its_numbers_and_leaves_the_runs_options(tmp_path):
    """eval_preferences.py --out_dir on a training run's folder (a Logger without `record`, appending): its results
    join the run's, and the run's options stay its hyperparameters."""
    from tensorboard.plugins.hparams import plugin_data_pb2

    run = Logger(tmp_path, {"lr": 0.1}, "p", "n", "disabled", True, resume_step=0, tensorboard=True)
    run.log({"x": 1.0}, 1)
    run.finish()
    time.sleep(1.1)  # a file of its own
    later = Logger(tmp_path, {"lr": 9.0}, "p", "n", "disabled", True, record=False, tensorboard=True)
    later.log({"eval/accuracy": 0.75}, 0)
    later.finish()
    assert scalars(tmp_path, "x") == [(1, 1.0)] and scalars(tmp_path, "eval/accuracy") == [(0, 0.75)]
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    start = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    assert plugin_data_pb2.HParamsPluginData.FromString(start).session_start_info.hparams["lr"].number_value == 0.1


def test_without_the_tensorboard_package_a_run_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else find_spec(name)
    )
    logger = Logger(tmp_path, {}, "p", "n", "disabled", True, resume_step=0, tensorboard=True)
    logger.log({"x": 1.0}, 1)
    logger.finish()
    err = capsys.readouterr().err.splitlines()
    assert err == ["tensorboard: not installed (pip install tensorboard, or --tensorboard false): no event files"]
    assert not list(tmp_path.glob(EVENT_FILES)) and helpers.read_metrics(tmp_path) == [{"step": 1, "x": 1.0}]


def test_a_full_disk_under_the_event_file_stops_in_one_line_with_exit_4(tmp_path, capsys, monkeypatch):
    import builtins

    from utils import logging as run_logging

    rows = helpers.write_sft_rows(tmp_path / "rows.jsonl", n=16)
    out = tmp_path / "run"

    def full_open(path, mode="r", *a, **k):  # the first row of numbers fails
        file = builtins.open(path, mode, *a, **k)
        return helpers.FullDiskFile(file, "train/loss") if Path(path).name.startswith("events.out") else file

    with monkeypatch.context() as patch:
        patch.setattr(run_logging, "open", full_open, raising=False)
        code, message = helpers.run_cli(sft, sft_args(rows, out, "--steps", "2", "--val_data", ""), capsys)
    (events,) = out.glob(EVENT_FILES)
    assert code == 4 and message.startswith(f"error: cannot write {events}: no space left on device; "), message
    assert run_sft(rows, out, "--steps", "2", "--val_data", "")[-1]["step"] == 2  # space again: the command finishes
    assert [step for step, _ in scalars(out, "train/loss")] == [1, 2]


def test_turning_tensorboard_off_changes_no_number(tmp_path):
    rows = helpers.write_sft_rows(tmp_path / "rows.jsonl", n=16)
    on = run_sft(rows, tmp_path / "on", "--steps", "3", "--eval_every", "2", "--lr", "1e-2")
    off = run_sft(rows, tmp_path / "off", "--steps", "3", "--eval_every", "2", "--lr", "1e-2", "--tensorboard", "false")

    def numbers(rows: list[dict]) -> list[dict]:
        return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]

    assert numbers(on) == numbers(off) and ["val/loss" in r for r in on] == [False, True, True]
    weights = [(tmp_path / run / "hf" / "model.safetensors").read_bytes() for run in ("on", "off")]
    assert weights[0] == weights[1]
    assert len(list((tmp_path / "on").glob(EVENT_FILES))) == 1 and not list((tmp_path / "off").glob(EVENT_FILES))


def test_a_published_picture_is_an_image_and_its_table_text_in_its_folder(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(3, 2))
    ax.plot([0, 1], [1, 0])
    png = tmp_path / "compare.png"
    fig.savefig(png, dpi=50)
    plt.close(fig)
    forest = tmp_path / "verdict_forest.png"
    fig, ax = plt.subplots(figsize=(2, 2))
    fig.savefig(forest, dpi=50)
    plt.close(fig)
    table = (["variant", "reward"], [["rso", 0.5], ["uniform|all", 0.25]])
    publish_picture(png, tmp_path, "compare", table, beside=(forest,))
    events = EventAccumulator(str(tmp_path), size_guidance={"images": 0, "tensors": 0})
    events.Reload()
    (image,) = events.Images("compare")
    assert image.encoded_image_string == png.read_bytes() and (image.width, image.height) == (150, 100)
    (image,) = events.Images("verdict_forest")  # a picture beside it, under its own name
    assert image.encoded_image_string == forest.read_bytes() and (image.width, image.height) == (100, 100)
    (text,) = events.Tensors("compare/table")
    markdown = text.tensor_proto.string_val[0].decode()
    assert markdown == "| variant | reward |\n|---|---|\n| rso | 0.5 |\n| uniform\\|all | 0.25 |"


def test_markdown_rows_reads_the_first_table_of_a_text_that_holds_several():
    """The verdict's and the frontier's texts hold several tables of different widths and prose between them; the
    table published beside their picture is the first (wandb.Table takes rows of one width)."""
    text = "| a | b |\n|---|---|\n| 1 | 2 |\n| 3 | 4 |\n\nprose\n\n| c |\n|---|\n| 5 |\n"
    assert markdown_rows(text) == (["a", "b"], [["1", "2"], ["3", "4"]])
    assert markdown_rows("Final: after the last round of seeds.\n\n" + text) == markdown_rows(text)  # prose first
