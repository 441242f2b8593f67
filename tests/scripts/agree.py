"""Run under 2 processes: utils.guard.all_ranks_agree when rank 1 alone raises a user error, a bug, or nothing.

    python -m torch.distributed.run --nproc_per_node=2 tests/scripts/agree.py OUT_DIR

Each rank writes OUT_DIR/rank{r}.json: per case, what it raised (class, message, exit code) or null.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from utils.dist import cleanup_distributed, setup_distributed  # noqa: E402
from utils.guard import all_ranks_agree  # noqa: E402


class BadRow(ValueError):
    exit_code = 2


def main(out_dir: str):
    info = setup_distributed("cpu")
    cases = {
        "user_error": BadRow("row 7 of the data is bad"),
        "bug": ZeroDivisionError("division by zero"),
        "none": None,
    }
    results = {}
    for name, exc in cases.items():
        try:
            with all_ranks_agree(f"case {name}", info.device):
                if info.rank == 1 and exc is not None:
                    raise exc
            results[name] = None
        except Exception as e:
            results[name] = [type(e).__name__, str(e), getattr(e, "exit_code", None)]
    Path(out_dir, f"rank{info.rank}.json").write_text(json.dumps(results))
    cleanup_distributed()


if __name__ == "__main__":
    main(sys.argv[1])
