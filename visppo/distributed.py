"""Several processes, one policy: the ``torch.distributed`` plumbing behind ``torchrun``.

``torchrun --nproc_per_node=N -m visppo train ...`` starts N copies of the command with
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` and the rendezvous address in
their environment. :class:`Context` reads them. Without them (a plain ``visppo train``) the
world is one process and nothing here runs: no process group, no collectives.

Each rank collects its own rollout with its own envs and seeds and accumulates its
minibatch's gradient locally; then :func:`reduce_minibatch` averages the gradients, the
minibatch statistics (approx-KL for early stopping) and an out-of-memory flag over the ranks
in one all-reduce, so every rank steps, stops or backs off alike. The advantage mean and std
are all-reduced before (:func:`mean_std`); episode statistics are gathered for logging.
Not DistributedDataParallel: its all-reduce runs inside the last backward, where a rank that
ran out of memory could not take part, and the others would wait for it forever.
Apart from the error type, imports nothing of visppo.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from visppo.errors import ConfigError


@dataclass(frozen=True)
class Context:
    """This process's place in the run: its rank among ``world`` processes, and on its machine."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    local_world: int = 1

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Context:
        """Read torchrun's variables; a world of one when they are absent."""
        env = os.environ if env is None else env
        if "WORLD_SIZE" not in env:
            return cls()
        try:
            world = int(env["WORLD_SIZE"])
            rank = int(env.get("RANK", "0"))
            local_rank = int(env.get("LOCAL_RANK", str(rank)))
            local_world = int(env.get("LOCAL_WORLD_SIZE", str(world)))
        except ValueError:
            raise ConfigError("RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE must be whole numbers: "
                              "let torchrun set them") from None
        if world < 1 or not 0 <= rank < world or not 0 <= local_rank < local_world:
            raise ConfigError(f"RANK={rank} WORLD_SIZE={world} LOCAL_RANK={local_rank} "
                              f"LOCAL_WORLD_SIZE={local_world} do not fit together: let torchrun set them")
        return cls(rank, world, local_rank, local_world)

    @property
    def enabled(self) -> bool:
        """More than one process: a process group, DDP, all-reduced statistics."""
        return self.world > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that logs, writes checkpoints and videos."""
        return self.rank == 0

    def place(self, device: torch.device, key: str = "train.device") -> torch.device:
        """This rank's device: ``cuda`` becomes ``cuda:LOCAL_RANK`` (one GPU per process), or the current
        GPU's index when alone. Always an index: ``torch.device("cuda") != torch.device("cuda:0")``, so
        a run given ``cuda`` for one device and ``cuda:0`` for the other would take them for two GPUs
        (an acting copy of the policy and a recomputed ``logp_old`` on the same GPU)."""
        if device.type != "cuda":
            return device
        if not self.enabled:
            return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
        if device.index is not None:
            if self.local_world > 1:
                raise ConfigError(f"{key}={device} would put all {self.local_world} processes of this "
                                  f"machine on one GPU: use {key}=cuda (process r takes GPU LOCAL_RANK)")
            return device
        count = torch.cuda.device_count()
        if count < self.local_world:
            raise ConfigError(f"{key}=cuda needs one GPU per process: {self.local_world} processes on this "
                              f"machine but {count} GPU(s): use --nproc_per_node={count} or {key}=cpu")
        return torch.device("cuda", self.local_rank)


def rank_seed(seed: int, rank: int) -> int:
    """The seed of rank ``rank``'s random streams: ``seed`` itself on rank 0 (which then draws
    what a single process would), an independent one derived from it on the others."""
    if rank == 0:
        return seed
    return int(np.random.SeedSequence([seed, rank]).generate_state(1)[0])


def init(ctx: Context, device: torch.device, timeout: timedelta | None = None) -> bool:
    """Join the process group: NCCL when ``device`` is a GPU, gloo on CPUs. Returns True when
    this call created it (then :func:`destroy` it at the end), False when alone or already in one."""
    if not ctx.enabled or dist.is_initialized():
        return False
    kwargs: dict[str, Any] = {"rank": ctx.rank, "world_size": ctx.world}
    if timeout is not None:
        kwargs["timeout"] = timeout
    try:
        if device.type == "cuda":
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", device_id=device, **kwargs)
        else:
            dist.init_process_group("gloo", **kwargs)
    except ValueError as exc:  # env:// without MASTER_ADDR / MASTER_PORT
        raise ConfigError(f"cannot join the other processes ({str(exc).splitlines()[0][:160]}): "
                          "launch with torchrun, which sets the rendezvous address") from None
    return True


def destroy(clean: bool = True) -> None:
    """Leave the process group. After a clean run every rank first waits for the others (a
    barrier): none tears down its connections, and then exits, while a peer is still in the last
    collective or writing the final checkpoint. After an error the peers may be gone or stuck
    elsewhere, so a barrier could only hang: the group is dropped at once."""
    if not dist.is_initialized():
        return
    if clean:
        dist.barrier()
    dist.destroy_process_group()


def broadcast_parameters(module: nn.Module) -> None:
    """Rank 0's parameters and buffers on every rank (seeding makes them equal already; this makes
    it certain, e.g. after a nondeterministic initialisation)."""
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            moved = tensor.to(_comm_device())
            dist.broadcast(moved, src=0)
            tensor.copy_(moved)


def reduce_minibatch(params: list[nn.Parameter], stats: Mapping[str, torch.Tensor | float],
                     failed: bool) -> tuple[dict[str, float], bool]:
    """Average the minibatch's gradients and statistics over the ranks, and learn whether any rank
    ``failed`` (ran out of memory): all in one all-reduce of one flat buffer.

    The buffer has the same layout on every rank: every parameter's gradient (zeros where a rank
    has none), then the statistics (same keys, same order), then the failure flag. Gradients
    come back averaged into ``.grad`` where a rank has one (a frozen trunk keeps ``None``, so Adam
    does not move it), unless some rank failed: then the minibatch is redone by every rank.
    Like DistributedDataParallel's bucket, the buffer costs one copy of the gradients, and no more:
    :func:`_flat_buffer` writes each gradient straight into it.
    """
    keys = list(stats)
    flat = _flat_buffer(params, [float(stats[k]) for k in keys] + [float(failed)], _comm_device())
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    anyone_failed = bool(flat[-1] > 0)
    if not anyone_failed:
        offset = 0
        for p in params:
            n = p.numel()
            if p.grad is not None:
                p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
            offset += n
    means = dict(zip(keys, flat[-1 - len(keys):-1].tolist()))
    return means, anyone_failed


def _flat_buffer(params: list[nn.Parameter], tail: list[float], device: torch.device) -> torch.Tensor:
    """One preallocated fp32 buffer: every parameter's gradient flattened in order (zeros where it
    has none), then ``tail``. Each gradient is copied into its slice: flattening a gradient that is
    not contiguous (a channels_last convolution's) first would copy it, and a list of such copies
    alive while they are concatenated held about twice the buffer (more than the probe's
    ``allreduce_buffer`` line counts)."""
    total = sum(p.numel() for p in params)
    flat = torch.empty(total + len(tail), dtype=torch.float32, device=device)
    offset = 0
    for p in params:
        part = flat[offset:offset + p.numel()].view(p.shape)
        if p.grad is None:
            part.zero_()
        else:
            part.copy_(p.grad)
        offset += p.numel()
    flat[total:].copy_(torch.tensor(tail, dtype=torch.float32))
    return flat


def _comm_device() -> torch.device:
    """Where tensors for collectives must live: the current GPU with NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def mean_std(x: torch.Tensor) -> tuple[float, float, int]:
    """Mean, unbiased standard deviation and count of ``x`` over every rank's share of it:
    one all-reduce of (sum, sum of squares, count), in float64."""
    x = x.detach().to(_comm_device(), torch.float64)
    totals = torch.stack([x.sum(), (x * x).sum(), torch.tensor(float(x.numel()), dtype=torch.float64,
                                                                device=x.device)])
    dist.all_reduce(totals)
    total, squares, n = totals.tolist()
    mean = total / n if n else float("nan")
    var = max(squares - n * mean * mean, 0.0) / (n - 1) if n > 1 else float("nan")
    return mean, math.sqrt(var), int(n)


def all_gather(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order, on every rank."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
