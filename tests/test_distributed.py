"""Distributed training: two ranks (gloo, CPU) train one policy as one process would.

The update tests spawn two ranks that run the real ``ppo.update``, each on its
own rollout (different data, different minibatch order), and compare with one process that
updates over the two rollouts concatenated. The end-to-end test launches
``torchrun --nproc_per_node=2 -m visppo train`` and resumes it.
"""

from __future__ import annotations

import contextlib
import csv
import os
import shutil
import socket
import subprocess
import sys
from datetime import timedelta

import gymnasium as gym
import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from conftest import tiny_overrides, update_with
from torch import nn

import visppo.ppo as ppo_module
from visppo import distributed
from visppo.buffer import RolloutBuffer, minibatches
from visppo.config import ModelConfig, PPOConfig, load_config
from visppo.encoders import FreezeSchedule
from visppo.errors import ConfigError
from visppo.policy import ActorCritic

CPU = torch.device("cpu")
T, N = 8, 4  # each rank's rollout: 32 samples
MINIBATCH, MICRO = 12, 5  # per rank: minibatches of 12, 12, 8; micro-batches of 5, 5, 2 (and 5, 3)
PPO = dict(minibatch_size=MINIBATCH, num_epochs=2, clip_value=True, learning_rate=3e-3)
SCENARIOS = {
    # name: (PPOConfig overrides, ModelConfig overrides, freeze_encoder_updates)
    "micro": ({}, {}, 0),
    "freeze": ({}, {}, 2),  # the trunk thaws after the second of six optimizer steps
    # approx-KL of the minibatches: 7.5e-4, 1.8e-3 (1.5e-3 on rank 1 alone, then 0.7e-3, 2.9e-3):
    # the update stops after one step, on both ranks; a per-rank check would stop rank 1 first
    "target_kl": ({"target_kl": 8e-4}, {}, 0),
}
STEPS_PER_UPDATE = 6  # 2 epochs x 3 minibatches
BACKWARDS_PER_UPDATE = 16  # 2 epochs x (3 + 3 + 2) micro-batches


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spaces():
    obs = gym.spaces.Dict({"pixels": gym.spaces.Box(0, 255, (3, 48, 48), np.uint8)})
    return obs, gym.spaces.Box(-1, 1, (2,), np.float32)


def _policy(model_overrides: dict) -> ActorCritic:
    torch.manual_seed(0)  # the same initial policy on every rank and in the reference
    return ActorCritic(*_spaces(), ModelConfig(feature_dim=32, hidden_dim=32, **model_overrides))


def _fill(policy: ActorCritic, rank: int, update_index: int) -> RolloutBuffer:
    """Rank ``rank``'s rollout for its ``update_index``-th update: its own frames, advantages with
    a rank-dependent mean and scale, approx-KL higher on rank 1: per-rank statistics would differ."""
    buf = RolloutBuffer(T, N, *_spaces())
    g = torch.Generator().manual_seed(1000 * update_index + rank)
    buf.obs["pixels"].copy_(torch.randint(0, 256, buf.obs["pixels"].shape, generator=g, dtype=torch.uint8))
    torch.manual_seed(1000 * update_index + rank)  # the actions' draws, wherever this runs
    with torch.no_grad():
        action, logp, value = policy.act({k: buf.flat(v) for k, v in buf.obs.items()})
    buf.actions.copy_(action.view(buf.actions.shape))
    # rank 0's logp_old is the acting policy's (its approx-KL starts at 0), rank 1's is off by noise
    buf.logp.copy_(logp.view(T, N) + 0.05 * rank * torch.randn(T, N, generator=g))
    buf.values.copy_(value.view(T, N))
    buf.advantages.normal_(generator=g).mul_(1.0 + 2.0 * rank).add_(rank)
    buf.returns.copy_(buf.values + buf.advantages)
    return buf


def _concat(bufs: list[RolloutBuffer]) -> RolloutBuffer:
    """The ranks' rollouts side by side, ``[T, ranks * N]``: rank r's env n is env r * N + n."""
    out = RolloutBuffer(T, N * len(bufs), *_spaces())
    for name in ("actions", "logp", "values", "advantages", "returns"):
        getattr(out, name).copy_(torch.cat([getattr(b, name) for b in bufs], dim=1))
    out.obs["pixels"].copy_(torch.cat([b.obs["pixels"] for b in bufs], dim=1))
    return out


def _minibatch_seed(rank: int) -> int:
    return 100 + rank


