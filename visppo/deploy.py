"""A trained policy outside visppo's env loop: ``load_policy(path) -> Policy``, ``Policy.act(frame)``.

``Policy.act`` takes what the env or a robot's camera gives, an HxWxC uint8 RGB frame or a dict
``{"pixels": frame, "state": vector}``, and packs it with :class:`visppo.envs.FrameStack`, the
code the env wrappers pack training's and evaluation's observations with: resized bilinearly
to ``env.image_size`` when the frame has another size, transposed to CxHxW, the episode's last
``env.frame_stack`` frames stacked (its first frame fills the stack), the state as float32.
The network turns the uint8 frames into floats itself, as in training. The action is the
Gaussian's mean (or a sample) clipped to the env's Box bounds, as evaluation clips it, or the
index of a discrete action.

``load_policy`` reads a run directory, a checkpoint, or a folder ``visppo export --format
folder`` wrote. What the network's input and output look like (image size, channels, frame
stack, state size, action bounds) is a :class:`PolicySpec`: from ``policy.json`` beside the
weights when there is one (an exported folder; a run whose env was built in code), otherwise
from one env made as the saved config says.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from visppo import extras
from visppo.atomic import atomic_write_text
from visppo.builders import build_policy
from visppo.checkpoint import CheckpointError
from visppo.config import Config, load_config, to_dict
from visppo.envs import FrameStack, check_env_id, make_env
from visppo.errors import UserError
from visppo.evaluate import load_weights, read_trained, resolve_checkpoint, tensor_state
from visppo.policy import ActorCritic

SPEC_FILE = "policy.json"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.yaml"
SPEC_FORMAT = "visppo-policy"
SPEC_VERSION = 1
PREPROCESS = ("each camera frame: RGB, HxWxC uint8, resized bilinearly (PIL) to image_size x image_size "
              "when it has another size, transposed to CxHxW; the input is the episode's last frame_stack "
              "frames concatenated along channels, oldest first (the episode's first frame fills the stack)")
"""How policy.json describes the input (the same steps as visppo.envs.FrameStack)."""


@dataclass
class PolicySpec:
    """The network's input and output: frames of ``image_size`` with ``channels`` each, ``frame_stack``
    of them stacked, ``state_dim`` state values (0: none), and the action (Box bounds or ``n``)."""

    image_size: int
    channels: int
    frame_stack: int
    state_dim: int = 0
    low: list[float] | None = None
    high: list[float] | None = None
    n: int = 0
    """Discrete actions: their number (0 for a Box)."""
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_spaces(cls, obs_space: gym.spaces.Dict, action_space: gym.Space, frame_stack: int) -> PolicySpec:
        stacked, height, _ = obs_space["pixels"].shape
        state = int(np.prod(obs_space["state"].shape)) if "state" in obs_space.spaces else 0
        if isinstance(action_space, gym.spaces.Discrete):
            return cls(height, stacked // frame_stack, frame_stack, state, n=int(action_space.n))
        return cls(height, stacked // frame_stack, frame_stack, state,
                   low=[float(v) for v in np.ravel(action_space.low)],
                   high=[float(v) for v in np.ravel(action_space.high)])

    def spaces(self) -> tuple[gym.spaces.Dict, gym.Space]:
        size, stacked = self.image_size, self.channels * self.frame_stack
        obs = {"pixels": gym.spaces.Box(0, 255, (stacked, size, size), np.uint8)}
        if self.state_dim:
            obs["state"] = gym.spaces.Box(-np.inf, np.inf, (self.state_dim,), np.float32)
        if self.n:
            return gym.spaces.Dict(obs), gym.spaces.Discrete(self.n)
        return gym.spaces.Dict(obs), gym.spaces.Box(np.array(self.low, np.float32), np.array(self.high, np.float32))

    def to_json(self, cfg: Config, **extra: Any) -> dict[str, Any]:
        """policy.json: the input (shape, dtype, frame stack, preprocessing), the action, the config."""
        stacked = self.channels * self.frame_stack
        inputs = {"pixels": {"shape": ["batch", stacked, self.image_size, self.image_size], "dtype": "uint8",
                             "layout": "NCHW", "preprocess": PREPROCESS}}
        if self.state_dim:
            inputs["state"] = {"shape": ["batch", self.state_dim], "dtype": "float32"}
        if self.n:
            action = {"type": "discrete", "n": self.n, "shape": ["batch"], "dtype": "int64"}
        else:
            action = {"type": "box", "shape": ["batch", len(self.low)], "dtype": "float32",
                      "low": [_finite(v) for v in self.low], "high": [_finite(v) for v in self.high],
                      "clipped": "to [low, high] (null: unbounded)"}
        return {"format": SPEC_FORMAT, "version": SPEC_VERSION, "env_id": cfg.env.id,
                "image_size": self.image_size, "channels_per_frame": self.channels,
                "frame_stack": self.frame_stack, "state_dim": self.state_dim, "inputs": inputs,
                "action": action, **extra, "config": to_dict(cfg)}

    @classmethod
    def from_json(cls, data: dict[str, Any], source: Path) -> PolicySpec:
        if data.get("format") != SPEC_FORMAT or not isinstance(data.get("action"), dict):
            raise CheckpointError(f"{source} is not a policy.json visppo wrote (no '{SPEC_FORMAT}' format)")
        try:
            action = data["action"]
            common = (int(data["image_size"]), int(data["channels_per_frame"]), int(data["frame_stack"]),
                      int(data.get("state_dim", 0)))
            if action["type"] == "discrete":
                spec = cls(*common, n=int(action["n"]), extra=data)
            else:
                low = [-math.inf if v is None else float(v) for v in action["low"]]
                high = [math.inf if v is None else float(v) for v in action["high"]]
                spec = cls(*common, low=low, high=high, extra=data)
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{source}: a policy.json with a missing or bad entry ({exc!r})") from None
        spec.check(source)
        return spec

    def check(self, source: Path) -> None:
        """Refuse sizes no network can have (a hand-edited policy.json), naming the field, before
        torch fails on them deep inside the layers."""
        for name, value, least in (("image_size", self.image_size, 1), ("channels_per_frame", self.channels, 1),
                                   ("frame_stack", self.frame_stack, 1), ("state_dim", self.state_dim, 0)):
            if value < least:
                raise CheckpointError(f"{source}: {name} is {value}, must be at least {least}: restore the "
                                      "exported value (or export the run again)")
        if self.low is None and self.n < 1:
            raise CheckpointError(f"{source}: action n is {self.n}, must be at least 1 discrete action: restore "
                                  "the exported value (or export the run again)")
        if self.low is not None and (not self.low or len(self.low) != len(self.high)
                                     or any(lo > hi for lo, hi in zip(self.low, self.high))
                                     or any(math.isnan(v) for v in (*self.low, *self.high))):
            raise CheckpointError(f"{source}: action low and high must be lists of one length with low <= high: "
                                  "restore the exported values (or export the run again)")


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


class Policy:
    """A trained policy acting on camera frames: ``reset()`` at each episode's start, then
    ``act(observation)`` once per control step."""

    def __init__(self, network: ActorCritic, spec: PolicySpec, config: Config, info: dict[str, Any] | None = None):
        self.network = network.eval()
        self.spec = spec
        self.config = config
        self.info = dict(info or {})
        """Where it came from: ``source``, ``run_dir`` (or None), ``global_step`` (or None)."""
        self._stack = FrameStack(spec.frame_stack, spec.state_dim > 0, spec.image_size)
        self._fresh = True

    def reset(self) -> None:
        """A new episode: the next frame fills the frame stack."""
        self._fresh = True

    def act(self, observation: Any, deterministic: bool = True) -> np.ndarray | int:
        """The action for one observation of the current episode: a float32 array within the Box's
        bounds, or an int for discrete actions. ``deterministic=False`` samples (torch's RNG)."""
        obs = self._observation(observation)
        packed = self._stack.first(obs) if self._fresh else self._stack.next(obs)
        self._fresh = False
        action = self.act_stacked(packed["pixels"][None], packed["state"][None] if "state" in packed else None,
                                  deterministic)[0]
        return int(action) if self.spec.n else action

    def act_stacked(self, pixels: np.ndarray, state: np.ndarray | None = None,
                    deterministic: bool = True) -> np.ndarray:
        """Actions of a batch of observations already packed as the env wrappers pack them:
        ``pixels`` uint8 [N, channels * frame_stack, image_size, image_size], ``state`` [N, state_dim]."""
        pixels = np.asarray(pixels)
        spec = self.spec
        shape = (spec.channels * spec.frame_stack, spec.image_size, spec.image_size)
        if pixels.dtype != np.uint8 or pixels.ndim != 4 or pixels.shape[1:] != shape:
            raise UserError(f"pixels of dtype {pixels.dtype} and shape {pixels.shape}: act_stacked takes uint8 "
                            f"[N, {', '.join(map(str, shape))}] (frames stacked as the env wrappers stack them); "
                            "act takes one frame as the camera gives it")
        batch = {"pixels": torch.as_tensor(pixels)}
        if spec.state_dim:
            if state is None:
                raise UserError(f"this policy also reads a state vector of {spec.state_dim} values: give state")
            state = np.asarray(state, dtype=np.float32)
            if state.shape != (len(pixels), spec.state_dim):
                raise UserError(f"state of shape {state.shape}: give [N, {spec.state_dim}] for {len(pixels)} frames")
            batch["state"] = torch.as_tensor(_finite_state(state))
        with torch.inference_mode():
            action, _, _ = self.network.act(batch, deterministic=deterministic)
        action = action.cpu().numpy()
        if self.spec.n:
            return action.astype(np.int64)
        return np.clip(action, np.array(self.spec.low, np.float32), np.array(self.spec.high, np.float32))

    def _observation(self, observation: Any) -> Any:
        """Check one observation; a float frame in [0, 1] becomes uint8 (round(255 x))."""
        state = None
        if isinstance(observation, dict):
            if "pixels" not in observation:
                raise UserError(f"observation dict has keys {sorted(observation)}: give 'pixels' (and 'state')")
            pixels, state = observation["pixels"], observation.get("state")
        else:
            pixels = observation
        pixels = self._frame(np.asarray(pixels))
        if not self.spec.state_dim:
            return pixels
        if state is None:
            raise UserError(f"this policy also reads a state vector of {self.spec.state_dim} values: give "
                            "{'pixels': frame, 'state': vector}")
        state = np.asarray(state, dtype=np.float32).reshape(-1)
        if state.size != self.spec.state_dim:
            raise UserError(f"state has {state.size} values, the policy reads {self.spec.state_dim}")
        return {"pixels": pixels, "state": _finite_state(state)}

    def _frame(self, pixels: np.ndarray) -> np.ndarray:
        channels = self.spec.channels
        if pixels.ndim == 2 and channels == 1:
            pixels = pixels[..., None]
        if pixels.ndim != 3 or pixels.shape[-1] != channels:
            hint = " (it looks like CxHxW: transpose it)" if pixels.ndim == 3 and pixels.shape[0] == channels else ""
            raise UserError(f"frame of shape {pixels.shape}: give one HxWx{channels} image{hint}")
        if np.issubdtype(pixels.dtype, np.floating):
            if not np.isfinite(pixels).all():
                raise UserError("a float frame holds NaN or infinite values: give values in [0, 1]")
            if pixels.size and (pixels.min() < 0 or pixels.max() > 1):
                raise UserError("a float frame must hold values in [0, 1] (or give uint8 0..255)")
            return np.rint(pixels * 255).astype(np.uint8)
        if pixels.dtype != np.uint8:
            if pixels.size and (pixels.min() < 0 or pixels.max() > 255):
                raise UserError(f"frame of dtype {pixels.dtype} has values outside 0..255: give uint8")
            pixels = pixels.astype(np.uint8)
        return pixels


# --------------------------------------------------------------------------- loading


def load_policy(path_or_run: str | Path) -> Policy:
    """The policy of a run directory (its latest checkpoint), a ``.pt`` checkpoint, or a folder
    ``visppo export --format folder`` wrote, on the CPU."""
    path = Path(path_or_run)
    if path.is_dir() and (path / SPEC_FILE).is_file() and not (path / "checkpoints").is_dir():
        if not (path / WEIGHTS_FILE).is_file():
            raise CheckpointError(f"{path} holds no {WEIGHTS_FILE}: load_policy reads a run directory, a "
                                  "checkpoint or a folder of `visppo export --format folder` (an ONNX, pt2 or "
                                  "TorchScript export runs with ONNX Runtime, torch.export.load or "
                                  "torch.jit.load)")
        return load_folder(path)
    return load_checkpoint(resolve_checkpoint(path))


def load_checkpoint(path: Path) -> Policy:
    """A checkpoint's policy, read as evaluation reads it (:func:`visppo.evaluate.read_trained`), its
    spec from the run's policy.json or from an env made as its config says."""
    ckpt, cfg, state = read_trained(path)
    run_dir = path.parent.parent if path.parent.name == "checkpoints" else None
    spec_file = run_dir / SPEC_FILE if run_dir is not None else None
    spec = read_spec(spec_file) if spec_file is not None and spec_file.is_file() else spec_from_env(cfg)
    network = build_network(cfg, spec, state, f"checkpoint {path}")
    step = ckpt.get("global_step")
    return Policy(network, spec, cfg, {"source": str(path), "run_dir": str(run_dir) if run_dir else None,
                                       "global_step": int(step) if step is not None else None})


def load_folder(folder: Path) -> Policy:
    """A folder of ``visppo export --format folder``: model.safetensors, config.yaml, policy.json."""
    extras.require("deploy", ("safetensors",), "loading an exported policy folder")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    spec = read_spec(folder / SPEC_FILE)
    cfg = load_config(folder / CONFIG_FILE)
    try:
        state = load_file(str(folder / WEIGHTS_FILE))
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{folder / WEIGHTS_FILE} cannot be read ({exc})") from None
    network = build_network(cfg, spec, state, str(folder / WEIGHTS_FILE))
    return Policy(network, spec, cfg, {"source": str(folder), "run_dir": None,
                                       "global_step": spec.extra.get("global_step")})


def read_spec(path: Path) -> PolicySpec:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path} cannot be read as JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} is not a policy.json visppo wrote")
    return PolicySpec.from_json(data, path)


