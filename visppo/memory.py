"""Memory meters: how many bytes a step really needs, on CUDA and on the CPU.

A leaf module (torch and the standard library only), so ``builders``, ``ppo`` and
``probe`` can all use it. CUDA has allocator statistics; the CPU has none, so
:class:`LiveBytes` counts the bytes of the tensors that ops create while it is
active. That lets the memory-bounded update be measured (and tested) on a
machine without a GPU.
"""

from __future__ import annotations

import os
import sys
import threading
import weakref
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["LiveBytes", "peak_bytes", "cpu_allocator_peak", "is_oom", "format_bytes", "cuda_block_size",
           "largest_fitting"]


class LiveBytes(TorchDispatchMode):
    """Live bytes of the tensor storages created while the mode is active (any device).

    Every op output whose storage is new (not the storage of one of the op's
    inputs, nor one already counted) adds its ``nbytes()`` once; views, in-place
    ops and ``out=`` results share a storage and add nothing. The bytes are
    subtracted when the *storage* is freed, not when a Python tensor dies:
    autograd keeps the outputs it saves for backward through its own handle on
    the storage, and a view may outlive its base, so a per-tensor count would
    drop activations that are still in memory. torch keeps a storage's Python
    object alive as long as the C++ storage lives, so a ``weakref.finalize`` on
    it fires exactly when the memory goes back to the allocator.

    ``current`` and ``peak`` are bytes relative to the moment tracking started;
    ``reset_peak()`` restarts the peak from ``current``. Counting also covers
    ops that autograd runs in ``.backward()`` (the mode is thread-local state
    that the autograd engine carries to the threads it uses).

    Limits: only tensors created by ops under the mode count (not the ones that
    existed before, even if resized inside; not memory that bypasses the
    dispatcher, e.g. ``torch.from_numpy`` or a library's workspace); it counts
    storage bytes, not what the allocator really holds (rounding, caching,
    fragmentation; ``block_size`` can model the rounding), so on CUDA prefer the
    allocator's statistics (:func:`peak_bytes` does). Under ``FakeTensorMode``, make
    every tensor a fake of that mode (a real input gets a fake storage of its own
    at each conversion, so a view of it would count as new memory). Tracking costs Python work on every op: measure
    memory and time in separate runs.
    """

    def __init__(self, block_size: Callable[[int], int] | None = None) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self.block_size = block_size
        """Optional: the bytes an allocator really hands out for a request (its rounding); then
        ``blocks_current`` / ``blocks_peak`` follow those alongside the exact counts."""
        self.blocks_current = 0
        self.blocks_peak = 0
        self._sizes: dict[int, int] = {}  # storage identity -> bytes counted for it
        self._lock = threading.RLock()  # finalizers may run on another thread

    def reset_peak(self) -> None:
        """Start a new peak from the bytes live now (e.g. between phases of one step)."""
        with self._lock:
            self.peak = self.current
            self.blocks_peak = self.blocks_current

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {key for t in tree_leaves((args, kwargs)) if (key := _storage_key(t)) is not None}
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            self._track(t, inputs)
        return out

    def _track(self, t: Any, inputs: set[int]) -> None:
        if not isinstance(t, torch.Tensor):
            return
        try:
            storage = t.untyped_storage()
            key, nbytes = storage._cdata, storage.nbytes()
        except (RuntimeError, NotImplementedError, AttributeError):  # sparse, wrapper subclasses
            return
        with self._lock:
            if key in self._sizes:  # already counted: a view, an in-place op, or a resize
                self._sub(self._sizes[key])
                self._add(nbytes)
                self._sizes[key] = nbytes
                return
            if key in inputs or nbytes == 0:  # aliases a tensor from before tracking, or empty
                return
            self._sizes[key] = nbytes
            self._add(nbytes)
        weakref.finalize(storage, self._free, key).atexit = False

    def _add(self, nbytes: int) -> None:
        self.current += nbytes
        self.peak = max(self.peak, self.current)
        if self.block_size is not None:
            self.blocks_current += self.block_size(nbytes)
            self.blocks_peak = max(self.blocks_peak, self.blocks_current)

    def _sub(self, nbytes: int) -> None:
        self.current -= nbytes
        if self.block_size is not None:
            self.blocks_current -= self.block_size(nbytes)

    def _free(self, key: int) -> None:
        with self._lock:
            self._sub(self._sizes.pop(key, 0))


def _storage_key(t: Any) -> int | None:
    """Identity of a tensor's storage (the C++ StorageImpl address), stable while it lives."""
    if not isinstance(t, torch.Tensor):
        return None
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, AttributeError):
        return None


