"""MkDocs hooks of the documentation site (``mkdocs.yml``: ``hooks:``).

- The configuration reference is generated from the daemon's config model
  (``scripts/config_reference.py``) into ``configuration.md``, in place of its marker line.
- The benchmark write-ups and results (``benchmarks/README.md``, ``benchmarks/NOTES.md``,
  ``benchmarks/results/*.md`` and ``*.png``) become pages and images of the site under
  ``benchmarks/``, read from where they lie in the repository: nothing is copied into docs/,
  and their relative links keep working.
- Sphinx roles in docstrings (``:meth:`x```, ``:class:`~a.b.C```) render as code on the API
  pages (``x``, ``C``) instead of showing the role.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

#: the repository root (docs/hooks/site.py lies two levels below it)
REPO = Path(__file__).resolve().parents[2]
#: the page the configuration reference goes into
CONFIG_PAGE = "configuration.md"
#: files of benchmarks/ that become part of the site, as globs relative to benchmarks/
BENCHMARK_FILES = ("README.md", "NOTES.md", "results/*.md", "results/*.png")
ROLE = re.compile(r":(?:py:)?(?:meth|class|func|mod|attr|data|exc|obj|const):(<code>)(~?)([^<]*)")


def _config_reference() -> ModuleType:
    """``scripts/config_reference.py``, imported from its path."""
    spec = importlib.util.spec_from_file_location("config_reference",
                                                  REPO / "scripts" / "config_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def on_files(files: Files, config: MkDocsConfig, **_: Any) -> Files:
    """Add the benchmark pages and images, from benchmarks/, under ``benchmarks/``."""
    for pattern in BENCHMARK_FILES:
        for path in sorted((REPO / "benchmarks").glob(pattern)):
            uri = "benchmarks/" + path.relative_to(REPO / "benchmarks").as_posix()
            files.append(File.generated(config, uri, abs_src_path=str(path)))
    return files


def on_page_markdown(markdown: str, page: Page, **_: Any) -> str:
    """Put the generated configuration reference into its page."""
    if page.file.src_uri != CONFIG_PAGE:
        return markdown
    reference = _config_reference()
    if markdown.count(reference.MARKER) != 1:
        raise ValueError(f"{CONFIG_PAGE} must hold the line {reference.MARKER} once")
    text: str = reference.reference()
    return markdown.replace(reference.MARKER, text)


def _role(match: re.Match[str]) -> str:
    """``:meth:<code>~a.b.c`` as ``<code>c``; without the tilde the whole name stays."""
    name = match.group(3)
    if match.group(2):
        name = name.rsplit(".", 1)[-1]
    return match.group(1) + name


def on_page_content(html: str, **_: Any) -> str:
    """Sphinx roles left in rendered docstrings become plain code."""
    return ROLE.sub(_role, html)
