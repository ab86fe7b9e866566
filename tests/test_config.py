import re
from pathlib import Path

import pytest
from conftest import one_error_line, run_main

from visppo.config import (
    Config,
    build_config,
    field_docs,
    from_dict,
    load_config,
    not_resumable,
    parse_bytes,
    to_dict,
)
from visppo.errors import ConfigError


def test_defaults_validate_and_public_keys_exist():
    cfg = load_config()
    docs = field_docs()
    for key in ["env.id", "env.pixels", "env.image_size", "env.frame_stack", "model.encoder",
                "model.encoder_weights", "model.freeze_encoder_updates", "ppo.num_envs",
                "ppo.num_steps", "ppo.minibatch_size", "ppo.num_epochs", "ppo.total_steps",
                "memory.micro_batch_size", "memory.infer_chunk_size", "memory.budget",
                "train.device", "train.amp", "train.seed", "train.deterministic", "run.dir"]:
        assert key in docs, key
    assert cfg.rollout_size == cfg.ppo.num_envs * cfg.ppo.num_steps


def test_every_key_has_a_one_line_doc():
    for key, (_, _, doc) in field_docs().items():
        assert doc and "\n" not in doc, f"{key} has no one-line docstring"


# A measured result in a key's docstring ("1.5x faster", "312 +- 40", "measured ..."): the
# evidence belongs in docs/, and a docstring says what the key does.
_FIGURE = re.compile(r"\d(\.\d+)?x (faster|slower|as|the)\b|\+- ?\d|\u00b1|\bmeasured\b|\bscored?\b|\bREADME\b")


def test_key_docstrings_say_what_the_key_does_not_what_a_run_measured():
    for key, (_, _, doc) in field_docs().items():
        assert not _FIGURE.search(doc), f"{key}'s docstring carries a result: {doc!r}"
        assert len(doc) <= 400, f"{key}'s docstring is {len(doc)} characters: move the detail to docs/"


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("ppo:\n  num_envs: 4\n  num_steps: 16\n  minibatch_size: 32\ntrain:\n  amp: off\n")
    cfg = load_config(path, ["ppo.num_steps=32", "env.kwargs.speed=0.2"])
    assert (cfg.ppo.num_envs, cfg.ppo.num_steps, cfg.train.amp) == (4, 32, "off")
    assert cfg.env.kwargs == {"speed": 0.2}


def test_round_trip_through_plain_dict():
    cfg = load_config(None, ["ppo.num_envs=3", "ppo.minibatch_size=48"])
    assert from_dict(to_dict(cfg)) == cfg
    assert isinstance(to_dict(cfg)["ppo"], dict)


@pytest.mark.parametrize("overrides,key", [
    (["ppo.num_envz=2"], "ppo.num_envz"),
    (["ppo.num_envs=two"], "ppo.num_envs"),
    (["ppo.num_envs=0"], "ppo.num_envs"),
    (["ppo.num_steps=-1"], "ppo.num_steps"),
    (["ppo.minibatch_size=100000"], "ppo.minibatch_size"),
    (["memory.micro_batch_size=512"], "memory.micro_batch_size"),
    (["memory.infer_chunk_size=0"], "memory.infer_chunk_size"),
    (["train.amp=fp8"], "train.amp"),
    (["train.device=tpu"], "train.device"),
    (["ppo.gamma=1.5"], "ppo.gamma"),
    (["memory.budget=lots"], "memory.budget"),
    (["nonsense"], "key=value"),
    (["model.shared_layers=-1"], "model.shared_layers"),
    (["model.keypoint_stride=0"], "model.keypoint_stride"),
    (["model.keypoints=0"], "model.keypoints"),
    (["model.encoder=drq", "model.keypoints=64"], "model.keypoints"),
    (["env.image_size=12", "model.keypoint_stride=8"], "env.image_size"),
    (["model.init_log_std=100"], "model.init_log_std must be between -20 and 5"),
    (["model.init_log_std=-60"], "model.init_log_std must be between -20 and 5"),
])
def test_bad_values_are_refused_naming_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, overrides)


