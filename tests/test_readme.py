"""The README is for users: its commands are true and parse, its tables are complete,
and it holds no reference a reader outside the project cannot resolve."""

from __future__ import annotations

import dataclasses
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from lookahead_vllm.core.config import LookaheadConfig
from lookahead_vllm.core.request_options import KEYS

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
# Words that point into the project's own bookkeeping (trackers, work diaries,
# internal notes), meaningless to a reader of the README.
INTERNAL = re.compile(r"\bissues?\b|\bsessions?\b|\bpart \d|\bseeds? \d{3}|DESIGN\.md|seed-digest", re.I)


def _table_keys() -> set[str]:
    return set(re.findall(r"^\| `([\w{}]+)", README, flags=re.M))


def _code_blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.M | re.S)


def _commands(block: str) -> list[list[str]]:
    """Shell commands of a bash block: continuations joined, comments dropped, split at ``&&``."""
    commands = []
    for line in block.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        while words:
            cut = words.index("&&") if "&&" in words else len(words)
            commands.append(words[:cut])
            words = words[cut + 1:]
    return [c for c in commands if c]


def _section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start:end if end > 0 else None]


# ---------------------------------------------------------------- tables
def test_every_config_field_in_the_configuration_table():
    missing = [f.name for f in dataclasses.fields(LookaheadConfig) if f.name not in _table_keys()]
    assert not missing, f"README configuration table lacks {missing}"


def _default_cell(text: str):
    """A configuration table default as a Python value: `one` -> "one", 2^20 -> 1048576, true -> True."""
    value = re.sub(r"\s*\((off|none)\)", "", text).strip().strip("`")
    if value in ("true", "false"):
        return value == "true"
    if value in ('""', "[]"):
        return {'""': "", "[]": ()}[value]
    if power := re.fullmatch(r"(\d+)\^(\d+)", value):
        return int(power.group(1)) ** int(power.group(2))
    try:
        return float(value)
    except ValueError:
        return value


def test_configuration_table_defaults_are_the_code_defaults():
    cells = dict(re.findall(r"^\| `(\w+)` \| ([^|]+) \|", README, flags=re.M))
    wrong = {}
    for f in dataclasses.fields(LookaheadConfig):
        if f.name == "decoding_length":  # documented as num_speculative_tokens, which defaults to it
            continue
        documented, actual = _default_cell(cells[f.name]), f.default
        if isinstance(actual, (int, float)) and not isinstance(actual, bool):
            actual = float(actual)
        if documented != actual:
            wrong[f.name] = (cells[f.name].strip(), f.default)
    assert not wrong, f"README defaults differ from LookaheadConfig (README, code): {wrong}"
    k = re.search(r"`num_speculative_tokens` \(default (\d+)\)", README)
    assert k and int(k.group(1)) == LookaheadConfig().decoding_length


def test_default_cell_parsing():
    assert _default_cell("`one`") == "one" and _default_cell("2^20") == 1 << 20
    assert _default_cell("0 (off)") == 0.0 and _default_cell('`""` (none)') == ""
    assert _default_cell("1e4") == 1e4 and _default_cell("true") is True and _default_cell("`[]`") == ()


def test_every_per_request_key_documented():
    assert set(KEYS) <= _table_keys()


def test_every_lookahead_metric_documented():
    from lookahead_vllm.vllm import metrics

    source = Path(metrics.__file__).read_text()
    names = set(re.findall(r'"(lookahead_[a-z_]+)"', source))
    documented = {k.split("{")[0].removesuffix("_total") for k in _table_keys()}
    assert names and not names - documented, names - documented


def test_results_table_is_marked_and_compares_the_four_methods():
    block = re.search(r"<!-- results-table -->(.*?)<!-- /results-table -->", README, flags=re.S)
    assert block, "the results table must sit between <!-- results-table --> and <!-- /results-table -->"
    header = next(line for line in block.group(1).splitlines() if line.startswith("| workload"))
    for method in ("plain", "`ngram`", "`suffix`", "lookahead"):
        assert method in header, method
    plots = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", block.group(1))
    assert plots and all((REPO / p).is_file() for p in plots), plots
    reproduce = [c for b in _code_blocks(block.group(1), "bash") for c in _commands(b)]
    assert any("benchmarks/bench_offline.py" in c for c in reproduce), "no command reproduces the table"


# ---------------------------------------------------------------- words and links
def test_no_internal_reference_words():
    found = sorted({m.group(0) for m in INTERNAL.finditer(README)})
    assert not found, f"README mentions {found}: say what is meant, or link to docs/"


