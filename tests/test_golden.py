"""Golden numbers: each stage's tiny fixed configuration reproduces its checked-in per-step numbers and final
parameters (tests/golden/*.json; tests/golden/stages.py runs them and regenerates the files).

Bit-exact when this machine's torch build, CPU vector ISA and processor model are the ones that recorded the files
(the same kernels, one thread: the same floating-point operations in the same order); otherwise every number within
a relative 1e-4, since another ISA's or processor's matmul kernels sum in another order."""

import json
import math

import pytest

from tests.golden.stages import GOLDEN, TOLERANCE, configurations, machine, run

NAMES = list(configurations())


def compare(name: str, want, got, exact: bool, path: str = "") -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict) and sorted(got) == sorted(want), f"{name}{path}: keys {sorted(got)} != {sorted(want)}"
        for k in want:
            compare(name, want[k], got[k], exact, f"{path}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), f"{name}{path}: {len(got)} entries, expected {len(want)}"
        for i, (a, b) in enumerate(zip(want, got)):
            compare(name, a, b, exact, f"{path}[{i}]")
    elif isinstance(want, float) and not exact:
        assert math.isclose(got, want, rel_tol=TOLERANCE, abs_tol=TOLERANCE), f"{name}{path}: {got!r} != golden {want!r}"
    else:
        assert got == want, f"{name}{path}: {got!r} != golden {want!r}"


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_stage_reproduces_its_golden_numbers(name, tmp_path):
    golden = json.loads((GOLDEN / f"{name}.json").read_text())
    recorded_on = golden.pop("machine")
    exact = recorded_on == machine()
    got = run(name, tmp_path)
    if not exact:  # another kernel set: the digest cannot match, the norm and every number must be close
        golden["params"].pop("sha256")
        got["params"].pop("sha256")
    compare(name, golden, got, exact)


def test_golden_configurations_cover_every_stage_and_grpo_variant():
    argvs = {name: argv_of(GOLDEN / "x") for name, (_, argv_of) in configurations().items()}
    assert {a[0] for a in argvs.values()} == {"sft.py", "reward_model.py", "dpo.py", "grpo.py"}
    grpo = " ".join(" ".join(a) for n, a in argvs.items() if n.startswith("grpo"))
    for option in ("--policy_epochs 2", "--ref_refresh_every 2", "--lora_rank 4", "--importance_level sequence",
                   "--rollout_correction tis", "--kl_in reward", "--min_group_std"):
        assert option in grpo, option
    assert configurations()["grpo_rso_2proc"][0] == 2
    for name in argvs:
        assert (GOLDEN / f"{name}.json").is_file(), f"tests/golden/{name}.json is missing: python -m tests.golden.stages {name}"


@pytest.mark.slow
def test_deterministic_option_leaves_cpu_numbers_unchanged(tmp_path):
    # CPU kernels are deterministic already: --deterministic (deterministic algorithms, the math attention kernel)
    # must reproduce SFT's golden numbers exactly as the default does
    golden = json.loads((GOLDEN / "sft.json").read_text())
    exact = golden.pop("machine") == machine()
    got = run("sft", tmp_path, ("--deterministic", "true"))
    if not exact:
        golden["params"].pop("sha256")
        got["params"].pop("sha256")
    compare("sft --deterministic true", golden, got, exact)


@pytest.mark.slow
def test_two_torchrun_agents_match_one_agent_with_two_processes(tmp_path):
    # two agents of one process each (--nnodes 2 --nproc_per_node 1, c10d rendezvous on localhost: how two nodes
    # meet) reproduce GRPO's golden two-process numbers, recorded with one agent; SFT's golden configuration on two
    # processes gives the same record from one agent and from two
    golden = json.loads((GOLDEN / "grpo_rso_2proc.json").read_text())
    exact = golden.pop("machine") == machine()
    got = run("grpo_rso_2proc", tmp_path / "grpo", agents=2)
    if not exact:
        golden["params"].pop("sha256")
        got["params"].pop("sha256")
    compare("grpo_rso_2proc on two agents", golden, got, exact)
    assert run("sft", tmp_path / "two_agents", nproc=2, agents=2) == run("sft", tmp_path / "one_agent", nproc=2)
