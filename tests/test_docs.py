"""The docs site: every public name of ``colfunc`` is in the API reference, and every page of the
navigation exists (``mkdocs build --strict`` itself runs in CI, see ``.ci/run``)."""

from __future__ import annotations

import re
from pathlib import Path

import colfunc

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def test_every_public_name_is_in_the_api_reference() -> None:
    reference = (DOCS / "reference.md").read_text()
    documented = set(re.findall(r"^::: colfunc\.(\w+)", reference, flags=re.M))
    missing = sorted(set(colfunc.__all__) - documented)
    assert not missing, f"not in docs/reference.md: {missing}"


def test_the_navigation_names_existing_pages_and_every_page_is_in_it() -> None:
    nav = re.findall(r":\s*(\S+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), flags=re.M)
    assert nav and len(nav) == len(set(nav))
    assert sorted(nav) == sorted(p.name for p in DOCS.glob("*.md"))
    for page in nav:
        text = (DOCS / page).read_text()
        assert text.startswith("# ") and len(text.split()) > 40, page
