"""Every relative link in the README and the documents resolves: the file exists, and an
``#anchor`` names a heading (GitHub's slug of it) or an explicit ``<a id="...">`` in the target.

Links inside fenced code blocks and inline code are ignored; absolute URLs (``http:``, ``https:``,
``mailto:``) are not fetched.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = sorted(
    [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), ROOT / "bench" / "README.md",
     ROOT / "bench" / "RESULTS.md", ROOT / "deploy" / "README.md", ROOT / "inflight_kernels" / "README.md"])

_FENCE = re.compile(r"^\s*(```|~~~)")
_LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_INLINE_CODE = re.compile(r"`[^`]*`")
_EXPLICIT_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")


def _prose_lines(text: str) -> list[str]:
    """The lines of a Markdown text outside fenced code blocks, inline code removed."""
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(_INLINE_CODE.sub("", line))
    return lines


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: lowercased, markup and punctuation other than
    ``-`` and ``_`` dropped, each space a ``-`` (github-slugger's rule)."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[*]", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    """Every anchor a Markdown file offers: its headings' slugs (duplicates numbered -1, -2, ...
    as GitHub does) and its explicit ``<a id>``/``<a name>`` anchors."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    text = path.read_text(encoding="utf-8")
    fenced = False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            continue
        found.update(_EXPLICIT_ANCHOR.findall(line))
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            slug = github_slug(m.group(1))
            n = seen.get(slug, 0)
            found.add(slug if n == 0 else f"{slug}-{n}")
            seen[slug] = n + 1
    return frozenset(found)


def relative_links(path: Path) -> list[str]:
    """The relative link targets (``file``, ``file#anchor`` or ``#anchor``) of a Markdown file."""
    targets = []
    for line in _prose_lines(path.read_text(encoding="utf-8")):
        for target in _LINK.findall(line):
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target):
                targets.append(target)
    return targets


def broken_links(path: Path) -> list[str]:
    """The relative links of ``path`` that do not resolve, each with why."""
    broken = []
    for target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading or <a id> '{anchor}' in {dest.name}")
    return broken


@pytest.mark.parametrize("doc", [d for d in DOCUMENTS if d.exists()], ids=lambda d: str(d.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path) -> None:
    assert broken_links(doc) == []


def test_the_checker_sees_a_broken_link_and_a_broken_anchor(tmp_path: Path) -> None:
    """The check itself can fail: a missing file and a missing anchor are reported, a heading's
    slug, an explicit anchor and links inside code are accepted."""
    (tmp_path / "other.md").write_text('# Run 36: K-quants (1B, 3B)\n\n<a id="run-7"></a>\n### 7. x\n')
    doc = tmp_path / "doc.md"
    doc.write_text("[a](other.md#run-36-k-quants-1b-3b) [b](other.md#run-7) [c](missing.md)\n"
                   "[d](other.md#nowhere) `[e](ignored.md)` [f](https://example.com/x)\n"
                   "```\n[g](also-ignored.md)\n```\n")
    assert broken_links(doc) == ["missing.md: no such file",
                                 "other.md#nowhere: no heading or <a id> 'nowhere' in other.md"]
