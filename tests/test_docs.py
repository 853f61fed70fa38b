"""The documentation: generated pages current, README short, no citation outside the repository,
no dead relative link."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 250

# Files that live outside this repository; nothing in it may cite them.
FOREIGN = ("../shared", "shared/spec", "LOAD_BALANCING.md", "SEED_EXPERIMENT.md", "DEEPSEEK_V4.md")
SCANNED = ("src", "tests", "benchmarks", "tools", "docs")
SKIPPED_DIRS = {"__pycache__", ".pytest_cache", ".hypothesis"}


def _config_docs():
    """tools/config_docs.py as a module (tools/ is not a package)."""
    spec = importlib.util.spec_from_file_location("config_docs", ROOT / "tools" / "config_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def test_config_page_is_what_the_script_writes():
    page = DOCS / "config.md"
    assert page.exists(), "docs/config.md is missing: run `python tools/config_docs.py`"
    assert page.read_text(encoding="utf-8") == _config_docs().render(), (
        "docs/config.md is stale: run `python tools/config_docs.py`")


def test_config_page_lists_every_key():
    from moebalance.config import describe

    text = (DOCS / "config.md").read_text(encoding="utf-8")
    missing = [key for key, *_ in describe() if f"| `{key}` |" not in text]
    assert not missing


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move detail to docs/")


def _machine_rows(text: str) -> list[dict]:
    """The README's table of the A/B on each machine: {machine, date, improvement, loss change,
    B / floor, B / refit} per row (None where not measured)."""
    lines = text.splitlines()
    start = lines.index("| machine | date | improvement | final loss A / B | B / floor | B / refit |")
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            return rows
        machine, date, improvement, loss, floor, refit = (c.strip() for c in line.split("|")[1:-1])
        number = re.compile(r"[+-]?\d+\.\d+")
        rows.append({"machine": machine, "date": date,
                     "improvement": float(number.search(improvement)[0]),
                     "loss": float(re.search(r"\(([+-]\d+\.\d+)%\)", loss)[1]),
                     "floor": float(number.search(floor)[0]) if floor else None,
                     "refit": float(number.search(refit)[0]) if refit else None})
    return rows


def test_readme_result_is_the_range_over_the_machines_measured():
    """The README gives the A/B's result as the range over the machines measured, each named
    and dated, and its balance claim holds on each with a margin of 5% (issue 43: one machine's
    figures read as the result; another gave B / refit 1.09 against a goal of 1.10)."""
    text = " ".join(README.read_text(encoding="utf-8").split())
    rows = _machine_rows(README.read_text(encoding="utf-8"))
    assert len(rows) >= 3 and all(re.match(r"\S.*(core|chip)", r["machine"]) for r in rows)
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\d", r["date"]) for r in rows)
    gains = [r["improvement"] for r in rows]
    assert f"removes {min(gains):.2f}-{max(gains):.2f}% of Run A's summed top-K variance" in text
    claim = re.search(r"at under ([\d.]+)% of final loss, and on each leaves Run B under "
                      r"([\d.]+)x the sampling floor and within ([\d.]+)x of what refitted", text)
    assert claim, "the balance claim is not where this test reads it"
    loss, floor, refit = (float(c) for c in claim.groups())
    assert all(abs(r["loss"]) <= 0.95 * loss for r in rows)
    assert all(r["floor"] <= 0.95 * floor and r["refit"] <= 0.95 * refit for r in rows)


def _scanned_files():
    yield README
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*")):
            parts = set(path.relative_to(ROOT).parts)
            if (not path.is_file() or parts & SKIPPED_DIRS
                    or any(p.endswith(".egg-info") for p in parts)):
                continue
            if path.resolve() == Path(__file__).resolve():
                continue
            yield path


def test_nothing_cites_files_outside_the_repository():
    found = []
    for path in _scanned_files():
        data = path.read_bytes()
        for needle in FOREIGN:
            if needle.encode() in data:
                line = data[: data.index(needle.encode())].count(b"\n") + 1
                found.append(f"{path.relative_to(ROOT)}:{line}: {needle}")
    assert not found, "cites files outside the repository:\n" + "\n".join(found)


# --- links ---------------------------------------------------------------------------------

_FENCE = re.compile(r"^\s*(```|~~~)")
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_CODE_SPAN = re.compile(r"`+[^`]*`+")


def _prose_lines(text: str):
    """(line number, line) outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces ->
    '-'."""
    text = _CODE_SPAN.sub(lambda m: m.group(0).strip("`"), heading.strip()).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for _, line in _prose_lines(path.read_text(encoding="utf-8")):
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        slug = _slug(match.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def _links(path: Path):
    for number, line in _prose_lines(path.read_text(encoding="utf-8")):
        for match in _LINK.finditer(_CODE_SPAN.sub("", line)):
            yield number, match.group(1)


def test_slugs_follow_github():
    assert _slug("Will it fit? `moebalance plan`") == "will-it-fit-moebalance-plan"
    assert _slug("2. Routing: scores, the selection-only bias") == "2-routing-scores-the-selection-only-bias"
    assert _slug("Performance on one GPU (H200, bfloat16)") == "performance-on-one-gpu-h200-bfloat16"


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    bad = []
    for number, target in _links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        linked = (page.parent / file_part).resolve() if file_part else page
        where = f"{page.relative_to(ROOT)}:{number}: {target}"
        if not linked.exists():
            bad.append(f"{where} (no such file)")
        elif not linked.is_relative_to(ROOT):
            bad.append(f"{where} (outside the repository)")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            bad.append(f"{where} (no heading with that anchor)")
    assert not bad, "dead links:\n" + "\n".join(bad)


def test_docs_pages_exist():
    assert (DOCS / "images" / "ab-variance.png").exists()
    for name in ("experiment", "results", "training", "data", "distributed", "api", "performance",
                 "config", "load_balancing", "seed_experiment", "architecture"):
        assert (DOCS / f"{name}.md").exists(), name


# --- commands ------------------------------------------------------------------------------

_PLACEHOLDER = re.compile(r"^[A-Z][A-Z_0-9]*$|\.\.\.|[\[\]|$<>]")  # CONFIG, RUN_DIR, [--x], $LONG
_SEPARATORS = re.compile(r"\s*(?:&&|\|\||;|\|)\s*")
# Subcommands cheap enough to run as written (no training): the others are parsed and their
# configs and overrides loaded.
_RUN_AS_WRITTEN = {"params", "plan", "keys", "demo"}


def _commands_in(text: str) -> list[tuple[str, bool]]:
    """Every `moebalance ...` command of a page with whether it is whole: lines of fenced code
    blocks (continuation lines joined, comments dropped, `&&` chains split) are commands to type;
    code spans of the prose that name a subcommand (a span may run over a line break) may be
    mentions that leave out required arguments (`moebalance plan --devices-per-host`)."""
    found, fenced, prose, block = [], False, [], ""
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            prose.append(line)
            continue
        block += line.rstrip("\\").strip() + " "
        if not line.rstrip().endswith("\\"):
            parts = (p.strip("\"'") for p in _SEPARATORS.split(block.split(" # ")[0].strip()))
            found += [(part, True) for part in parts if re.match(r"^(\S*/)?moebalance\s", part)]
            block = ""
    for span in re.findall(r"`([^`]+)`", "\n".join(prose)):
        span = " ".join(span.split())
        if re.match(r"^moebalance [a-z]+\s", span):
            found.append((span, False))
    return found


def _concrete(command: str) -> list[str] | None:
    """The command's arguments after `moebalance`, or None for a synopsis with placeholders."""
    import shlex

    words = shlex.split(command)[1:]
    return None if any(_PLACEHOLDER.search(w) for w in words) else words


