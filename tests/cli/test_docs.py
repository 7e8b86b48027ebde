"""docs/trainer.md's config reference is generated from the field docstrings and must match them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from nnscaler.cli.docgen import BEGIN, END, SECTIONS, field_docs, render_reference

DOC = Path(__file__).resolve().parents[2] / "docs" / "trainer.md"


def test_reference_matches_the_code():
    text = DOC.read_text()
    generated = text.split(BEGIN, 1)[1].split(END, 1)[0]
    assert generated.strip() == render_reference().strip(), (
        "run: python -m nnscaler.cli.docgen docs/trainer.md"
    )


def test_every_field_has_a_docstring():
    for title, cls in SECTIONS:
        docs = field_docs(cls)
        undocumented = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
        assert not undocumented, f"{title}: {undocumented}"
