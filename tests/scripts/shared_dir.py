"""Run under 2 processes: every rank checks --out_dir is one folder for all (utils.rundir.check_shared_dir).

    python tests/scripts/shared_dir.py BASE same|per_rank ...

Each case, in one launch: same: both ranks pass BASE/same/run; per_rank: rank r passes BASE/per_rank/run_r, as two
nodes without a shared filesystem see two different folders under one path. Each rank writes BASE/CASE.txt.RANK: the
error, or "" when the check passed.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from utils.config import ConfigError  # noqa: E402
from utils.dist import cleanup_distributed, setup_distributed  # noqa: E402
from utils.rundir import check_run_dir, check_shared_dir  # noqa: E402


def main(base: str, modes: list[str]):
    info = setup_distributed("cpu")
    for mode in modes:
        run_dir = Path(base) / mode / ("run" if mode == "same" else f"run_{info.rank}")
        check_run_dir(run_dir)
        try:
            check_shared_dir(run_dir, wait_s=1.0)
            error = ""
        except ConfigError as e:
            error = str(e)
        Path(base, f"{mode}.txt.{info.rank}").write_text(error)
    cleanup_distributed()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
