"""Tree causal conv1d (megatron/shared_prefix/ssm/tree_conv.py) against its oracle and dense runs.

* Oracle: ``reference.tree_causal_conv1d_sequential`` walks every token's root path; float64, relative
  error (max|a - b| / max|b|) <= 1e-10 for the output and the gradients of x, weight and bias.
* Dense: each original sequence of the row run alone through an ordinary causal conv (F.conv1d with
  left zero padding); every packed token must equal its value in every sequence through it, and the
  gradient of a multiplicity-weighted loss must equal the dense one.
Forests: random (depth 1..4, skewed segment lengths, many one-token segments, so prompts and whole
paths shorter than the window), a hand-made chain of short segments, and a padded row.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from forest_rows import EXACT, SHORT_CHAIN, make_forest, rel_err

from megatron.shared_prefix.ssm import reference
from megatron.shared_prefix.ssm.tree_conv import tree_causal_conv1d


def conv_inputs(num_tokens, channels, width, *, dtype=torch.float64, bias=True, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return (
            torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype).requires_grad_()
        )

    return rand(1, num_tokens, channels), rand(channels, width), rand(channels) if bias else None


FORESTS = [
    pytest.param(dict(seed=1, depth=1), 1, id="depth-1"),
    pytest.param(dict(seed=2, depth=2), 1, id="depth-2"),
    pytest.param(dict(seed=3, depth=3, max_segment=3), 1, id="depth-3-short-segments"),
    pytest.param(dict(seed=4, depth=4), 8, id="depth-4-padded"),
    pytest.param(None, 1, id="short-chain"),
]
# (width, activation, bias) per forest of FORESTS for the oracle test.
CONV_OPTIONS = [
    (4, "silu", True),
    (2, None, True),
    (5, "swish", False),
    (4, None, True),
    (3, "silu", True),
]


def forest_of(spec, pad_multiple, forest_sequences):
    sequences = SHORT_CHAIN if spec is None else forest_sequences(**spec)
    return sequences, *make_forest(sequences, pad_multiple)


@pytest.mark.parametrize(
    "spec, pad_multiple, width, activation, bias",
    [
        pytest.param(*forest.values, *options, id=forest.id)
        for forest, options in zip(FORESTS, CONV_OPTIONS)
    ],
)
def test_tree_conv_matches_oracle(forest_sequences, spec, pad_multiple, width, activation, bias):
    _, layout, forest = forest_of(spec, pad_multiple, forest_sequences)
    x, weight, conv_bias = conv_inputs(layout.num_tokens, 6, width, bias=bias)
    leaves = [t for t in (x, weight, conv_bias) if t is not None]
    actual = tree_causal_conv1d(x, weight, conv_bias, forest, activation)
    expected = reference.tree_causal_conv1d_sequential(x, weight, conv_bias, layout, activation)
    assert actual.shape == x.shape and rel_err(actual, expected) <= EXACT
    probe = torch.randn(
        actual.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64
    )
    for got, want in zip(
        torch.autograd.grad((actual * probe).sum(), leaves),
        torch.autograd.grad((expected * probe).sum(), leaves),
    ):
        assert rel_err(got, want) <= EXACT


def dense_conv(x, weight, bias, activation):
    """x [L, d] -> [L, d]: the ordinary causal conv of one sequence (zeros before position 0)."""
    width = weight.shape[1]
    out = F.conv1d(x.T[None], weight[:, None], bias, padding=width - 1, groups=x.shape[1])[
        0, :, : x.shape[0]
    ].T
    return F.silu(out) if activation else out


@pytest.mark.parametrize("spec, pad_multiple", FORESTS)
@pytest.mark.parametrize(
    "dtype, tol", [(torch.float64, EXACT), (torch.float32, 1e-6)], ids=["fp64", "fp32"]
)
def test_tree_conv_matches_dense_sequences(forest_sequences, spec, pad_multiple, dtype, tol):
    """Every sequence's dense conv, read at its root path, equals the tree conv (values and gradients)."""
    _, layout, forest = forest_of(spec, pad_multiple, forest_sequences)
    x, weight, bias = conv_inputs(layout.num_tokens, 5, 4, dtype=dtype, seed=3)
    probe = torch.randn(
        1, layout.num_tokens, 5, generator=torch.Generator().manual_seed(1), dtype=dtype
    )
    multiplicity = torch.tensor(layout.token_multiplicity, dtype=dtype)[None, :, None]
    tree = tree_causal_conv1d(x, weight, bias, forest, "silu")
    tree_grads = torch.autograd.grad((tree * probe * multiplicity).sum(), (x, weight, bias))

    dense_loss = 0.0
    for k in range(len(layout.sequence_ids)):
        path = torch.as_tensor(layout.root_path(k))
        dense = dense_conv(x[0, path], weight, bias, "silu")
        assert rel_err(tree[0, path], dense) <= tol
        dense_loss = dense_loss + (dense * probe[0, path]).sum()
    dense_grads = torch.autograd.grad(dense_loss, (x, weight, bias))
    for got, want in zip(tree_grads, dense_grads):
        assert rel_err(got, want) <= tol


