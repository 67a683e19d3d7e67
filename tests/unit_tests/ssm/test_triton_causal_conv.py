"""Triton causal conv1d of a packed row (ssm/triton_causal_conv.py) and the tree conv that runs it.

* Row conv against a float64 ``F.conv1d`` (left zero padding, ``groups = channels``) and SiLU on
  the same inputs: output and the gradients of x, weight and bias, on strided token-major inputs
  (a slice of a wider tensor, as Mamba's xBC is of the projection), widths 1-4, with and without
  bias and SiLU, row lengths that are not multiples of the backward's token ranges.
* Tree conv with ``backend="triton"`` (the row conv and the fix-up as one autograd node) against
  the sequential oracle (``reference.tree_causal_conv1d_sequential``) on a forest whose windows
  cross segment boundaries, widths 2-4, with and without bias and SiLU.
* A TreeMambaMixer with ``tree_conv_backend="triton"`` against the same mixer on "torch": output
  and every gradient.
* CPU: Triton's interpreter (TRITON_INTERPRET=1 must be set before triton compiles anything, hence
  a subprocess running this file), float32: the bound is float32 rounding.
* GPU (marked ``gpu``): compiled kernels, float32 and bf16, against the torch backend's tree conv.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from triton_interpreter import run_interpreted

from megatron.shared_prefix.planning import plan_shared_prefix
from megatron.shared_prefix.ssm import reference
from megatron.shared_prefix.ssm.tree_conv import tree_causal_conv1d
from megatron.shared_prefix.ssm.triton_causal_conv import BACKWARD_TOKENS, MAX_WIDTH
from megatron.shared_prefix.tensors import ForestTensors

FP32_TOLERANCE = 1e-6
# (tokens, channels, width, silu, bias): rows of more than one backward program (each walks
# BACKWARD_TOKENS tokens and the w - 1 after them), channel tails, every width up to MAX_WIDTH.
ROW_CASES = [
    (2 * BACKWARD_TOKENS + 45, 37, 4, True, True),
    (BACKWARD_TOKENS + 2, 130, 4, False, True),
    (5, 9, 3, True, False),
    (BACKWARD_TOKENS + 7, 16, 2, True, True),
    (50, 20, 3, False, False),
    (40, 8, 1, True, True),
]
# (width, silu, bias) of the tree conv cases: the fix-up and its backward at every width that
# has one, each with and without the SiLU and the bias.
TREE_CASES = [(4, True, True), (4, False, False), (3, True, False), (2, False, True)]


def rel_err(actual, expected):
    actual, expected = actual.detach().double(), expected.detach().double()
    return float((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30))


def dense_conv(x, weight, bias, silu):
    """[T, C] -> [T, C]: PyTorch's causal depthwise conv of one row, then SiLU."""
    tokens, channels = x.shape
    out = F.conv1d(x.T[None], weight[:, None], bias, padding=weight.shape[1] - 1, groups=channels)
    out = out[0, :, :tokens].T
    return F.silu(out) if silu else out


def row_errors(tokens, channels, width, silu, bias, device, dtype):
    """Relative errors of the Triton row conv (output, dx, dweight[, dbias]) against float64."""
    from megatron.shared_prefix.ssm.triton_causal_conv import row_causal_conv1d

    generator = torch.Generator().manual_seed(tokens * 31 + width)

    def rand(*shape):
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    x = rand(tokens, channels + 7)[:, 3 : 3 + channels].requires_grad_()  # token stride C + 7
    weight = rand(channels, width).requires_grad_()
    conv_bias = rand(channels).requires_grad_() if bias else None
    leaves = [t for t in (x, weight, conv_bias) if t is not None]
    probe = rand(tokens, channels)
    out = row_causal_conv1d(x, weight, conv_bias, silu)
    assert out.shape == (tokens, channels) and out.dtype == dtype and out.is_contiguous()
    grads = torch.autograd.grad((out.float() * probe.float()).sum(), leaves)
    exact = [t.detach().double().requires_grad_() for t in leaves]
    expected = dense_conv(exact[0], exact[1], exact[2] if bias else None, silu)
    expected_grads = torch.autograd.grad((expected * probe.double()).sum(), exact)
    return [rel_err(out, expected)] + [rel_err(a, e) for a, e in zip(grads, expected_grads)]


