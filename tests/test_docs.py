"""Every reference resolves: citations of docs/ sections in code, tests and docs point at headings that exist, the docs
name files (and functions, classes, tests) that exist, and nothing cites the specs kept outside the repository.

Anchors are computed the way GitHub renders markdown headings (`docs/models.md#kda`, `#block-attention-residuals`).
"""

from __future__ import annotations

import re
from collections import Counter
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".cpp", ".h", ".cu", ".proto", ".sh", ".json",
                 ".jinja", ".tpl", ".cfg", ".ini"}
TEXT_NAMES = {"Makefile", "Dockerfile"}
SKIP_DIRS = {"__pycache__", "build", "dist", "bench_out", "node_modules"}
# The specs outside the repository (spelled so that this file does not match itself).
OUTSIDE_SPEC = re.compile(r"\.\./shared|shared/spe[c]|\b(?:MODELS|LESSONS|ANCHORS|STYLE)\.md\b")
DOC_CITATION = re.compile(r"(?<![\w./-])docs/([\w.-]+\.md)(?:#([\w-]*))?")  # not inside a longer path
MD_LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
# A backticked repository path, optionally with `::name`; or a bare `::name` continuing the last path.
CODE_PATH = re.compile(r"`((?:[\w.-]+/)+[\w.-]*)(?:::([\w.]+))?`|`::([\w.]+)`")
PATH_SUFFIXES = (".py", ".proto", ".cpp", ".md", ".yaml", ".json", ".toml", ".sh", ".jinja")


def repo_text_files() -> list[Path]:
    """Source, config and documentation files of the working tree (hidden folders and build outputs excluded)."""
    found = []
    for path in sorted(ROOT.rglob("*")):
        rel = path.relative_to(ROOT)
        if any(part.startswith(".") or part in SKIP_DIRS or part.endswith(".egg-info") for part in rel.parts[:-1]):
            continue
        if path.is_file() and (path.suffix in TEXT_SUFFIXES or path.name in TEXT_NAMES):
            found.append(path)
    return found


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: markup dropped, lower case, punctuation removed, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links keep their text
    text = text.replace("`", "").replace("*", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def headings(markdown: str) -> list[str]:
    """Heading texts outside fenced code blocks, in order."""
    out, in_fence = [], False
    for line in markdown.splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
        elif not in_fence and (m := HEADING.match(line)):
            out.append(m.group(2))
    return out


@cache
def anchors_of(md_file: Path) -> frozenset[str]:
    """Every anchor of a markdown file, with GitHub's -1, -2 suffixes for repeated headings."""
    seen: Counter[str] = Counter()
    result = set()
    for text in headings(md_file.read_text(encoding="utf-8")):
        slug = github_slug(text)
        result.add(slug if not seen[slug] else f"{slug}-{seen[slug]}")
        seen[slug] += 1
    return frozenset(result)


def outside_code_fences(markdown: str) -> str:
    lines, in_fence = [], False
    for line in markdown.splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
            lines.append("")
        else:
            lines.append("" if in_fence else line)
    return "\n".join(lines)


def where(path: Path, text: str, offset: int) -> str:
    return f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, offset) + 1}"


def check_target(file: Path, anchor: str | None, cited_at: str, problems: list[str]) -> None:
    if not file.is_file():
        problems.append(f"{cited_at}: {file.relative_to(ROOT)} does not exist")
    elif anchor and file.suffix == ".md" and anchor not in anchors_of(file):
        problems.append(f"{cited_at}: {file.relative_to(ROOT)} has no heading with anchor #{anchor} "
                        f"(anchors: {sorted(anchors_of(file))})")


def test_github_slug_matches_githubs_rules():
    assert github_slug("KDA") == "kda"
    assert github_slug("Beta and q/k normalisation") == "beta-and-qk-normalisation"
    assert github_slug("Kimi-K3 tensors") == "kimi-k3-tensors"
    assert github_slug("1. Router: identity and checks") == "1-router-identity-and-checks"
    assert github_slug("`A_log` and [links](x.md)") == "a_log-and-links"
    assert headings("# A\n```\n# not a heading\n```\n## B ##\n") == ["A", "B"]


def test_the_docs_exist():
    for name in ("models.md", "lessons.md", "design.md", "request-flow.md", "anchors.md"):
        assert (DOCS / name).is_file(), f"docs/{name} is missing"
        assert anchors_of(DOCS / name), f"docs/{name} has no headings"


def test_nothing_cites_the_specs_outside_the_repository():
    problems = []
    for path in repo_text_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        problems += [f"{where(path, text, m.start())}: {m.group(0)!r}" for m in OUTSIDE_SPEC.finditer(text)]
    assert not problems, "cite docs/ instead:\n" + "\n".join(problems)


def test_every_docs_citation_resolves():
    """`docs/<page>.md#<anchor>` anywhere in the repository names a page and a heading that exist."""
    problems: list[str] = []
    for path in repo_text_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        for m in DOC_CITATION.finditer(text):
            check_target(DOCS / m.group(1), m.group(2), where(path, text, m.start()), problems)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", sorted(p.name for p in DOCS.glob("*.md")) + ["../README.md"])
def test_markdown_links_resolve(page):
    """Relative links in the docs and the README point at files and headings that exist."""
    md = (DOCS / page).resolve()
    text = outside_code_fences(md.read_text(encoding="utf-8"))
    problems: list[str] = []
    for m in MD_LINK.finditer(text):
        target = m.group(1)
        if re.match(r"[a-z]+:", target):
            continue  # http:, https:, mailto:
        file_part, _, anchor = target.partition("#")
        file = (md.parent / file_part).resolve() if file_part else md
        check_target(file, anchor or None, where(md, text, m.start()), problems)
    assert not problems, "\n".join(problems)


def defines(file: Path, name: str) -> bool:
    """True when `file` defines `name` (a function, class, method or module-level name; dotted: its last part)."""
    last = name.split(".")[-1]
    source = file.read_text(encoding="utf-8", errors="replace")
    return re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{re.escape(last)}\b|^{re.escape(last)}\s*[:=]", source,
                     re.MULTILINE) is not None


@pytest.mark.parametrize("page", sorted(p.name for p in DOCS.glob("*.md")))
def test_files_and_names_the_docs_mention_exist(page):
    """A backticked `path/to/file.py` (or `path/::name`, or `::name` after it) in the docs exists in the repository."""
    md = DOCS / page
    text = outside_code_fences(md.read_text(encoding="utf-8"))
    problems: list[str] = []
    current: Path | None = None
    for m in CODE_PATH.finditer(text):
        path, name, continued = m.groups()
        at = where(md, text, m.start())
        if path is not None:
            if not (path.endswith("/") or path.endswith(PATH_SUFFIXES)):
                continue  # not a repository path (e.g. an `owner/repo` name)
            current = ROOT / path
            if not current.exists():
                problems.append(f"{at}: {path} does not exist")
                current = None
                continue
        else:
            name = continued
        if name and current is not None and current.is_file() and not defines(current, name):
            problems.append(f"{at}: {current.relative_to(ROOT)} does not define {name}")
    assert not problems, "\n".join(problems)