def _setup(name: str):
    ppo_overrides, model_overrides, freeze_steps = SCENARIOS[name]
    policy = _policy(model_overrides)
    # eps 1e-3, above the gradients (a thawed trunk's are ~5e-5 here): Adam's step is then about
    # linear in the gradient, so a wrong average across ranks shows, where eps 1e-5 would divide it
    # away. With eps 1e-5 the trunk's first steps after thawing amplify float rounding ~lr/eps:
    # 1.5e-4 apart on an AVX-512 CPU (3e-8 with eps 1e-3); training's own eps is unchanged.
    optimizer = torch.optim.Adam(policy.parameters(), lr=PPO["learning_rate"], eps=1e-3)
    freeze = FreezeSchedule(policy.encoders(), freeze_steps, optimizer) if freeze_steps else None
    return policy, optimizer, freeze, PPOConfig(**PPO, **ppo_overrides)


# --------------------------------------------------------------------------- the two ranks


def _rank_worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    ctx = distributed.Context.from_env()
    assert distributed.init(ctx, CPU, timeout=timedelta(seconds=60))
    results = {}
    real_all_reduce = torch.distributed.all_reduce
    for name in SCENARIOS:
        policy, optimizer, freeze, cfg = _setup(name)
        counts = {"all_reduces": 0, "gradient_all_reduces": 0, "backwards": 0}

        def counting_all_reduce(tensor, *args, counts=counts, **kwargs):
            counts["all_reduces"] += 1
            counts["gradient_all_reduces"] += int(tensor.numel() > 1000)  # the flat gradient buffer
            return real_all_reduce(tensor, *args, **kwargs)

        def counting(method, counts=counts):
            def call(*args, **kwargs):
                counts["backwards"] += 1  # one forward per backward pass
                return method(*args, **kwargs)
            return call

        distributed.dist.all_reduce = counting_all_reduce
        policy.score_actions = counting(policy.score_actions)
        generator = torch.Generator().manual_seed(_minibatch_seed(rank))
        first = update_with(policy, optimizer, _fill(policy, rank, 0), cfg, MICRO, 1024,
                            generator, before_step=freeze, across_ranks=True)
        after_first = {k: v.clone() for k, v in policy.state_dict().items()}
        first_counts = dict(counts)
        for k in (1, 2):  # more updates on fresh rollouts
            update_with(policy, optimizer, _fill(policy, rank, k), cfg, MICRO, 1024,
                        generator, before_step=freeze, across_ranks=True)
        everyone = distributed.all_gather([p.detach().clone() for p in policy.parameters()])
        results[name] = {
            "params_after_first": after_first, "optimizer_steps": first.optimizer_steps,
            "early_stopped": first.early_stopped, "counts": first_counts,
            "identical": all(torch.equal(a, b) for a, b in zip(everyone[0], everyone[1])),
            "moved": any(not torch.equal(a, b) for a, b in zip(everyone[0], _policy(SCENARIOS[name][1]).parameters())),
        }
    if ctx.is_main:
        torch.save(results, out)
    distributed.destroy()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp") / "results.pt"
    mp.start_processes(_rank_worker, args=(2, _free_port(), str(out)), nprocs=2, start_method="spawn", join=True)
    return torch.load(out, weights_only=False)


def _one_process_update(name: str) -> tuple[ActorCritic, object]:
    """One process, one update over both ranks' rollouts side by side; each minibatch is the union
    of the ranks' minibatches (the ranks' own orders, replayed), in one backward (no micro-batches)."""
    policy, optimizer, freeze, cfg = _setup(name)
    bufs = [_fill(policy, rank, 0) for rank in range(2)]
    gens = [torch.Generator().manual_seed(_minibatch_seed(rank)) for rank in range(2)]

    def to_concat(index: torch.Tensor, rank: int) -> torch.Tensor:
        return index // N * (2 * N) + rank * N + index % N

    def union_of_ranks(size, minibatch_size, generator):
        per_rank = [minibatches(T * N, MINIBATCH, g) for g in gens]
        return [torch.cat([to_concat(mb, r) for r, mb in enumerate(mbs)]) for mbs in zip(*per_rank)]

    ppo_module.minibatches = union_of_ranks  # in the reference's own process, which ends after it
    cfg.minibatch_size = 2 * MINIBATCH
    result = update_with(policy, optimizer, _concat(bufs), cfg, cfg.minibatch_size, 1024,
                    torch.Generator(), before_step=freeze)
    return policy, result


