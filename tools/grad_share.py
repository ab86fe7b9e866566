"""Which loss trains the encoder? The policy and value terms' gradients, measured apart.

    python tools/grad_share.py RUN_DIR_OR_CHECKPOINT [--minibatches 8] [--seed 1] [--json F]

PPO's loss is ``policy + value_coef * value - entropy_coef * entropy``, and one global
gradient-norm clip (``ppo.max_grad_norm``) scales the sum. With a shared encoder, the term
whose gradient is larger steers what the encoder learns. This tool loads a checkpoint,
collects one rollout with its policy (its config's envs and sizes; with ``ppo.norm_reward`` the
rewards scaled by the checkpoint's return statistics), computes GAE, and for a
few minibatches takes the gradient of the clipped-surrogate term alone and of the whole loss
(the rest is the value term, plus the entropy term when its weight is not 0). It prints the
median norm of each over the parameter groups (the actor's encoder, the critic's encoder when
it has its own, the actor head with the log-std, the critic head), the cosine between the two
on each encoder, and the median clip factor ``min(1, max_grad_norm / |total gradient|)``.
Each auxiliary loss that is on (reconstruction: ``model.recon_size``, ``ppo.recon_coef``;
inverse dynamics: ``model.invdyn``, ``ppo.invdyn_coef``;
reward prediction: ``model.reward_head``, ``ppo.reward_coef``) adds a column with its term's gradient
(part of the total); their heads are groups of their own.

It reads the training code's own pieces (``ppo_loss``, ``normalize_advantages``,
``compute_gae``, ``collect``) in fp32 on the CPU, and changes nothing on disk.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import torch


def parameter_groups(policy) -> dict[str, list[torch.nn.Parameter]]:
    """Named groups of the parameters the optimizer trains (a scheduled log-std or a frozen trunk
    has no gradient to measure); a shared encoder is one group."""
    own_critic = policy.critic_encoder is not None
    groups = {
        "encoder (actor's)" if own_critic else "encoder": list(policy.encoder.parameters()),
        "encoder (critic's)": list(policy.critic_encoder.parameters()) if own_critic else [],
        "actor head": list(policy.actor.parameters()) + ([policy.log_std] if hasattr(policy, "log_std") else []),
        "critic head": list(policy.critic.parameters()),
        "decoder": list(policy.decoder.parameters()) if policy.decoder is not None else [],
        "inverse-dynamics head": list(policy.invdyn.parameters()) if policy.invdyn is not None else [],
        "reward head": list(policy.reward_head.parameters()) if policy.reward_head is not None else [],
    }
    trained = {name: [q for q in qs if q.requires_grad] for name, qs in groups.items()}
    return {name: qs for name, qs in trained.items() if qs}


AUX_TERMS = {"recon": "reconstruction term", "invdyn": "inverse-dynamics term", "reward": "reward-prediction term"}
"""The auxiliary losses' short names (the training metrics call them ``<name>_loss``) and column titles."""


def flat_grad(loss: torch.Tensor, params: list[torch.nn.Parameter]) -> torch.Tensor:
    grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
    return torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1) for g, p in zip(grads, params)])


def rollout(policy, cfg, seed: int, reward_scale: dict | None = None):
    """One rollout of the checkpoint's policy in its config's envs, with GAE filled in; with
    ``ppo.norm_reward``, the rewards divided by the checkpoint's return scale (as training does)."""
    from visppo.buffer import ReturnScale, RolloutBuffer, compute_gae
    from visppo.envs import make_vector_env
    from visppo.rollout import RolloutState, collect, to_torch

    cfg.env.vector = "sync"
    envs = make_vector_env(cfg)
    try:
        buffer = RolloutBuffer(cfg.ppo.num_steps, cfg.ppo.num_envs, envs.single_observation_space,
                               envs.single_action_space)
        state = RolloutState.start(envs, seed=seed)
        collect(envs, policy, buffer, state, torch.device("cpu"))
    finally:
        envs.close()
    if cfg.ppo.norm_reward and reward_scale is not None:
        scale = ReturnScale(cfg.ppo.num_envs, cfg.ppo.gamma)
        scale.load_state_dict(reward_scale)
        buffer.rewards /= scale.std
    with torch.no_grad():
        last_value = policy.value(to_torch(buffer.last_obs, torch.device("cpu")))
    buffer.advantages[:], buffer.returns[:] = compute_gae(
        buffer.rewards, buffer.values, last_value, buffer.terminated, buffer.truncated,
        buffer.final_values, cfg.ppo.gamma, cfg.ppo.gae_lambda)
    return buffer


