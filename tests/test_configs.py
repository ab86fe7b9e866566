"""Every YAML recipe in configs/ loads, validates, and means what it says."""

import importlib.util
from pathlib import Path

import pytest
import yaml

from visppo.config import load_config, to_dict
from visppo.envs import check_env_id

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


def _flatten(data: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in data.items():
        if isinstance(value, dict) and not (prefix == "env." and key == "kwargs"):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_config_loads_with_every_value_it_sets(path):
    cfg = load_config(path)
    if not (cfg.env.id.startswith("dmc:") and importlib.util.find_spec("dm_control") is None):
        check_env_id(cfg.env.id)  # a registered task (DeepMind Control ones need the dmc extra)
    written = _flatten(yaml.safe_load(path.read_text()))
    resolved = _flatten(to_dict(cfg))
    assert written, f"{path.name} sets nothing"
    for key, value in written.items():
        got = resolved[key]
        if key == "train.amp" and value is False:  # YAML 1.1 reads a bare `off` as false
            value = "off"
        assert got == value or (isinstance(value, (int, float)) and got == pytest.approx(value)), (key, value, got)
    assert cfg.ppo.minibatch_size <= cfg.rollout_size