def crossing_forest(device):
    """Depth 3: one-token and two-token segments (windows reaching into the grandparent), a long
    root, a second root, and padding."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(1, 50, 90).tolist()
    sequences = [prompt + rng.integers(1, 50, n).tolist() for n in (1, 2, 70)]
    sequences += [prompt + [7] + rng.integers(1, 50, n).tolist() for n in (1, 40)]
    sequences += [prompt[:10] + [3], [5, 6]]
    layout = plan_shared_prefix(sequences, capacity=1024, pad_multiple=8).rows[0]
    return layout, ForestTensors.from_layout(layout, device)


def tree_errors(device, dtype, expected_backend, width=4, silu=True, bias=True):
    """Relative errors (output, dx, dweight[, dbias]) of the tree conv on the Triton backend
    against ``expected_backend`` ("oracle": the float64 sequential reference; "torch": the torch
    backend, same dtype)."""
    layout, forest = crossing_forest(device)
    generator = torch.Generator().manual_seed(5 + width)
    channels, activation = 24, "silu" if silu else None

    def rand(*shape):
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    x = rand(1, layout.num_tokens, channels + 5)[..., 2 : 2 + channels].requires_grad_()
    weight = rand(channels, 1, width).requires_grad_()
    conv_bias = rand(channels).requires_grad_() if bias else None
    inputs = [x, weight, conv_bias]
    leaves = [t for t in inputs if t is not None]
    probe = rand(1, layout.num_tokens, channels).float()
    out = tree_causal_conv1d(*inputs, forest, activation, backend="triton")
    grads = torch.autograd.grad((out.float() * probe).sum(), leaves)
    copy = torch.float64 if expected_backend == "oracle" else dtype
    expected_inputs = [None if t is None else t.detach().to(copy).requires_grad_() for t in inputs]
    expected_leaves = [t for t in expected_inputs if t is not None]
    if expected_backend == "oracle":
        expected_inputs[1] = expected_inputs[1].reshape(channels, width)
        expected = reference.tree_causal_conv1d_sequential(*expected_inputs, layout, activation)
        probe = probe.double()
    else:
        expected = tree_causal_conv1d(*expected_inputs, forest, activation, backend="torch")
    expected_grads = torch.autograd.grad((expected.to(probe.dtype) * probe).sum(), expected_leaves)
    return [rel_err(out, expected)] + [rel_err(a, e) for a, e in zip(grads, expected_grads)]


def mixer_errors():
    """Relative errors of a TreeMambaMixer with ``tree_conv_backend="triton"`` against the same
    mixer with "torch" (float32, CPU: the torch scan), on the crossing forest: the output, the input
    gradient and every parameter gradient."""
    from test_mamba_mixer import build_mixer

    from megatron.shared_prefix.ssm import triton_causal_conv
    from megatron.shared_prefix.tensors import forest_scope
    from megatron.shared_prefix.training.distributed import init_single_process

    init_single_process("cpu")
    mixer = build_mixer(chunk_size=16, hidden_size=32, heads=4, state=8, dtype=torch.float32)
    layout, forest = crossing_forest("cpu")
    generator = torch.Generator().manual_seed(9)
    hidden = torch.randn(layout.num_tokens, 1, 32, generator=generator).requires_grad_()
    probe = torch.randn(layout.num_tokens, 1, 32, generator=generator)
    leaves = [hidden, *mixer.parameters()]
    # Count the Triton row conv's forward launches (tree_conv.py looks it up at each call).
    calls = []
    row_forward = triton_causal_conv.forward_rows
    triton_causal_conv.forward_rows = lambda *args, **kwargs: (
        calls.append(1),
        row_forward(*args, **kwargs),
    )[1]
    results = {}
    for backend, expected_calls in (("torch", 0), ("triton", 1)):
        mixer.tree_conv_backend = backend
        with forest_scope(forest):
            out = mixer(hidden)[0]
        grads = torch.autograd.grad((out * probe).sum(), leaves, allow_unused=True)
        results[backend] = [out, *(g for g in grads if g is not None)]
        assert len(calls) == expected_calls, (backend, len(calls))
    assert len(results["triton"]) == len(leaves) + 1  # every parameter reached
    return [rel_err(a, b) for a, b in zip(results["triton"], results["torch"])]


def tap_table_gives_the_row_conv_bits(device, dtype) -> None:
    """``forward_rows`` with the tap table of a plain row (each token's w - 1 predecessors and
    itself, -1 before the row) writes the bits of the row conv without a table; a table that
    moves a token's taps (a segment head's window elsewhere) changes that token alone."""
    from megatron.shared_prefix.ssm.triton_causal_conv import forward_rows

    generator = torch.Generator().manual_seed(11)
    tokens, channels, width = BACKWARD_TOKENS + 9, 37, 4
    x = torch.randn(tokens, channels + 3, generator=generator).to(device=device, dtype=dtype)
    x = x[:, 1 : 1 + channels]  # a strided row, as xBC is
    weight = torch.randn(channels, width, generator=generator).to(device=device, dtype=dtype)
    bias = torch.randn(channels, generator=generator).to(device=device, dtype=dtype)
    taps = torch.arange(tokens)[:, None] - (width - 1) + torch.arange(width)
    taps = taps.clamp(min=-1).to(device=device, dtype=torch.int32)
    plain = forward_rows(x, weight, bias, True)
    assert torch.equal(forward_rows(x, weight, bias, True, tap_tokens=taps), plain)
    moved = taps.clone()
    moved[50] = torch.tensor([-1, 3, 9, 50], dtype=torch.int32)
    out = forward_rows(x, weight, bias, True, tap_tokens=moved)
    changed = (out != plain).any(dim=1).nonzero()[:, 0].tolist()
    assert changed == [50], changed
    window = x[[3, 9, 50]].float() * weight[:, 1:].float().T
    expected = F.silu(bias.float() + window.sum(0))
    assert rel_err(out[50], expected) <= (1e-5 if dtype == torch.float32 else 1e-2)


def interpreted_checks():
    """Run in the TRITON_INTERPRET=1 subprocess: every row case, the tree conv and a mixer on
    each backend, float32."""
    for case in ROW_CASES:
        errors = row_errors(*case, "cpu", torch.float32)
        assert max(errors) <= FP32_TOLERANCE, (case, errors)
    for case in TREE_CASES:
        errors = tree_errors("cpu", torch.float32, "oracle", *case)
        assert max(errors) <= FP32_TOLERANCE, (case, errors)
    errors = mixer_errors()
    assert max(errors) <= FP32_TOLERANCE, errors
    tap_table_gives_the_row_conv_bits("cpu", torch.float32)
    print("interpreted row conv, tree conv and mixer within", FP32_TOLERANCE)


def test_interpreted_kernels_match_dense_conv_and_oracle():
    pytest.importorskip("triton")
    assert "interpreted row conv, tree conv and mixer within" in run_interpreted(__file__)


def test_rejects_bad_inputs_before_launching():
    from megatron.shared_prefix.ssm.triton_causal_conv import row_causal_conv1d

    x, weight = torch.randn(8, 6), torch.randn(6, 4)
    with pytest.raises(ValueError, match="unit channel stride"):
        row_causal_conv1d(x.T, weight)
    with pytest.raises(ValueError, match="weight must be"):
        row_causal_conv1d(x, weight[1:])
    with pytest.raises(ValueError, match=f"w <= {MAX_WIDTH}"):
        row_causal_conv1d(x, torch.randn(6, MAX_WIDTH + 1))
    with pytest.raises(ValueError, match="bias must be"):
        row_causal_conv1d(x, weight, torch.randn(5))
    with pytest.raises(ValueError, match="dtype"):
        row_causal_conv1d(x.double(), weight.double())
    from megatron.shared_prefix.ssm.triton_causal_conv import forward_rows

    for taps in (torch.zeros(8, 4, dtype=torch.int64), torch.zeros(8, 3, dtype=torch.int32)):
        with pytest.raises(ValueError, match="tap_tokens must be int32 \\[8, 4\\]"):
            forward_rows(x, weight, None, True, tap_tokens=taps)
    _, forest = crossing_forest("cpu")
    with pytest.raises(ValueError, match="backend"):
        tree_causal_conv1d(torch.randn(1, forest.num_tokens, 6), weight, None, forest, None, "cuda")


def test_rows_past_int32_offsets_are_refused_or_left_to_torch():
    """The kernels index in int32: the largest offset of a [T, C] row (T - 1) * stride + C - 1
    must fit. Such rows are refused by the kernel, and "auto" leaves them, and convs wider than
    MAX_WIDTH, to PyTorch's conv."""
    from megatron.shared_prefix.ssm import tree_conv
    from megatron.shared_prefix.ssm.triton_causal_conv import MAX_OFFSET, offsets_fit

    stride, channels = 10304, 6144  # hidden 2048: the projection's width and xBC's channels
    longest = (MAX_OFFSET - channels) // stride + 1
    assert offsets_fit(longest, stride, channels)
    assert not offsets_fit(longest + 1, stride, channels)
    assert offsets_fit(MAX_OFFSET // channels, 1, channels)  # contiguous outputs use C

    class Row:  # the attributes _use_triton reads of a CUDA tensor, without allocating one
        is_cuda, dtype, shape = True, torch.bfloat16, (1, longest, channels)

        def stride(self, dim):
            return (longest * stride, stride, 1)[dim]

    row = Row()
    assert tree_conv._use_triton(row, 4, "auto")
    assert not tree_conv._use_triton(row, MAX_WIDTH + 1, "auto")  # wider convs: PyTorch's
    row.shape = (1, longest + 1, channels)
    assert not tree_conv._use_triton(row, 4, "auto")
    assert tree_conv._use_triton(row, 4, "triton") and not tree_conv._use_triton(row, 4, "torch")
    with pytest.raises(ValueError, match="int32 offsets"):
        from megatron.shared_prefix.ssm.triton_causal_conv import row_causal_conv1d

        x = torch.empty_strided((longest + 1, channels), (stride, 1), device="meta")
        row_causal_conv1d(x, torch.empty(channels, 4, device="meta"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"]
)
def test_compiled_kernels_match_torch_backend(dtype, tolerance):
    """On CUDA the Triton tree conv equals the torch backend's to rounding (bf16: a few output
    roundings: the torch backend rounds the conv before the SiLU, Triton once after it), and the
    row conv equals float64 PyTorch."""
    for case in TREE_CASES:
        errors = tree_errors("cuda", dtype, "torch", *case)
        assert max(errors) <= tolerance, (case, errors)
    for case in ROW_CASES:
        errors = row_errors(*case, "cuda", dtype)
        assert max(errors) <= tolerance, (case, errors)
    tap_table_gives_the_row_conv_bits("cuda", dtype)


if __name__ == "__main__":  # run by test_interpreted_kernels_match_dense_conv_and_oracle
    interpreted_checks()
