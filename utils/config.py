"""Typed dataclass configs from the command line.

Every field of a config dataclass becomes `--name VALUE`; the string literal written under a field is its
help text, so `--help` documents every option from the same place the code does. Booleans take
true/false/1/0/yes/no. A misspelled option fails with the closest valid names.
"""

import argparse
import ast
import dataclasses
import difflib
import inspect
import sys
import textwrap
import types
import typing
from typing import Any, Literal, TypeVar

T = TypeVar("T")


def field_docs(cls) -> dict[str, str]:
    """Field name -> the string literal under its annotation, for a dataclass and its bases."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body
        for node, nxt in zip(body, body[1:] + [None]):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                    docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _parse_bool(s: str) -> bool:
    v = s.strip().lower()
    if v in ("1", "true", "yes", "y", "on"):
        return True
    if v in ("0", "false", "no", "n", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean (true/false), got '{s}'")


def _converter(tp) -> tuple[Any, list | None]:
    """(function from string, allowed choices or None) for a field type."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = list(typing.get_args(tp))
        kind = type(choices[0])
        return kind, choices
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        inner, choices = _converter(args[0])
        return (lambda s: None if s.lower() in ("none", "null", "") else inner(s)), choices
    if tp is bool:
        return _parse_bool, None
    if tp in (int, float, str):
        return tp, None
    raise TypeError(f"config type {tp} is not supported")


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, valid: list[str], **kwargs):
        super().__init__(*args, **kwargs)
        self.valid = valid

    def error(self, message: str):
        if message.startswith("unrecognized arguments"):
            hints = []
            for tok in message.split(":", 1)[1].split():
                if tok.startswith("--"):
                    close = difflib.get_close_matches(tok[2:].split("=")[0].replace("-", "_"), self.valid, n=3)
                    if close:
                        hints.append(f"{tok}: did you mean {', '.join('--' + c for c in close)}?")
            message = message + ("\n  " + "\n  ".join(hints) if hints else "")
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_config(cls: type[T], argv: list[str] | None = None, description: str | None = None) -> T:
    """Build `cls` from its defaults overridden by `--field value` arguments."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    fields = [f for f in dataclasses.fields(cls) if f.init]
    parser = _Parser(
        description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        valid=[f.name for f in fields],
    )
    for f in fields:
        conv, choices = _converter(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        parser.add_argument(
            f"--{f.name}", type=conv, choices=choices, default=default,
            help=docs.get(f.name, "") or " ", metavar=hints[f.name].__name__.upper() if isinstance(hints[f.name], type) else None,
        )
    args = parser.parse_args(argv)
    cfg = cls(**vars(args))
    if hasattr(cfg, "validate"):
        try:
            cfg.validate()
        except ValueError as e:
            parser.print_usage(sys.stderr)
            parser.exit(2, f"{parser.prog}: error: {e}\n")
    return cfg


def config_to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)
