"""Named choices of the algorithm (selection rules, advantage estimators, loss aggregations, KL estimators, rollout
corrections): each a dict from an option's value to its function, filled by a decorator where the function is
defined (verl's core_algos registers its advantage estimators and policy losses the same way).

    ADVANTAGES = Registry("advantage estimator")

    @ADVANTAGES.register("rloo", help="RLOO's leave-one-out baseline (arXiv 2402.14740)")
    def leave_one_out(rewards_BK, reduce_sum): ...

The option that picks one (rollouts/options.py) takes the registry as its choices, so `--help`, the generated option
tables in docs/ and the option's check list what is registered; a new choice is its function, its decorator and its
test. Pure Python: the registries hold torch functions but import nothing."""

from collections.abc import Callable


class Registry(dict):
    """name -> function, in the order of registration. `help[name]` is what `--help` says of each (one short phrase);
    `facts[name]` holds what a registration declares besides (e.g. the fewest kept samples per group it needs).
    Looking up a name that is not registered is a ValueError naming the kind and listing every registered name."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.help: dict[str, str] = {}
        self.facts: dict[str, dict] = {}

    def register(self, name: str, help: str, **facts) -> Callable[[Callable], Callable]:
        """Decorator: register the function under `name`, with its `help` phrase and `facts`; returns it unchanged."""

        def add(fn: Callable) -> Callable:
            if name in self:
                raise ValueError(f"{self.kind} {name!r} is registered twice ({self[name].__name__}, {fn.__name__})")
            self[name], self.help[name], self.facts[name] = fn, help, facts
            return fn

        return add

    def __missing__(self, name):
        raise ValueError(f"unknown {self.kind} {name!r}; expected one of {', '.join(self)}")

    def check(self, name: str) -> None:
        """ValueError (as a lookup) unless `name` is registered."""
        self[name]