def _reference_worker(_index: int, out: str) -> None:
    """The one-process reference, in a fresh process with the ranks' thread count: the comparison
    is then of the maths alone, not of state an earlier test left in the pytest process or of
    kernels that a different thread count picks."""
    torch.set_num_threads(1)
    results = {}
    for name in SCENARIOS:
        policy, result = _one_process_update(name)
        results[name] = {"params": policy.state_dict(), "optimizer_steps": result.optimizer_steps,
                         "early_stopped": result.early_stopped}
    torch.save(results, out)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference") / "results.pt"
    mp.start_processes(_reference_worker, args=(str(out),), nprocs=1, start_method="spawn", join=True)
    return torch.load(out, weights_only=False)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_one_update_of_two_ranks_equals_one_process_over_the_concatenated_rollouts(two_ranks, one_process, name):
    """Same parameters (fp32) after one update: gradient averaged over the ranks, advantages
    normalised and approx-KL checked over the minibatch of both, micro-batches accumulated."""
    ranks, result = two_ranks[name], one_process[name]
    assert ranks["optimizer_steps"] == result["optimizer_steps"]
    assert ranks["early_stopped"] == result["early_stopped"]
    for key, value in result["params"].items():
        torch.testing.assert_close(ranks["params_after_first"][key], value, rtol=1e-4, atol=1e-6, msg=key)
    if name == "target_kl":  # the stop happened within the update, on both ranks at once
        assert result["early_stopped"] and 0 < result["optimizer_steps"] < STEPS_PER_UPDATE
    else:
        assert result["optimizer_steps"] == STEPS_PER_UPDATE


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_parameters_are_identical_on_both_ranks_after_several_updates(two_ranks, name):
    assert two_ranks[name]["moved"], "the updates did train"
    assert two_ranks[name]["identical"]


@pytest.mark.timeout(300)
def test_two_all_reduces_per_optimizer_step(two_ranks):
    """Micro-batches accumulate locally: the gradients of the 16 backward passes of an update are
    all-reduced 6 times, once per optimizer step, together with the minibatch statistics and the
    out-of-memory flag; the advantage mean and std are the only other all-reduce."""
    for name in ("micro", "freeze"):
        counts = two_ranks[name]["counts"]
        assert counts["backwards"] == BACKWARDS_PER_UPDATE, name
        assert counts["gradient_all_reduces"] == STEPS_PER_UPDATE, (name, counts)
        assert counts["all_reduces"] == 2 * STEPS_PER_UPDATE, (name, counts)
    stopped = two_ranks["target_kl"]  # the minibatch that stops the update was reduced, not stepped
    assert stopped["counts"]["gradient_all_reduces"] == stopped["optimizer_steps"] + 1


# --------------------------------------------------------------------------- torchrun, end to end

# episodes of 16 steps, rollouts of 32: every iteration starts on fresh episodes (exact resume)
EXACT = {"env.max_episode_steps": 16, "ppo.total_steps": 384, "run.checkpoint_every": 1,
         "train.deterministic": "true", "ppo.minibatch_size": 24, "memory.micro_batch_size": 10,
         "run.tensorboard": "true", "ppo.norm_reward": "true"}


def _torchrun(args: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "visppo", "train", *args]
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}  # a rank that crashes prints its Python stacks
    return subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)


def _failure(res: subprocess.CompletedProcess) -> str:
    """What the ranks printed: the end of stdout, and stderr without torchrun's own summary (which
    follows the ranks' messages and would push them out of a short tail)."""
    stderr, _, launcher = res.stderr.rpartition("Traceback (most recent call last):")
    if "ChildFailedError" not in launcher:  # the last traceback is a rank's: keep it
        stderr, launcher = res.stderr, ""
    cause = launcher.rpartition("Root Cause")[2][-600:]  # which rank failed first, and its exit code
    return (f"exit {res.returncode}\n--- stdout\n{res.stdout[-2000:]}\n--- stderr\n{stderr[-6000:]}"
            f"\n--- root cause\n{cause}")


