"""The option tables in docs/ say what `--help` says, `--help` lists the options by section with the script's own
first, every command-line tool's `--help` shows each option's default, README.md stays a short guide, and every link
between the markdown pages resolves."""

import dataclasses
import importlib
import re
import sys
from pathlib import Path

import pytest

from utils.config import DOCS_BLOCK, OTHER, REGENERATE, SECTIONS, build_parser, field_sections, render_docs

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ("sft", "reward_model", "dpo", "grpo", "eval_preferences")
ROW = re.compile(r"^\| `(--\w+)` \| `(.*?)` \|", re.M)


def help_entries(text: str) -> dict[str, str]:
    """Option -> its entry in argparse's help (the flag's line and the lines under it, whitespace collapsed)."""
    entries, current = {}, None
    for line in text.splitlines():
        if match := re.match(r"^  (-[-\w]+)", line):
            current = match.group(1)
            entries[current] = line
        elif current and line.startswith("      "):
            entries[current] += " " + line.strip()
        else:
            current = None
    return {k: " ".join(v.split()) for k, v in entries.items()}


def test_docs_option_tables_are_generated_from_the_configs():
    stale = [
        str(p.relative_to(ROOT))
        for p in sorted((ROOT / "docs").glob("*.md"))
        if render_docs(p.read_text()) != p.read_text()
    ]
    assert not stale, f"the option tables in {', '.join(stale)} differ from --help; regenerate them with: {REGENERATE}"


@pytest.mark.parametrize("script", SCRIPTS)
def test_docs_table_lists_what_help_lists(script, monkeypatch):
    """The script's full table in docs/ has every option of `python SCRIPT.py --help`, in its order, with its
    default (read from the help text itself, not from the generator)."""
    monkeypatch.setenv("COLUMNS", "1000")  # no wrapping inside a default (argparse breaks "trl-lib" at its hyphen)
    blocks = [
        m
        for p in sorted((ROOT / "docs").glob("*.md"))
        for m in DOCS_BLOCK.finditer(p.read_text())
        if m.group(2) == script and m.group(3) is None
    ]
    assert len(blocks) == 1, f"docs/ should hold one full option table of {script}.py (<!-- options: {script} -->)"
    rows = ROW.findall(blocks[0].group(4))
    cls = importlib.import_module(script).Config
    entries = help_entries(build_parser(cls).format_help())
    assert "--config" in entries  # every script's; its prose is README's and docs/sft.md's, not a table row
    entries = {k: v for k, v in entries.items() if k not in ("-h", "--config")}
    assert [name for name, _ in rows] == list(entries), f"regenerate with: {REGENERATE}"
    as_help = {"true": "True", "false": "False", '""': ""}
    for name, default in rows:
        assert entries[name].endswith(f"(default: {as_help.get(default, default)})"), (
            name,
            f"regenerate: {REGENERATE}",
        )


@pytest.mark.parametrize("script", SCRIPTS + ("sample",))
def test_every_option_is_in_a_known_section(script):
    cls = importlib.import_module(script).Config
    sections = field_sections(cls)
    for f in dataclasses.fields(cls):
        assert sections.get(f.name, OTHER) in SECTIONS, (
            f"{script}.py --{f.name} is in section {sections.get(f.name, OTHER)!r}: put it under a `# --- SECTION` "
            f"line naming one of {SECTIONS}"
        )


@dataclasses.dataclass
class _Shared:
    # --- run
    seed: int = 1
    """Seed."""
    # --- models
    model: str = "gpt2"
    """Weights."""


@dataclasses.dataclass
class _Stage(_Shared):
    model: str = "tiny"
    # --- models
    reference: str = ""
    """Reference."""
    # --- objective
    beta: float = 0.1
    """Beta."""
    # --- run: a note after the name
    seed_offset: int = 0
    """Seed offset."""


@dataclasses.dataclass
class _Unmarked(_Shared):
    extra: int = 3
    """A field above every section line of its class."""


def test_help_groups_by_section_with_the_scripts_own_options_first():
    groups = [
        (g.title, [a.dest for a in g._group_actions])
        for g in build_parser(_Stage)._action_groups
        if g._group_actions and g.title != "options"
    ]
    # sections in SECTIONS order; own options (reference, seed_offset) before shared ones; the redeclared --model
    # keeps the section of its first declaration and its place among the shared options
    assert groups == [("models", ["reference", "model"]), ("objective", ["beta"]), ("run", ["seed_offset", "seed"])]
    assert build_parser(_Stage).parse_args([]).model == "tiny"


@pytest.mark.parametrize("script", SCRIPTS + ("sample",))
def test_help_starts_with_a_one_line_usage(script):
    # argparse's own usage line lists every option: 42 lines for grpo.py above its first group
    usage = build_parser(importlib.import_module(script).Config).format_usage()
    assert usage.count("\n") == 1 and len(usage) < 120, usage


def test_an_option_under_no_section_line_still_parses_and_is_listed_last():
    parser = build_parser(_Unmarked)
    assert [g.title for g in parser._action_groups if g._group_actions][-1] == "other options"
    assert parser.parse_args(["--extra", "5"]).extra == 5


TOOLS = (  # every command line but the four training scripts (parse_config, as eval_preferences.py)
    "demo",
    "verdict",
    "eval_preferences",
    "evaluation.compare",
    "evaluation.plots",
    "evaluation.selection_signal",
    "bench.run_all",
    "bench.trl_grpo",
    "bench.trl_stages",
    "model.lora",
    "data.synthetic",
    "utils.config",
)


@pytest.mark.parametrize("module", TOOLS)
def test_every_tool_help_shows_each_default(module, monkeypatch, capsys):
    tool = importlib.import_module(module)
    monkeypatch.setattr(sys, "argv", [module, "--help"])
    with pytest.raises(SystemExit) as exit_:
        if module == "eval_preferences":
            from utils.config import parse_config

            parse_config(tool.Config)
        else:
            tool.main()
    assert exit_.value.code == 0
    entries = help_entries(capsys.readouterr().out)
    missing = [k for k, v in entries.items() if k != "-h" and "(default:" not in v]
    assert entries and not missing, f"{module} --help shows no default for {missing}"


README_MAX_LINES = 300


def test_readme_is_a_short_guide():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines, more than {README_MAX_LINES}: keep it a guide (the commands, what the stages "
        "do, where to read on) and move detail into the page of docs/ where it belongs, with a link from README"
    )


def heading_anchors(path: Path) -> set[str]:
    """GitHub's anchors of a markdown file's headings: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.*)$", text, re.M)}


def test_every_relative_link_of_the_markdown_pages_resolves():
    broken = []
    for page in [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for link in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"\w+://", link):
                continue
            path, _, anchor = link.partition("#")
            target = (page.parent / path) if path else page
            if not target.exists() or (anchor and target.suffix == ".md" and anchor not in heading_anchors(target)):
                broken.append(f"{page.relative_to(ROOT)}: {link}")
    assert not broken, f"links to no file or no heading: {broken}"
