"""The repository stands on its own: its design doc is docs/design.md, every citation of
it names a section that exists, and the golden vectors it prints are the tested ones."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import test_hashing

ROOT = Path(__file__).resolve().parent.parent
DESIGN = ROOT / "docs" / "design.md"
SOURCES = ("cas_bank", "runtime", "tools", "tests", "benchmarks")


def _texts() -> dict[Path, str]:
    files = [ROOT / "README.md", ROOT / "pyproject.toml", ROOT / "Makefile"]
    for top in SOURCES:
        files += sorted((ROOT / top).rglob("*.py"))
    return {p: p.read_text(encoding="utf-8") for p in files if p.is_file()}


def _sections() -> set[str]:
    return {m.group(1).strip() for m in re.finditer(r"^#+ (.+)$", DESIGN.read_text(), re.M)}


def test_nothing_points_outside_the_repository() -> None:
    outside = re.compile(r"DESIGN\.md|STYLE\.md|\.\./shared|/work/")
    found = [
        f"{p.relative_to(ROOT)}:{text[: m.start()].count(chr(10)) + 1}: {m.group(0)}"
        for p, text in _texts().items()
        if p.name != "test_docs.py"
        for m in outside.finditer(text)
    ]
    assert found == []


def test_every_citation_names_a_section_of_the_design_doc() -> None:
    # `docs/design.md, "Section"` (the quotes may sit across a line break in a docstring)
    cite = re.compile(r'docs/design\.md,\s+"([^"]+)"')
    sections = _sections()
    cited = {
        (p.relative_to(ROOT), " ".join(m.group(1).split()))
        for p, text in _texts().items()
        if p.name != "test_docs.py"
        for m in cite.finditer(text)
    }
    assert cited, "no citation found: the pattern above no longer matches how code cites"
    assert sorted((str(p), s) for p, s in cited if s not in sections) == []


def test_the_golden_vectors_in_the_design_doc_are_the_tested_ones() -> None:
    text = DESIGN.read_text()
    vectors = [
        test_hashing.GOLDEN_FINGERPRINT,
        test_hashing.GOLDEN_ROOT_64,
        test_hashing.GOLDEN_ROOT_ZERO_FP_4,
        *test_hashing.GOLDEN_CHAIN_ZERO_ROOT,
        *test_hashing.GOLDEN_CHAIN_SPEC_ROOT,
        test_hashing.GOLDEN_PAYLOAD_DIGEST_ABC,
    ]
    assert [v for v in vectors if v not in text] == []


MAPPED = ("cas_bank", "runtime", "tools")


def _module_map() -> list[str]:
    """The first cell of every table row in the design doc's "Module map" section."""
    text = DESIGN.read_text()
    start = text.index("\n## Module map\n")
    end = text.find("\n## ", start + 1)
    section = text[start : end if end != -1 else len(text)]
    return re.findall(r"^\| `([^`]+)` \|", section, re.M)


def _holds_code(path: Path) -> bool:
    """A package's `__init__.py` is a module of its own once it holds more than a
    docstring; an empty or docstring-only one only marks the folder."""
    body = ast.parse(path.read_text(encoding="utf-8")).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return bool(body)


def _python_files() -> list[Path]:
    """The modules under MAPPED: those git tracks in a checkout (a module another
    engineer has not committed yet is not the tree's), every one in an unpacked sdist."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--", *MAPPED],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout.decode()
    except (OSError, subprocess.CalledProcessError):
        return [p for top in MAPPED for p in (ROOT / top).rglob("*.py")]
    return [ROOT / f for f in out.split("\0") if f.endswith(".py") and (ROOT / f).is_file()]


def test_the_module_map_lists_every_module_and_nothing_else() -> None:
    listed = _module_map()
    assert listed, 'no module map found: docs/design.md needs a "## Module map" table'
    modules = {
        str(p.relative_to(ROOT))
        for p in _python_files()
        if p.name != "__init__.py" or _holds_code(p)
    }
    missing = sorted(modules - set(listed))
    extra = sorted(p for p in listed if not (ROOT / p.rstrip("/")).exists())
    twice = sorted({p for p in listed if listed.count(p) > 1})
    assert (missing, extra, twice) == ([], [], []), (
        "docs/design.md, Module map, is out of step with the tree: "
        f"modules not listed: {missing}; listed paths that do not exist: {extra}; "
        f"listed twice: {twice}"
    )
