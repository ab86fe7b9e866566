"""Every configuration key, its type, its default and one line on what it does.

A config is built from the dataclass defaults, then a YAML file, then
``key=value`` overrides (OmegaConf does the merging and the type checks), then
:func:`validate` refuses values that cannot work. Every failure is a
:class:`ConfigError` whose message names the key and says what to change.

Sizes follow the rule of the design notes: ``ppo.*`` sizes change the
learning, ``memory.*`` sizes only change how much memory one pass takes.
"""

from __future__ import annotations

import ast
import functools
import inspect
import math
import os
import re
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Union

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

# re-exported for users' code only (`from visppo.config import ConfigError` keeps working); visppo's own
# modules, tools and tests import them from visppo.errors
from visppo.errors import ConfigError, RunError, Stopped, UserError  # noqa: F401

TORCHVISION_ENCODERS = ("resnet18", "resnet34", "resnet50", "mobilenet_v3_small", "efficientnet_b0")
"""model.encoder names built by torchvision (visppo.encoders knows how to cut each family)."""
ENCODERS = ("nature", "impala", "drq", "spatial_softmax", *TORCHVISION_ENCODERS)

CODE_PREFIX = "code/"
"""Ids of envs built in code (``visppo.train(env=...)``): ``code/<name>-v<n>``, known to one process,
so only a process that has the env can build it (or resume a run on it)."""

RESUMABLE = ("ppo.total_steps", "run.progress", "run.tensorboard", "run.log_every",
             "run.checkpoint_every", "run.keep_checkpoints", "train.threads", "train.max_bad_steps",
             "train.device", "rollout.device", "train.amp")
"""Keys a resumed run may change; everything else would make it a different run. The devices and
the precision are the machine's: a run moved to another machine may need them changed."""


@dataclass
class EnvConfig:
    id: str = "visppo/Reach-v0"
    """gymnasium id: a visppo task (visppo/DotReach-v0, ...), any id that renders (Reacher-v5, ...), dmc:<domain>-<task> (DeepMind Control, the dmc extra) or module:EnvId (imports module, which registers EnvId)."""
    pixels: bool = True
    """Observe rendered camera frames; false passes the env's own observation through (must be an image)."""
    state: bool = False
    """Also observe the robot's proprioceptive vector, as a dict {"pixels", "state"}."""
    image_size: int = 84
    """Side of the square frames the policy sees, in pixels."""
    frame_stack: int = 1
    """Number of consecutive frames stacked along channels (needed when velocity matters)."""
    action_repeat: int = 1
    """Times each action is repeated in the env; rewards are summed (dmc ids: the env repeats and renders one frame per agent step)."""
    camera: str = ""
    """Camera name for gymnasium MuJoCo ids (empty: the env's default camera; a name the model lacks is refused); name or index for dmc ids (empty: 0, quadruped 2); visppo's tasks have one fixed camera, 'policy'."""
    render_samples: int = -1
    """Anti-aliasing samples of a MuJoCo env's offscreen renderer; -1 keeps the env's own (Reacher-v5: 4). 0 turns it off: faster on a software GL (llvmpipe), nearly the same 84x84 frames (docs/performance.md)."""
    max_episode_steps: int = 0
    """Time limit in env steps before action repeat (frames); 0 keeps the env's registered limit (dmc ids: 1000)."""
    vector: str = "auto"
    """sync | async | auto: async worker processes (forkserver) for rendered envs when this process may use more than 2 CPUs, and always for a user's module:EnvId env (its crash is then one error line); sync otherwise, and for the synthetic tasks. sync runs a module:EnvId env in this process (faster on 2 CPUs; a segfault then ends the run with no message)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the env's constructor, through gymnasium.make (e.g. env.kwargs.look=fast for dmc ids); a mapping. On the command line env.kwargs.KEY=value sets one, env.kwargs={...} replaces them all."""


@dataclass
class ModelConfig:
    encoder: str = "spatial_softmax"
    """Image encoder: spatial_softmax (keypoint positions) | nature | impala | drq (DrQ-v2's, keeps a 35x35 map at 84x84) | resnet18 | resnet34 | resnet50 | mobilenet_v3_small | efficientnet_b0 (torchvision). (evidence: docs/learning.md)"""
    keypoints: int = 32
    """spatial_softmax: number of keypoint maps, two coordinates (x, y in [-1, 1]) each."""
    keypoint_stride: int = 4
    """spatial_softmax: stride of the first 8x8 conv, 1 to 8; the maps' side is (env.image_size - 8) / stride + 1 (84x84: 20 at 4); halving it quadruples the trunk's multiply-adds."""
    encoder_weights: str = "none"
    """none | imagenet (torchvision's file in $TORCH_HOME/hub/checkpoints, never downloaded) | PATH (torchvision state dict or visppo checkpoint)."""
    freeze_encoder_updates: int = 0
    """Keep the encoder's trunk frozen (no gradient, no Adam step) for this many optimizer steps, then train it."""
    encoder_lr_scale: float = 1.0
    """The encoder trunk's learning rate is ppo.learning_rate times this (its own optimizer param group); 0 leaves the trunk as loaded (frozen)."""
    encoder_checkpointing: bool = False
    """Recompute the trunk's activations block by block in backward (less memory, about 1/3 more compute); not for nature, drq or spatial_softmax."""
    resize: int = 0
    """Resize frames to this side before a torchvision backbone (224 is ImageNet's); 0 keeps env.image_size."""
    feature_dim: int = 256
    """Width of the encoder's output features."""
    hidden_dim: int = 256
    """Width of the actor's and critic's hidden layers."""
    state_hidden_dim: int = 64
    """Width of the MLP branch for the proprioceptive vector."""
    shared_layers: int = 0
    """Tanh layers of hidden_dim over the encoder's features (pixels and state concatenated), before the actor's and critic's own hidden layer: trained by both losses with a shared encoder, each encoder's own copy by its head's loss with share_encoder=false; 0: the heads read the features directly."""
    share_encoder: bool = True
    """Actor and critic share one encoder; false gives the critic its own (a second encoder's forward and backward in every update). (evidence: docs/learning.md)"""
    init_log_std: float = -0.5
    """Initial log standard deviation of the Gaussian policy (Box actions), between -20 and 5; -0.5 is std 0.61. (evidence: docs/learning.md)"""