@pytest.mark.timeout(900)
def test_torchrun_two_processes_rank_0_writes_and_the_run_resumes_exactly(tmp_path):
    full = tmp_path / "run"
    res = _torchrun(tiny_overrides(tmp_path, **EXACT))
    assert res.returncode == 0, _failure(res)
    assert res.stdout.count("visppo: run directory") == 1 and res.stdout.count("run finished") == 1
    assert "2 processes" in res.stdout
    rows = list(csv.DictReader((full / "metrics.csv").open()))
    assert [int(r["global_step"]) for r in rows] == [128, 256, 384]  # 2 ranks x 2 envs x 32 steps
    assert [int(r["episodes"]) for r in rows] == [8, 8, 8]  # both ranks' episodes: 2 per env
    assert sorted(p.name for p in full.iterdir() if not p.name.startswith("events")) == [
        ".lock", "checkpoints", "config.yaml", "metrics.csv"]  # .lock: rank 0 held the run-dir lock
    assert len(list(full.glob("events.out.tfevents.*"))) == 1  # one writer: rank 0
    ckpt = torch.load(full / "checkpoints" / "latest.pt", weights_only=True)
    assert ckpt["world_size"] == 2 and len(ckpt["ranks"]) == 2
    assert not torch.equal(ckpt["ranks"][0]["rng"]["torch"], ckpt["ranks"][1]["rng"]["torch"])
    # ppo.norm_reward: one reward scale for all ranks, from every rank's returns (2 x 64 per iteration)
    scales = [r["reward_scale"] for r in ckpt["ranks"]]
    assert scales[0]["count"] == scales[1]["count"] == pytest.approx(384, abs=1e-3)
    assert (scales[0]["mean"], scales[0]["var"]) == (scales[1]["mean"], scales[1]["var"])

    cut = tmp_path / "cut"  # the same run as if it had stopped after iteration 2
    shutil.copytree(full, cut)
    shutil.copy(cut / "checkpoints" / "iter_000002.pt", cut / "checkpoints" / "latest.pt")
    (cut / "checkpoints" / "iter_000003.pt").unlink()
    res = _torchrun(["--resume", str(cut)])
    assert res.returncode == 0, _failure(res)
    assert res.stdout.count("visppo: resuming") == 1
    resumed = torch.load(cut / "checkpoints" / "latest.pt", weights_only=True)
    assert resumed["global_step"] == 384
    for key, value in ckpt["model"].items():  # each rank resumed its own envs, RNGs, minibatch order
        assert torch.equal(resumed["model"][key], value), key
    assert [int(r["global_step"]) for r in csv.DictReader((cut / "metrics.csv").open())] == [128, 256, 384]

    res = subprocess.run([sys.executable, "-m", "visppo", "train", "--resume", str(cut), "ppo.total_steps=512"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and res.stderr.startswith("error: this run was trained by 2 process(es), not 1")


# --------------------------------------------------------------------------- one process, devices


@pytest.mark.parametrize("clean", [True, False])
def test_leaving_the_group_waits_for_the_other_ranks_only_after_a_clean_run(clean, monkeypatch):
    """A rank that finished must not tear down its connections while a peer still uses them; one
    that failed must not wait for peers that may never come (the barrier would hang)."""
    calls = []
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "barrier", lambda: calls.append("barrier"))
    monkeypatch.setattr(torch.distributed, "destroy_process_group", lambda: calls.append("destroy"))
    distributed.destroy(clean=clean)
    assert calls == (["barrier", "destroy"] if clean else ["destroy"])


@pytest.mark.parametrize("fails", [False, True])
def test_a_run_leaves_its_group_cleanly_only_when_it_did_not_fail(fails, tmp_path, monkeypatch):
    import visppo.loop as train_module

    left = []
    monkeypatch.setattr(distributed, "init", lambda ctx, device, timeout=None: True)  # "joined"
    monkeypatch.setattr(distributed, "destroy", lambda clean=True: left.append(clean))
    if fails:
        def broken(*args, **kwargs):
            raise RuntimeError("a rank failed while building its run")

        monkeypatch.setattr(train_module, "build_run", broken)
    with pytest.raises(RuntimeError) if fails else contextlib.nullcontext():
        train_module.train(load_config(None, tiny_overrides(tmp_path, **{"ppo.total_steps": 64})))
    assert left == [not fails]


def test_one_process_makes_no_process_group_and_no_collectives(tmp_path, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)

    def refuse(*args, **kwargs):
        raise AssertionError("one process needs no process group and no collectives")

    monkeypatch.setattr(torch.distributed, "init_process_group", refuse)
    monkeypatch.setattr(distributed, "reduce_minibatch", refuse)
    monkeypatch.setattr(distributed, "mean_std", refuse)
    from visppo.loop import train

    train(load_config(None, tiny_overrides(tmp_path)))
    assert distributed.Context.from_env() == distributed.Context(0, 1, 0, 1)
    assert not torch.distributed.is_initialized()


def test_alone_cuda_is_the_current_gpu_by_index_so_cuda_and_cuda0_are_one_device(monkeypatch):
    """train.device=auto (cuda) with rollout.device=cuda:0 is one GPU: no acting copy, no second pass."""
    from visppo.config import TrainConfig
    from visppo.precision import for_run

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    alone = distributed.Context(0, 1, 0, 1)
    train_on, act_on = alone.place(torch.device("cuda")), alone.place(torch.device("cuda", 0))
    assert train_on == act_on == torch.device("cuda", 0)
    assert alone.place(torch.device("cuda", 1)) == torch.device("cuda", 1) and alone.place(CPU) == CPU
    precision = for_run(TrainConfig(amp="bf16"), train_on, act_on)
    assert precision.acting is precision.update and not precision.recompute_logp_old


def test_each_local_process_takes_its_own_gpu_or_the_input_is_refused(tmp_path, monkeypatch, capsys):
    from visppo.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    ctx = distributed.Context(rank=3, world=4, local_rank=1, local_world=2)  # second machine's second
    assert ctx.place(torch.device("cuda")) == torch.device("cuda", 1)
    assert ctx.place(CPU) == CPU
    with pytest.raises(ConfigError, match="train.device=cuda:0 would put all 2 processes"):
        ctx.place(torch.device("cuda", 0))

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["train", *tiny_overrides(tmp_path, **{"train.device": "cuda"})]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: train.device=cuda needs one GPU per process: 2 processes on this machine "
                          "but 1 GPU(s)") and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")  # the same input: reported once per machine, by local rank 0
    assert main(["train", *tiny_overrides(tmp_path, **{"train.device": "cuda"})]) == 2
    assert capsys.readouterr().err == ""


