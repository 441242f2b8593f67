import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"


def shared_file(name: str) -> Path:
    path = SHARED_DATA / name
    if not path.is_file():
        pytest.skip(f"real TL;DR rows not found at {path} (the ../shared/data folder is absent)")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_script(args: list[str], nproc: int = 1, timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a top-level script as one plain process, or under torchrun with `nproc` gloo processes."""
    full_env = {**os.environ, "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1", **(env or {})}
    if nproc == 1:
        cmd = [sys.executable, *args]
    else:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
            "--master_addr=127.0.0.1", f"--master_port={free_port()}", *args,
        ]
    out = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}")
    return out


@pytest.fixture
def tiny_cfg():
    from model.gpt2 import GPTConfig

    return GPTConfig(vocab_size=50257, n_positions=128, n_layer=2, n_head=2, n_embd=32)


def requires_gpu():
    return pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