@dataclass
class PPOConfig:
    num_envs: int = 8
    """Parallel environments; the rollout is num_envs * num_steps samples."""
    num_steps: int = 64
    """Steps per environment per iteration."""
    minibatch_size: int = 128
    """Samples per optimizer step (changes the learning; memory.micro_batch_size bounds the memory). (evidence: docs/learning.md)"""
    num_epochs: int = 4
    """Passes over the rollout per iteration. (evidence: docs/learning.md)"""
    total_steps: int = 100_000
    """Agent steps (policy decisions, summed over envs: frames / env.action_repeat) to train for (the learning rate anneals to 0 there)."""
    learning_rate: float = 1e-3
    """Adam learning rate at the start. (evidence: docs/learning.md)"""
    anneal_lr: bool = True
    """Decay the learning rate linearly to 0 over total_steps."""
    gamma: float = 0.99
    """Discount factor, in [0, 1] (CleanRL's 0.99). (evidence: docs/learning.md)"""
    gae_lambda: float = 0.95
    """GAE lambda, in [0, 1]: 0 is one-step TD, 1 is Monte Carlo (CleanRL's 0.95). (evidence: docs/learning.md)"""
    clip_coef: float = 0.2
    """PPO ratio clipping range, > 0 (CleanRL's 0.2). (evidence: docs/learning.md)"""
    clip_value: bool = False
    """Clip the value update around the old values with clip_coef (CleanRL has it on; off here). (evidence: docs/learning.md)"""
    value_coef: float = 0.5
    """Weight of the value loss, >= 0 (CleanRL's 0.5); on a shared encoder, raw returns in the hundreds make its gradient outweigh the policy's unless it is small. (evidence: docs/learning.md)"""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus, >= 0; 0 is off. (evidence: docs/learning.md)"""
    max_grad_norm: float = 0.5
    """Clip the global gradient norm of each optimizer step to this (> 0)."""
    norm_adv: bool = True
    """Normalise advantages over each minibatch."""
    norm_reward: bool = False
    """Divide rewards by a running std of the discounted return before GAE, so value targets stay near unit scale (logged returns stay raw). (evidence: docs/learning.md)"""
    target_kl: float = 0.0
    """Stop the iteration's update when a minibatch's approx KL exceeds 1.5x this; 0 disables."""
    recompute_logp_old: bool = False
    """Recompute logp_old over the rollout (chunked, no grad) before the update instead of using the acting pass's."""
    recompute_advantages: bool = False
    """Recompute advantages and returns from the current critic (chunked, no grad) at the start of every epoch after the first; the value clip stays anchored at the rollout's values."""
    adam_eps: float = 1e-5
    """Adam epsilon (> 0)."""


@dataclass
class MemoryConfig:
    micro_batch_size: Union[int, str] = 0  # noqa: UP007  (OmegaConf needs typing.Union)
    """Samples per backward pass, gradients accumulate to the minibatch; 0: whole minibatch; auto: probe memory.budget. Never changes the maths."""
    infer_chunk_size: Union[int, str] = 1024  # noqa: UP007
    """Samples per no-grad encoder pass (acting over the envs, bootstrap values, logp_old, values); auto: probe memory.budget. Never changes the maths."""
    budget: str = "8GiB"
    """Device memory budget for the probe and for auto sizes (e.g. 8GiB, 6000MB)."""
    buffer_device: str = "cpu"
    """cpu | device: keep the rollout buffer in host memory, or on the train device (no copies; costs device memory)."""


@dataclass
class TrainConfig:
    device: str = "auto"
    """cpu | cuda | cuda:N | auto (cuda when available)."""
    amp: str = "auto"
    """off | bf16 | fp16 | auto: mixed precision; auto is bf16 on a CUDA GPU with bf16 units (compute capability 8 on; fp16 on older ones) and off (fp32) on a CPU. fp16 is CUDA only."""
    channels_last: bool = True
    """Run convolutions in channels_last memory format (much faster on CPU); the rollout buffer keeps frames in it too."""
    seed: int = 1
    """Seed for torch, numpy, python and the envs (0 .. 2**31 - 1)."""
    deterministic: bool = False
    """Deterministic torch algorithms (slower; for reproducing runs exactly)."""
    threads: int = 0
    """torch intra-op threads; 0 keeps torch's default (at most 1024)."""
    max_bad_steps: int = 10
    """Stop the run after this many optimizer steps in a row with a non-finite loss or gradient (>= 1)."""
    profile: bool = False
    """Record the third iteration with torch.profiler into <run>/profile/ (a Chrome trace for Perfetto or TensorBoard)."""