def test_rank_seeds_differ_and_rank_0_keeps_the_seed():
    seeds = [distributed.rank_seed(7, r) for r in range(4)]
    assert seeds[0] == 7 and len(set(seeds)) == 4
    with pytest.raises(ConfigError, match="do not fit together"):
        distributed.Context.from_env({"WORLD_SIZE": "2", "RANK": "2"})


def _fake_collectives(monkeypatch, world: int = 2) -> list[torch.Tensor]:
    """The collectives of one process that pretends to be one of ``world``: ``all_reduce`` sums
    nothing and keeps what it is handed (the caller then divides it by ``world`` in place)."""
    handed: list[torch.Tensor] = []
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda t, *a, **k: handed.append(t))
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a: world)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda *a: "gloo")
    return handed


def test_the_all_reduce_buffer_is_one_flat_copy_of_channels_last_gradients(monkeypatch):
    """Convolution gradients in channels_last do not flatten into a view: copied one by one and
    then concatenated, they held twice the flat buffer at the peak. Written straight into one
    preallocated buffer, the peak is that buffer (what the probe's allreduce_buffer line counts), its
    content is every gradient flattened in order (zeros for none), then the statistics and the flag;
    the average comes back in each gradient's own layout."""
    from visppo.memory import LiveBytes

    convs = [nn.Conv2d(64, 64, 3).to(memory_format=torch.channels_last) for _ in range(3)]
    params = [p for conv in convs for p in conv.parameters()]
    frozen = nn.Parameter(torch.ones(5))  # a parameter with no gradient on this rank
    params.insert(1, frozen)
    g = torch.Generator().manual_seed(0)
    for p in params:
        if p is not frozen:
            p.grad = torch.empty_like(p).copy_(torch.randn(p.shape, generator=g))
    before = [None if p.grad is None else p.grad.clone() for p in params]
    expected = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
                         + [torch.tensor([1.5, -2.0, 0.0])])
    handed = _fake_collectives(monkeypatch)
    with LiveBytes() as meter:
        means, failed = distributed.reduce_minibatch(params, {"a": 1.5, "b": torch.tensor(-2.0)}, failed=False)
    flat_bytes = 4 * (sum(p.numel() for p in params) + 3)
    assert meter.peak <= flat_bytes + 1024, (meter.peak, flat_bytes)
    assert len(handed) == 1 and torch.equal(handed[0] * 2, expected)
    assert means == {"a": 0.75, "b": -1.0} and not failed
    assert frozen.grad is None
    for p, old in zip(params, before):
        if old is not None:
            assert torch.equal(p.grad, old / 2) and p.grad.stride() == old.stride()
