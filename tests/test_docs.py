"""The repository stands on its own: its design doc is docs/design.md, every citation of
it names a section that exists, and the golden vectors it prints are the tested ones."""

from __future__ import annotations

import re
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
