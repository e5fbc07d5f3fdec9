"""Relative links resolve: in the Markdown docs, and the file paths library docstrings cite.

Markdown: every link and image target of README.md and of the Markdown under docs/, benchmarks/,
research/ and charts/ that is not a URL must name an existing file or folder, relative to the
Markdown file (anchors and queries are ignored). Library code (sidecar/, operator/): every path
to a .md, .py or .json file in a docstring or comment must exist relative to the module's
folder, its package's root or the repository root. And docs/operations.md names exactly the
Prometheus metrics the sidecar exports.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from markdown_it import MarkdownIt

ROOT = Path(__file__).resolve().parent.parent
MARKDOWN_DIRS = ("docs", "benchmarks", "research", "charts")
LIBRARY_DIRS = ("sidecar", "operator")
#: a path to a .md/.py/.json file as prose cites it: "docs/results.md", "basis.py", "data/*.json"
CITED = re.compile(r"(?<![\w/.*-])((?:\.\.?/)?[\w*-][\w.*-]*(?:/[\w.*-]+)*\.(?:md|py|json))(?![\w/])")


def markdown_files(root: Path = ROOT) -> list[Path]:
    files = [root / "README.md"]
    for d in MARKDOWN_DIRS:
        files += sorted((root / d).rglob("*.md"))
    return [f for f in files if f.is_file()]


def library_files(root: Path = ROOT) -> list[Path]:
    return [f for d in LIBRARY_DIRS for f in sorted((root / d).rglob("*.py"))]


def _targets(tokens) -> list[str]:
    out = []
    for t in tokens:
        if t.type == "link_open":
            out.append(t.attrGet("href"))
        elif t.type == "image":
            out.append(t.attrGet("src"))
        if t.children:
            out += _targets(t.children)
    return out


def broken_markdown_links(md: Path, root: Path = ROOT) -> list[str]:
    """The relative link targets of ``md`` that name nothing on disk."""
    broken = []
    for href in _targets(MarkdownIt("commonmark").parse(md.read_text(encoding="utf-8"))):
        url = urlsplit(href or "")
        if url.scheme or url.netloc or not url.path:  # a URL, or an anchor in this file
            continue
        path = unquote(url.path)
        target = root / path.lstrip("/") if path.startswith("/") else md.parent / path
        if not target.exists():
            broken.append(href)
    return broken


def _prose(source: str) -> list[str]:
    """Docstrings and comments of one module."""
    texts = [
        doc
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and (doc := ast.get_docstring(node, clean=False))
    ]
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return texts + [t.string for t in tokens if t.type == tokenize.COMMENT]


def _package_root(module: Path, root: Path) -> Path:
    top, package = module.relative_to(root).parts[:2]  # e.g. sidecar/kvfetcher
    return root / top / package


def broken_cited_paths(module: Path, root: Path = ROOT) -> list[str]:
    """Paths to .md/.py/.json files cited in ``module``'s docstrings and comments that do not exist."""
    bases = (module.parent, _package_root(module, root), root)
    cited = {m for text in _prose(module.read_text(encoding="utf-8")) for m in CITED.findall(text)}
    return sorted(p for p in cited if not any(any(b.glob(p)) if "*" in p else (b / p).exists() for b in bases))


def _rel(p: Path) -> str:
    return str(p.relative_to(ROOT))


@pytest.mark.parametrize("md", markdown_files(), ids=_rel)
def test_markdown_links_resolve(md: Path):
    broken = broken_markdown_links(md)
    assert not broken, f"{_rel(md)} links to what does not exist: {broken}"


@pytest.mark.parametrize("module", library_files(), ids=_rel)
def test_cited_paths_resolve(module: Path):
    broken = broken_cited_paths(module)
    assert not broken, f"{_rel(module)} cites files that do not exist: {broken}"


def test_the_checks_catch_a_broken_link(tmp_path: Path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "there.md").write_text("# there\n")
    md = tmp_path / "README.md"
    md.write_text(
        "[ok](docs/there.md#there) [url](https://example.com/x.md) [anchor](#top) ![img](docs/gone.png)\n"
        "[gone](docs/gone.md) [ref][r]\n\n[r]: docs/also-gone.md\n\n```\n[in code](docs/nothing.md)\n```\n"
    )
    assert broken_markdown_links(md, tmp_path) == ["docs/gone.png", "docs/gone.md", "docs/also-gone.md"]

    pkg = tmp_path / "sidecar" / "pkg" / "sub"
    pkg.mkdir(parents=True)
    (pkg / "near.py").write_text("")
    mod = pkg / "mod.py"
    mod.write_text(
        '"""Uses near.py and sub/near.py, docs/there.md and docs/*.md; see docs/gone.md."""\n'
        "x = 'not/a/docstring.md'  # but bench/probe.py is a comment\n"
    )
    assert broken_cited_paths(mod, tmp_path) == ["bench/probe.py", "docs/gone.md"]


def test_operations_lists_every_sidecar_metric():
    from kvfetcher.metrics import Metrics

    families = Metrics().registry.collect()
    suffix = {"counter": "_total", "info": "_info"}
    exported = {f.name + suffix.get(f.type, "") for f in families}
    text = (ROOT / "docs" / "operations.md").read_text(encoding="utf-8")
    documented = set(re.findall(r"\bkvfetcher_(?!operator_)[a-z_]*[a-z]", text))
    assert documented == exported