def test_only_segment_heads_are_recomputed(forest_sequences):
    """The fix-up covers exactly the first min(w - 1, len) tokens of each segment."""
    from megatron.shared_prefix.ssm.tree_conv import (
        _fixup_windows,  # pylint: disable=import-outside-toplevel
    )

    layout, forest = make_forest(forest_sequences(seed=5, depth=3))
    fixup = _fixup_windows(forest, 4)
    expected = np.concatenate(
        [np.arange(s, s + min(3, n)) for s, n in zip(layout.segment_starts, layout.segment_lengths)]
    )
    assert np.array_equal(fixup.tokens.numpy(), expected)
    assert torch.equal(fixup.windows[:, -1], fixup.tokens)
    assert torch.equal(fixup.skip.nonzero()[:, 0], fixup.tokens)
    # The Triton forward's taps: the w - 1 tokens before each token and itself, or its window.
    tokens = torch.arange(layout.num_tokens)
    expected_taps = tokens[:, None] - 3 + torch.arange(4)
    expected_taps[fixup.tokens] = fixup.windows
    assert fixup.tap_tokens.dtype == torch.int32
    assert torch.equal(fixup.tap_tokens.long(), expected_taps)
    # The present entries by the distinct token they read, in index order within a target: the
    # order the Triton backward adds their gradients in.
    entries = fixup.windows.reshape(-1)
    assert torch.equal(fixup.targets, entries[entries >= 0].unique())
    starts = fixup.target_starts.tolist()
    assert starts[0] == 0 and starts[-1] == int((entries >= 0).sum())
    for target, first, end in zip(fixup.targets.tolist(), starts, starts[1:]):
        expected_entries = (entries == target).nonzero()[:, 0]
        assert torch.equal(fixup.target_entries[first:end], expected_entries)
    assert fixup.max_target_entries == max(b - a for a, b in zip(starts, starts[1:]))
    assert fixup.max_target_entries > 1  # a parent's tail is read by several children
    assert forest.derive(("tree_conv_fixup", 4), lambda: None) is not None  # cached on the forest


def test_fixup_rewrites_exactly_the_fixed_tokens(forest_sequences):
    """The tree conv is the plain row conv everywhere but at the fixed tokens, where it is the
    oracle's root-path conv: the fix-up (shared by both backends) writes those rows and no other."""
    from megatron.shared_prefix.ssm.tree_conv import (  # pylint: disable=import-outside-toplevel
        _fixup_windows,
    )

    layout, forest = make_forest(forest_sequences(seed=6, depth=3, max_segment=3))
    x, weight, bias = conv_inputs(layout.num_tokens, 5, 4)
    out = tree_causal_conv1d(x, weight, bias, forest, "silu", backend="torch")[0].detach()
    row_conv = F.conv1d(x.transpose(1, 2), weight[:, None], bias, padding=3, groups=5)
    row_conv = F.silu(row_conv[0, :, : layout.num_tokens].T).detach()
    fixed = torch.zeros(layout.num_tokens, dtype=torch.bool)
    fixed[_fixup_windows(forest, 4).tokens] = True
    assert torch.equal(out[~fixed], row_conv[~fixed])
    expected = reference.tree_causal_conv1d_sequential(x, weight, bias, layout, "silu")[0]
    assert rel_err(out[fixed], expected[fixed]) <= EXACT
    assert not torch.allclose(row_conv[fixed], expected[fixed])  # the fix-up changed something


def test_fixup_writes_into_the_row_conv_output(monkeypatch):
    """The fix-up overwrites the segment heads in the row conv's own output (index_put_), not in a
    copy of it: the result is the buffer the row conv's activation returned."""
    layout, forest = make_forest(SHORT_CHAIN)
    x, weight, bias = conv_inputs(layout.num_tokens, 4, 4)
    activated = []
    silu = F.silu
    monkeypatch.setattr(F, "silu", lambda t: activated.append(silu(t)) or activated[-1])
    out = tree_causal_conv1d(x, weight, bias, forest, "silu", backend="torch")
    row_output = activated[0]  # the row conv's; the fix-up's own SiLU comes second
    assert row_output.shape == (layout.num_tokens, 4)
    assert out[0].data_ptr() == row_output.data_ptr()
    expected = reference.tree_causal_conv1d_sequential(x, weight, bias, layout, "silu")
    assert rel_err(out, expected) <= EXACT


def test_bf16_runs_in_input_dtype():
    layout, forest = make_forest(SHORT_CHAIN)
    x, weight, bias = conv_inputs(layout.num_tokens, 4, 4, dtype=torch.bfloat16)
    out = tree_causal_conv1d(x, weight, bias, forest, "silu")
    assert out.dtype == torch.bfloat16
    exact = tree_causal_conv1d(x.double(), weight.double(), bias.double(), forest, "silu")
    assert rel_err(out, exact) <= 2.0**-6  # a few bf16 roundings of inputs and output
    out.float().sum().backward()
    assert all(t.grad is not None for t in (x, weight, bias))


def test_rejects_bad_arguments():
    layout, forest = make_forest(SHORT_CHAIN)
    x, weight, bias = conv_inputs(layout.num_tokens, 4, 4)
    with pytest.raises(ValueError, match="activation"):
        tree_causal_conv1d(x, weight, bias, forest, "relu")
    with pytest.raises(ValueError, match="shape"):
        tree_causal_conv1d(x[:, 1:], weight, bias, forest)
    with pytest.raises(ValueError, match="weight"):
        tree_causal_conv1d(x, weight[1:], bias, forest)
    # [d, 1, w] weights (as megatron-core stores them) are accepted.
    assert torch.equal(
        tree_causal_conv1d(x, weight[:, None], bias, forest),
        tree_causal_conv1d(x, weight, bias, forest),
    )
