"""The README and docs/ say only what exists: every relative link and #anchor resolves, every
repository path named in backticks exists, every command they show names a real subcommand, module,
flag or make target, the configuration page is what its command generates, and the site builds
with `mkdocs build --strict`."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import unicodedata
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Backticked text that starts like one of these is a repository path and must exist.
REPO_DIRS = ("lmcache_triton/", "bench/", "tests/", "examples/", "docs/", ".github/")

_FENCE = re.compile(r"^(```|~~~)")
_LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _split(text: str) -> tuple[list[str], list[str]]:
    """(prose lines, fenced code lines): links and headings live in prose, commands in both."""
    prose, code, fenced = [], [], False
    for line in text.splitlines():
        if _FENCE.match(line.lstrip()):
            fenced = not fenced
            prose.append("")
            continue
        (code if fenced else prose).append(line)
        if fenced:
            prose.append("")
    return prose, code


def _heading_text(raw: str) -> str:
    """A heading as rendered: links reduced to their text, code and emphasis marks dropped."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", raw)
    text = re.sub(r"<[^>]+>", "", text)
    return text.replace("`", "").replace("*", "").strip()


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, each space a hyphen."""
    return re.sub(r"[^\w\- ]", "", _heading_text(heading).lower()).replace(" ", "-")


def mkdocs_slug(heading: str) -> str:
    """Python-Markdown's toc slugify (mkdocs' default): ASCII, punctuation dropped, runs of spaces
    and hyphens one hyphen."""
    text = unicodedata.normalize("NFKD", _heading_text(heading)).encode("ascii", "ignore").decode()
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", text).strip().lower())


def _dedupe(slugs: list[str], sep: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for s in slugs:
        n = seen.get(s, 0)
        out.add(s if n == 0 else f"{s}{sep}{n}")
        seen[s] = n + 1
    return out


@cache
def anchors(path: Path) -> frozenset[str]:
    """The anchors a page's headings make, on GitHub and, for docs/ pages, in the mkdocs site too
    (an anchor must work in both places a reader may follow it)."""
    prose, _ = _split(path.read_text())
    headings = [m.group(1) for line in prose if (m := re.match(r"^#{1,6}\s+(.+?)\s*#*\s*$", line))]
    github = _dedupe([github_slug(h) for h in headings], "-")
    if path.parent != ROOT / "docs":
        return frozenset(github)
    return frozenset(github & _dedupe([mkdocs_slug(h) for h in headings], "_"))


def link_problems(path: Path) -> list[str]:
    prose, _ = _split(path.read_text())
    problems = []
    for n, line in enumerate(prose, 1):
        for m in _LINK.finditer(_CODE_SPAN.sub("", line)):
            target = m.group(1)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            where = f"{_rel(path)}:{n}: ({target})"
            if not dest.exists():
                problems.append(f"{where} names a file that does not exist")
            elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
                problems.append(f"{where}: no heading makes #{anchor} (headings: {sorted(anchors(dest))})")
    return problems


def _code_spans(path: Path) -> list[str]:
    prose, _ = _split(path.read_text())
    return [m.group(2).strip() for line in prose for m in _CODE_SPAN.finditer(line)]


def path_problems(path: Path) -> list[str]:
    problems = []
    for span in _code_spans(path):
        for word in span.split():
            word = word.strip("(),;:'\"").split("::")[0]
            if not word.startswith(REPO_DIRS) or re.search(r"[<>*{}$]|\.\.\.", word):
                continue  # not a path, or a pattern (`bench/results/<name>-<time>.json`)
            if not (ROOT / word.rstrip("/")).exists():
                problems.append(f"{_rel(path)}: `{span}` names {word}, which does not exist")
    return problems


# ---------------------------------------------------------------------------------------------
# Commands: `lmcache-triton SUB ...`, `python -m MODULE ...` and `make TARGET` as written.
# ---------------------------------------------------------------------------------------------

def _command_lines(path: Path) -> list[str]:
    """Each fenced code line (backslash continuations joined) and each code span."""
    _, code = _split(path.read_text())
    joined, buf = [], ""
    for line in code:
        buf += line.rstrip()
        if buf.endswith("\\"):
            buf = buf[:-1] + " "
            continue
        joined.append(buf)
        buf = ""
    return joined + _code_spans(path)


def _commands(line: str, program: str) -> list[list[str]]:
    """The argument lists after each `program` in a shell line, up to a comment or an operator."""
    out = []
    for m in re.finditer(rf"(?:^|[\s(/]){re.escape(program)}\s+(.*)", line):
        rest = re.split(r"\s#|[&|;>]", m.group(1))[0]
        try:
            out.append(shlex.split(rest))
        except ValueError:  # an unbalanced quote in prose: take the words
            out.append(rest.split())
    return out


def _flags(words: list[str]) -> list[str]:
    return [w.split("=")[0] for w in words if w.startswith("--") and len(w) > 2]


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {o for a in parser._actions for o in a.option_strings}


def _module_file(module: str) -> Path | None:
    base = ROOT / Path(*module.split("."))
    return next((p for p in (base.with_suffix(".py"), base / "__main__.py") if p.exists()), None)


def _bench_flags_known(module: str, flags: list[str]) -> list[str]:
    """Flags missing from a bench module's source (or a bench module it hands over to)."""
    source = _module_file(module).read_text()
    sources = [source] + [p.read_text() for p in (ROOT / "bench").glob("*.py") if f"bench.{p.stem}" in source]
    return [f for f in flags if not any(f'"{f}"' in s for s in sources)]


