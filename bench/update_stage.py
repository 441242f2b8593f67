"""The GRPO update stage (rollouts.update.policy_update) of two source trees, interleaved, on one configuration:
seconds per update and the peak RSS the update adds over what was resident before it (CPU).

    git archive HEAD~1 | (mkdir -p /tmp/before && tar -x -C /tmp/before)
    python -m bench.update_stage /tmp/before . --rounds 3

Each round runs one child process per tree, alternating (A B A B ...), so a machine whose load changes during
the run slows both alike. A child builds the configuration as bench/grpo_step.py does (random tiny GPT-2 with the
full 50,257-token vocabulary, the reward model, FSDP world 1), runs one rollouts.step.train_step (warm-up; its batches
carry the reference log-probs), then times `repeats` policy_update calls on those batches. Peak memory: VmHWM
reset (/proc/self/clear_refs) right before each timed update, minus the RSS just before it, so only what the
update itself allocates counts. The default configuration is bench/trl_grpo.py's cpu-trl-comparison (8 prompts
x 16 samples x 16 new tokens, every sample kept: 128 sequences in micro-batches of 16).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, sys, time, dataclasses
from pathlib import Path
import torch
from bench import common, grpo_step
from bench.trl_grpo import configs as trl_configs
from rollouts.update import policy_update
try:
    from rollouts.step import train_step
except ImportError:  # a tree from before GRPO's step moved from grpo.py to rollouts/step.py
    from grpo import train_step

torch.set_num_threads(int(sys.argv[2]))
torch.manual_seed(0)
device = torch.device("cpu")
bcfg = trl_configs(device, False)[0]
s = grpo_step.build(bcfg, device)
if int(sys.argv[3]) >= 0 and hasattr(s.cfg, "entropy_every"):  # a tree without the option logs it every step
    s.cfg.entropy_every = int(sys.argv[3])
r = train_step(s.models, s.optimizer, s.scheduler, s.prompts, s.spec, s.cfg, 1)

def rss():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

seconds, added = [], []
for i in range(int(sys.argv[1])):
    before = rss()
    common.reset_peak_memory(device)
    t0 = time.perf_counter()
    policy_update(s.models.policy, s.optimizer, s.scheduler, r.batches, s.cfg, 1, device, guard=None, step=i + 2)
    seconds.append(time.perf_counter() - t0)
    added.append(common.peak_memory(device)[0] - before)
first = r.batches[0]  # a dict in a tree without typed micro-batches
response_ids = first["response_ids"] if isinstance(first, dict) else first.response_ids
logits = response_ids.numel() * s.models.policy.cfg.vocab_size * 4
print(json.dumps({"seconds": seconds, "peak_added": added, "logits_bytes": logits, "config": bcfg.describe()}))
"""


def child(tree: Path, repeats: int, threads: int, entropy_every: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree.resolve())}
    argv = [sys.executable, "-c", CHILD, str(repeats), str(threads), str(entropy_every)]
    out = subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"{tree}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("trees", nargs=2, type=Path, help="two source trees: before, after")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of one child per tree, the trees interleaved")
    parser.add_argument("--repeats", type=int, default=3, help="timed updates per child")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads in each child")
    parser.add_argument(
        "--entropy_every",
        type=int,
        default=-1,
        help="grpo --entropy_every in trees that have it (-1: their default); 0 skips the entropy",
    )
    args = parser.parse_args()
    results = {str(t): [] for t in args.trees}
    for rnd in range(args.rounds):
        for tree in args.trees:
            load = os.getloadavg()[0]
            m = child(tree, args.repeats, args.threads, args.entropy_every)
            results[str(tree)].append(m)
            print(
                f"round {rnd + 1} {tree}: update "
                + " ".join(f"{x:.3f}" for x in m["seconds"])
                + " s, peak added "
                + " ".join(f"{x / 2**20:.0f}" for x in m["peak_added"])
                + f" MiB (load average before {load:.2f})",
                flush=True,
            )
    print(
        f"{args.threads} torch threads; config: {m['config']}; "
        f"one micro-batch's fp32 logits: {m['logits_bytes'] / 2**20:.0f} MiB"
    )
    for tree, ms in results.items():
        secs = [x for m in ms for x in m["seconds"]]
        peaks = [x for m in ms for x in m["peak_added"]]
        print(
            f"{tree}: update median {statistics.median(secs):.3f} s (min {min(secs):.3f}, max {max(secs):.3f}); "
            f"peak added median {statistics.median(peaks) / 2**20:.0f} MiB (min {min(peaks) / 2**20:.0f}, "
            f"max {max(peaks) / 2**20:.0f})"
        )


if __name__ == "__main__":
    main()
