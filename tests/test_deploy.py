"""visppo.load_policy and Policy: a trained policy acting on camera frames outside visppo's env loop.

The parity tests record episodes as the env gives them (raw frames, below visppo's wrappers) while
``visppo eval``'s code path (:func:`visppo.evaluate.evaluate`) plays them, then feed those frames
to ``Policy.act``: the actions must be the ones evaluation took.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from conftest import act_on, evaluate_recorded, tiny_kwargs

import visppo
from visppo.checkpoint import CheckpointError
from visppo.deploy import load_policy
from visppo.errors import UserError


@pytest.fixture(scope="module")
def dot_run(tmp_path_factory):
    """A tiny DotReach run with 2 stacked frames, trained through visppo.train."""
    return visppo.train(None, **tiny_kwargs(tmp_path_factory.mktemp("deploy"), env__frame_stack=2,
                                     ppo__total_steps=64, ppo__num_epochs=1))


@pytest.fixture(scope="module")
def recorded(dot_run):
    with pytest.MonkeyPatch.context() as patch:
        return evaluate_recorded(patch, dot_run)[0]


def test_policy_act_on_a_recorded_episode_gives_evaluations_actions(dot_run, recorded):
    assert all(e["obs"][0].shape == (48, 48, 3) and e["obs"][0].dtype == np.uint8 for e in recorded)
    assert sum(len(e["actions"]) for e in recorded) == 100  # two whole episodes of 50 steps
    policy = load_policy(dot_run)
    assert policy.spec.frame_stack == 2 and policy.info["global_step"] == 64
    assert act_on(policy, recorded) == 0.0  # the same arrays through the same network: bit for bit
    assert act_on(load_policy(dot_run / "checkpoints" / "latest.pt"), recorded) == 0.0


def test_reset_makes_the_next_frame_fill_the_stack(dot_run, recorded):
    policy = load_policy(dot_run)
    policy.reset()
    for obs in recorded[0]["obs"][:-1]:
        policy.act(obs)
    stale = policy.act(recorded[1]["obs"][0])  # no reset: the old episode's frame is still in the stack
    policy.reset()
    fresh = policy.act(recorded[1]["obs"][0])
    assert np.array_equal(fresh, recorded[1]["actions"][0]) and stale.shape == fresh.shape


def test_a_frame_of_another_size_or_kind_is_converted_as_training_converts_it(dot_run, recorded):
    """A 96x96 camera frame is resized to 48x48; a float frame in [0, 1] is the same as its uint8."""
    from PIL import Image

    policy = load_policy(dot_run)
    frame = recorded[0]["obs"][0]
    big = np.asarray(Image.fromarray(frame).resize((96, 96), Image.NEAREST))
    policy.reset()
    a = policy.act(big)
    policy.reset()
    b = policy.act(np.asarray(Image.fromarray(big).resize((48, 48), Image.BILINEAR)))
    assert np.array_equal(a, b)
    policy.reset()
    c = policy.act(frame.astype(np.float32) / 255)
    policy.reset()
    assert np.array_equal(c, policy.act(frame))
    low, high = np.array(policy.spec.low), np.array(policy.spec.high)
    policy.reset()
    sampled = [policy.act(frame, deterministic=False) for _ in range(20)]
    assert all(np.all(s >= low) and np.all(s <= high) for s in sampled)


@pytest.mark.parametrize("observation, match", [
    (np.zeros((3, 48, 48), np.uint8), "transpose"),
    (np.zeros((48, 48, 4), np.uint8), "HxWx3"),
    (np.full((48, 48, 3), 2.0), r"\[0, 1\]"),
    (np.full((48, 48, 3), np.nan), "NaN or infinite"),
    (np.full((48, 48, 3), 300), "outside 0..255"),
    ({"state": np.zeros(4)}, "give 'pixels'"),
])
def test_a_bad_observation_is_one_clear_error(dot_run, observation, match):
    with pytest.raises(UserError, match=match):
        load_policy(dot_run).act(observation)


@pytest.fixture(scope="module")
def state_policy(tmp_path_factory):
    """A tiny DotReach run that reads a state vector beside the frames, loaded."""
    run = visppo.train(None, **tiny_kwargs(tmp_path_factory.mktemp("deploy_state"), env__state=True,
                                           ppo__total_steps=64, ppo__num_epochs=1))
    return load_policy(run)


def test_a_state_with_nan_or_infinity_is_refused_not_turned_into_an_action(state_policy):
    frame = np.zeros((48, 48, 3), np.uint8)
    dim = state_policy.spec.state_dim
    assert state_policy.act({"pixels": frame, "state": np.zeros(dim)}).shape == (2,)
    for bad in (np.nan, np.inf):
        state = np.zeros(dim)
        state[1] = bad
        state_policy.reset()
        with pytest.raises(UserError, match="NaN or infinite"):
            state_policy.act({"pixels": frame, "state": state})
        with pytest.raises(UserError, match="NaN or infinite"):
            state_policy.act_stacked(np.zeros((1, 3, 48, 48), np.uint8), state[None])


@pytest.mark.parametrize("pixels, state, match", [
    (np.zeros((1, 6, 48, 48), np.float32), None, "uint8"),  # 0..255 floats would read as [0, 1]
    (np.zeros((1, 48, 48, 6), np.uint8), None, r"\[N, 6, 48, 48\]"),  # HxWxC
    (np.zeros((6, 48, 48), np.uint8), None, r"\[N, 6, 48, 48\]"),  # no batch axis
])
def test_act_stacked_refuses_what_is_not_stacked_as_the_wrappers_stack(dot_run, pixels, state, match):
    policy = load_policy(dot_run)
    assert policy.act_stacked(np.zeros((2, 6, 48, 48), np.uint8)).shape == (2, 2)
    with pytest.raises(UserError, match=match):
        policy.act_stacked(pixels, state)


def test_unbounded_actions_are_written_as_null_and_read_back(dot_run):
    from visppo.deploy import PolicySpec

    spec = load_policy(dot_run).spec
    data = PolicySpec(spec.image_size, spec.channels, spec.frame_stack, 0, low=[-np.inf, -1.0],
                      high=[np.inf, 1.0]).to_json(load_policy(dot_run).config)
    assert data["action"]["low"] == [None, -1.0] and data["action"]["high"] == [None, 1.0]
    back = PolicySpec.from_json(json.loads(json.dumps(data)), dot_run / "policy.json")
    assert back.low == [-np.inf, -1.0] and back.high == [np.inf, 1.0]


def test_a_policy_json_that_disagrees_with_its_config_is_refused(exported, tmp_path):
    """Weights that fit any image size (spatial softmax) would act on frames of the edited size."""
    for field, value, match in (("image_size", 96, "image_size 96, the run's config 48"),
                                ("frame_stack", 3, "frame_stack 3"), ("action", None, "low <= high")):
        folder = tmp_path / field
        shutil.copytree(exported, folder)
        data = json.loads((folder / "policy.json").read_text())
        if field == "action":
            data["action"]["low"][0] = float("nan")
        else:
            data[field] = value
        (folder / "policy.json").write_text(json.dumps(data))
        with pytest.raises(CheckpointError, match=match):
            load_policy(folder)


def test_what_is_not_a_policy_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        load_policy(tmp_path / "nothing")
    (tmp_path / "policy.json").write_text("{}")
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_policy(tmp_path)


@pytest.fixture(scope="module")
def exported(dot_run, tmp_path_factory):
    """The tiny run as a folder of `visppo export --format folder`."""
    from visppo.export import export

    return export(dot_run, tmp_path_factory.mktemp("exported") / "policy", "folder")


@pytest.mark.parametrize("field, value", [("image_size", -1), ("frame_stack", 0), ("channels_per_frame", 0),
                                          ("state_dim", -1), ("n", 0)])
def test_a_hand_edited_policy_json_with_an_impossible_size_names_the_field(exported, tmp_path, field, value):
    """Such sizes crashed deep in torch (negative dimensions, a NaN Box) or blamed the weights."""
    folder = tmp_path / "edited"
    shutil.copytree(exported, folder)
    spec = json.loads((folder / "policy.json").read_text())
    if field == "n":
        spec["action"] = {"type": "discrete", "n": value, "shape": ["batch"], "dtype": "int64"}
    else:
        spec[field] = value
    (folder / "policy.json").write_text(json.dumps(spec))
    with pytest.raises(UserError, match=rf"{field} is {value}, must be at least") as refused:
        load_policy(folder)
    message = str(refused.value)
    assert str(folder / "policy.json") in message and "\n" not in message


def test_a_float_frame_is_rounded_to_the_nearest_uint8_value():
    """Policy.act's float frames in [0, 1] become round(255 x), as documented: a camera's 0.501 is
    128 (127.76), not 127; frame / 255 packs to the very frame it was made from."""
    import visppo.deploy as deploy

    spec = deploy.PolicySpec(image_size=16, channels=3, frame_stack=1, low=[-1.0], high=[1.0])
    policy = deploy.Policy.__new__(deploy.Policy)  # no network needed: only the frame conversion
    policy.spec = spec
    values = np.array([0.0, 0.3 / 255, 0.7 / 255, 0.499, 0.501, 254.6 / 255, 1.0])
    frame = np.resize(values, (16, 16, 3))
    expected = np.resize(np.array([0, 0, 1, 127, 128, 255, 255], np.uint8), (16, 16, 3))
    for dtype in (np.float32, np.float64):
        converted = policy._observation(frame.astype(dtype))
        assert converted.dtype == np.uint8 and np.array_equal(converted, expected)
    exact = np.arange(256, dtype=np.uint8).repeat(3).reshape(16, 16, 3)
    assert np.array_equal(policy._observation(exact.astype(np.float32) / 255), exact)
