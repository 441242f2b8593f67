"""Golden numbers: tiny fixed CPU configurations of every stage, their per-step numbers and final parameters.

    python -m tests.golden.stages            # run every configuration, write tests/golden/<this machine>/*.json
    python -m tests.golden.stages grpo_rso   # only the named ones

Each machine fingerprint (torch build, CPU vector ISA, processor model and flags: `machine()`) has a set of records of
its own, tests/golden/<machine_id>/<name>.json: bit-exact on the machine that recorded it, and a tolerance check for
every other machine (tests/test_golden.py). A refactor must leave every record unchanged. A change that is meant to
move numbers regenerates them with the command above on every machine kind that has a set (a set that cannot be
regenerated is deleted, and the commit says so), and its commit says which numbers moved and why. Every run is fp32
on the CPU with one OpenMP thread per process, on the small fixed data in tests/golden/data (checked in, so a change to
the embedded synthetic task does not move these numbers).
"""

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

GOLDEN = Path(__file__).resolve().parent
ROOT = GOLDEN.parents[1]
DATA = GOLDEN / "data"
# Used only where no record of this machine's fingerprint exists: every number within a relative REL_TOL or an
# absolute ABS_TOL. Measured between the Intel and AMD sets (torch 2.13.0): 30 numbers differ by more than 1e-4
# relative, all of them near zero (the sampler-trainer log-prob gaps, ~1e-7, are rounding noise; an evaluation score
# mean of -0.0085 cancels), the largest by 9.5e-7 absolute. The floor keeps 5x above that and stays below what a 1%
# error in a loss term moves: GRPO's KL by 2.4e-5 at step 2 and its loss by 6.1e-6 at step 3
# (test_a_one_percent_kl_error_fails_the_tolerance_comparison).
REL_TOL = 1e-4
ABS_TOL = 5e-6


def _common(out: Path) -> list[str]:
    return ["--dtype", "fp32", "--device", "cpu", "--wandb_mode", "disabled", "--out_dir", str(out), "--seed", "3"]


def _grpo(out: Path, *extra: str) -> list[str]:
    return [
        "grpo.py",
        "--model",
        "tiny",
        "--random_init",
        "true",
        "--reward_model",
        "tiny",
        "--reward_random_init",
        "true",
        "--train_data",
        str(DATA / "prompts" / "train.jsonl"),
        "--val_data",
        str(DATA / "sft" / "validation.jsonl"),
        "--pref_data",
        str(DATA / "preference" / "validation.jsonl"),
        "--pref_rows",
        "4",
        "--val_rows",
        "4",
        "--num_samples",
        "8",
        "--num_kept",
        "4",
        "--max_new_tokens",
        "10",
        "--max_prompt_len",
        "96",
        "--pref_max_response_len",
        "24",
        "--prompts_per_step",
        "4",
        "--micro_batch_size",
        "8",
        "--steps",
        "3",
        "--lr",
        "1e-3",
        "--warmup_steps",
        "1",
        "--beta",
        "0.1",
        "--eval_every",
        "3",
        "--table_every",
        "0",
        "--rewards",
        "reward_model + 0.5*format",
        *_common(out),
        *extra,
    ]


