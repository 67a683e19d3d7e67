"""Tests of the bitwise replay harness, above all that it catches nondeterminism.

A harness that passes everything would make every kernel replay test green for free, so each way a
run can differ (outputs, input gradients, parameter gradients, the inputs themselves, bit patterns
that compare equal as floats) has a negative control here that must fail.
"""

import itertools
import secrets

import pytest
import torch

from .replay import assert_bitwise_replay

try:
    import triton
    import triton.language as tl
except ImportError:  # the atomic-accumulation control then skips
    triton = None

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _random_order_sum(x):
    """Sum the last dimension of x in a fresh random order on every call.

    Float addition is not associative, so the rounding (and the bits) of each sum depend on the
    order. The permutation comes from the OS's entropy, not from torch's RNG, which the harness
    reseeds every run.
    """
    generator = torch.Generator().manual_seed(secrets.randbits(62))
    perm = torch.randperm(x.shape[-1], generator=generator).to(x.device)
    return x[..., perm].sum(-1)


def _mixed_magnitudes(*shape, device="cpu"):
    """Values over six orders of magnitude: another summation order almost surely rounds apart."""
    generator = torch.Generator().manual_seed(1234)
    exponents = 6 * torch.rand(*shape, generator=generator) - 3
    return (torch.randn(*shape, generator=generator) * 10**exponents).to(device)


class _RandomOrderBackward(torch.autograd.Function):
    """Identity forward; the backward scales by a random-order sum that is 1 in exact arithmetic.

    This is the shape of a real bug: a kernel whose forward reproduces but whose backward
    accumulates with atomics. Only the gradients differ between runs.
    """

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        terms = _mixed_magnitudes(grad.shape[-1], 512, device=grad.device)
        return grad * (_random_order_sum(terms) / terms.sum(-1))


class _RandomOrderScale(torch.nn.Module):
    """Multiplies by a weight whose gradient goes through _RandomOrderBackward."""

    def __init__(self, n):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(n))

    def forward(self, x):
        return x * _RandomOrderBackward.apply(self.weight)


def _random_input(n=64):
    return torch.randn(n, requires_grad=True)


# ---- positive controls: deterministic work must pass ---------------------------------------


def test_deterministic_forward_backward_passes_and_names_every_tensor():
    layer = torch.nn.Linear(16, 8)

    def fn(x, scale):
        hidden = torch.tanh(layer(x)) * scale
        return hidden.logsumexp(-1), (hidden.argmax(-1), hidden)

    def make_inputs():
        return torch.randn(4, 16, requires_grad=True), 2.0

    record = assert_bitwise_replay(fn, make_inputs, runs=3, module=layer)
    assert set(record) == {
        "input[0]",
        "output[0]",
        "output[1]",
        "output[2]",
        "grad of input[0]",
        "grad of param weight",
        "grad of param bias",
    }
    assert record["output[1]"].dtype == torch.int64


def test_deterministic_settings_are_on_inside_and_restored_after():
    before = torch.are_deterministic_algorithms_enabled()

    def fn(x):
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()
        return x * 2

    assert_bitwise_replay(fn, _random_input)
    assert torch.are_deterministic_algorithms_enabled() == before
    with pytest.raises(AssertionError):
        assert_bitwise_replay(_random_order_sum, lambda: _mixed_magnitudes(8, 256))
    assert torch.are_deterministic_algorithms_enabled() == before


def test_identical_nans_pass_and_unused_inputs_get_no_gradient():
    """Bitwise, NaN matches NaN of the same payload (torch.equal would call that a difference)."""

    def fn(x, unused):
        return x * float("nan")

    record = assert_bitwise_replay(fn, lambda: (_random_input(), _random_input()))
    assert record["output[0]"].isnan().all()
    assert record["grad of input[1]"] is None


def test_global_rng_stream_is_left_untouched():
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    assert_bitwise_replay(lambda x: x * 2, _random_input)
    assert torch.equal(torch.rand(3), expected)


def test_fewer_than_two_runs_is_an_error():
    with pytest.raises(ValueError, match="at least 2 runs"):
        assert_bitwise_replay(lambda x: x, _random_input, runs=1)


# ---- negative controls: nondeterminism must be detected -------------------------------------