@dataclass
class RolloutConfig:
    device: str = "auto"
    """cpu | cuda | cuda:N | auto (the train device): where the policy acts; a copy is synced once per iteration."""


@dataclass
class RunConfig:
    dir: str = ""
    """Run directory; empty: runs/<task>-<date>-<time>-<random>."""
    log_every: int = 1
    """Write metrics every this many iterations."""
    checkpoint_every: int = 10
    """Save a checkpoint every this many iterations (and at the end)."""
    keep_checkpoints: int = 3
    """Numbered checkpoints to keep besides latest.pt (the newest up to the run's iteration)."""
    eval_every: int = 0
    """Evaluate every this many iterations (and at the end); 0 disables."""
    eval_episodes: int = 5
    """Episodes per periodic evaluation (deterministic actions)."""
    eval_video: bool = True
    """Record each periodic evaluation to videos/iter_N.mp4 in the run directory."""
    progress: bool = True
    """Show a progress bar."""
    tensorboard: bool = True
    """Write TensorBoard events in the run directory."""
    wandb: bool = False
    """Also log to Weights & Biases (the wandb extra): every metric the CSV gets, the config and the evaluation videos; WANDB_MODE=offline keeps the run on disk."""
    wandb_project: str = "visppo"
    """W&B project of the run."""
    wandb_entity: str = ""
    """W&B entity (user or team); empty: your default entity."""
    wandb_name: str = ""
    """W&B run name; empty: the run directory's name."""


@dataclass
class Config:
    env: EnvConfig = field(default_factory=EnvConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    run: RunConfig = field(default_factory=RunConfig)

    @property
    def rollout_size(self) -> int:
        return self.ppo.num_envs * self.ppo.num_steps

    @property
    def micro_batch(self) -> int:
        """The micro-batch size in effect (0 means the whole minibatch); resolve ``auto`` first."""
        if self.memory.micro_batch_size == "auto":
            raise ValueError("memory.micro_batch_size=auto must be resolved by the probe first")
        return int(self.memory.micro_batch_size) or self.ppo.minibatch_size


# --------------------------------------------------------------------------- loading


def _schema() -> DictConfig:
    cfg = OmegaConf.structured(Config)
    OmegaConf.set_struct(cfg, True)
    OmegaConf.set_struct(cfg.env.kwargs, False)  # free-form: passed on to gymnasium.make
    return cfg


def _explain(exc: OmegaConfBaseException, source: str) -> ConfigError:
    key = getattr(exc, "full_key", None) or ""
    msg = str(exc).splitlines()[0]
    if "not in" in msg or "Key '" in msg and "not" in msg:
        section = key.rsplit(".", 1)[0] if "." in key else ""
        known = _known_keys(section)
        hint = f" (known keys{' in ' + section if section else ''}: {', '.join(known)})" if known else ""
        return ConfigError(f"unknown config key '{key}' in {source}{hint}")
    if "nterpolation" in type(exc).__name__:
        return ConfigError(f"'{key}': {msg}: a '${{...}}' in a value is an OmegaConf reference to "
                           "another key, which visppo configs do not keep: write the value out")
    if key:
        return ConfigError(f"bad value for '{key}' in {source}: {msg}")
    return ConfigError(f"{source}: {msg}")


def _known_keys(section: str) -> list[str]:
    node: Any = Config
    for part in filter(None, section.split(".")):
        match = [f for f in fields(node) if f.name == part]
        if not match or not is_dataclass(match[0].default_factory):  # type: ignore[arg-type]
            return []
        node = match[0].default_factory  # type: ignore[assignment]
    return [f.name for f in fields(node)]


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults <- YAML file <- ``key=value`` overrides, validated."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} not found: give the path of a YAML file (see configs/)")
        data = read_config_file(path)
    return build_config(data, overrides, source=str(path) if path is not None else "the defaults")


MAX_BASE_DEPTH = 8
"""How many ``base:`` files a config may chain (a loop is refused before this)."""


def names_a_file(arg: str | os.PathLike) -> bool:
    """``Path.is_file`` for any argument: an override's text, or YAML given for a path, may be no
    valid path at all (a name too long)."""
    try:
        return Path(arg).is_file()
    except OSError:
        return False


def read_config_file(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    """A config file's sections, merged over those of the file its top-level ``base:`` names.

    ``base`` is a path relative to the file that holds it; the base may name its own base. This
    is how the DMC tasks share one recipe: ``configs/dmc_walker_walk.yaml`` is ``base: dmc.yaml``
    and its ``env.id``.
    """
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"{path}: base files form a loop ({' -> '.join(p.name for p in (*seen, path))}): "
                          "remove one base key")
    if len(seen) >= MAX_BASE_DEPTH:
        raise ConfigError(f"{path}: more than {MAX_BASE_DEPTH} chained base files: merge some of them")
    data = read_yaml(path)
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str) or not base.strip():
        raise ConfigError(f"{path}: base must be the path of another config file, relative to this one")
    base_path = path.parent / base
    if not base_path.is_file():
        raise ConfigError(f"{path}: its base {base} ({base_path}) is not a file: fix the base key")
    # a section left empty (``ppo:`` with its keys commented out) keeps the base's keys, as ``ppo: {}``
    data = {k: {} if v is None and k in _known_keys("") else v for k, v in data.items()}
    return _merge(read_config_file(base_path, (*seen, path)), data)


