"""The docs hold together: every relative link in README.md and docs/ resolves (the file, and the #anchor to a
heading of it), every page under docs/ is reachable from the README by links, and every module or source file a
page names (`python -m X`, `lingua/...py`, a bare `name.py`) exists. Files only: nothing is imported or run."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", ROOT / "hang_bug_ideas.md", *(ROOT / "docs").rglob("*.md")])
OUR_PACKAGES = ("apps", "lingua", "setup", "tests")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
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
        target = match.group(1) or match.group(2)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = page if not path else (page.parent / path).resolve()
        out.append((resolved, anchor or None, target))
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for resolved, anchor, target in links(page):
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading with that anchor in {resolved.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


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
