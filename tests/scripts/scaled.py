"""Run a top-level script with one function of the project multiplied by a factor: the error a golden comparison must
catch (tests/test_golden.py injects a 1% error into the KL estimator).

    python tests/scripts/scaled.py rlhf.policy_gradient:k3_kl 1.01 grpo.py --option value ...

The function is replaced on its module and in the module's registries (rlhf/registry.py) that hold it, so every caller
that looks it up there (the module's own functions, a registered name) gets the scaled one."""

import importlib
import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main(target: str, factor: float, argv: list[str]) -> None:
    module_name, _, function_name = target.partition(":")
    module = importlib.import_module(module_name)
    original = getattr(module, function_name)

    def scaled(*args, **kwargs):
        return original(*args, **kwargs) * factor

    setattr(module, function_name, scaled)
    # and in the module's registries, e.g. rlhf.policy_gradient.KL_ESTIMATORS
    for registry in [v for v in vars(module).values() if isinstance(v, dict)]:
        for name in [name for name, fn in registry.items() if fn is original]:
            registry[name] = scaled
    sys.argv = argv
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), sys.argv[3:])
