"""The docs site and what points into it: `mkdocs build --strict` passes (no dead link, no
missing page), every doc the code cites exists with the section it names, the README and docs
point nowhere outside the repository and carry no dates of work or issue numbers, and every
config field is described in the generated reference."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
SOURCES = [
    p
    for folder in ("ray_diloco", "tests", "benchmarks", "docs", "examples")
    for p in (ROOT / folder).rglob("*.py")
    if p != Path(__file__).resolve()  # its own patterns are not citations
]
PAGES = [
    p for p in (ROOT / "README.md", ROOT / "CONTRIBUTING.md", *DOCS.rglob("*.md")) if p.exists()
]
# "docs/algorithm.md section 5", "docs/algorithm.md sections 4 to 8", "sections 3 and 6", "3-7"
DESIGN_DOCS = ("algorithm.md", "design.md", "contracts.md", "ray-notes.md")
CITATION = re.compile(
    r"(?<![\w/.-])((?:docs/)?[\w./-]+\.md)(?:,? sections? (\d+)(?:(?: to |-| and )(\d+))?)?"
)


def test_mkdocs_build_strict(tmp_path):
    # A dead link, a missing page or a broken anchor fails the build (mkdocs.yml: strict, and
    # every validation at "warn").
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "site" / "algorithm" / "index.html").exists()


def _sections(page: Path) -> set[int]:
    return {int(m) for m in re.findall(r"^## (\d+)\.", page.read_text(), flags=re.MULTILINE)}


def test_every_doc_the_code_cites_exists_with_its_section():
    bad = []
    for path in SOURCES:
        text = path.read_text()
        for m in CITATION.finditer(text):
            name, first, last = m.groups()
            where = f"{path.relative_to(ROOT)}: {m.group(0)!r}"
            if not name.startswith("docs/"):
                if Path(name).name in DESIGN_DOCS:
                    bad.append(f"{where}: cite docs/{Path(name).name}, the repository's own")
                continue  # a results file, an example's README, a file name in prose
            target = ROOT / name
            if not target.exists():
                bad.append(f"{where}: {name} does not exist")
                continue
            if first:
                have = _sections(target)
                wanted = range(int(first), int(last or first) + 1)
                missing = [n for n in wanted if n not in have]
                if missing:
                    bad.append(f"{where}: {name} has no section {missing}")
    assert not bad, "\n".join(bad)


def test_pages_point_nowhere_outside_the_repository():
    bad = []
    link = re.compile(r"\]\(([^)\s]+)\)")
    for page in PAGES:
        text = page.read_text()
        for target in link.findall(text):
            if target.startswith(("http://", "https://", "#", "mailto:")):
                continue
            resolved = (page.parent / target.split("#")[0]).resolve()
            if not resolved.is_relative_to(ROOT):
                bad.append(f"{page.relative_to(ROOT)}: {target} is outside the repository")
            elif page.parent == DOCS / "results" and target.endswith(".png"):
                if not (ROOT / "benchmarks" / "results" / target).exists():
                    bad.append(f"{page.relative_to(ROOT)}: no benchmarks/results/{target}")
            elif not resolved.exists():
                bad.append(f"{page.relative_to(ROOT)}: {target} does not exist")
        if "shared/docs" in text or "/work/" in text:
            bad.append(f"{page.relative_to(ROOT)}: names a path outside the repository")
    assert not bad, "\n".join(bad)


def test_pages_carry_no_dates_of_work_nor_issue_numbers():
    # Experiment history belongs to docs/decisions (as figures, not as a diary) and to commit
    # messages; a page says what is, not when it became so.
    bad = []
    for page in PAGES:
        for n, line in enumerate(page.read_text().splitlines(), 1):
            if re.search(r"\b20\d\d-\d\d-\d\d\b|\b[Ii]ssues? #?\d+|closing note", line):
                bad.append(f"{page.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
    assert not bad, "\n".join(bad)


def test_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300


def test_every_decision_record_is_listed():
    index = (DOCS / "decisions" / "index.md").read_text()
    records = sorted(p.name for p in (DOCS / "decisions").glob("[0-9][0-9][0-9]-*.md"))
    assert records, "no decision records"
    missing = [name for name in records if f"({name})" not in index]
    assert not missing, f"add to docs/decisions/index.md: {missing}"
    numbers = [name[:3] for name in records]
    assert len(numbers) == len(set(numbers)), f"two records share a number: {numbers}"


def test_every_config_field_is_described():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import config_reference
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert config_reference.check() == []
