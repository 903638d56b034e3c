"""The documents the code cites live in the repo and say what the citations claim.

Docstrings cite the spec as ``docs/algorithms.md §4.8`` (or ``§4.1–4.8``, ``§2.1, 2.5``) and
the design as ``docs/design.md, "The data that flows"``. These tests read files only: every
cited section must exist as a heading, nothing may cite the old out-of-repo spec files,
every relative link in README.md and docs/*.md must point to a file that exists, those pages
must use words a reader can decode (no lecture, issue numbers, commit hashes or "seed" for a
source document), and the README stays short.
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


# --- plain words in user documentation -----------------------------------------------------

USER_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 200

LECTURE = re.compile(r"\blectures?\b", re.I)
MEASURED_HERE = re.compile(r"\bmeasured here\b", re.I)
ISSUE_NUMBER = re.compile(r"\bissues?\s+#?\d+", re.I)
HASH_NUMBER = re.compile(r"#\d+\b")
COMMIT_HASH = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b")
HEADING = re.compile(r"^\s{0,3}#{1,6}\s")
LINK_TARGET = re.compile(r"\]\([^)]*\)")
INLINE_CODE = re.compile(r"`[^`\n]*`")
SEED = re.compile(r"\bseeds?\b", re.I)
# "seed 0", "seeds 0–2", "seed=1", "seed: 3", "seed N": a value follows ...
SEED_VALUE = re.compile(r"\s*[=:]?\s*(?:\d|[A-Z]\b)")
# ... but a zero-padded number ("seed 004", "seeds 001/002") names a document, not a value.
SEED_DOCUMENT_NUMBER = re.compile(r"\s*[=:]?\s*0\d")
SEED_TABLE_HEADER = re.compile(r"\|\s*$")
RANDOMNESS_WORDS = {"random", "run", "another", "other", "own", "each", "same", "generator", "different"}


def _line_of(text: str, position: int) -> int:
    return text.count("\n", 0, position) + 1


def _prose(text: str) -> str:
    """The text with inline code blanked out, every offset kept (fenced blocks stay: their
    comments are read too)."""
    return INLINE_CODE.sub(lambda m: " " * len(m.group(0)), text)


def _seed_as_document(prose: str, match: re.Match) -> bool:
    """Whether this "seed"/"seeds" names one of the project's source documents.

    It counts as a random seed, and passes, when it is a command-line flag (``--seed``), when a
    value follows ("seed 0", "seeds 0–2", "seeds 0, 1 and 2", "seed=1", "seed N"), when it is a
    table column (``| seed |``), or when the word before it is about randomness ("random seed",
    "another seed", "each seed", "its own seed", "run seed", "generator seeds", ...; the line
    break between the two words does not matter). Inline code (``seed``, ``Random(seed + i)``
    between backticks) is not read; comments in code blocks are. Anything else — "the seed's
    example 1", "the seeds describe", "seed 004" (a zero-padded number) — is flagged: name the
    example, paper or idea instead.
    """
    before, after = prose[: match.start()], prose[match.end() :]
    if before.endswith("--"):
        return False
    if SEED_DOCUMENT_NUMBER.match(after):
        return True
    if SEED_VALUE.match(after):
        return False
    if SEED_TABLE_HEADER.search(before.split("\n")[-1]) and after.lstrip(" ").startswith("|"):
        return False
    words = re.findall(r"[\w-]+", before[-80:].lower())
    return not (words and words[-1] in RANDOMNESS_WORDS)


def _plain_word_problems(text: str) -> list[tuple[int, str]]:
    """(line, what) for every word of ``text`` a reader cannot decode (see the test below)."""
    found = []
    for number, line in enumerate(text.split("\n"), 1):
        for name, pattern in [
            ("'lecture'", LECTURE),
            ("'measured here' (say where)", MEASURED_HERE),
            ("an issue number", ISSUE_NUMBER),
            ("a commit hash", COMMIT_HASH),
        ]:
            found += [(number, f"{name}: {m.group(0)!r}") for m in pattern.finditer(line)]
        if not HEADING.match(line):
            outside_links = LINK_TARGET.sub("", line)
            found += [(number, f"an issue number: {m.group(0)!r}") for m in HASH_NUMBER.finditer(outside_links)]
    prose = _prose(text)
    for m in SEED.finditer(prose):
        if _seed_as_document(prose, m):
            context = " ".join(prose[max(0, m.start() - 30) : m.end() + 15].split())
            found.append((_line_of(prose, m.start()), f"'seed' naming a document: {context!r}"))
    return sorted(found)


def test_plain_words_rule_flags_documents_and_passes_random_seeds():
    flagged = [
        "make demo    # then the seed's example 1",
        "The seed lectures close with one table",
        "Reward hacking, as the seeds describe it",
        "Asynchronous RL (seed 004, AReaL)",
        "Direct assessment (seeds 000/001)",
        "as issue 22 asked",
        "see #22 for the plan",
        "before ad3932d, seeds drew",
        "Measured here (seed 0)",
    ]
    passed = [
        '`make demo ARGS="--seed 1"` repeats it with another\nrandom seed',
        "on seeds 0–2, seed 2 lowest; seeds 0, 1 and 2; --seed N",
        "each seed on its own problems, generated from another\nseed than the training problems",
        "| variant | seed | greedy |",
        "the `seed` key, `rollout.vllm.seed`",
        "## 4. Policy losses",
        "see [the losses](algorithms.md#4-policy-losses)",
        "a 2-core CPU, 1e-4 and 3.4e-5 and 0.0739 s/step",
    ]
    for text in flagged:
        assert _plain_word_problems(text), f"not flagged: {text!r}"
    for text in passed:
        assert not _plain_word_problems(text), f"flagged: {text!r}: {_plain_word_problems(text)}"


def test_user_docs_use_plain_words():
    """README.md and docs/*.md name things a reader can look up.

    Flagged anywhere in the text: "lecture(s)"; "measured here" (say where: "on a 2-core CPU",
    "on one H100"); issue numbers ("issue 22", "issues 41/42", "#22" outside headings and link
    anchors); commit hashes (7–40 lowercase hex characters with a letter and a digit). Flagged
    outside code: "seed"/"seeds" used for one of the project's source documents rather than a
    random seed — the rule is in ``_seed_as_document``.
    """
    problems = []
    for page in USER_PAGES:
        for number, what in _plain_word_problems(_read(page)):
            problems.append(f"{page.relative_to(ROOT)}:{number}: {what}")
    assert not problems, "words a reader cannot decode:\n" + "\n".join(problems)


def test_readme_is_short():
    lines = _read(ROOT / "README.md").splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}); move details to docs/*.md"
    )
