"""The manual builds: ``mkdocs build --strict`` (what ``make docs`` and CI run) succeeds on the tree as it is.

Strict mode turns every warning into a failure: a page missing from the navigation, a link to a page or
anchor that does not exist, a docstring mkdocstrings cannot render. The built site carries the generated
configuration reference and the error tree.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    site = tmp_path / "site"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "-f",
            str(ROOT / "mkdocs.yml"),
            "-d",
            str(site),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    reference = (site / "reference" / "index.html").read_text()
    assert "OMNIGATE_ENGINES__&lt;i&gt;__API_KEY" in reference
    assert "<!-- config-reference" not in reference
    grounding = (site / "policies" / "grounding" / "index.html").read_text()
    assert "speech_chars_per_second" in grounding and "<!-- config-reference" not in grounding
    architecture = (site / "architecture" / "index.html").read_text()
    assert "ContextLengthExceeded" in architecture and "engine_busy" in architecture
    contract = (site / "writing-a-policy" / "index.html").read_text()
    assert 'id="policies.base.StreamCheck"' in contract and ":class:" not in contract


def test_every_page_is_in_the_navigation() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = sorted(str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md"))
    assert pages and all(f" {p}" in nav for p in pages), [p for p in pages if f" {p}" not in nav]
