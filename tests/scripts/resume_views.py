"""Run under 2 processes: rank 0 chooses the checkpoint to resume from (utils.checkpoint.newest_intact), and ranks
whose views of the run directory differ stop together.

    python tests/scripts/resume_views.py RUN_DIR OUT.txt pointer|view|resume_from

Both save checkpoints of steps 1 and 2 of a tiny model. pointer: rank 1 reads `latest` as naming step 1 (a stale
file-system cache); view: rank 1 sees a shard of step 2 as missing; resume_from: a fresh run directory resumes from
--resume_from step 2's folder (utils.checkpoint.find_checkpoint), whose state.pt rank 1 does not see (rank 0 chooses
whether it is a checkpoint folder or a run directory). Each rank writes OUT.txt.RANK: the name of the checkpoint it
would resume from, or "error: " and the error (a collective that ranks entered differently fails within 30 s).
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


def main(run_dir: str, out: str, case: str):
    info = setup_distributed("cpu", 0.5 if case == "resume_from" else 30.0)
    model = shard_model(GPT2LMHeadModel(CFG))
    optimizer = build_optimizer(model, 1e-2, 0.1)
    scheduler = build_scheduler(optimizer, 1, 10)
    for step in (1, 2):
        save_checkpoint(run_dir, step, model, optimizer, scheduler, {"stage": "test"}, rank=info.rank)
    if info.rank == 1 and case == "pointer":
        checkpoint._read_pointer = lambda ckpt_root: "step_00000001"
    if info.rank == 1 and case == "view":
        real = checkpoint._size_problem
        checkpoint._size_problem = lambda file, want: (
            f"{file} is missing" if file.name == "__1_0.distcp" else real(file, want)
        )
    if info.rank == 1 and case == "resume_from":
        real = Path.is_file
        Path.is_file = lambda path: path.name != "state.pt" and real(path)
    try:
        if case == "resume_from":
            source = Path(run_dir) / "checkpoints" / "step_00000002"
            result = find_checkpoint(Path(run_dir) / "fresh", str(source), {"stage": "test"}).name
        else:
            result = newest_intact(run_dir, info.rank, info.world_size).name
    except CheckpointError as e:
        result = f"error: {e}"
    except Exception as e:  # ranks that ran different collectives
        result = f"failed: {type(e).__name__}: {e}"
    Path(f"{out}.{info.rank}").write_text(result)
    cleanup_distributed()


if __name__ == "__main__":
    main(*sys.argv[1:4])
