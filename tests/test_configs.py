"""Every YAML recipe in configs/ loads and validates."""

from pathlib import Path

import pytest

from visppo.config import load_config

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_config_loads(path):
    load_config(path)