def test_internal_word_check_can_fail():
    assert INTERNAL.search("see issue 5") and INTERNAL.search("Part 3 (measured)")
    assert INTERNAL.search("seed 000") and INTERNAL.search("read DESIGN.md")
    assert not INTERNAL.search("tissue partition seeded")


def test_relative_links_exist():
    links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", README)
    # docs/vllm-versions.md is written alongside; every other link must resolve now.
    missing = [p for p in links if not (REPO / p).exists() and p != "docs/vllm-versions.md"]
    assert links and not missing, missing


# ---------------------------------------------------------------- the two commands
def test_the_two_commands_come_first():
    first = _code_blocks(README, "bash")[0]
    assert README.index(first) < 200, "the two commands must open the README"
    assert _commands(first) == [["bash", "scripts/demo.sh"], ["bash", "scripts/test.sh"]]
    demo, test = (REPO / "scripts/demo.sh").read_text(), (REPO / "scripts/test.sh").read_text()
    assert "scripts/setup.sh" in demo and "benchmarks/bench_offline.py" in demo
    assert "scripts/setup.sh" in test and "pytest" in test
    assert "scripts/test.sh" in (REPO / ".ci/run").read_text(), "CI must run the README's test command"


# ---------------------------------------------------------------- every command parses
def _serve_parser():
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from lookahead_vllm.vllm.plugin import register

    register()
    return make_arg_parser(FlexibleArgumentParser())


def _check_serve_args(argv: list[str]) -> None:
    from lookahead_vllm.serve import lookahead_config_error

    args = _serve_parser().parse_args(argv)
    assert (args.model_tag or args.model), argv
    assert lookahead_config_error(args) is None, lookahead_config_error(args)


def _check_command(words: list[str]) -> None:
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # env assignments
        words = words[1:]
    prog, rest = words[0], words[1:]
    if prog == "bash":
        script = REPO / rest[0]
        assert script.is_file(), script
        subprocess.run(["bash", "-n", str(script)], check=True)
    elif prog == "lookahead-vllm-serve":
        scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
        assert prog in scripts
        _check_serve_args(rest)
    elif prog == "vllm":
        assert rest[0] == "serve", words
        _check_serve_args(rest[1:])
    elif prog == "python" and rest[:2] == ["-m", "vllm.entrypoints.openai.api_server"]:
        _check_serve_args(rest[2:])
    elif prog == "python" and rest[0] == "benchmarks/bench_offline.py":
        sys.path.insert(0, str(REPO / "benchmarks"))
        try:
            import bench_offline
        finally:
            sys.path.pop(0)
        bench_offline.parse_args(rest[1:])
    elif prog == "pip":
        extras = re.fullmatch(r"\.\[([\w,]+)\]", rest[-1]).group(1).split(",")
        declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
        assert set(extras) <= set(declared), extras
    elif prog == "docker":
        if rest[0] == "build":
            assert (REPO / rest[rest.index("-f") + 1]).is_file()
    else:
        raise AssertionError(f"README command {shlex.join(words)!r}: no check knows {prog!r}")


def _readme_commands() -> list[list[str]]:
    return [c for block in _code_blocks(README, "bash") for c in _commands(block)]


def test_command_check_can_fail():
    with pytest.raises(AssertionError):
        _check_command(["bash", "scripts/no_such_script.sh"])
    with pytest.raises(AssertionError):
        _check_command(["curl", "http://127.0.0.1:8000"])


@pytest.mark.vllm
def test_every_readme_command_parses():
    commands = _readme_commands()
    programs = {c[0] if not re.fullmatch(r"[A-Z_]+=\S*", c[0]) else c[1] for c in commands}
    assert {"lookahead-vllm-serve", "vllm", "python", "bash"} <= programs
    for words in commands:
        _check_command(words)


@pytest.mark.vllm
def test_serve_check_rejects_a_bad_lookahead_field():
    with pytest.raises((AssertionError, SystemExit)):
        _check_command(["lookahead-vllm-serve", "bundled", "--speculative-model", "lookahead",
                        "--additional-config", '{"lookahead": {"branch_length": 1}}'])


def test_quickstart_python_compiles():
    blocks = _code_blocks(_section("Quickstart"), "python")
    assert len(blocks) >= 2
    for block in blocks:
        compile(block, "README.md", "exec")
    assert '"method": "lookahead"' in blocks[0]


@pytest.mark.parametrize("script", ["scripts/demo.sh", "scripts/cpu_env.sh"])
def test_our_scripts_answer_help(script):
    proc = subprocess.run(["bash", str(REPO / script), "--help"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and "LOOKAHEAD_CPU_PRELOAD" in proc.stdout, proc.stderr