def test_commands_are_found_in_fences_chains_and_spans():
    page = ("Run `moebalance plan deepseek4-flash\nici_fsdp_parallelism=8 --devices 64` or\n"
            "```bash\npip install -e . && .venv/bin/moebalance ab deepseek4-tiny \\\n"
            "    --out runs/ab   # the default\nssh host --command \"cd m && moebalance keys\"\n"
            "```\nsee `moebalance ab CONFIG --out DIR`.\n")
    commands = _commands_in(page)
    assert commands == [(".venv/bin/moebalance ab deepseek4-tiny --out runs/ab", True),
                        ("moebalance keys", True),
                        ("moebalance plan deepseek4-flash ici_fsdp_parallelism=8 --devices 64",
                         False),
                        ("moebalance ab CONFIG --out DIR", False)]
    assert [_concrete(c) for c, _ in commands] == [
        ["ab", "deepseek4-tiny", "--out", "runs/ab"], ["keys"],
        ["plan", "deepseek4-flash", "ici_fsdp_parallelism=8", "--devices", "64"], None]


def _documented_commands():
    for page in _pages():
        for command, whole in _commands_in(page.read_text(encoding="utf-8")):
            try:
                words = _concrete(command)
            except ValueError:  # unbalanced quotes: the test names the command
                words = command
            if words is not None:
                shown = words if isinstance(words, str) else " ".join(words)
                yield pytest.param(words, whole, id=f"{page.relative_to(ROOT)}: {shown}")


@pytest.mark.parametrize(("words", "whole"), list(_documented_commands()))
def test_documented_command_is_valid(words, whole, monkeypatch, capsys):
    """Each concrete command of README.md and docs/ parses (a mention in the prose may leave out
    required arguments and option values, nothing else: an unknown option or choice fails); its config and overrides load; the cheap ones (no
    training) run as written and succeed."""
    from moebalance import cli
    from moebalance.config import load_config

    assert not isinstance(words, str), f"`{words}` has unbalanced quotes"
    try:
        args = cli.build_parser().parse_args(words)
    except SystemExit:
        error = capsys.readouterr().err
        if not whole and ("arguments are required" in error or "expected one argument" in error):
            return  # a mention: `moebalance eval --refit-batches`
        pytest.fail(f"`moebalance {' '.join(words)}` does not parse: {error}")
    if getattr(args, "config", None) is not None:
        config = ROOT / args.config if (ROOT / args.config).exists() else args.config
        load_config(config, args.overrides)
    if args.command in _RUN_AS_WRITTEN:
        monkeypatch.chdir(ROOT)
        assert cli.main(words) == 0, capsys.readouterr().err


def _synopsis_options():
    for page in _pages():
        for command, _ in _commands_in(page.read_text(encoding="utf-8")):
            words = command.split()[1:]
            if _concrete(command) is None and words and re.match(r"^[a-z]+$", words[0]):
                options = sorted({o for o in re.findall(r"(?<![\w-])--[a-z][a-z-]*", command)})
                if options:
                    yield pytest.param(words[0], options,
                                       id=f"{page.relative_to(ROOT)}: {' '.join(words)}")


@pytest.mark.parametrize(("command", "options"), list(_synopsis_options()))
def test_documented_synopsis_names_real_options(command, options):
    """A synopsis (`moebalance demo [--steps 600] ...`) names only options its subcommand has."""
    from moebalance import cli

    parser = cli.build_parser()
    subcommands = next(a for a in parser._actions if a.choices and command in a.choices).choices
    known = subcommands[command]._option_string_actions
    assert not [o for o in options if o not in known], f"`moebalance {command}` has no such option"