def command_problems(path: Path) -> list[str]:
    from bench.cli import COMMANDS
    from lmcache_triton.tools.cli import build_parser

    subs = _subparsers(build_parser())
    makefile = (ROOT / "Makefile").read_text()
    problems = []
    for line in _command_lines(path):
        where = f"{_rel(path)}: `{line.strip()}`"
        for words in _commands(line, "lmcache-triton"):
            if not words or not re.match(r"^[a-z][\w-]*$", words[0]):
                continue  # `lmcache-triton` alone, or prose
            if words[0] == "bench":
                if len(words) > 1 and words[1] not in COMMANDS and re.match(r"^[a-z]", words[1]):  # not a PLACEHOLDER
                    problems.append(f"{where}: no bench command {words[1]!r}")
                elif len(words) > 1 and words[1] in COMMANDS:
                    flags = [f for f in _flags(words[2:]) if f != "--plot"]  # the harness takes --plot
                    for module in COMMANDS[words[1]].modules[:1]:
                        problems += [f"{where}: {module} has no {f}" for f in _bench_flags_known(module, flags)]
                continue
            if words[0] not in subs:
                problems.append(f"{where}: no subcommand {words[0]!r} (lmcache_triton/tools/cli.py)")
                continue
            if words[0] == "serve":
                continue  # its arguments are vLLM's
            parser, rest = subs[words[0]], words[1:]
            nested = _subparsers(parser)
            if nested and rest and re.match(r"^[a-z][\w-]*$", rest[0]):
                if rest[0] not in nested:
                    problems.append(f"{where}: `{words[0]}` has no subcommand {rest[0]!r}")
                    continue
                parser, rest = nested[rest[0]], rest[1:]
            problems += [f"{where}: `{words[0]}` has no {f}" for f in _flags(rest) if f not in _options(parser)]
        for words in _commands(line, "python -m"):
            if not words or not words[0].startswith(("bench", "lmcache_triton")):
                continue
            if _module_file(words[0]) is None:
                problems.append(f"{where}: no module {words[0]}")
            elif words[0].startswith("bench."):
                problems += [f"{where}: {words[0]} has no {f}" for f in _bench_flags_known(words[0], _flags(words[1:]))]
        for words in _commands(line, "make"):
            if words and re.match(r"^[a-z][\w-]*$", words[0]) and not re.search(rf"^{words[0]}:", makefile, re.M):
                problems.append(f"{where}: the Makefile has no target {words[0]!r}")
    return problems


# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_links_and_anchors_resolve(page):
    assert not link_problems(page), "\n".join(link_problems(page))


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_paths_in_backticks_exist(page):
    assert not path_problems(page), "\n".join(path_problems(page))


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_commands_name_what_exists(page):
    assert not command_problems(page), "\n".join(command_problems(page))


def test_readme_is_a_guide():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) < 250, f"README.md has {len(lines)} lines: move reference material to docs/"


def test_every_page_is_in_the_site_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    missing = [p.name for p in PAGES[1:] if not re.search(rf":\s+{re.escape(p.name)}\s*$", nav, re.M)]
    assert not missing, f"docs pages missing from mkdocs.yml's nav: {missing}"


def test_configuration_page_is_generated_from_the_declaration():
    from lmcache_triton.tools.config_docs import COMMAND, page

    on_disk = (ROOT / "docs" / "configuration.md").read_text()
    assert on_disk == page(), f"docs/configuration.md differs from the config's declaration: run `{COMMAND}`"


def test_mkdocs_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})  # quiet its banner
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "configuration" / "index.html").exists()
