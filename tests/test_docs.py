"""The README stays a front door and the docs cite what exists: README ≤ 300 lines with a map of every docs/ page,
every benchmarks/ path the docs name is there, and every file in benchmarks/ is cited by the docs or its index."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README_LINES = 300
BENCHMARK = re.compile(r"\d{4}-\d{2}-\d{2}-[\w.-]+?\.json")
LINK = re.compile(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)")


def _texts(*paths: Path) -> dict[Path, str]:
    return {path: path.read_text(encoding="utf-8") for path in paths}


def docs() -> dict[Path, str]:
    return _texts(ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))


def missing_links(texts: dict[Path, str]) -> list[str]:
    return sorted(f"{path.name} -> {link}" for path, text in texts.items() for link in LINK.findall(text)
                  if not link.startswith("http") and not (path.parent / link).resolve().is_file())


def cited(texts: dict[Path, str]) -> set[str]:
    return {name for text in texts.values() for name in BENCHMARK.findall(text)}


def test_the_readme_is_a_front_door_with_a_map_of_the_docs():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= README_LINES
    assert [page.name for page in sorted((ROOT / "docs").glob("*.md")) if f"(docs/{page.name})" not in readme] == []


def test_every_link_between_the_docs_leads_to_a_page():
    assert missing_links(docs()) == []


def test_every_benchmark_the_docs_name_is_in_the_tree():
    kept = {path.name for path in (ROOT / "benchmarks").glob("*.json")}
    assert sorted(cited(docs()) - kept) == []


def test_every_file_in_benchmarks_is_cited_by_the_docs_or_the_index():
    index = _texts(ROOT / "benchmarks" / "README.md")
    kept = {path.name for path in (ROOT / "benchmarks").glob("*.json")}
    assert sorted(kept - cited({**docs(), **index})) == []


def test_a_dangling_link_and_an_uncited_name_are_found():
    page = ROOT / "docs" / "commands.md"
    assert missing_links({page: "see [there](nowhere.md#x) and [here](trees.md)"}) == ["commands.md -> nowhere.md"]
    assert cited({page: "from `benchmarks/2026-12-06-demo-a_b.json`, not 2026-12-06.json"}) == {"2026-12-06-demo-a_b.json"}
