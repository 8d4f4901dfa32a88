"""README.md and docs/: every quoted command's script exists, every repository path they name exists, and every
relative link (and its #anchor) resolves. Text only: no imports beyond the standard library, well under a second."""

from __future__ import annotations

import pathlib
import re
from typing import Dict, Iterator, List, Set, Tuple

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))

COMMAND = re.compile(r"\b(?:python3?|bash|sbatch|torchrun|megatron-grpo|VENV/bin/python)\b[^\n`|#]*")
"""A quoted command, up to its line's end, closing backtick or comment: `python tools/study/sweep.py ...`,
`bash tools/setup.sh`, `sbatch ... tools/cluster/grpo.sbatch RECIPE`, `megatron-grpo train recipes/X.yaml`."""
SCRIPT = re.compile(r"(?<![\w/.-])((?:tools|recipes)/[\w./-]+)")
"""The scripts and recipes a command names."""
PATH = re.compile(r"`((?:tools|recipes|tests|megatron_grpo|docs)/[\w./-]+\.(?:py|sh|sbatch|yaml|md))(?:::\w+)?[` ]")
"""A repository file named in backticks (`tools/study/pretrain.py`, `tests/test_tools.py::test_x`)."""
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
ELSEWHERE = {"tools/checkpoint/gpt_hybrid_conversion.py", "docs/user-guide/hybrid-model-migration.md"}
"""Paths in other repositories that a page quotes (Megatron-LM's, in docs/megatron-versions.md)."""


def pages() -> Iterator[Tuple[pathlib.Path, str]]:
    for page in PAGES:
        yield page, page.read_text(encoding="utf-8")


def prose(text: str) -> str:
    """The text without fenced code blocks and inline code (links there are not links)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: pathlib.Path, cache: Dict[pathlib.Path, Set[str]]) -> Set[str]:
    if page not in cache:
        text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.M | re.S)
        seen: Dict[str, int] = {}
        found = set()
        for heading in re.findall(r"^#{1,6} (.+)$", text, flags=re.M):
            base = slug(heading)
            found.add(base if base not in seen else f"{base}-{seen[base]}")
            seen[base] = seen.get(base, 0) + 1
        cache[page] = found
    return cache[page]


def announced() -> Set[str]:
    """Result pages a pre-registration names before its study has run ("The generated page is `X`")."""
    return {path for page in (ROOT / "docs" / "results").glob("preregistration-*.md")
            for path in re.findall(r"generated (?:result )?page is\s+`([^`]+)`", page.read_text(encoding="utf-8"))}


def _missing(found: List[Tuple[str, str]]) -> List[str]:
    allowed = ELSEWHERE | announced()
    return sorted({f"{where}: {path}" for where, path in found
                   if path not in allowed and not (ROOT / path.rstrip(".")).exists()})


def test_quoted_commands_name_existing_scripts():
    found = [(page.relative_to(ROOT).as_posix(), path) for page, text in pages() for command in COMMAND.findall(text)
             for path in SCRIPT.findall(command) if not re.search(r"[*{<]|RECIPE", path)]
    assert len(found) > 90, found  # the collector still sees the commands (README, guides, results pages)
    assert not _missing(found), "quoted commands name scripts that do not exist:\n" + "\n".join(_missing(found))


def test_named_repository_files_exist():
    found = [(page.relative_to(ROOT).as_posix(), m.group(1)) for page, text in pages()
             for m in PATH.finditer(text) if not re.search(r"[*{<]", m.group(1))]
    assert len(found) > 60, found
    assert not _missing(found), "pages name files that do not exist:\n" + "\n".join(_missing(found))


def test_relative_links_and_anchors_resolve():
    cache: Dict[pathlib.Path, Set[str]] = {}
    broken, count = [], 0
    for page, text in pages():
        for target in LINK.findall(prose(text)):
            if re.match(r"[a-z]+:", target):  # http(s), mailto
                continue
            count += 1
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(ROOT).as_posix()}: ({target})"
            if not dest.exists():
                broken.append(f"{where}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest, cache):
                broken.append(f"{where}: no heading #{anchor} in {dest.relative_to(ROOT).as_posix()}")
    assert count > 40
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_slug_matches_githubs_anchors():
    """The README's old anchors as GitHub made them (independent reference: the links that worked on main)."""
    assert slug("FP8 rollouts (generation_dtype / shadow_dtype fp8)") == "fp8-rollouts-generation_dtype--shadow_dtype-fp8"
    assert slug("Speed against TRL's GRPOTrainer") == "speed-against-trls-grpotrainer"
    assert slug("Limits (current)") == "limits-current"