def test_negative_control_random_order_sum_is_detected():
    expected = r"run 1 vs run 0, output\[0\]: \d+ of 64 elements differ"
    with pytest.raises(AssertionError, match=expected):
        assert_bitwise_replay(
            _random_order_sum, lambda: _mixed_magnitudes(64, 4096).requires_grad_()
        )


def test_negative_control_gradient_only_nondeterminism_names_the_input_gradient():
    with pytest.raises(AssertionError) as excinfo:
        assert_bitwise_replay(lambda x: _RandomOrderBackward.apply(x) * 2, _random_input)
    message = str(excinfo.value)
    assert "grad of input[0]" in message
    assert "output[0]" not in message


def test_negative_control_parameter_gradient_is_detected():
    module = _RandomOrderScale(64)
    with pytest.raises(AssertionError, match=r"grad of param weight: \d+ of 64 elements differ"):
        assert_bitwise_replay(module, lambda: torch.randn(64), module=module)


def test_signed_zero_difference_is_detected():
    """0.0 and -0.0 compare equal as floats, but not bitwise; a sign flip can surface later."""
    calls = itertools.count()

    def fn(x):
        return x * (0.0 if next(calls) == 0 else -0.0)

    with pytest.raises(AssertionError, match=r"output\[0\]: 16 of 16 elements differ"):
        assert_bitwise_replay(fn, lambda: torch.rand(16) + 1)


def test_nondeterministic_inputs_are_reported_as_such():
    def make_inputs():
        return torch.randn(8, generator=torch.Generator().manual_seed(secrets.randbits(62)))

    with pytest.raises(AssertionError, match="make_inputs is not deterministic"):
        assert_bitwise_replay(lambda x: x + 1, make_inputs)


# ---- GPU -------------------------------------------------------------------------------------


@pytest.mark.gpu
@requires_cuda
def test_gpu_deterministic_work_passes_under_concurrent_stream_work():
    calls = itertools.count()
    layer = torch.nn.Linear(256, 256, device="cuda", dtype=torch.bfloat16)

    def fn(x):
        next(calls)
        return torch.softmax(layer(x) @ x.transpose(0, 1), dim=-1)

    def make_inputs():
        return torch.randn(512, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    assert_bitwise_replay(fn, make_inputs, concurrent_stream_work=True, module=layer)
    assert next(calls) == 3, "concurrent_stream_work on CUDA must replay 3 times"


@pytest.mark.gpu
@requires_cuda
def test_gpu_negative_control_random_order_sum_is_detected():
    def make_inputs():
        return _mixed_magnitudes(64, 4096, device="cuda").requires_grad_()

    with pytest.raises(AssertionError, match=r"output\[0\]"):
        assert_bitwise_replay(_random_order_sum, make_inputs, concurrent_stream_work=True)


if triton is not None:

    @triton.jit
    def _atomic_bucket_sum_kernel(x_ptr, out_ptr, n, buckets, BLOCK: tl.constexpr):
        """Add every x[i] into out[i % buckets] with one float atomic each: heavy collisions."""
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        values = tl.load(x_ptr + offsets, mask=mask, other=0.0)
        tl.atomic_add(out_ptr + offsets % buckets, values, mask=mask)


def _atomic_bucket_sum(x, buckets=4):
    out = torch.zeros(buckets, device=x.device, dtype=x.dtype)
    n = x.numel()
    _atomic_bucket_sum_kernel[(triton.cdiv(n, 1024),)](x, out, n, buckets, BLOCK=1024)
    return out


@pytest.mark.gpu
@requires_cuda
@pytest.mark.skipif(triton is None, reason="needs triton, for atomics torch cannot serialize")
def test_gpu_negative_control_atomic_accumulation():
    """Float atomics from many blocks into few addresses land in scheduling order, which varies.

    torch's own index_add_ is no use here: under deterministic settings it switches to a sorted,
    reproducible path, which is the point of those settings. A Triton kernel cannot be switched.
    """
    x = _mixed_magnitudes(1 << 22, device="cuda")
    distinct = {tuple(_atomic_bucket_sum(x).view(torch.int32).tolist()) for _ in range(8)}
    if len(distinct) == 1:
        pytest.skip(
            "8 launches of the colliding float atomics gave identical bits: this GPU/driver "
            "ordered them the same way each time, so the control cannot show their detection"
        )
    with pytest.raises(AssertionError, match=r"output\[0\]"):
        assert_bitwise_replay(_atomic_bucket_sum, lambda: x, runs=8, concurrent_stream_work=True)
