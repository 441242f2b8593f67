"""Run under 2 processes: several runs of one top-level script, one after the other in one launch and one process
group (a launch starts three processes that each import torch: seconds of start-up per run saved).

    python -m torch.distributed.run --nproc_per_node=2 tests/scripts/runs.py SCRIPT CASES.json

CASES.json maps each case's name to its command-line options. A case runs SCRIPT's main(parse_config(Config, options)),
as `python SCRIPT options` does, with one difference: the process group outlives the case (utils.run's teardown at the
end of a run is skipped; the last case's is done after it), so the next case's start_run finds it set up. A case that
raises writes its traceback beside CASES.json, as NAME.error.RANK, and the launch ends there (the ranks may have
stopped in different collectives): the cases after it do not run.
"""

import importlib
import json
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from utils import run as run_plumbing  # noqa: E402
from utils.config import parse_config  # noqa: E402
from utils.dist import cleanup_distributed  # noqa: E402


def main(script: str, cases_file: str) -> None:
    module = importlib.import_module(Path(script).stem)
    cases = json.loads(Path(cases_file).read_text())
    run_plumbing.cleanup_distributed = lambda: None  # torn down once, after the last case
    for name, options in cases.items():
        try:
            module.main(parse_config(module.Config, options))
        except BaseException:
            Path(cases_file).with_name(f"{name}.error.{os.environ['RANK']}").write_text(traceback.format_exc())
            raise
    cleanup_distributed()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
