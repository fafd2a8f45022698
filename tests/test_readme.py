"""The README is for users: its commands are true and parse, its tables are complete,
and it holds no reference a reader outside the project cannot resolve. The configuration
table (README and docs/configuration.md) is held to the public model's schema, the
profile's table (docs/configuration.md) to the profile; docs/results.md holds the
detailed results: both docs are held to the code too."""

from __future__ import annotations

import dataclasses
import importlib
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from lookahead_vllm.core.config import PLATFORM_DECODING_LENGTH, PLATFORM_VALUES, LookaheadConfig, Profile
from lookahead_vllm.core.request_options import KEYS

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
CONFIG_DOC = (REPO / "docs" / "configuration.md").read_text()
RESULTS_DOC = (REPO / "docs" / "results.md").read_text()
# The public fields, from the model's JSON schema (what a user may set).
SCHEMA = LookaheadConfig.model_json_schema()
PUBLIC = set(SCHEMA["properties"])
# Words that point into the project's own bookkeeping (trackers, work diaries,
# internal notes), meaningless to a reader of the README.
INTERNAL = re.compile(r"\bissues?\b|\bsessions?\b|\bpart \d|\bseeds? \d{3}|DESIGN\.md|seed-digest", re.I)


def _table_keys(text: str = README) -> set[str]:
    return set(re.findall(r"^\| `([\w{}]+)", text, flags=re.M))


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
def _config_table(text: str, header: str = "| field | default | range | meaning |") -> str:
    """The table that follows a document's ``header``."""
    start = text.index(header)
    end = text.find("\n\n", start)
    return text[start:end if end > 0 else None]


def _cells(table: str, column: int) -> dict[str, str]:
    """Row name -> the text of its ``column`` (1 = default, 2 = range)."""
    rows = re.findall(r"^\| `(\w+)` \|(.*)$", table, flags=re.M)
    return {name: rest.split(" | ")[column - 1].strip(" |") for name, rest in rows}


@pytest.mark.parametrize("name", ["README.md", "docs/configuration.md"])
def test_configuration_table_lists_exactly_the_public_fields(name):
    text = {"README.md": README, "docs/configuration.md": CONFIG_DOC}[name]
    rows = _table_keys(_config_table(text))
    assert rows == PUBLIC, f"{name}: missing {sorted(PUBLIC - rows)}, not public {sorted(rows - PUBLIC)}"
    assert len(PUBLIC) <= 10
    assert "docs/configuration.md" in _section("Configuration")


@pytest.mark.parametrize("name", ["README.md", "docs/configuration.md"])
def test_configuration_table_ranges_are_the_schemas(name):
    """Choices and bounds in the range column are the schema's."""
    text = {"README.md": README, "docs/configuration.md": CONFIG_DOC}[name]
    ranges = _cells(_config_table(text), 2)
    for field, prop in SCHEMA["properties"].items():
        options = prop.get("enum") or [o.get("const") for o in prop.get("anyOf", []) if "const" in o]
        text = ranges[field]
        if options:
            assert sorted(re.findall(r"`([^`]+)`", text)) == sorted(options), (name, field, text)
            continue
        parts = prop.get("anyOf", [prop])  # int | None: the int part
        kind = next(p["type"] for p in parts if p.get("type") in ("integer", "number", "string"))
        if kind == "string":
            assert text == "a file path", (name, field, text)
            continue
        typed = int if kind == "integer" else float
        lo, hi = (next(p[b] for p in parts if b in p) for b in ("minimum", "maximum"))
        minus_one = text.startswith("-1 or ")
        lo_doc, hi_doc = (typed(_default_cell(x)) for x in
                          re.findall(r"\d+\^\d+|1e\d+|\d+", text.removeprefix("-1 or "))[:2])
        assert hi_doc == hi and (lo == -1 if minus_one else lo_doc == lo), (name, field, text, lo, hi)
        assert _accepts(field, lo_doc) and _accepts(field, hi_doc) and not _accepts(field, hi_doc + 1), field
        below = lo_doc - (1 if typed is int else typed(0.5))
        assert not _accepts(field, below) or (minus_one and below <= -1), (field, below)


def _accepts(field: str, value) -> bool:
    try:
        LookaheadConfig(**{field: value})
    except ValueError:
        return False
    return True


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


@pytest.mark.parametrize("name", ["README.md", "docs/configuration.md"])
def test_configuration_table_defaults_are_the_code_defaults(name):
    text = {"README.md": README, "docs/configuration.md": CONFIG_DOC}[name]
    cells = _cells(_config_table(text), 1)
    wrong = {}
    for field, info in LookaheadConfig.model_fields.items():
        if field == "decoding_length":  # documented as num_speculative_tokens, which defaults to it
            assert info.default is None and cells[field] == "`num_speculative_tokens`", cells[field]
            continue
        documented, actual = _default_cell(cells[field]), info.default
        if isinstance(actual, (int, float)) and not isinstance(actual, bool):
            actual = float(actual)
        if documented != actual:
            wrong[field] = (cells[field], info.default)
    assert not wrong, f"{name} defaults differ from LookaheadConfig (documented, code): {wrong}"
    k = re.search(r"`num_speculative_tokens` \(default (\d+), (\d+) on a GPU\)", text)
    assert k and (int(k.group(1)), int(k.group(2))) == (PLATFORM_DECODING_LENGTH["cpu"], PLATFORM_DECODING_LENGTH["gpu"])


