"""``visppo export RUN --format folder|onnx|pt2|torchscript --out DIR``: a policy to run elsewhere.

- ``folder`` (the default): ``model.safetensors`` (the network's weights), ``config.yaml`` (the
  run's resolved config), ``policy.json`` and a model card ``README.md``: the layout the Hugging
  Face Hub expects (``huggingface_hub.upload_folder`` publishes it as it is), which
  :func:`visppo.load_policy` loads.
- ``onnx`` (``policy.onnx``), ``pt2`` (``policy.pt2``, a ``torch.export`` program: TorchScript's
  successor, loaded with ``torch.export.load``) and ``torchscript`` (``policy.pt``, for libtorch
  in C++; ``torch.jit`` is deprecated from torch 2.14 on): one self-contained network,
  stacked uint8 frames ``pixels`` [batch, channels * frame_stack, H, W] (and ``state`` [batch, d])
  in, the deterministic action out (the Gaussian's mean clipped to the Box's bounds, or the
  discrete action's index), with ``policy.json`` saying how to stack the frames.

Every format writes its files into a temporary folder beside ``--out`` and renames it into
place: a failure leaves nothing under ``--out``. The folder and ONNX formats need the ``deploy``
extra (safetensors; onnx and onnxscript), checked before any work; pt2 and TorchScript need only torch.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from visppo import extras, seeding
from visppo.atomic import atomic_write_text, dir_mode
from visppo.config import to_yaml
from visppo.deploy import CONFIG_FILE, SPEC_FILE, WEIGHTS_FILE, Policy, load_policy
from visppo.errors import ConfigError

FORMATS = ("folder", "onnx", "pt2", "torchscript")
NEEDS = {"folder": ("safetensors",), "onnx": ("onnx", "onnxscript"), "pt2": (), "torchscript": ()}
"""The modules each format needs (the deploy extra's; pt2 and TorchScript need only torch)."""
FILES = {"onnx": "policy.onnx", "pt2": "policy.pt2", "torchscript": "policy.pt"}
EXAMPLE_BATCH = 2
"""The batch the exporters trace with; the exported batch dimension is dynamic."""


class ActionNetwork(nn.Module):
    """The deterministic policy as one module: stacked uint8 frames (and the state) in, action out.

    The same layers as ``ActorCritic.act(deterministic=True)``: the encoder, the actor's head, the
    Gaussian's mean (the head's output) clipped to the bounds, or the most likely discrete action.
    """

    def __init__(self, policy: Policy):
        super().__init__()
        network = policy.network
        self.encoder, self.actor = network.encoder, network.actor
        self.discrete = bool(policy.spec.n)
        self.has_state = policy.spec.state_dim > 0
        if not self.discrete:
            self.register_buffer("low", torch.tensor(policy.spec.low, dtype=torch.float32))
            self.register_buffer("high", torch.tensor(policy.spec.high, dtype=torch.float32))

    def forward(self, pixels: torch.Tensor, state: torch.Tensor | None = None) -> torch.Tensor:
        obs = {"pixels": pixels}
        if self.has_state:
            obs["state"] = state
        out = self.actor(self.encoder(obs)).float()
        if self.discrete:
            return out.argmax(-1)
        return torch.clamp(out, self.low, self.high)


def export(source: str | Path, out: str | Path, fmt: str = "folder") -> Path:
    """Export the policy of ``source`` (a run directory or checkpoint) to the folder ``out``."""
    if fmt not in FORMATS:
        raise ConfigError(f"--format {fmt}: choose one of {', '.join(FORMATS)}")
    extras.require("deploy", NEEDS[fmt], f"visppo export --format {fmt}")
    out = check_out(Path(out))
    policy = load_policy(source)  # a bad source is refused before anything is created
    make_parent(out)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
    try:
        files = write_folder(policy, tmp) if fmt == "folder" else write_network(policy, tmp, fmt)
        spec = policy.spec.to_json(policy.config, files=files, global_step=policy.info.get("global_step"),
                                   source=policy.info.get("source"))
        atomic_write_text(tmp / SPEC_FILE, json.dumps(spec, indent=2) + "\n")
        os.chmod(tmp, dir_mode())  # mkdtemp makes 0700 folders
        if out.is_dir():
            out.rmdir()  # empty (check_out): the rename needs it gone
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def check_out(out: Path) -> Path:
    """``--out`` must be a new folder, or an empty one other than the current folder, under a writable
    directory (checked, not created)."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file: give a folder to create")
    if out.is_dir() and out.resolve() == Path.cwd().resolve():  # the rename would replace the cwd
        raise ConfigError(f"--out {out} is the folder you are in: give a new folder, e.g. {out / 'policy'}")
    if out.is_dir() and any(out.iterdir()):
        raise ConfigError(f"--out {out} is a folder that is not empty: give a new folder (nothing is overwritten)")
    existing = out.absolute().parent
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"--out {out}: {existing} is not a writable folder")
    return out


def make_parent(out: Path) -> None:
    """Create ``--out``'s parent folders (once the policy has loaded)."""
    parent = out.absolute().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--out {out}: cannot create {parent} ({exc.strerror or exc})") from None


def example_inputs(policy: Policy) -> tuple[torch.Tensor, ...]:
    spec = policy.spec
    pixels = torch.zeros((EXAMPLE_BATCH, spec.channels * spec.frame_stack, spec.image_size, spec.image_size),
                         dtype=torch.uint8)
    return (pixels, torch.zeros((EXAMPLE_BATCH, spec.state_dim))) if spec.state_dim else (pixels,)


def write_network(policy: Policy, folder: Path, fmt: str) -> dict[str, str]:
    """The ONNX, pt2 or TorchScript file of :class:`ActionNetwork`, its batch dimension dynamic."""
    module = ActionNetwork(policy).eval().to(memory_format=torch.contiguous_format).requires_grad_(False)
    inputs = example_inputs(policy)
    names = ["pixels", "state"][:len(inputs)]
    path = folder / FILES[fmt]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's deprecation notes on tracing, the exporter's chatter
        batch = torch.export.Dim("batch")
        dynamic = {n: {0: batch} for n in names}
        if fmt == "onnx":
            torch.onnx.export(module, inputs, str(path), input_names=names, output_names=["action"],
                              dynamo=True, dynamic_shapes=dynamic, verbose=False, external_data=False)
        elif fmt == "pt2":
            torch.export.save(torch.export.export(module, inputs, dynamic_shapes=dynamic), str(path))
        else:
            with torch.no_grad():
                traced = torch.jit.trace(module, inputs, check_trace=False)
            traced.save(str(path))
    return {"model": path.name, "inputs": ", ".join(names), "output": "action"}


def write_folder(policy: Policy, folder: Path) -> dict[str, str]:
    """model.safetensors, config.yaml and README.md (policy.json is written by the caller)."""
    from safetensors.torch import save_file

    state = {k: v.detach().contiguous().clone() for k, v in policy.network.state_dict().items()}
    save_file(state, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    atomic_write_text(folder / CONFIG_FILE, to_yaml(policy.config))
    found = find_evaluation(policy.info.get("run_dir"), policy.info.get("global_step"))
    atomic_write_text(folder / "README.md", model_card(policy, found))
    return {"weights": WEIGHTS_FILE, "config": CONFIG_FILE, "card": "README.md"}


def find_evaluation(run_dir: str | None, global_step: int | None = None) -> tuple[str, dict[str, Any]] | None:
    """The run's evaluation: ``final_eval.json``, else another JSON file of ``visppo eval --json``;
    only one of the task as trained (no ``env_overrides``) and, where both are known, of the policy's
    ``global_step``: a card must not present another env's or another checkpoint's figures."""
    if not run_dir:
        return None
    root = Path(run_dir)
    candidates = [root / "final_eval.json", *sorted(p for p in root.glob("*.json") if p.name != "final_eval.json")]
    for path in candidates:
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            continue
        if not _an_evaluation(data):  # another tool's JSON in the run folder
            continue
        other_step = None not in (global_step, data.get("global_step")) and data["global_step"] != global_step
        if not data.get("env_overrides") and not other_step:
            return path.name, data
    return None


def _an_evaluation(data: Any) -> bool:
    """Whether ``data`` reads as ``visppo eval --json``'s output: its fields of the kinds the card
    prints (a stray JSON file with a ``mean_return`` must not crash the export)."""
    def number(value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return (isinstance(data, dict) and number(data.get("mean_return")) and number(data.get("episodes"))
            and data["episodes"] >= 1 and int(data["episodes"]) == data["episodes"]
            and all(data.get(k) is None or number(data[k]) for k in ("std_return", "seed", "success_rate", "global_step")))


def evaluation_lines(found: tuple[str, dict[str, Any]] | None, run_dir: str | None) -> list[str]:
    if found is None:
        where = run_dir or "RUN"
        return [f"Not evaluated: run `visppo eval {where} --episodes 10 --deterministic --json "
                f"{where}/final_eval.json`, then export again."]
    name, result = found
    episodes, seed = int(result["episodes"]), int(result.get("seed") or 0)
    seeds = [seeding.episode_seed(seed, i, seeding.EVAL) for i in range(min(episodes, 10))]
    more = ", ..." if episodes > 10 else ""
    success = result.get("success_rate")
    mode = "deterministic" if result.get("deterministic") else "stochastic"
    lines = [f"- return {result['mean_return']:.2f} +- {result.get('std_return') or 0:.2f} over {episodes} "
             f"episodes ({mode} actions)" + (f", success {100 * success:.0f}%" if success is not None else ""),
             f"- evaluation stream seed {seed}: episode reset seeds {', '.join(map(str, seeds))}{more} "
             "(`visppo.seeding.episode_seed(seed, i, EVAL)`, never a training episode's)",
             f"- from `{name}` of the run" + (f" (checkpoint at step {result['global_step']})"
                                             if result.get("global_step") is not None else "")]
    return lines


def model_card(policy: Policy, found: tuple[str, dict[str, Any]] | None) -> str:
    """The folder's README.md: the Hub's front matter, the task, budget, evaluation and command."""
    cfg, spec = policy.config, policy.spec
    action = (f"{spec.n} discrete actions" if spec.n else
              f"Box of {len(spec.low)} in [{', '.join(f'{v:g}' for v in spec.low)}] .. "
              f"[{', '.join(f'{v:g}' for v in spec.high)}]")
    step = policy.info.get("global_step")
    tag = cfg.env.id.replace(":", "-").replace("/", "-")
    return "\n".join([
        "---", "library_name: visppo", "pipeline_tag: reinforcement-learning",
        "tags:", "- reinforcement-learning", "- ppo", "- visppo", f"- {tag}", "---", "",
        f"# visppo policy for `{cfg.env.id}`", "",
        f"PPO from camera images, trained with visppo: {cfg.env.image_size}x{cfg.env.image_size} frames "
        f"of {spec.channels} channels, {spec.frame_stack} stacked, {spec.state_dim or 'no'} state values, "
        f"{action}; encoder `{cfg.model.encoder}`.", "",
        "## Training", "",
        f"- task: `{cfg.env.id}`",
        f"- budget: {cfg.ppo.total_steps} agent steps (`ppo.total_steps`)"
        + (f"; this checkpoint at step {step}" if step is not None else ""),
        f"- seed: {cfg.train.seed}",
        "- command: `visppo train config.yaml`, with this folder's `config.yaml` (the run's resolved "
        "config: every key)", "",
        "## Evaluation", "", *evaluation_lines(found, policy.info.get("run_dir")), "",
        "## Use", "", "```python", "import visppo", "",
        "policy = visppo.load_policy(\"path/to/this/folder\")",
        "policy.reset()                  # at each episode's start",
        "action = policy.act(frame)      # frame: HxWxC uint8 RGB, as the camera gives it",
        "```", "",
        f"`{WEIGHTS_FILE}`: the weights; `{CONFIG_FILE}`: the config; `{SPEC_FILE}`: the input "
        "(shape, dtype, frame stack, preprocessing) and the action bounds.", ""])