def _merge(base: dict, over: dict) -> dict:
    """``over``'s keys over ``base``'s, section by section (nested mappings merge, values replace)."""
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


class _StrictLoader(yaml.SafeLoader):
    """``yaml.safe_load`` that refuses a key given twice in one mapping (YAML's last-wins hides typos)."""

    def construct_mapping(self, node, deep=False):
        seen: set = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: its keys may be overridden
                continue
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, (str, int, float, bool)):
                continue  # unhashable keys: PyYAML's own error follows
            if key in seen:
                raise ConfigError(f"line {key_node.start_mark.line + 1}: key '{key}' is given twice in "
                                  "the same section: keep one")
            seen.add(key)
        return super().construct_mapping(node, deep)


MAX_NODES = 10_000
"""A config has a few hundred values; more (YAML aliases expanding a "billion laughs") is refused."""


def read_yaml(path: Path) -> dict:
    """A YAML config file as nested dicts: valid UTF-8 YAML, no duplicate keys, a mapping, of sane size."""
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_StrictLoader) or {}  # noqa: S506 - safe
    except ConfigError as exc:
        raise ConfigError(f"{path} {exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not a text (UTF-8) file: give a YAML config") from None
    except OSError as exc:  # unreadable (permissions, a special file): not the catch-all's "cannot write"
        raise ConfigError(f"config file {path} cannot be read ({exc.strerror or exc}): "
                          "make it readable or give another file") from None
    except (yaml.YAMLError, RecursionError) as exc:
        where = getattr(exc, "problem_mark", None)
        line = f" line {where.line + 1}" if where is not None else ""
        raise ConfigError(f"{path}{line} is not valid YAML: fix the syntax") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must be a mapping of sections (env:, ppo:, ...), not {type(data).__name__}")
    if _count_nodes(data, MAX_NODES) > MAX_NODES:
        raise ConfigError(f"{path} expands to more than {MAX_NODES} values (YAML aliases?): a visppo config "
                          "has a few hundred; write the values out")
    return data


def _count_nodes(data: Any, limit: int) -> int:
    """Values in ``data``, counted through aliases (shared or self-referencing containers), up to ``limit``."""
    count, stack = 0, [data]
    while stack and count <= limit:
        item = stack.pop()
        count += 1
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return count


DELETE = "; delete the key"
"""The advice that ends each ``REMOVED`` message: right for a config file or an override, not for
a checkpoint, whose saved config the user cannot edit."""


def _lost(key: str, what: str, why: str = "it lost", evidence: str = "docs/learning.md",
          on: str = "2026-12-03") -> str:
    return f"{key} ({what}) was removed on {on} ({why}: {evidence}){DELETE}"


UNADOPTED = "the one learning recipe does not use it"
SHIFTS_LOST = "random shifts in every loss lost on two of three dev tasks"
NORM_VALUE_LOST = "raw value targets won the dev set over two seeds"
NORM_VALUE_REMOVED = ("2026-12-06", "docs/recipe.md")
"""When model.norm_value was removed, and where the evidence is."""


REMOVED = {
    "rollout.overlap": (False, "rollout.overlap was removed: two alternating halves of async envs were "
                        "slower than plain collection on every configuration measured" + DELETE),
    "model.recon_size": (0, _lost("model.recon_size", "the reconstruction loss's decoder")),
    "model.recon_motion": (0.0, _lost("model.recon_motion", "the reconstruction of each frame's change")),
    "ppo.recon_coef": (0.0, _lost("ppo.recon_coef", "the reconstruction loss's weight")),
    "model.invdyn": (False, _lost("model.invdyn", "the inverse-dynamics head")),
    "ppo.invdyn_coef": (0.0, _lost("ppo.invdyn_coef", "the inverse-dynamics loss's weight")),
    "model.reward_head": (False, _lost("model.reward_head", "the reward-prediction head")),
    "ppo.reward_coef": (0.0, _lost("ppo.reward_coef", "the reward-prediction loss's weight")),
    "model.detach_actor": (False, _lost("model.detach_actor", "the actor reading detached features")),
    "model.privileged_critic": (False, _lost("model.privileged_critic", "a critic reading only env.state")),
    "model.action_dist": ("normal", _lost("model.action_dist", "the Beta policy; the Gaussian remains")),
    "model.noise_beta": (0.0, _lost("model.noise_beta", "exploration noise correlated in time")),
    "model.keypoint_norm": (0, _lost("model.keypoint_norm", "standardised spatial_softmax keypoints")),
    "ppo.drac_coef": (0.0, _lost("ppo.drac_coef", "DrAC's policy-KL and value regularisers")),
    "model.rotate_degrees": (180.0, _lost("model.rotate_degrees", "the largest turn of model.augment=rotate",
                                          UNADOPTED)),
    "model.final_log_std": (None, _lost("model.final_log_std", "the linear log-std schedule; the std is always learned")),
    "model.augment": ("none", _lost("model.augment", "the update's image augmentation", SHIFTS_LOST, "docs/recipe.md")),
    "model.shift_pad": (4, _lost("model.shift_pad", "the largest random shift", SHIFTS_LOST, "docs/recipe.md")),
    "ppo.augment_loss": (False, _lost("ppo.augment_loss", "every loss on shifted frames", SHIFTS_LOST, "docs/recipe.md")),
    "model.norm_value": (False, _lost("model.norm_value", "the critic's standardised value targets",
                                      NORM_VALUE_LOST, NORM_VALUE_REMOVED[1], NORM_VALUE_REMOVED[0])),
    "model.feature_norm": (False, _lost("model.feature_norm", "the LayerNorm over the encoder's output",
                                        "it did not beat arm E on the dev set", "docs/recipe.md", "2026-12-07")),
}
"""Keys that no longer exist: (their old default, the message). A saved config holds every key,
so a removed key at its old default is dropped quietly; any other value is refused."""