def test_profile_table_is_the_profile():
    """docs/configuration.md's developer table: every knob, its default or per-platform values."""
    cells = _cells(_config_table(CONFIG_DOC, "| knob | default | range | meaning |"), 1)
    knobs = {f.name: f for f in dataclasses.fields(Profile) if f.name != "platform"}
    assert set(cells) == set(knobs), (sorted(set(knobs) - set(cells)), sorted(set(cells) - set(knobs)))
    wrong = {}
    for name, f in knobs.items():
        if name in PLATFORM_VALUES["cpu"]:
            documented = dict(part.split(" ", 1) for part in cells[name].split(", "))
            actual = {p: PLATFORM_VALUES[p][name] for p in ("cpu", "gpu")}
            documented = {p: _default_cell(v) for p, v in documented.items()}
        else:
            documented, actual = _default_cell(cells[name]), f.default
        actual = {k: float(v) if not isinstance(v, bool) else v for k, v in actual.items()} \
            if isinstance(actual, dict) else float(actual) if isinstance(actual, (int, float)) \
            and not isinstance(actual, bool) else actual
        if documented != actual:
            wrong[name] = (cells[name], actual)
    assert not wrong, f"docs/configuration.md profile defaults differ (documented, code): {wrong}"


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


@pytest.mark.parametrize("name", ["docs/configuration.md", "docs/results.md"])
def test_docs_relative_links_exist(name):
    text = (REPO / name).read_text()
    links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text)
    missing = [p for p in links if not (REPO / name).parent.joinpath(p).exists()]
    assert links and not missing, missing


def _expand(name: str) -> list[str]:
    """``a_{x,y}.json`` -> ``a_x.json``, ``a_y.json`` (shell brace expansion, one level per pass)."""
    m = re.search(r"\{([^{}]*)\}", name)
    if not m:
        return [name]
    return [n for part in m.group(1).split(",") for n in _expand(name[:m.start()] + part + name[m.end():])]


def _cited_results(text: str) -> set[str]:
    """Result files a document names: ``benchmarks/results/...`` paths and bare ``*.json``/``*.png`` names."""
    names = set()
    for token in re.findall(r"[\w{},./-]+\.(?:json|png|log)\b", text):
        token = re.sub(r"^(\.\./)?benchmarks/results/", "", token)
        if "/" in token and not token.startswith("gpu_logs/"):
            continue  # a path elsewhere (tmp files, datasets)
        names.update(_expand(token))
    return names


@pytest.mark.parametrize("name", ["README.md", "docs/results.md", "docs/configuration.md"])
def test_cited_result_files_exist_at_the_top_of_results(name):
    cited = _cited_results((REPO / name).read_text())
    missing = sorted(n for n in cited if not (REPO / "benchmarks/results" / n).is_file())
    assert cited and not missing, f"{name} cites result files missing from benchmarks/results/: {missing}"


@pytest.mark.parametrize("folder", ["benchmarks/results", "benchmarks/results/archive"])
def test_every_result_file_is_in_its_folder_index(folder):
    index = (REPO / folder / "README.md").read_text()
    listed = {n for tok in re.findall(r"`([^`]+)`", index) for n in _expand(tok)}
    stems = {n.rsplit("/", 1)[-1] for n in listed}
    files = [p for p in (REPO / folder).iterdir() if p.is_file() and p.name != "README.md"]
    unlisted = sorted(p.name for p in files if p.name not in listed and p.name not in stems
                      and p.stem not in stems and f"{p.stem}.{{json,png}}" not in listed)
    assert files and not unlisted, f"{folder}/README.md does not list {unlisted}"


def test_cited_results_expands_braces():
    assert _cited_results("`sim_gpu_floor_bs{1,8}_dev.json` and ![p](../benchmarks/results/a.png)") == {
        "sim_gpu_floor_bs1_dev.json", "sim_gpu_floor_bs8_dev.json", "a.png"}


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
    elif prog == "python" and rest[0] in ("benchmarks/bench_offline.py", "benchmarks/bench_serve.py"):
        sys.path.insert(0, str(REPO / "benchmarks"))
        try:
            bench = importlib.import_module(Path(rest[0]).stem)
        finally:
            sys.path.pop(0)
        bench.parse_args(rest[1:])
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
def test_every_results_doc_command_parses():
    commands = [c for block in _code_blocks(RESULTS_DOC, "bash") for c in _commands(block)]
    assert any("benchmarks/bench_serve.py" in c for c in commands), "no command reproduces the serving table"
    for words in commands:
        _check_command(words)


@pytest.mark.vllm
def test_serve_check_rejects_a_bad_lookahead_field():
    with pytest.raises((AssertionError, SystemExit)):
        _check_command(["lookahead-vllm-serve", "bundled", "--speculative-model", "lookahead",
                        "--additional-config", '{"lookahead": {"decoding_length": 0}}'])


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
