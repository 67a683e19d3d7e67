"""Tests of the dense tree-attention allow-mask oracle against root paths of planned rows."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron.shared_prefix.attention.reference import tree_attention_allow_mask
from megatron.shared_prefix.planning import plan_shared_prefix


def path_to_token(layout, token):
    """Packed indices from the root of ``token``'s tree down to ``token`` itself."""
    seg = int(layout.token_segment[token])
    parts = [np.arange(layout.segment_starts[seg], token + 1)]
    seg = int(layout.segment_parents[seg])
    while seg >= 0:
        start = int(layout.segment_starts[seg])
        parts.append(np.arange(start, start + int(layout.segment_lengths[seg])))
        seg = int(layout.segment_parents[seg])
    return np.concatenate(parts)


def test_grpo_mask():
    # prompt [5, 6] -> completions [1, 2] and [3]; 1 token of padding with pad_multiple=2.
    plan = plan_shared_prefix([[5, 6, 1, 2], [5, 6, 3]], capacity=8, pad_multiple=2)
    (row,) = plan.rows
    assert row.tokens.tolist() == [5, 6, 1, 2, 3, 0]
    expected = np.array(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [1, 1, 1, 1, 0, 0],
            [1, 1, 0, 0, 1, 0],  # the second completion does not see the first
            [0, 0, 0, 0, 0, 1],  # padding attends to itself only
        ],
        dtype=bool,
    )
    np.testing.assert_array_equal(tree_attention_allow_mask(row), expected)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=6), min_size=1, max_size=6),
    st.integers(1, 3),
)
def test_mask_is_causal_attention_along_root_paths(sequences, pad_multiple):
    capacity = pad_multiple * sum(len(s) for s in sequences)
    for row in plan_shared_prefix(sequences, capacity=capacity, pad_multiple=pad_multiple).rows:
        mask = tree_attention_allow_mask(row)
        assert mask.shape == (row.num_tokens, row.num_tokens) and mask.dtype == bool
        for token in range(row.num_tokens):
            expected = np.zeros(row.num_tokens, dtype=bool)
            expected[path_to_token(row, token)] = True
            np.testing.assert_array_equal(mask[token], expected)
        # Every sequence sees exactly its own prefix: the dense causal mask along its root path.
        for k in range(len(row.sequence_ids)):
            path = row.root_path(k)
            np.testing.assert_array_equal(
                mask[np.ix_(path, path)], np.tril(np.ones((len(path),) * 2, bool))
            )


def test_expand_row_gives_back_every_sequence():
    from megatron.shared_prefix.attention.reference import expand_row
    from megatron.shared_prefix.planning import plan_shared_prefix

    sequences = [[5, 6, 7, 8], [5, 6, 9], [5, 6, 7, 8], [1, 2], [5, 6, 7]]
    plan = plan_shared_prefix(sequences, capacity=64, pad_multiple=4)
    expanded = {}
    for row in plan.rows:
        expanded.update(expand_row(row))
    assert sorted(expanded) == list(range(len(sequences)))
    for index, (tokens, positions) in expanded.items():
        assert tokens.tolist() == sequences[index]
        assert positions.tolist() == list(range(len(sequences[index])))
