"""The documents the code cites live in the repo and say what the citations claim.

Docstrings cite the spec as ``docs/algorithms.md §4.8`` (or ``§4.1–4.8``, ``§2.1, 2.5``) and
the design as ``docs/design.md, "The data that flows"``. These tests read files only: every
cited section must exist as a heading, nothing may cite the old out-of-repo spec files, and
every relative link in README.md and docs/*.md must point to a file that exists.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALGORITHMS = ROOT / "docs" / "algorithms.md"
DESIGN = ROOT / "docs" / "design.md"

# Where citations are looked for; docs/*.md are scanned separately (see _citations).
CITING = ["posttrain", "tests", "benchmarks", "examples", "scripts", "configs", "README.md"]
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".sh", ".toml", ".txt", ".cfg", ".ini", ".json"}
SKIP_DIRS = {"__pycache__", "runs", "node_modules", "build", "dist"}

NUM = r"\d+(?:\.\d+)?"
# "§4.8", "§4.1–4.8", "§4.9–§6", "§2.1, 2.5, 2.6", "§§2.2, 2.3", "§2.7, §7, §8".
SECTION_GROUP = rf"§§?\s*{NUM}(?:\s*(?:–|—|-|,|and|to)\s*§?\s*{NUM})*"
ALGO_CITATION = re.compile(rf"docs/algorithms\.md['’]?s?[\s,(]*({SECTION_GROUP})")
BARE_GROUP = re.compile(SECTION_GROUP)
RANGE_PART = re.compile(rf"§?\s*({NUM})\s*(?:–|—|-|to)\s*§?\s*({NUM})")
DESIGN_CITATION = re.compile(r'docs/design\.md,?\s*"([^"]+)"')
# The old names, written so that this file does not match itself.
OUT_OF_REPO = re.compile(r"(?<![\w/])(?:ALGORITHMS|DESIGN)\.md\b")
MD_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _files(paths: list[str]) -> Iterator[Path]:
    for name in paths:
        path = ROOT / name
        if path.is_file():
            yield path
        elif path.is_dir():
            for sub in sorted(path.rglob("*")):
                parts = sub.relative_to(ROOT).parts
                if any(p.startswith(".") or p in SKIP_DIRS or p.endswith(".egg-info") for p in parts):
                    continue
                if sub.is_file() and sub.suffix in TEXT_SUFFIXES:
                    yield sub


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def _headings(path: Path) -> list[str]:
    return [m.group(1).strip() for m in re.finditer(r"^#{1,6}\s+(.+)$", _read(path), re.M)]


def _algorithm_sections() -> set[str]:
    """Section numbers of docs/algorithms.md: '## 4. Policy losses' → 4, '### 4.8 AReaL' → 4.8."""
    sections = set()
    for heading in _headings(ALGORITHMS):
        m = re.match(rf"({NUM})\.?\s", heading)
        if m:
            sections.add(m.group(1))
    return sections


def _expand(group: str) -> list[str]:
    """Every section a reference names; a range within one chapter names the steps between."""
    cited = list(re.findall(NUM, group))
    for low, high in RANGE_PART.findall(group):
        if "." in low and "." in high and low.split(".")[0] == high.split(".")[0]:
            chapter, first, last = low.split(".")[0], int(low.split(".")[1]), int(high.split(".")[1])
            cited += [f"{chapter}.{n}" for n in range(first, last + 1)]
    return list(dict.fromkeys(cited))


def _citations() -> list[tuple[str, str, str]]:
    """(file:line, reference as written, section) for every section of docs/algorithms.md cited.

    In code, tests and the README a section counts as cited when it follows
    ``docs/algorithms.md``. In docs/*.md every ``§`` means a section of docs/algorithms.md.
    """
    found = []

    def add(path: Path, text: str, start: int, group: str) -> None:
        where = f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, start) + 1}"
        found.extend((where, group, section) for section in _expand(group))

    for path in _files(CITING):
        text = _read(path)
        for m in ALGO_CITATION.finditer(text):
            add(path, text, m.start(), m.group(1))
    for path in sorted((ROOT / "docs").glob("*.md")):
        text = _read(path)
        for m in BARE_GROUP.finditer(text):
            add(path, text, m.start(), m.group(0))
    return found


def test_algorithms_doc_has_the_numbered_sections():
    sections = _algorithm_sections()
    expected = {str(n) for n in range(11)} | {"1.1", "1.2", "2.0", "2.9", "3.1", "4.8", "4.10", "5.5", "10.9"}
    assert expected <= sections, f"docs/algorithms.md lacks headings for {sorted(expected - sections)}"


def test_every_cited_algorithms_section_exists():
    sections = _algorithm_sections()
    citations = _citations()
    # The code cites the spec dozens of times; finding few means the pattern broke, not the docs.
    assert len(citations) > 40, f"only {len(citations)} citations of docs/algorithms.md found"
    missing = [f"{where}: {written!r} → §{section}" for where, written, section in citations if section not in sections]
    assert not missing, "cited sections that docs/algorithms.md lacks:\n" + "\n".join(missing)


def test_every_cited_design_section_exists():
    headings = [h.replace("`", "") for h in _headings(DESIGN)]
    citations = []
    for path in _files([*CITING, "docs"]):
        text = _read(path)
        citations += [(path.relative_to(ROOT), m.group(1)) for m in DESIGN_CITATION.finditer(text)]
    assert citations, "no quoted docs/design.md section found; did the citation style change?"
    missing = [f"{path}: {title!r}" for path, title in citations if not any(title in h for h in headings)]
    assert not missing, "cited sections that docs/design.md lacks:\n" + "\n".join(missing)


def test_nothing_cites_the_out_of_repo_spec_files():
    offenders = []
    for path in _files(["."]):
        for number, line in enumerate(_read(path).splitlines(), 1):
            if OUT_OF_REPO.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "cite docs/algorithms.md or docs/design.md instead:\n" + "\n".join(offenders)


def test_relative_markdown_links_resolve():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for m in MD_LINK.finditer(_read(page)):
            target = m.group(1)
            if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
                continue  # a URL, a mailto: or an anchor in the same page
            if not (page.parent / target.split("#")[0]).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)
