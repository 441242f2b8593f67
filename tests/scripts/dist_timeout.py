"""Run under 2 processes: --dist_timeout_minutes reaches the process group. Rank 1 is busy (up to 8 s, until rank 0 has
written its result) before it joins a barrier; rank 0 waits in the barrier under a timeout of TIMEOUT_MINUTES and saves
how long it waited and the error.

    python tests/scripts/dist_timeout.py OUT.json TIMEOUT_MINUTES
"""

import json
import sys
import time
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from utils.dist import setup_distributed  # noqa: E402


def main(out: str, timeout_minutes: float):
    info = setup_distributed("cpu", timeout_minutes)
    if info.rank == 1:  # busy until rank 0 has timed out and written its result, 8 s at most
        deadline = time.monotonic() + 8.0
        while not Path(out).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    t0 = time.monotonic()
    try:
        dist.barrier()
        error = ""
    except RuntimeError as e:
        error = str(e).splitlines()[0]
    if info.rank == 0:
        Path(out).write_text(json.dumps({"seconds": time.monotonic() - t0, "error": error}))


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