def measure(policy, cfg, buffer, minibatches: int, generator: torch.Generator) -> dict:
    """Per minibatch: the norm of the policy term's and of the rest's gradient per group, their
    cosine on each encoder, the total norm; returns the medians over the minibatches."""
    from visppo.buffer import minibatches as minibatch_indices
    from visppo.buffer import obs_of
    from visppo.ppo import (
        auxiliary_errors,
        auxiliary_weights,
        needs_previous_step,
        normalize_advantages,
        ppo_loss,
    )

    p = cfg.ppo
    groups = parameter_groups(policy)
    params = [q for qs in groups.values() for q in qs]
    sizes = [sum(q.numel() for q in qs) for qs in groups.values()]
    per_mb: list[dict[str, float]] = []
    weights = auxiliary_weights(policy, p)
    coefs = {name.removesuffix("_loss"): w for name, w in weights.items()}
    if needs_previous_step(weights):
        buffer.fill_previous_actions()
    advantages = buffer.flat(buffer.advantages)
    for mb in minibatch_indices(buffer.size, p.minibatch_size, generator)[:minibatches]:
        batch = buffer.gather(mb, torch.device("cpu"))
        adv = normalize_advantages(advantages[mb]) if p.norm_adv else advantages[mb]
        obs = obs_of(batch)
        if p.augment_loss:  # the losses read shifted (or turned) frames, as the update's do
            obs = policy.augment.augment_obs(obs, policy.augment.draw(len(mb)))
        if coefs:
            logp, entropy, values, aux = policy.score_actions_aux(obs, batch["actions"], batch.get("prev_actions"),
                                                                batch.get("prev_rewards"))
            aux = auxiliary_errors(aux, batch)
        else:
            logp, entropy, values = policy.score_actions(obs, batch["actions"])
        args = (logp, batch["logp"], adv, values, batch["values"], batch["returns"], entropy, p.clip_coef, p.clip_value)
        full, _ = ppo_loss(*args, p.value_coef, p.entropy_coef, policy.value_scale())
        surrogate, _ = ppo_loss(*args, 0.0, 0.0, policy.value_scale())
        g_full = flat_grad(full.mean(), params)
        g_pg = flat_grad(surrogate.mean(), params)
        g_rest = g_full - g_pg
        g_aux = {k: flat_grad(c * aux[f"{k}_loss"].mean(), params).split(sizes) for k, c in coefs.items()}
        g_total = g_full + sum((torch.cat(g) for g in g_aux.values()), torch.zeros_like(g_full))
        row = {"total": float(g_total.norm())}
        for i, ((name, _), a, b) in enumerate(zip(groups.items(), g_pg.split(sizes), g_rest.split(sizes))):
            row[f"{name}/policy"], row[f"{name}/value"] = float(a.norm()), float(b.norm())
            for k, g in g_aux.items():
                row[f"{name}/{k}"] = float(g[i].norm())
            if name.startswith("encoder"):
                denom = float(a.norm() * b.norm())
                row[f"{name}/cosine"] = float(a @ b) / denom if denom > 0 else math.nan  # nan: one term is 0 there
        row["clip factor"] = min(1.0, p.max_grad_norm / row["total"]) if row["total"] > 0 else 1.0
        per_mb.append(row)
    return {k: statistics.median(r[k] for r in per_mb) for k in per_mb[0]}


def report(medians: dict, value_label: str) -> str:
    names = list(dict.fromkeys(k.split("/")[0] for k in medians if "/" in k))
    aux = [k for k in AUX_TERMS if any(m.endswith(f"/{k}") for m in medians)]
    extra = ("".join(f" {AUX_TERMS[k]} |" for k in aux), " --- |" * len(aux))
    lines = [f"| group | policy term | {value_label} | value / policy | cosine |{extra[0]}",
             f"| --- | --- | --- | --- | --- |{extra[1]}"]
    for n in names:
        pol, val = medians[f"{n}/policy"], medians[f"{n}/value"]
        ratio = f"{val / pol:.3g}" if pol > 0 else "inf" if val > 0 else ""
        cos = medians.get(f"{n}/cosine")
        rec = "".join(f" {medians[f'{n}/{k}']:.3g} |" for k in aux)
        lines.append(f"| {n} | {pol:.3g} | {val:.3g} | {ratio} | "
                     f"{'' if cos is None or math.isnan(cos) else f'{cos:.2f}'} |{rec}")
    lines.append(f"\nmedian total gradient norm {medians['total']:.3g}, "
                 f"clip factor {medians['clip factor']:.3g} (ppo.max_grad_norm over the norm, at most 1)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("source", help="a run directory or a checkpoint file")
    parser.add_argument("--minibatches", type=int, default=8, help="minibatches to measure (median over them)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the envs and the minibatch order")
    parser.add_argument("--json", type=Path, help="write the medians here")
    ns = parser.parse_args(argv)
    from visppo.config import UserError
    from visppo.evaluate import load_policy, resolve_checkpoint

    if ns.minibatches < 1:
        print("error: --minibatches must be at least 1", file=sys.stderr)
        return 2
    try:
        policy, cfg, ckpt = load_policy(resolve_checkpoint(ns.source))
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    torch.manual_seed(ns.seed)
    policy.train()
    buffer = rollout(policy, cfg, ns.seed, ckpt.get("reward_scale"))
    medians = measure(policy, cfg, buffer, ns.minibatches, torch.Generator().manual_seed(ns.seed))
    value_label = "value term" + (" + entropy term" if cfg.ppo.entropy_coef else "")
    print(f"{ns.source}: step {ckpt.get('global_step')}, {min(ns.minibatches, buffer.size // cfg.ppo.minibatch_size)} "
          f"minibatches of {cfg.ppo.minibatch_size} (medians)\n")
    print(report(medians, value_label))
    if ns.json:
        ns.json.write_text(json.dumps({"source": str(ns.source), "global_step": ckpt.get("global_step"), **medians},
                                      indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
