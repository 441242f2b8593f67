"""Run under 2 processes: rank 0 chooses the checkpoint to resume from (utils.checkpoint.newest_intact), and ranks
whose views of the run directory differ stop together.

    python tests/scripts/resume_views.py BASE pointer|view|resume_from ...

Each case, in the order given, in one process group (one launch for every case: a launch costs seconds of start-up),
saves checkpoints of steps 1 and 2 of a tiny model in BASE/CASE. pointer: rank 1 reads `latest` as naming step 1 (a
stale file-system cache); view: rank 1 sees a shard of step 2 as missing; resume_from: a fresh run directory resumes
from --resume_from step 2's folder (utils.checkpoint.find_checkpoint), whose state.pt rank 1 does not see (rank 0
chooses whether it is a checkpoint folder or a run directory). Each rank writes BASE/CASE.txt.RANK: the name of the
checkpoint it would resume from, or "error: " and the error. A collective that ranks entered differently fails within
30 s (the group's timeout) and leaves the group unusable: that case writes "failed: " and the error, and the cases
after it write "not run".
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from model.gpt2 import GPT2LMHeadModel, GPTConfig  # noqa: E402
from utils import checkpoint  # noqa: E402
from utils.checkpoint import CheckpointError, find_checkpoint, newest_intact, save_checkpoint  # noqa: E402
from utils.dist import cleanup_distributed, setup_distributed  # noqa: E402
from utils.fsdp import shard_model  # noqa: E402
from utils.optim import build_optimizer, build_scheduler  # noqa: E402

CFG = GPTConfig(vocab_size=50257, n_layer=1, n_head=2, n_embd=16, n_positions=32)


def run_case(run_dir: Path, case: str, rank: int, world_size: int) -> str:
    model = shard_model(GPT2LMHeadModel(CFG))
    optimizer = build_optimizer(model, 1e-2, 0.1)
    scheduler = build_scheduler(optimizer, 1, 10)
    for step in (1, 2):
        save_checkpoint(run_dir, step, model, optimizer, scheduler, {"stage": "test"}, rank=rank)
    # rank 1's view of the run directory, for this case only (put back below)
    read_pointer, size_problem, is_file = checkpoint._read_pointer, checkpoint.size_problem, Path.is_file
    if rank == 1 and case == "pointer":
        checkpoint._read_pointer = lambda ckpt_root: "step_00000001"
    if rank == 1 and case == "view":
        checkpoint.size_problem = lambda file, want: (
            f"{file} is missing" if file.name == "__1_0.distcp" else size_problem(file, want)
        )
    if rank == 1 and case == "resume_from":
        Path.is_file = lambda path: path.name != "state.pt" and is_file(path)
    try:
        if case == "resume_from":
            source = run_dir / "checkpoints" / "step_00000002"
            return find_checkpoint(run_dir / "fresh", str(source), {"stage": "test"}).name
        return newest_intact(run_dir, rank, world_size).name
    except CheckpointError as e:
        return f"error: {e}"
    finally:
        checkpoint._read_pointer, checkpoint.size_problem, Path.is_file = read_pointer, size_problem, is_file


def main(base: str, cases: list[str]):
    info = setup_distributed("cpu", 0.5)
    broken = False
    for case in cases:
        if broken:
            result = "not run: an earlier case's collectives failed"
        else:
            try:
                result = run_case(Path(base) / case, case, info.rank, info.world_size)
            except Exception as e:  # ranks that ran different collectives
                result, broken = f"failed: {type(e).__name__}: {e}", True
        Path(base, f"{case}.txt.{info.rank}").write_text(result)
    if not broken:
        cleanup_distributed()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