def peak_bytes(fn: Callable[[], Any], device: torch.device | str) -> int:
    """Peak bytes that ``fn()`` adds on ``device`` above what was allocated before it.

    CUDA: the caching allocator's own peak statistic (what a real GPU needs,
    including the allocator's rounding). Elsewhere: :class:`LiveBytes`, which
    counts the storages ``fn`` creates (see its limits).
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return max(0, torch.cuda.max_memory_allocated(device) - before)
    with LiveBytes() as meter:
        fn()
    return meter.peak


def cpu_allocator_peak(fn: Callable[[], Any]) -> tuple[int, Any]:
    """``(peak, fn())``: the most bytes the CPU allocator held during ``fn()`` beyond what it held
    before, from ``torch.profiler``'s allocation events (``profile_memory``).

    Unlike :class:`LiveBytes` this sees what kernels allocate and free inside one op (oneDNN's
    reordered weights and reduction buffers, im2col columns), which no dispatch mode can see.
    It cannot run inside another profiler, and starting one costs milliseconds: measure
    single ops, not whole steps.
    """
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _quiet_stderr():  # Kineto writes "USDT: ... profiler_start" to fd 2, whatever its log level
        prof.__enter__()
    try:
        out = fn()
    finally:
        with _quiet_stderr():
            prof.__exit__(None, None, None)
    events = sorted(((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU),
                    key=lambda event: event[0])  # stable: events of one instant keep their order
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak, out


@contextmanager
def _quiet_stderr():
    """File descriptor 2 to /dev/null for the block (C++ code's prints; Python's own stderr is flushed first)."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


CUDA_BLOCK_ROUND = 512
CUDA_LARGE_SEGMENT_ROUND = 2 * 2**20
CUDA_OWN_SEGMENT_ABOVE = 10 * 2**20


def cuda_block_size(nbytes: int) -> int:
    """Bytes PyTorch's CUDA caching allocator sets aside for a request of ``nbytes``.

    Every block is rounded up to a multiple of 512 B (what ``max_memory_allocated``
    counts). A request above 10 MiB gets a segment of its own from ``cudaMalloc``,
    rounded up to 2 MiB (what ``max_memory_reserved`` then holds for it); smaller
    ones are carved out of shared 2 MiB / 20 MiB segments, whose unused rest is
    fragmentation this model leaves to the probe's margin. Expandable segments
    (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``) round the same way.
    """
    size = -(-nbytes // CUDA_BLOCK_ROUND) * CUDA_BLOCK_ROUND
    if size > CUDA_OWN_SEGMENT_ABOVE:
        size = -(-size // CUDA_LARGE_SEGMENT_ROUND) * CUDA_LARGE_SEGMENT_ROUND
    return size


_OOM_MESSAGES = ("out of memory", "can't allocate memory",
                 "cudnn_status_alloc_failed", "cublas_status_alloc_failed")
"""Lower-case words of an allocation failure in a RuntimeError: torch's, the CPU allocator's, and
cuDNN's and cuBLAS's own statuses (near a full card they fail to allocate their workspace)."""


def is_oom(exc: BaseException) -> bool:
    """True when ``exc`` means an allocation failed, so a caller can back off to a smaller size.

    torch raises ``torch.OutOfMemoryError`` on CUDA, but a plain ``RuntimeError``
    for the CPU allocator ("DefaultCPUAllocator: can't allocate memory") and
    for some CUDA paths (cuDNN/cuBLAS "CUDA out of memory", or their ``*_STATUS_ALLOC_FAILED``); Python's own
    ``MemoryError`` counts too. Any other error is a bug and must propagate.
    """
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    if isinstance(exc, RuntimeError):
        msg = str(exc).lower()
        return any(m in msg for m in _OOM_MESSAGES)
    return False


_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(n: int) -> str:
    """Bytes for people, three significant digits: 512 B, 1.50 GiB, 12.0 MiB, 100 MiB."""
    sign = "-" if n < 0 else ""
    value = float(abs(n))
    unit = 0
    while round(value) >= 1024 and unit < len(_UNITS) - 1:  # 1023.7 KiB is 1.00 MiB, not "1024 KiB"
        value /= 1024
        unit += 1
    if unit == 0:
        return f"{sign}{int(value)} B"
    if round(value, 2) < 10:
        text = f"{value:.2f}"
    elif round(value, 1) < 100:
        text = f"{value:.1f}"
    else:
        text = f"{value:.0f}"
    return f"{sign}{text} {_UNITS[unit]}"


def largest_fitting(fits: Callable[[int], bool], limit: int, start: int = 1) -> tuple[int, list[int]]:
    """Largest size in ``[start, limit]`` with ``fits(size)``: double upward, then bisect.

    Assumes memory grows with size (fits is monotone). Returns ``(size, tried)``;
    size is 0 when even ``start`` does not fit. ``tried`` lists the sizes
    measured, in order, so callers can report every candidate.
    """
    tried: list[int] = []

    def check(n: int) -> bool:
        tried.append(n)
        return fits(n)

    if not check(start):
        return 0, tried
    good, bad = start, None
    while bad is None and good < limit:
        nxt = min(good * 2, limit)
        if check(nxt):
            good = nxt
        else:
            bad = nxt
    while bad is not None and bad - good > 1:
        mid = (good + bad) // 2
        if check(mid):
            good = mid
        else:
            bad = mid
    return good, tried