ACTING_UNCHANGED = frozenset({"model.norm_value"})
"""Removed keys that changed only how the critic learned: a checkpoint trained with them acts
as it did, so loading it to act (evaluation, export, load_policy) drops them whatever their
value. Training on from such a checkpoint is still refused."""

def _saved_value(data: dict, key: str, default: Any) -> Any:
    section, name = key.split(".")
    values = data.get(section)
    return values.get(name, default) if isinstance(values, dict) else default


def not_resumable(data: dict) -> str | None:
    """Why a checkpoint whose saved config is ``data`` cannot train on (it was trained with a
    removed key set to other than its old default), or None."""
    for key, (old_default, message) in REMOVED.items():
        value = _saved_value(data, key, old_default)
        if value == old_default:
            continue
        if key in ACTING_UNCHANGED:
            on, evidence = NORM_VALUE_REMOVED
            return (f"was trained with {key}={value}, which was removed on {on} ({evidence}): the run cannot go "
                    "on; its policy still evaluates and exports (visppo eval, visppo export), and a new run trains "
                    "without it")
        return (f"was trained with {key}={value}: {message.removesuffix(DELETE)}; the run cannot go on, and a new "
                "run trains without it")
    return None


def _drop_removed(data: dict, overrides: list[str] | tuple[str, ...], source: str,
                  to_act: bool = False) -> dict:
    data = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
    for key, (default, message) in REMOVED.items():
        section, name = key.split(".")
        if isinstance(data.get(section), dict) and name in data[section]:
            value = data[section].pop(name)
            if value != default and not (to_act and key in ACTING_UNCHANGED):
                if to_act:  # a checkpoint's saved config: nothing for the user to delete
                    raise ConfigError(f"{source} was trained with {key}={value}: {message.removesuffix(DELETE)}; "
                                      "this version cannot rebuild its policy: act with the visppo version that "
                                      "trained it")
                raise ConfigError(f"{message} (in {source})")
        if any(item.split("=", 1)[0].strip() == key for item in overrides):
            raise ConfigError(message)
    return data


@functools.cache
def _whole_keys() -> frozenset[str]:
    """Keys of integer type (``memory.*`` sizes may also be ``auto``); cached: reading the field
    docs parses the source (a third of a second)."""
    return frozenset({key for key, (typ, _, _) in field_docs().items() if typ in ("int", "Union[int, str]")})


_FLOAT = re.compile(r"^\s*[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?\s*$")


def _whole(value: Any) -> Any:
    """``2e6``, ``2.0e6`` or ``1000.0`` as the int they name; anything else unchanged."""
    number = value
    if isinstance(value, str) and _FLOAT.match(value):
        number = float(value)
    if isinstance(number, float) and math.isfinite(number) and number.is_integer():
        return int(number)
    return value


def _whole_numbers(data: dict, overrides: list[str] | tuple[str, ...]) -> tuple[dict, list[str]]:
    """Integer keys written as whole floats (``ppo.total_steps=2e6``) become ints."""
    keys = _whole_keys()
    for section, values in data.items():
        if isinstance(values, dict):
            for name, value in values.items():
                if f"{section}.{name}" in keys and not isinstance(value, bool):
                    values[name] = _whole(value)
    out = []
    for item in overrides:
        key, eq, value = item.partition("=")
        out.append(f"{key}={_whole(value)}" if eq and key.strip() in keys else item)
    return data, out


def _check_sections(data: dict, source: str) -> None:
    """Each known section must be a mapping of keys (``ppo: 5`` is a misplaced value); an empty
    one (``ppo:`` alone) is an empty mapping."""
    for name, value in data.items():
        if name in _known_keys("") and value is None:
            data[name] = {}
        elif name in _known_keys("") and value is not None and not isinstance(value, dict):
            raise ConfigError(f"'{name}' in {source} must be a section of keys (e.g. {name}.{_known_keys(name)[0]}), "
                              f"not the {type(value).__name__} {str(value)[:40]!r}: indent its keys under it")