def configurations() -> dict[str, tuple[int, callable]]:
    """name -> (processes, out_dir -> argv)."""
    sft_data = ["--train_data", str(DATA / "sft" / "train.jsonl"), "--val_data", str(DATA / "sft" / "validation.jsonl")]
    pref_data = [
        "--train_data",
        str(DATA / "preference" / "train.jsonl"),
        "--val_data",
        str(DATA / "preference" / "validation.jsonl"),
    ]
    sizes = [
        "--batch_size",
        "8",
        "--micro_batch_size",
        "4",
        "--steps",
        "3",
        "--max_prompt_len",
        "96",
        "--max_response_len",
        "24",
        "--lr",
        "1e-3",
        "--warmup_steps",
        "1",
        "--eval_every",
        "3",
    ]
    return {
        "sft": (
            1,
            lambda out: [
                "sft.py",
                "--model",
                "tiny",
                "--random_init",
                "true",
                *sft_data,
                "--val_rows",
                "8",
                "--prompt_loss_weight",
                "0.5",
                "--prompt_loss_positions",
                "4",
                *sizes,
                *_common(out),
            ],
        ),
        "reward_model": (
            1,
            lambda out: [
                "reward_model.py",
                "--model",
                "tiny",
                "--random_init",
                "true",
                *pref_data,
                "--val_rows",
                "8",
                "--norm_prompts",
                "4",
                "--norm_samples_per_prompt",
                "2",
                "--norm_batch_size",
                "2",
                *sizes,
                *_common(out),
            ],
        ),
        "dpo": (
            1,
            lambda out: [
                "dpo.py",
                "--model",
                "tiny",
                "--random_init",
                "true",
                *pref_data,
                "--val_rows",
                "8",
                "--label_smoothing",
                "0.1",
                *sizes,
                *_common(out),
            ],
        ),
        "grpo_rso": (1, lambda out: _grpo(out)),
        "grpo_mu2_refresh": (
            1,
            lambda out: _grpo(
                out,
                "--policy_epochs",
                "2",
                "--ref_refresh_every",
                "2",
                "--selection",
                "uniform",
                "--loss_type",
                "dapo",
                "--entropy_coef",
                "0.01",
                "--eps_high",
                "0.28",
            ),
        ),
        "grpo_lora": (
            1,
            lambda out: _grpo(
                out,
                "--lora_rank",
                "4",
                "--lora_alpha",
                "8",
                "--ref_refresh_every",
                "2",
                "--selection",
                "top_bottom",
                "--rewards",
                "reward_model + length",
                "--loss_type",
                "dr_grpo",
                "--lr",
                "1e-2",
            ),
        ),
        "grpo_rso_2proc": (2, lambda out: _grpo(out)),
        # TIS at cap 1.5, not 1: in fp32 the sampler's and the trainer's log-probs agree to ~1e-7, so the share of
        # tokens past a cap of exactly 1 would be rounding noise, different on every kernel set
        "grpo_options": (
            1,
            lambda out: _grpo(
                out,
                "--importance_level",
                "sequence",
                "--eps_low",
                "0.05",
                "--eps_high",
                "0.05",
                "--policy_epochs",
                "2",
                "--rollout_correction",
                "tis",
                "--rollout_correction_cap",
                "1.5",
                "--kl_in",
                "reward",
                "--kl_estimator",
                "k1",
                "--min_group_std",
                "0.05",
            ),
        ),
    }


