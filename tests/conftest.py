import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
# The real TL;DR rows: ../shared/data beside the checkout; RLHF_SHARED_DATA points elsewhere (a path with no rows, e.g.
# RLHF_SHARED_DATA=/nonexistent, shows the suite without them: every test that reads them skips with its reason).
SHARED_DATA = Path(os.environ.get("RLHF_SHARED_DATA", ROOT.parent / "shared" / "data"))

# The suite's processes are short: a process's first large blocks on transparent huge pages cost more than its few
# steps gain from them (utils/host.py huge_pages; docs/benchmarks.md), so the suite and the runs it starts go without,
# as a user's own THP_MEM_ALLOC_ENABLE setting does; the demo of tests/test_learning.py, whose stages run minutes, goes
# with them as `make demo` does (SUITE_UNSET: what to remove for that). No number depends on it; tests/test_utils.py
# checks the setting itself in a process of its own.
SUITE_UNSET = () if "THP_MEM_ALLOC_ENABLE" in os.environ else ("THP_MEM_ALLOC_ENABLE",)
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "0")


# `make test` runs the suite but the learning test in JOBS pytest-xdist workers (2 by default; --dist loadfile: a
# file's tests, and the module-scoped fixtures they share, stay on one worker); `make check` runs the learning test
# after it, alone. Each worker is one process of several sharing the machine's cores, so it computes on one thread (the
# scripts the tests start already do: run_script's OMP_NUM_THREADS=1; the learning test's demo is the one exception,
# tests/test_learning.py), and the files go out longest first so that no long file starts last. SLOWEST_FIRST: the
# files whose tests take longest on a 2-core machine (pytest --durations), longest first; the others follow in their
# own order. One process (JOBS=0) keeps the files' own order.
SLOWEST_FIRST = (
    "test_learning.py",
    "test_frontier_runs.py",
    "test_golden.py",
    "test_distributed.py",
    "test_grpo.py",
    "test_reward_dpo.py",
    "test_run_record.py",
    "test_errors.py",
    "test_grpo_iterative.py",
    "test_sampler.py",
    "test_grpo_options.py",
    "test_lora.py",
    "test_frontier.py",
)
IN_A_WORKER = bool(os.environ.get("PYTEST_XDIST_WORKER"))
if IN_A_WORKER:
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if IN_A_WORKER:
        rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
        items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order


def shared_file(name: str) -> Path:
    path = SHARED_DATA / name
    if not path.is_file():
        pytest.skip(f"real TL;DR rows not found at {path} (the ../shared/data folder is absent)")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_script(
    args: list[str], nproc: int = 1, timeout: int = 600, env: dict | None = None, unset: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    """Run a top-level script as one plain process, or under torchrun with `nproc` gloo processes; `env` adds to the
    suite's environment, `unset` removes variables from it."""
    full_env = {**os.environ, "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1", **(env or {})}
    for name in unset:
        full_env.pop(name, None)
    if nproc == 1:
        cmd = [sys.executable, *args]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={nproc}",
            "--master_addr=127.0.0.1",
            f"--master_port={free_port()}",
            *args,
        ]
    out = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}")
    return out


@pytest.fixture
def tiny_cfg():
    from model.gpt2 import GPTConfig

    return GPTConfig(vocab_size=50257, n_positions=128, n_layer=2, n_head=2, n_embd=32)


@pytest.fixture
def one_rank_group():
    """A one-rank gloo process group, so shard_model's FSDP2 (mixed precision included) runs in this process."""
    from utils.dist import cleanup_distributed, setup_distributed

    cleanup_distributed()
    setup_distributed("cpu")
    yield
    cleanup_distributed()


def requires_gpu():
    return pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# ----------------------------------------------------------------------------------------------------
# Killing runs part-way (crash-safe resume tests)


def script_command(args: list[str], nproc: int = 1) -> list[str]:
    if nproc == 1:
        return [sys.executable, *args]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        *args,
    ]


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (torchrun starts its workers in sessions of their own, so killing torchrun's
    process group does not reach them)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def checkpoint_step(run_dir: Path) -> int:
    """Step of the checkpoint `latest` names, 0 when there is none."""
    try:
        return int((run_dir / "checkpoints" / "latest").read_text().strip().split("_")[1])
    except (OSError, IndexError, ValueError):
        return 0


def run_and_interrupt(
    args: list[str], run_dir: Path, min_step: int, sig: int, nproc: int = 1, timeout: int = 300, whole_tree: bool = True
) -> tuple[int, str]:
    """Start a script, wait until it has saved a checkpoint of step >= min_step, send `sig` (to the launcher and,
    with whole_tree, to every worker: a node failure; without, to the launcher alone: torchrun forwards SIGTERM as
    a scheduler's preemption does), and wait for it to end. Returns (exit code, stdout + stderr)."""
    import signal
    import time

    env = {**os.environ, "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}
    log = run_dir.with_name(run_dir.name + f".{signal.Signals(sig).name}.log")
    with open(log, "w") as out:
        proc = subprocess.Popen(
            script_command(args, nproc), cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + timeout
        try:
            while checkpoint_step(run_dir) < min_step:
                if proc.poll() is not None:
                    raise AssertionError(
                        f"ended ({proc.returncode}) before a step-{min_step} checkpoint:\n{log.read_text()[-3000:]}"
                    )
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"no step-{min_step} checkpoint within {timeout} s:\n{log.read_text()[-3000:]}"
                    )
                time.sleep(0.02)
            targets = [proc.pid] + (descendants(proc.pid) if whole_tree else [])
            for pid in reversed(targets):  # workers first
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            code = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                for pid in [proc.pid, *descendants(proc.pid)]:
                    os.kill(pid, 9)
                proc.wait()
    return code, log.read_text()


def kill_and_rerun(args: list[str], run_dir: Path, min_step: int, nproc: int = 1) -> int:
    """SIGKILL a run (launcher and workers) once it has a checkpoint of step >= min_step, check it died, then rerun
    the same command to the end. Returns the step of the checkpoint the rerun resumed from."""
    import signal

    code, _ = run_and_interrupt(args, run_dir, min_step, signal.SIGKILL, nproc=nproc)
    assert code != 0, f"the run ended ({code}) before it could be killed"
    killed_at = checkpoint_step(run_dir)
    run_script(args, nproc=nproc)
    return killed_at


def assert_same_metrics(full: list[dict], resumed: list[dict], keys: tuple[str, ...], context: str = "") -> None:
    """The resumed run's metrics.jsonl reads as the uninterrupted run's: same steps, and bit-identical values."""
    assert [m["step"] for m in resumed] == [m["step"] for m in full], context
    for a, b in zip(full, resumed, strict=True):
        for key in keys:
            assert a.get(key) == b.get(key), (context, a["step"], key, a.get(key), b.get(key))
