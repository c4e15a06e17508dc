"""The docs hold together: every relative link in the repository's markdown pages resolves (the file, and the
#anchor to a heading of it, slugged as GitHub does), every page is reachable from the README by links, and every
module or source file a page names (`python -m X`, `lingua/...py`, a bare `name.py`) exists. The landing page
stays one: README.md fits 120 lines and its test command is the one CI runs. Files only: nothing is imported or
run."""

import os
import re
from pathlib import Path

import pytest

from tests.readme import TEST_COMMAND, commands, readme_blocks

ROOT = Path(__file__).resolve().parents[2]
DOC_FOLDERS = ("docs", "apps", "lingua", "setup", "tests", "configs")  # not .venv, data/ or dumps/: not ours
PAGES = sorted([*ROOT.glob("*.md"), *(p for folder in DOC_FOLDERS for p in (ROOT / folder).rglob("*.md"))])
README_MAX_LINES = 120
OUR_PACKAGES = ("apps", "lingua", "setup", "tests")
# [text](target), ![alt](target), a reference definition `[label]: target` and an HTML <a href="target">
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)|^ {0,3}\[[^\]]+\]:\s+(\S+)"
                  r"|<a\s[^>]*href=\"([^\"]+)\"", re.M)
FENCE = re.compile(r"^\s*(```|~~~)")


def prose(text: str) -> str:
    """The page without its fenced code blocks (headings and links there are not markdown)."""
    kept, inside = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            inside = not inside
            continue
        if not inside:
            kept.append(line)
    return "\n".join(kept)


def without_inline_code(text: str) -> str:
    """Inline code spans may cross lines, never paragraphs."""
    return "\n\n".join(re.sub(r"`[^`]*`", "", paragraph) for paragraph in text.split("\n\n"))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set:
    found, seen = set(), {}
    for line in prose(page.read_text()).splitlines():
        match = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    found.update(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", page.read_text()))
    return found


def links(page: Path) -> list:
    """(target path, anchor or None) of each relative link of the page, outside code."""
    out = []
    for match in LINK.finditer(without_inline_code(prose(page.read_text()))):
        target = next(group for group in match.groups() if group)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = page if not path else (page.parent / path).resolve()
        out.append((resolved, anchor or None, target))
    return out


def broken_links(page: Path) -> list:
    """Each relative link of the page whose file is missing, or whose #anchor no heading of that page makes."""
    broken = []
    for resolved, anchor, target in links(page):
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading with that anchor in {os.path.relpath(resolved, page.parent)}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = broken_links(page)
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


@pytest.mark.parametrize("heading, github_anchor", [
    ("Recipe: Llama-3.1-8B teaching a ~1B student on one node of 8 GPUs",
     "recipe-llama-31-8b-teaching-a-1b-student-on-one-node-of-8-gpus"),
    ("2026-11-27: one NVIDIA H100 80GB HBM3, the bench", "2026-11-27-one-nvidia-h100-80gb-hbm3-the-bench"),
    ("Meta Lingua's keys", "meta-linguas-keys"),
    ("Running on SLURM: `lingua.stool`", "running-on-slurm-linguastool"),
    ("The `distillation.*` keys (every one)", "the-distillation-keys-every-one"),
    ("snake_case stays, **bold** goes", "snake_case-stays-bold-goes"),
    ("A [linked](x.md) word", "a-linked-word"),
])
def test_anchors_are_slugged_as_github_slugs_them(heading, github_anchor):
    assert slug(heading) == github_anchor


def test_the_crawler_finds_a_missing_file_a_missing_anchor_and_a_repeated_heading(tmp_path):
    """The crawler itself: a page with every kind of link, good and broken, and only the broken ones reported."""
    (tmp_path / "other.md").write_text("# Other\n\n## Twice\n\n## Twice\n\n```\n# not a heading\n```\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n## Here\n\n"
        "[ok](other.md) [ok](other.md#twice) [ok](other.md#twice-1) [ok](#here) ![img](other.md) [web](https://x.y/z)\n"
        "[gone](missing.md) [bad](other.md#nowhere) [bad](other.md#not-a-heading) [bad](#twice)\n"
        "`[code](ignored.md)` <a href=\"also_missing.md\">html</a>\n\n[ref]: ref_missing.md\n"
        "```\n[in a block](ignored_too.md)\n```\n")
    assert broken_links(page) == [
        "missing.md: no such file", "other.md#nowhere: no heading with that anchor in other.md",
        "other.md#not-a-heading: no heading with that anchor in other.md",
        "#twice: no heading with that anchor in page.md", "also_missing.md: no such file",
        "ref_missing.md: no such file"]


def test_the_readme_is_a_landing_page_of_at_most_120_lines():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines; move detail into a docs/ page and link it (at most {README_MAX_LINES})")


def test_the_readmes_test_command_is_what_ci_runs():
    """The first screen's second command is the suite, and .ci/run runs exactly it, with the real SLURM tests
    required (tests/dist/test_demo.py runs the first command, the demo)."""
    (block,) = readme_blocks("first screen")
    assert commands(block)[-1] == TEST_COMMAND, block
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.strip().startswith("#")]
    assert ci[-1] == TEST_COMMAND, ci
    assert "export LINGUA_REQUIRE_SLURM=1" in ci, ci


def test_every_docs_page_is_reachable_from_the_readme():
    seen, todo = set(), [ROOT / "README.md"]
    while todo:
        page = todo.pop()
        if page in seen or not page.exists() or page.suffix != ".md":
            continue
        seen.add(page)
        todo.extend(resolved for resolved, _, _ in links(page))
    missing = [str(p.relative_to(ROOT)) for p in PAGES if p not in seen]
    assert not missing, f"pages no link chain from README.md reaches: {missing}"


def module_exists(dotted: str) -> bool:
    path = ROOT / dotted.replace(".", "/")
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


SOURCE_PATH = re.compile(r"(?<![\w/.-])((?:apps|lingua|setup|tests|configs)/[\w/.-]*\w)")
BARE_FILE = re.compile(r"(?<![\w/.\\-])([a-z_][a-z0-9_]*\.py)\b")
ALL_FILES = {p.name for p in ROOT.rglob("*.py") if ".venv" not in p.parts}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_module_and_source_file_a_page_names_exists(page):
    text = page.read_text()
    missing = []
    for module in re.findall(r"python\d?(?:\.\d+)? -m ([\w.]+)", text):
        if module.split(".")[0] in OUR_PACKAGES and not module_exists(module):
            missing.append(f"python -m {module}")
    for match in SOURCE_PATH.finditer(text):
        path, before = match.group(1), text[max(0, match.start() - 30):match.start()]
        file_part = path.split(":")[0]
        if "<" in file_part or "*" in file_part or "Lingua's" in before:  # Meta Lingua's own tree, not ours
            continue
        if not (ROOT / file_part).exists():
            missing.append(path)
    for name in BARE_FILE.findall(text):
        if name not in ALL_FILES:
            missing.append(name)
    assert not missing, f"{page.relative_to(ROOT)} names what does not exist: {sorted(set(missing))}"