def _commands(argv: list[str], nproc: int, agents: int = 1) -> list[list[str]]:
    """The launch: one plain process; one torchrun agent starting `nproc` processes; or `agents` torchrun agents of
    nproc / agents processes each, meeting through torchrun's c10d rendezvous on localhost (as nodes do)."""
    if nproc == 1 and agents == 1:
        return [[sys.executable, *argv]]
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launcher = [sys.executable, "-m", "torch.distributed.run"]
    if agents == 1:
        return [[*launcher, f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1", f"--master_port={port}", *argv]]
    if nproc % agents:
        raise ValueError(f"{nproc} processes cannot be split over {agents} agents")
    rendezvous = [
        f"--nnodes={agents}",
        f"--nproc_per_node={nproc // agents}",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint=127.0.0.1:{port}",
        f"--rdzv_id=golden-{port}",
    ]
    return [[*launcher, *rendezvous, *argv] for _ in range(agents)]


def param_digest(hf_folder: Path) -> dict:
    """sha256 over the exported parameters (name, dtype, shape, bytes, in name order) and their global L2 norm."""
    from safetensors.torch import load_file

    tensors = {}
    for f in sorted(hf_folder.glob("*.safetensors")):
        tensors.update(load_file(f))
    h = hashlib.sha256()
    sq = 0.0
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        sq += float(np.square(t.double().numpy()).sum())  # numpy's pairwise sum: the same whatever torch's threads
    return {"sha256": h.hexdigest(), "l2": sq**0.5, "tensors": len(tensors)}


def run(
    name: str,
    work: Path,
    extra: tuple[str, ...] = (),
    fresh: bool = True,
    nproc: int | None = None,
    agents: int = 1,
    wrapper: tuple[str, ...] = (),
) -> dict:
    """Run configuration `name` in a fresh folder under `work` (fresh=False: in the folder already there, resuming
    from its checkpoints); returns its golden record. `extra` options override the configuration's (the last
    occurrence of an option wins); `nproc` overrides its number of processes, `agents` splits them over that
    many torchrun agents; `wrapper` is a script (and its arguments) that runs the stage's script
    (tests/scripts/scaled.py)."""
    default_nproc, argv_of = configurations()[name]
    nproc = nproc or default_nproc
    out = work / name
    if fresh and out.exists():
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    argv = [*wrapper, *argv_of(out), *extra]
    env = {**os.environ, "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    procs, logs = [], []
    for i, cmd in enumerate(_commands(argv, nproc, agents)):  # logs in files: a full pipe would stall its agent
        logs.append(open(out.parent / f"{name}.agent{i}.log", "w+"))
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=logs[-1], stderr=subprocess.STDOUT, text=True))
    try:
        # a hung run fails after GOLDEN_RUN_TIMEOUT seconds (bench/gpu_all.sh sets it low to fit its time budget)
        codes = [p.wait(timeout=float(os.environ.get("GOLDEN_RUN_TIMEOUT", 900))) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    output = []
    for log in logs:
        log.seek(0)
        output.append(log.read())
        log.close()
    if any(codes):
        raise RuntimeError(f"golden run {name} failed ({codes}):\n" + "\n".join(o[-4000:] for o in output))
    steps = []
    for line in (out / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        steps.append(
            {k: v for k, v in sorted(row.items()) if not k.startswith("perf/") and k not in ("time", "_runtime")}
        )
    record = {"processes": nproc, "steps": steps, "params": param_digest(out / "hf")}
    norm = out / "hf" / "reward_normalization.json"
    if norm.is_file():
        record["reward_normalization"] = json.loads(norm.read_text())
    return record


def cpu_model() -> str:
    """The processor as its vendor, family and model numbers and a digest of its feature flags ("GenuineIntel 6/167
    flags 1a2b3c4d"; platform.processor() where /proc/cpuinfo is absent). Two processors of the same vector ISA can
    still differ in the matmul kernels MKL and oneDNN pick for them (blocking, hence summation order): measured, an
    AVX512 machine reproduced files recorded on another AVX512 machine only to ~1e-9 relative."""
    fields = {}
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            key, _, value = line.partition(":")
            if not line.strip():
                break  # the first processor is enough
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        return platform.processor()
    flags = hashlib.sha256(" ".join(sorted(fields.get("flags", "").split())).encode()).hexdigest()[:8]
    return f"{fields.get('vendor_id', '?')} {fields.get('cpu family', '?')}/{fields.get('model', '?')} flags {flags}"


def machine() -> dict:
    """What decides bit-exactness of CPU kernels: the torch build, the vector ISA it dispatches to, and the processor
    model (the kernels' blocking)."""
    return {
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_model": cpu_model(),
    }


def machine_id(m: dict) -> str:
    """A folder name for a fingerprint: "intel-6-167-fc7df03f-avx512-torch2.13.0+cpu"."""
    vendor, family_model, _, flags = (m["cpu_model"].split(" ") + ["?", "?", "?", "?"])[:4]
    vendor = {"GenuineIntel": "intel", "AuthenticAMD": "amd"}.get(vendor, vendor.lower())
    return f"{vendor}-{family_model.replace('/', '-')}-{flags}-{m['cpu_capability'].lower()}-torch{m['torch']}"


def records(name: str) -> list[tuple[Path, dict]]:
    """Every recorded set's record of configuration `name`: (path, record), the record's "machine" included."""
    return [(p, json.loads(p.read_text())) for p in sorted(GOLDEN.glob(f"*/{name}.json")) if p.parent.name != "data"]


def main(names: list[str]) -> None:
    names = names or list(configurations())
    folder = GOLDEN / machine_id(machine())
    folder.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            record = {"machine": machine(), **run(name, Path(tmp))}
            (folder / f"{name}.json").write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
            print(
                f"wrote {folder.relative_to(ROOT)}/{name}.json: {len(record['steps'])} logged steps, "
                f"params {record['params']['sha256'][:12]}"
            )


if __name__ == "__main__":
    main(sys.argv[1:])