def spec_from_env(cfg: Config) -> PolicySpec:
    """The spec of the env ``cfg`` makes (one env, closed again)."""
    check_env_id(cfg.env.id)
    env = make_env(cfg)
    try:
        return PolicySpec.from_spaces(env.observation_space, env.action_space, cfg.env.frame_stack)
    finally:
        env.close()


def build_network(cfg: Config, spec: PolicySpec, state: Any, source: str) -> ActorCritic:
    """The config's network for ``spec`` on the CPU, filled with ``state`` (refused unless it fits);
    ``cfg`` itself keeps the run's devices, as an export writes it."""
    state = tensor_state(state, f"{source}: the weights")
    for name, said, trained in (("image_size", spec.image_size, cfg.env.image_size),
                                ("frame_stack", spec.frame_stack, cfg.env.frame_stack)):
        if said != trained:  # the weights may fit either (spatial softmax, torchvision trunks): it would act on other frames
            raise CheckpointError(f"{source}: policy.json says {name} {said}, the run's config {trained}: restore "
                                  "the exported policy.json (or export the run again)")
    obs_space, action_space = spec.spaces()
    network = build_policy(cfg, obs_space, action_space, torch.device("cpu"), load_weights=False)
    return load_weights(network, state, source)


def _finite_state(state: np.ndarray) -> np.ndarray:
    """``state``, refused when it holds NaN or infinite values: the action would be NaN (sent on
    to a robot) or an extreme one, as evaluation refuses them from an env."""
    if not np.isfinite(state).all():
        raise UserError("state holds NaN or infinite values: a policy cannot act on them (check the sensor that "
                        "fills it)")
    return state


def write_spec(run_dir: Path, cfg: Config) -> Path:
    """Write ``run_dir/policy.json`` (the spec of the env ``cfg`` makes), so the run's policy loads
    without making its env, e.g. one built in code by ``visppo.train(env=...)``."""
    path = Path(run_dir) / SPEC_FILE
    atomic_write_text(path, json.dumps(spec_from_env(cfg).to_json(cfg), indent=2) + "\n")
    return path