def _check_kwargs(data: dict, overrides: list[str] | tuple[str, ...], source: str) -> None:
    """``env.kwargs`` go to the env's constructor as keywords, so they must be a mapping; checked
    here because OmegaConf's merge of a list into it raises a bare TypeError."""
    env = data.get("env")
    if isinstance(env, dict) and "kwargs" in env:
        _kwargs_mapping(env["kwargs"], f"in {source}")
    for item in overrides:
        key, eq, value = item.partition("=")
        if eq and key.strip() == "env.kwargs":
            try:
                parsed = yaml.safe_load(value)
            except yaml.YAMLError:
                continue  # not YAML at all: the merge's own message says so
            _kwargs_mapping(parsed, "on the command line")


def _kwargs_mapping(value: Any, where: str) -> None:
    if not isinstance(value, dict):
        shown = "nothing" if value is None else f"the {type(value).__name__} {str(value)[:40]!r}"
        raise ConfigError(f"env.kwargs {where} must be a mapping of the env's keyword arguments "
                          f"(e.g. env.kwargs.look=published, or kwargs: {{look: published}} in a file), not {shown}")


def build_config(data: dict, overrides: list[str] | tuple[str, ...] = (), source: str = "the config",
                 to_act: bool = False) -> Config:
    """Defaults <- ``data`` (nested sections) <- ``key=value`` overrides, validated. ``to_act``:
    the config of a checkpoint loaded only to act (see ``ACTING_UNCHANGED``)."""
    data = _drop_removed(data, overrides, source, to_act)
    _check_sections(data, source)
    _check_kwargs(data, overrides, source)
    data, overrides = _whole_numbers(data, overrides)
    cfg = _schema()
    try:
        cfg = OmegaConf.merge(cfg, OmegaConf.create(data))
    except OmegaConfBaseException as exc:
        raise _explain(exc, source) from None
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' must look like key=value (e.g. ppo.num_envs=4)")
        key, _, value = item.partition("=")
        key = key.strip()  # "ppo.num_envs = 4", quoted with its spaces
        if not key or "." not in key or "" in key.split("."):
            raise ConfigError(f"override '{item}' must name section.key (e.g. ppo.num_envs=4)")
        # key= is the empty string (env.camera's and run.dir's default), not YAML's null
        item = f"{key}={value}" if value.strip() else f"{key}=''"
        try:
            if key == "env.kwargs":  # a mapping given whole replaces the config's, as any other value does
                cfg = _replace_kwargs(cfg, item)
                continue
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([item]))
        except OmegaConfBaseException as exc:
            raise _explain(exc, "the command line") from None
        except Exception as exc:  # yaml errors in the value part
            problem = getattr(exc, "problem", None) or str(exc).strip().splitlines()[0]
            raise ConfigError(f"cannot parse override '{item}': the value is not valid YAML ({problem}); "
                              "quote it for a string, e.g. 'key=\"...\"'") from None
    try:
        obj: Config = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    except OmegaConfBaseException as exc:  # a ${...} that names no key, or one that cannot resolve
        raise _explain(exc, source) from None
    _refuse_interpolation(asdict(obj))  # not to_dict: that resolves again
    validate(obj)
    return obj


def _replace_kwargs(cfg: Any, item: str) -> Any:
    """``env.kwargs={...}``: the constructor's arguments become exactly these (a merge would keep
    the config's others, so ``env.kwargs={}`` would change nothing)."""
    given = OmegaConf.from_dotlist([item])
    cfg = OmegaConf.merge(cfg, given)  # the value checked as a merge would
    OmegaConf.update(cfg, "env.kwargs", given.env.kwargs, merge=False)
    return cfg


def _refuse_interpolation(data: Any, key: str = "") -> None:
    """No value may keep a ``${``: OmegaConf reads it as a reference to another key each time the
    config is resolved, so an escaped one would pass here and fail when the run saves its first
    checkpoint (and its config.yaml would not load again)."""
    if isinstance(data, dict):
        for name, value in data.items():
            _refuse_interpolation(value, f"{key}.{name}" if key else str(name))
    elif isinstance(data, (list, tuple)):
        for value in data:
            _refuse_interpolation(value, key)
    elif isinstance(data, str) and "${" in data:
        raise ConfigError(f"{key}={data!r}: a '${{' in a value is an OmegaConf reference to another key, "
                          "which visppo configs do not keep: write the value out")


def from_dict(data: dict, overrides: list[str] | tuple[str, ...] = (), to_act: bool = False) -> Config:
    """Rebuild a Config from a plain dict (e.g. the one stored in a checkpoint), with ``overrides``;
    ``to_act``: for a checkpoint loaded only to act (``ACTING_UNCHANGED``)."""
    return build_config(data, overrides, source="the saved config", to_act=to_act)


def to_dict(cfg: Config) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)  # type: ignore[return-value]


def differences(mine: Config, theirs: Config) -> list[tuple[str, Any, Any]]:
    """Every key whose value differs between two configs, as (dotted name, mine, theirs) in field
    order: what makes one run another (a resume's checks, a report's run folders)."""
    a, b = to_dict(mine), to_dict(theirs)
    return [(f"{section}.{key}", value, b.get(section, {}).get(key))
            for section, values in a.items() for key, value in values.items()
            if b.get(section, {}).get(key) != value]


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


# --------------------------------------------------------------------------- validation

_BYTES = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """'8GiB' -> 8589934592. Raises ValueError on anything else."""
    m = _BYTES.match(str(text))
    if not m:
        raise ValueError(f"'{text}' is not a size like 8GiB, 6000MB or 1073741824")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "B").lower()])


