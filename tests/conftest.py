"""Shared test fixtures: paths to the bundled reference data."""

from __future__ import annotations

from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parent.parent / "lightning_parcae" / "data"


@pytest.fixture
def data_dir() -> Path:
    """The package's bundled data folder (p3 trace, throughput tables, 1-hour segments)."""
    return DATA