def test_malformed_yaml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("ppo: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("ppo:\n  lr: 0.1\n")
    with pytest.raises(ConfigError, match=r"ppo\.lr"):
        load_config(unknown)


def test_an_unreadable_config_file_is_one_error_line_saying_it_cannot_be_read(tmp_path, monkeypatch, capsys):
    """Not the CLI's catch-all "cannot write ..." with exit 1 (permissions are faked: root reads anything)."""
    locked = tmp_path / "locked.yaml"
    locked.write_text("ppo:\n  num_envs: 4\n")
    read_text = Path.read_text

    def refuse(self, *args, **kwargs):
        if self.name == locked.name:
            raise PermissionError(13, "Permission denied", str(self))
        return read_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", refuse)
    with pytest.raises(ConfigError, match=r"locked\.yaml cannot be read \(Permission denied\)"):
        load_config(locked)
    code, err = run_main(capsys, "config", locked)
    assert code == 2 and "cannot write" not in one_error_line(err, "locked.yaml", "cannot be read")


def test_env_kwargs_that_are_not_a_mapping_are_refused_naming_the_key(tmp_path, capsys):
    """A list merged into env.kwargs was a TypeError traceback (file, dict) or a wrong "quote it" hint."""
    path = tmp_path / "kw.yaml"
    path.write_text("env:\n  kwargs: [1]\n")
    mapping = r"env\.kwargs .*must be a mapping"
    with pytest.raises(ConfigError, match=mapping + r".*not the list"):
        load_config(path)
    with pytest.raises(ConfigError, match=mapping):
        build_config({"env": {"kwargs": [1]}}, source="the config dict")  # visppo.train(env__kwargs=[1])
    with pytest.raises(ConfigError, match=mapping) as refused:
        load_config(None, ["env.kwargs=[1]"])
    assert "quote" not in str(refused.value)
    code, err = run_main(capsys, "config", path)
    assert code == 2 and one_error_line(err, "env.kwargs", "kw.yaml", "mapping")
    assert load_config(None, ["env.kwargs={look: published}"]).env.kwargs == {"look": "published"}


def test_env_kwargs_given_whole_replace_the_configs_and_one_key_sets_one(tmp_path):
    path = tmp_path / "kw.yaml"
    path.write_text("env:\n  kwargs: {frame_skip: 8, look: fast}\n")
    assert load_config(path, ["env.kwargs={}"]).env.kwargs == {}
    assert load_config(path, ["env.kwargs={look: published}"]).env.kwargs == {"look": "published"}
    assert load_config(path, ["env.kwargs.look=published"]).env.kwargs == {"frame_skip": 8, "look": "published"}


def test_overrides_as_typed_are_read_as_meant():
    """An empty value is the empty string (env.camera's and run.dir's default), spaces around the
    key are dropped, and what YAML reads as something else is named as typed."""
    cfg = load_config(None, ["env.camera=", "run.dir=", "ppo.num_envs = 4"])
    assert (cfg.env.camera, cfg.run.dir, cfg.ppo.num_envs) == ("", "", 4)
    for item, needle in [("ppo..num_envs=4", "must name section.key"), ("train.amp=on", "train.amp=on"),
                         ("env.id=", "env.id is empty"), ("model.encoder_weights=", "model.encoder_weights must be")]:
        with pytest.raises(ConfigError, match=re.escape(needle)):
            load_config(None, [item])


def test_parse_bytes():
    assert parse_bytes("8GiB") == 8 * 2**30
    assert parse_bytes("6000MB") == 6 * 10**9
    assert parse_bytes("1024") == 1024
    with pytest.raises(ValueError):
        parse_bytes("8 gigs")


def test_micro_batch_zero_means_whole_minibatch():
    assert Config().micro_batch == Config().ppo.minibatch_size


def test_a_removed_key_is_refused_with_what_happened_to_it(tmp_path):
    from visppo.config import build_config, load_config
    from visppo.errors import ConfigError

    with pytest.raises(ConfigError, match="rollout.overlap was removed"):
        load_config(None, ["rollout.overlap=true"])
    path = tmp_path / "old.yaml"
    path.write_text("rollout:\n  overlap: true\n")
    with pytest.raises(ConfigError, match=r"rollout.overlap was removed.*old.yaml"):
        load_config(path)
    # a config saved before the removal holds every key: its default value is dropped quietly
    assert build_config({"rollout": {"overlap": False, "device": "cpu"}}).rollout.device == "cpu"


RETIRED = {  # issue 55: the keys removed on 2026-12-03, their old defaults and another value each
    "model.recon_size": (0, 21), "model.recon_motion": (0.0, 4.0), "ppo.recon_coef": (0.0, 1.0),
    "model.invdyn": (False, True), "ppo.invdyn_coef": (0.0, 1.0), "model.reward_head": (False, True),
    "ppo.reward_coef": (0.0, 1.0), "model.detach_actor": (False, True), "model.privileged_critic": (False, True),
    "model.action_dist": ("normal", "beta"), "model.noise_beta": (0.0, 0.5), "model.keypoint_norm": (0, 4096),
    "ppo.drac_coef": (0.0, 0.1), "model.rotate_degrees": (180.0, 90), "model.final_log_std": (None, -1.6),
    "model.augment": ("none", "shift"), "model.shift_pad": (4, 8), "ppo.augment_loss": (False, True),
    "model.norm_value": (False, True),  # removed on 2026-12-06 (docs/recipe.md)
    "model.feature_norm": (False, True),  # removed on 2026-12-07 (docs/recipe.md, arm F)
}


@pytest.mark.parametrize("key", sorted(RETIRED))
def test_each_retired_key_is_refused_as_removed_and_dropped_at_its_old_default(tmp_path, capsys, key):
    """On the command line (any value) and in a file (another value than its old default) the key
    is refused as removed; a saved config holding it at the old default loads quietly."""
    from visppo.cli import main

    old, other = RETIRED[key]
    removed = rf"{key.replace('.', '[.]')} \(.*\) was removed on 2026-12-0[367] .*delete the key"
    with pytest.raises(ConfigError, match=removed):
        load_config(None, [f"{key}={other}"])
    code, err = main(["config", f"{key}={other}"]), capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and "was removed" in err, err
    section, name = key.split(".")
    path = tmp_path / "old.yaml"
    path.write_text(f"{section}:\n  {name}: {other}\n")
    with pytest.raises(ConfigError, match=removed + r".*old\.yaml"):
        load_config(path)
    saved = to_dict(Config())
    saved[section][name] = old
    assert from_dict(saved) == Config()
    assert not_resumable(saved) is None
    saved[section][name] = other  # a checkpoint trained with it: advice for a run, not for a file
    why = not_resumable(saved)
    assert why is not None and f"{key}={other}" in why and "cannot go on" in why and "delete the key" not in why


def test_random_shifts_are_refused_as_removed_and_an_old_config_without_them_loads(tmp_path, capsys):
    """Random shifts went on 2026-12-03 (docs/recipe.md, arm C): a config saved before, holding
    model.augment, model.shift_pad and ppo.augment_loss at their old defaults, loads as today's;
    one that used shifts (or the earlier rotate), on the command line or in a file, is refused
    with one line that says why and where the figures are."""
    from visppo.cli import main

    path = tmp_path / "old.yaml"
    path.write_text("model:\n  augment: none\n  shift_pad: 4\n  feature_dim: 128\nppo:\n  augment_loss: false\n")
    assert load_config(path) == load_config(None, ["model.feature_dim=128"])
    removed = r"model[.]augment \(.*\) was removed on 2026-12-03 \(random shifts .*: docs/recipe[.]md\); delete the key"
    for value in ("shift", "rotate"):
        with pytest.raises(ConfigError, match=removed):
            load_config(None, [f"model.augment={value}", "ppo.augment_loss=true"])
        code, err = main(["config", f"model.augment={value}"]), capsys.readouterr().err
        assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and "was removed" in err, err
        path.write_text(f"model:\n  augment: {value}\n  shift_pad: 4\n  rotate_degrees: 180.0\n"
                        "ppo:\n  augment_loss: true\n")
        with pytest.raises(ConfigError, match=removed + r".*old\.yaml"):
            load_config(path)


def test_differences_names_every_key_that_differs_and_only_those():
    from visppo.config import differences

    a = load_config(None, ["ppo.learning_rate=0.001", "env.kwargs={look: fast}"])
    b = load_config(None, ["ppo.learning_rate=0.002", "train.seed=7", "env.kwargs={look: fast}"])
    assert differences(a, b) == [("ppo.learning_rate", 0.001, 0.002), ("train.seed", 1, 7)]
    assert differences(b, b) == []
