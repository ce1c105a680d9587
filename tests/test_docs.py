"""The documentation holds together: every relative link in README.md and docs/ resolves to a file
of the repository (and a ``page.md#anchor`` link to a heading of that page, slugged as GitHub slugs
headings), README.md stays a front page of at most 10,000 characters, every ``sim/...py`` or
``hw_validate/...py`` path the pages name exists (docs/research/ aside: notes of their own time),
and docs/scenarios.md has a row for every field of the scenario schema. The checkers run on planted
mistakes too, so a test that passes has looked."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest
from conftest import ROOT

README_LIMIT = 10_000
#: Pages whose source paths are not checked: research notes quote the tree as it was when written.
PATHS_EXEMPT = ("docs/research/",)

_FENCE = re.compile(r"^\s*(```|~~~)")
_INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
_LINK = re.compile(r"\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:|^//")
_SOURCE_PATH = re.compile(r"(?<![\w./-])((?:sim|hw_validate)/[\w./-]*\.(?:py|sh))(?![\w/-])")


def markdown_pages(root: Path) -> list[Path]:
    """README.md and every page under docs/."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: its text (links reduced to their text, markup dropped),
    lower case, every character but letters, digits, '_', '-' and spaces removed, spaces -> '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading anchor of a page; a repeated slug gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for _, line in _prose_lines(text):
        m = _HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def link_problems(page: Path, root: Path) -> list[str]:
    """Relative links of ``page`` whose file (or heading anchor) does not exist in ``root``."""
    text = page.read_text()
    problems = []
    for number, line in _prose_lines(text):
        for target in _LINK.findall(_INLINE_CODE.sub("", line)):
            if _SCHEME.match(target):
                continue
            path_part, _, anchor = target.partition("#")
            where = f"{page.relative_to(root)}:{number}: {target}"
            dest = (page.parent / unquote(path_part)).resolve() if path_part else page.resolve()
            if root.resolve() not in (dest, *dest.parents):
                problems.append(f"{where}: leaves the repository")
            elif not dest.exists():
                problems.append(f"{where}: no such file")
            elif anchor and dest.suffix == ".md" and unquote(anchor) not in anchors(dest.read_text()):
                problems.append(f"{where}: no heading '#{anchor}' in {dest.name}")
    return problems


def path_problems(page: Path, root: Path) -> list[str]:
    """``sim/...py`` and ``hw_validate/...py`` (or ``.sh``) paths named in ``page`` that do not exist."""
    problems = []
    for number, line in enumerate(page.read_text().splitlines(), 1):
        for path in _SOURCE_PATH.findall(line):
            if not (root / path).is_file():
                problems.append(f"{page.relative_to(root)}:{number}: {path} does not exist")
    return problems


def undocumented_fields(reference: str) -> list[str]:
    """Fields of the scenario schema without a table row (``| `field` |``) in their section (``## model``,
    ``## routing``, ...; the file's top-level fields under ``## Top level``) of ``reference``."""
    from sim.inputs import faults, sections
    from sim.inputs.scenario import Scenario

    rows: dict[str, set[str]] = {}
    section = ""
    for _, line in _prose_lines(reference):
        if line.startswith("## "):
            section = line[3:].strip()
        elif m := re.match(r"^\| `(\w+)` \|", line):
            rows.setdefault(section, set()).add(m.group(1))
    models = [
        ("Top level", "", Scenario), ("cluster", "cluster", sections.ClusterConfig),
        ("model", "model", sections.ModelConfig), ("parallelism", "parallelism", sections.ParallelismConfig),
        ("training", "training", sections.TrainingConfig), ("routing", "routing", sections.RoutingConfig),
        ("routing", "routing.aux_free_balancing", sections.AuxFreeBalancing),
        ("collectives", "collectives", sections.CollectivesConfig), ("faults", "faults", faults.FaultsConfig),
        ("faults", "faults.links[]", faults.LinkFault), ("faults", "faults.stragglers[]", faults.Straggler),
        ("faults", "faults.jitter", faults.Jitter),
    ]  # fmt: skip
    return [
        f"{prefix}.{field}".lstrip(".")
        for heading, prefix, model in models
        for field in model.model_fields
        if field not in rows.get(heading, set())
    ]


# ---- the repository's pages ------------------------------------------------------------------------
def test_readme_is_a_front_page():
    n = len((ROOT / "README.md").read_text())
    assert n <= README_LIMIT, f"README.md has {n} characters; at most {README_LIMIT}: move detail to docs/"


@pytest.mark.parametrize("page", markdown_pages(ROOT), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    assert not link_problems(page, ROOT)


@pytest.mark.parametrize(
    "page",
    [p for p in markdown_pages(ROOT) if not str(p.relative_to(ROOT)).startswith(PATHS_EXEMPT)],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_named_source_files_exist(page):
    assert not path_problems(page, ROOT)


def test_scenario_reference_lists_every_field():
    missing = undocumented_fields((ROOT / "docs" / "scenarios.md").read_text())
    assert not missing, f"docs/scenarios.md has no row for: {', '.join(missing)}"


# ---- the checkers themselves -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("heading", "anchor"),
    [
        ("Calibration (`moesim calibrate`)", "calibration-moesim-calibrate"),
        ("1. Simulate a step", "1-simulate-a-step"),
        ("Overriding fields: `--set`", "overriding-fields---set"),
        ("`sim/` top level", "sim-top-level"),
        ("See [the layout](#the-layout) here", "see-the-layout-here"),
    ],
)
def test_slug_as_github(heading, anchor):
    assert slug(heading) == anchor


def test_checkers_catch_planted_mistakes(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "sim").mkdir()
    (tmp_path / "sim" / "real.py").write_text("")
    (tmp_path / "docs" / "page.md").write_text(
        "# Page\n\n## Real heading\n\n## Real heading\n\n```\n## Not a heading\n```\n"
    )
    (tmp_path / "README.md").write_text(
        "# Top\n\n"
        "[ok](docs/page.md) [ok](docs/page.md#real-heading) [ok](docs/page.md#real-heading-1) [ok](#top)\n"
        "[web](https://example.org/x.md) `[in code](nowhere.md)`\n"
        "[missing](docs/nowhere.md)\n"
        "[bad anchor](docs/page.md#no-such-heading) [fenced](docs/page.md#not-a-heading)\n"
        "[bad local anchor](#bottom) [outside](../elsewhere.md)\n"
        "```\n[in a fence](nowhere.md) sim/in_a_fence_too.py\n```\n"
        "Code in `sim/real.py`, `sim/gone.py`, hw_validate/gone.sh; tests/hw_validate/not_ours.py.\n"
    )
    readme = tmp_path / "README.md"
    links = link_problems(readme, tmp_path)
    assert [p.split(": ", 1)[1] for p in links] == [
        "docs/nowhere.md: no such file",
        "docs/page.md#no-such-heading: no heading '#no-such-heading' in page.md",
        "docs/page.md#not-a-heading: no heading '#not-a-heading' in page.md",
        "#bottom: no heading '#bottom' in README.md",
        "../elsewhere.md: leaves the repository",
    ]
    assert [p.split(": ", 1)[1] for p in path_problems(readme, tmp_path)] == [
        "sim/in_a_fence_too.py does not exist",
        "sim/gone.py does not exist",
        "hw_validate/gone.sh does not exist",
    ]
    assert link_problems(tmp_path / "docs" / "page.md", tmp_path) == []


def test_field_check_sees_a_missing_row():
    reference = (ROOT / "docs" / "scenarios.md").read_text().replace("| `top_k` |", "| top_k |")
    assert undocumented_fields(reference) == ["model.top_k"]