MAX_THREADS = 1024
"""More CPU threads than any machine has cores (torch.set_num_threads aborts on huge counts)."""
MAX_INT = 10**15
"""Larger whole numbers are typos (and overflow torch's int64 sizes)."""


def validate(cfg: Config) -> None:
    """Refuse values that cannot work, naming the key and what to change."""

    def positive(key: str, value: float) -> None:
        if value <= 0:
            raise ConfigError(f"{key} must be positive, got {value}")

    for section in fields(cfg):
        for f in fields(getattr(cfg, section.name)):
            value = getattr(getattr(cfg, section.name), f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{section.name}.{f.name} must be a finite number, got {value}")
            if isinstance(value, int) and abs(value) > MAX_INT:
                raise ConfigError(f"{section.name}.{f.name}={value} is out of range (at most {MAX_INT:.0e})")

    for key in ("memory.micro_batch_size", "memory.infer_chunk_size"):
        value = getattr(cfg.memory, key.split(".")[1])
        if isinstance(value, str) and value != "auto":
            raise ConfigError(f"{key} must be a whole number or auto, got '{value}'")
    for key in ("ppo.num_envs", "ppo.num_steps", "ppo.minibatch_size", "ppo.num_epochs",
                "ppo.total_steps", "ppo.learning_rate",
                "env.image_size", "env.frame_stack", "env.action_repeat", "model.feature_dim",
                "model.hidden_dim", "model.state_hidden_dim", "model.keypoints", "run.log_every", "run.eval_episodes",
                "run.checkpoint_every"):
        section, name = key.split(".")
        positive(key, getattr(getattr(cfg, section), name))
    if cfg.memory.infer_chunk_size != "auto" and cfg.memory.infer_chunk_size <= 0:
        raise ConfigError(f"memory.infer_chunk_size must be positive (or auto), got {cfg.memory.infer_chunk_size}")
    if cfg.memory.micro_batch_size != "auto" and cfg.memory.micro_batch_size < 0:
        raise ConfigError(f"memory.micro_batch_size must be >= 0 (or auto), got {cfg.memory.micro_batch_size}")
    _validate_learning_keys(cfg)
    for key in ("ppo.entropy_coef", "ppo.target_kl",
                "env.max_episode_steps", "train.threads", "model.freeze_encoder_updates",
                "model.shared_layers", "run.keep_checkpoints", "ppo.value_coef", "run.eval_every"):
        section, name = key.split(".")
        if getattr(getattr(cfg, section), name) < 0:
            raise ConfigError(f"{key} must be >= 0, got {getattr(getattr(cfg, section), name)}")
    if cfg.train.threads > MAX_THREADS:  # torch aborts the process for absurd counts
        raise ConfigError(f"train.threads must be at most {MAX_THREADS} (0: torch's default), got {cfg.train.threads}")
    if not 0 <= cfg.train.seed < 2**31:  # numpy takes 32-bit seeds; env and rank seeds are added to it
        raise ConfigError(f"train.seed must be in 0 .. 2**31 - 1, got {cfg.train.seed}")
    if not cfg.env.id.strip():
        raise ConfigError("env.id is empty: give the task's id (e.g. visppo/Reach-v0, dmc:cartpole-swingup)")
    if not -20 <= cfg.model.init_log_std <= 5:  # exp() beyond: a std of inf or a variance of 0, so NaN log-probs
        raise ConfigError(f"model.init_log_std must be between -20 and 5 (std 2e-9 to 148), got {cfg.model.init_log_std}")
    if cfg.env.render_samples < -1:
        raise ConfigError(f"env.render_samples must be -1 (the env's own) or >= 0, got {cfg.env.render_samples}")
    _validate_relations(cfg)
    _validate_choices(cfg)


NO_LEARNING = {
    "ppo.max_grad_norm": "0 scales every gradient to zero and the weights never change; to clip nothing, "
                         "give a large norm such as 1e6",
    "ppo.clip_coef": "0 clips every probability ratio to 1 and the policy stops changing after its first "
                     "step (0.2 is usual)",
    "ppo.adam_eps": "Adam divides by the gradient's running size plus it, and a parameter without gradient "
                    "then turns NaN (1e-5 is usual)",
    "train.max_bad_steps": "0 stops a healthy run after its first iteration as diverged (1 stops at the "
                           "first non-finite step)",
}
"""Keys that must be positive because 0 (or less) would silently stop the learning."""


def _validate_learning_keys(cfg: Config) -> None:
    for key, why in NO_LEARNING.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value <= 0:
            raise ConfigError(f"{key} must be positive, got {value}: {why}")


def _validate_relations(cfg: Config) -> None:
    if cfg.ppo.minibatch_size > cfg.rollout_size:
        raise ConfigError(
            f"ppo.minibatch_size ({cfg.ppo.minibatch_size}) is larger than the rollout "
            f"ppo.num_envs * ppo.num_steps = {cfg.rollout_size}: lower it or collect more steps")
    if cfg.memory.micro_batch_size != "auto" and cfg.memory.micro_batch_size > cfg.ppo.minibatch_size:
        raise ConfigError(
            f"memory.micro_batch_size ({cfg.memory.micro_batch_size}) is larger than "
            f"ppo.minibatch_size ({cfg.ppo.minibatch_size}): lower it (0 means the whole minibatch)")
    for key in ("ppo.gamma", "ppo.gae_lambda"):
        value = getattr(cfg.ppo, key.split(".")[1])
        if not 0.0 <= value <= 1.0:
            raise ConfigError(f"{key} must be in [0, 1], got {value}")


def _validate_choices(cfg: Config) -> None:
    def choice(key: str, value: str, options: tuple[str, ...]) -> None:
        if value not in options:
            raise ConfigError(f"{key} must be one of {' | '.join(options)}, got '{value}'")

    if cfg.train.amp in ("False", "false"):  # YAML 1.1 reads a bare `off` as the boolean false
        cfg.train.amp = "off"
    if cfg.train.amp in ("True", "true"):  # and `on` or `yes` as true: not a precision
        raise ConfigError("train.amp=on (or yes, true) names no precision: give bf16, fp16, auto or off")
    choice("train.amp", cfg.train.amp, ("off", "bf16", "fp16", "auto"))
    choice("env.vector", cfg.env.vector, ("sync", "async", "auto"))
    choice("memory.buffer_device", cfg.memory.buffer_device, ("cpu", "device"))
    choice("model.encoder", cfg.model.encoder, ENCODERS)
    _validate_finetuning(cfg)
    for key in ("train.device", "rollout.device"):
        value = getattr(cfg, key.split(".")[0]).device
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", value):
            raise ConfigError(f"{key} must be cpu, cuda, cuda:N or auto, got '{value}'")
    try:
        parse_bytes(cfg.memory.budget)
    except ValueError as exc:
        raise ConfigError(f"memory.budget: {exc}") from None
    if cfg.env.image_size < 36 and cfg.model.encoder == "nature":
        raise ConfigError(f"env.image_size must be >= 36 for the nature encoder, got {cfg.env.image_size}")
    if cfg.env.image_size < 15 and cfg.model.encoder == "drq":
        raise ConfigError(f"env.image_size must be >= 15 for the drq encoder, got {cfg.env.image_size}")
    if cfg.model.encoder == "spatial_softmax" and cfg.env.image_size < 8 + cfg.model.keypoint_stride:
        raise ConfigError(f"env.image_size must be >= {8 + cfg.model.keypoint_stride} for the spatial_softmax "
                          f"encoder at model.keypoint_stride={cfg.model.keypoint_stride}, got {cfg.env.image_size}")


def _validate_finetuning(cfg: Config) -> None:
    """Encoder, weights and fine-tuning keys. Never reads a weights file: that
    happens when the policy is built, so recipes load on machines without the file."""
    m = cfg.model
    torchvision = m.encoder in TORCHVISION_ENCODERS
    if not m.encoder_weights.strip():
        raise ConfigError("model.encoder_weights must be none, imagenet or the path of a weights file, got ''")
    if m.encoder_weights == "imagenet" and not torchvision:
        raise ConfigError(f"model.encoder_weights=imagenet needs a torchvision backbone "
                          f"({', '.join(TORCHVISION_ENCODERS)}), not model.encoder={m.encoder}")
    if m.encoder_lr_scale < 0:
        raise ConfigError(f"model.encoder_lr_scale must be >= 0, got {m.encoder_lr_scale}")
    if m.resize < 0:
        raise ConfigError(f"model.resize must be >= 0 (0: off), got {m.resize}")
    if not 1 <= m.keypoint_stride <= 8:
        raise ConfigError(f"model.keypoint_stride must be 1 to 8 (the first conv is 8x8), got {m.keypoint_stride}")
    if (m.keypoints, m.keypoint_stride) != (ModelConfig.keypoints, ModelConfig.keypoint_stride) \
            and m.encoder != "spatial_softmax":
        raise ConfigError(f"model.keypoints and model.keypoint_stride shape spatial_softmax, not model.encoder="
                          f"{m.encoder}: remove them")
    if m.resize and not torchvision:
        raise ConfigError(f"model.resize applies to torchvision backbones, not model.encoder={m.encoder}: "
                          "set env.image_size instead")
    if m.encoder_checkpointing and m.encoder in ("nature", "drq", "spatial_softmax"):
        raise ConfigError("model.encoder_checkpointing needs a backbone made of blocks (impala or a "
                          f"torchvision one), not {m.encoder}: set it to false")
    side = m.resize or cfg.env.image_size
    if torchvision and side < 32:
        raise ConfigError(f"model.encoder={m.encoder} needs frames of at least 32x32, got {side}: "
                          "raise env.image_size or set model.resize")


# --------------------------------------------------------------------------- documentation


def field_docs(cls: type = Config) -> dict[str, tuple[str, Any, str]]:
    """``{"ppo.num_envs": (type, default, doc), ...}`` read from the attribute docstrings."""
    out: dict[str, tuple[str, Any, str]] = {}
    for section in fields(cls):
        sub = section.default_factory  # type: ignore[misc]
        tree = ast.parse(inspect.getsource(sub))
        body = tree.body[0].body  # type: ignore[attr-defined]
        docs: dict[str, str] = {}
        for node, nxt in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
                docs[node.target.id] = str(nxt.value.value)  # type: ignore[union-attr]
        default = sub()
        for f in fields(sub):
            out[f"{section.name}.{f.name}"] = (str(f.type), getattr(default, f.name), docs.get(f.name, ""))
    return out
