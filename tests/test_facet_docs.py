"""The Facets guide documents every facet TorchLens can produce."""

from pathlib import Path

from torchlens.facets import FACETS

PAGE = Path(__file__).resolve().parent.parent / "docs" / "guides" / "facets.md"


def test_every_facet_is_documented():
    text = PAGE.read_text()
    missing = [name for table in FACETS.values() for name in table if f"`{name}`" not in text]
    assert missing == [], f"docs/guides/facets.md does not document: {missing}"
