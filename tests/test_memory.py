"""visppo.memory: the CPU live-bytes meter counts what is really live, OOM detection, formatting."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from visppo.memory import LiveBytes, format_bytes, is_oom, peak_bytes

MIB = 2**20


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# --------------------------------------------------------------------------- LiveBytes


def test_known_allocation_is_counted_exactly_and_freed():
    with LiveBytes() as meter:
        x = torch.empty(256, 1024)  # 1 MiB of float32
        assert meter.current == MIB
        y = torch.zeros(1000, dtype=torch.uint8)
        assert meter.current == MIB + 1000
        del x
        assert meter.current == 1000
        del y
    assert meter.current == 0
    assert meter.peak == MIB + 1000


def test_tensors_from_before_tracking_are_not_counted():
    x = torch.randn(1000)
    with LiveBytes() as meter:
        v = x[10:]
        x.mul_(2)
        w = x.view(10, 100).t()
    assert meter.peak == 0
    del v, w


def test_views_add_nothing_and_keep_their_base_alive():
    with LiveBytes() as meter:
        x = torch.randn(100, 50)
        size = nbytes(x)
        views = [x[1:], x.view(-1), x.t(), x.reshape(50, 100), x.unsqueeze(0), x[:, ::2]]
        assert meter.current == meter.peak == size
        del x  # the views still hold the storage
        assert meter.current == size
        views.pop(0)
        assert meter.current == size
        del views
        assert meter.current == 0
    assert meter.peak == size


def test_in_place_ops_add_nothing():
    with LiveBytes() as meter:
        x = torch.randn(1000)
        x.add_(1).mul_(2).relu_().clamp_(max=3)
        x[:10] = 0.0
        torch.add(x, 1.0, out=x)
        assert meter.current == meter.peak == nbytes(x)


def test_a_freed_temporary_counts_in_peak_but_not_in_current():
    x = torch.randn(1000, 100)
    with LiveBytes() as meter:
        total = (x * 2).sum()  # x * 2 is freed once the sum is taken
    assert meter.current == nbytes(total)
    assert meter.peak == nbytes(x) + nbytes(total)


def test_reset_peak_starts_from_current():
    with LiveBytes() as meter:
        keep = torch.empty(1000)
        tmp = torch.empty(5000)
        del tmp
        assert meter.peak == 24000
        meter.reset_peak()
        assert meter.peak == meter.current == 4000
        torch.empty(100)  # dies at once
        assert meter.peak == 4400
    del keep


def test_backward_counts_gradients():
    torch.manual_seed(0)
    model = nn.Linear(64, 32)
    x = torch.randn(16, 64)
    with LiveBytes() as meter:
        loss = model(x).sum()
        loss.backward()
        del loss
    params = nbytes(*model.parameters())
    assert all(p.grad is not None for p in model.parameters())
    # What stays live is exactly the fresh gradients (graph and loss are gone).
    assert meter.current == nbytes(*(p.grad for p in model.parameters())) == params
    assert meter.peak >= params
    model.zero_grad(set_to_none=True)
    assert meter.current == 0


def test_activations_saved_for_backward_stay_counted():
    """The graph keeps an output alive after its Python tensor dies: the count must follow the storage."""
    a = torch.randn(1000, requires_grad=True)
    with LiveBytes() as meter:
        y = a.exp()  # exp saves its output for backward
        z = y.sum()
        del y
        assert meter.current == nbytes(a) + nbytes(z)
        del z  # frees the graph and with it the saved output
        assert meter.current == 0


def test_peak_bytes_on_cpu():
    x = torch.randn(1000, 100)

    def fn() -> None:
        y = x * 2
        (y + 1).sum()

    assert peak_bytes(fn, "cpu") == 2 * nbytes(x) + 4


@pytest.mark.cuda
def test_peak_bytes_on_cuda():
    keep = torch.empty(MIB, device="cuda")  # allocated before: not part of the peak

    def fn() -> None:
        torch.empty(4 * MIB, dtype=torch.uint8, device="cuda")

    assert peak_bytes(fn, "cuda") == 4 * MIB
    del keep


# --------------------------------------------------------------------------- is_oom


def test_is_oom_recognises_allocation_failures():
    assert is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_oom(RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 7.8 GiB total)"))
    assert is_oom(RuntimeError("cuDNN error: out of memory"))
    assert is_oom(RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"))  # training backs off, as for an OOM
    assert is_oom(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"))
    assert is_oom(MemoryError())
    try:
        torch.empty(2**62, dtype=torch.uint8)  # fails at once: no address space that large
    except Exception as exc:  # the real CPU allocator message
        assert is_oom(exc), str(exc)
    else:
        pytest.fail("a 4 EiB allocation succeeded")


def test_is_oom_rejects_other_errors():
    assert not is_oom(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x3)"))
    assert not is_oom(ValueError("out of memory"))  # not an allocator error
    assert not is_oom(KeyboardInterrupt())
    assert not is_oom(TypeError("bad argument"))


# --------------------------------------------------------------------------- format_bytes


@pytest.mark.parametrize("n, text", [
    (0, "0 B"), (512, "512 B"), (1023, "1023 B"), (1024, "1.00 KiB"), (1536, "1.50 KiB"),
    (12 * MIB, "12.0 MiB"), (100 * MIB, "100 MiB"), (int(1.5 * 2**30), "1.50 GiB"),
    (8 * 2**30, "8.00 GiB"), (-3 * MIB, "-3.00 MiB"), (5 * 2**40, "5.00 TiB"),
    (MIB - 1, "1.00 MiB"), (2**30 - 300, "1.00 GiB"),  # rounded up to the next unit, not "1024 KiB"
])
def test_format_bytes(n, text):
    assert format_bytes(n) == text


def test_largest_fitting_doubles_then_bisects():
    from visppo.memory import largest_fitting

    size, tried = largest_fitting(lambda n: n * 3 <= 100, limit=1000)
    assert size == 33
    assert tried[:7] == [1, 2, 4, 8, 16, 32, 64] and all(t in range(32, 65) for t in tried[7:])
    assert largest_fitting(lambda n: True, limit=40) == (40, [1, 2, 4, 8, 16, 32, 40])
    assert largest_fitting(lambda n: False, limit=40) == (0, [1])


def test_block_size_counts_the_allocators_rounded_blocks_alongside():
    from visppo.memory import cuda_block_size

    with LiveBytes(cuda_block_size) as meter:
        x = torch.empty(100, dtype=torch.uint8)
        y = torch.empty(11 * MIB, dtype=torch.uint8)
        assert (meter.current, meter.blocks_current) == (100 + 11 * MIB, 512 + 12 * MIB)
        del x, y
    assert meter.blocks_current == 0 and meter.blocks_peak == 512 + 12 * MIB
