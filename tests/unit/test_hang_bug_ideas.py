"""hang_bug_ideas.md stands on its own: every test and function it cites exists where it says, every file it
names is in the repository, and nothing points outside it. Tests get renamed and moved; this keeps the map true."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "hang_bug_ideas.md"
FILE_SUFFIXES = (".py", ".md", ".sh", ".yaml", ".ini", ".txt")


def quoted(text: str) -> list[str]:
    """Every `code span` without spaces: where the file names tests, files and functions."""
    return re.findall(r"`([^`\s]+)`", text)


def defined_names(path: Path) -> set[str]:
    """The module's functions and classes, and `Class.method` for each method."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            names |= {f"{node.name}.{item.name}" for item in node.body
                      if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return names


def test_every_cited_test_and_function_exists_in_the_file_named():
    citations = [span for span in quoted(DOC.read_text()) if "::" in span]
    missing = []
    for citation in citations:
        path, name = citation.split("::", 1)
        name = name.split("[")[0]  # a parametrized case names its test
        if not (ROOT / path).is_file() or name not in defined_names(ROOT / path):
            missing.append(citation)
    assert not missing, f"hang_bug_ideas.md cites what does not exist: {missing}"
    assert len(citations) >= 60, citations  # each of the hazards names its tests


def test_tests_are_cited_with_their_file():
    bare = [span for span in quoted(DOC.read_text()) if re.fullmatch(r"test_\w+", span)]
    assert not bare, f"cite these as tests/<folder>/<file>.py::<name>: {bare}"


def test_every_file_named_is_in_the_repository():
    named = [span.split("::")[0] for span in quoted(DOC.read_text())]
    files = [name for name in named if name.endswith(FILE_SUFFIXES)]
    folders = [name for name in named if re.fullmatch(r"(apps|configs|docs|lingua|setup|tests)/[\w/]*", name)]
    assert len(files) >= 10
    missing = [name for name in files + folders if not (ROOT / name).exists()]
    assert not missing, f"hang_bug_ideas.md names files this repository does not have: {missing}"


def test_nothing_points_outside_the_repository():
    text = DOC.read_text()
    assert "../" not in text
    links = re.findall(r"\]\(([^)#]+)", text)
    assert all((ROOT / link).exists() for link in links if "://" not in link), links
