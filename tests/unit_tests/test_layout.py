"""Tests of ForestLayout: derived fields, immutability, root paths and every check of validate()."""

import dataclasses
import pickle

import numpy as np
import pytest

from megatron.shared_prefix.layout import ForestLayout


def valid_fields():
    """A hand-built row: tree 56 -> {7, 89} with a sequence ending inside 89, a root [4], 2 padding.

    Sequences (row order): 0 = [5, 6, 7], 2 = [5, 6, 8], 1 = [5, 6, 8, 9], 3 = [4].
    """
    return dict(
        tokens=[5, 6, 7, 8, 9, 4, 0, 0],
        position_ids=[0, 1, 2, 2, 3, 0, 0, 1],
        segment_starts=[0, 2, 3, 5, 6],
        segment_lengths=[2, 1, 2, 1, 2],
        segment_parents=[-1, 0, 0, -1, -1],
        token_multiplicity=[3, 3, 1, 2, 1, 1, 0, 0],
        edge_source=[0, 1, 1, 0, 3],
        edge_target=[6, 7, 8, 6, 9],
        edge_sequence=[0, 0, 2, 1, 1],
        edge_position=[1, 2, 2, 1, 3],
        sequence_ids=[0, 2, 1, 3],
        sequence_last_index=[2, 3, 4, 5],
    )


def test_derived_fields_and_root_paths():
    layout = ForestLayout(**valid_fields())
    layout.validate()
    assert layout.num_tokens == 8 and layout.num_padding == 2
    assert layout.token_segment.tolist() == [0, 0, 1, 2, 2, 3, 4, 4]
    assert layout.segment_depth.tolist() == [0, 1, 1, 0, 0]
    assert layout.root_path(0).tolist() == [0, 1, 2]
    assert layout.root_path(1).tolist() == [0, 1, 3]
    assert layout.root_path(2).tolist() == [0, 1, 3, 4]
    assert layout.root_path(3).tolist() == [5]
    assert layout.tokens[layout.root_path(2)].tolist() == [5, 6, 8, 9]
    with pytest.raises(IndexError):
        layout.root_path(4)
    for name in ("tokens", "edge_source", "token_segment", "segment_depth"):
        value = getattr(layout, name)
        assert value.dtype == np.int64 and not value.flags.writeable
    assert "num_tokens=8" in repr(layout)


def test_pickled_layout_stays_read_only():
    """A layout planned in a data-loader worker crosses to the training process by pickling."""
    layout = ForestLayout(**valid_fields())
    copy = pickle.loads(pickle.dumps(layout))
    assert copy.num_tokens == layout.num_tokens and copy.num_padding == layout.num_padding
    for field in dataclasses.fields(ForestLayout):
        value, original = getattr(copy, field.name), getattr(layout, field.name)
        if isinstance(original, np.ndarray):
            np.testing.assert_array_equal(value, original)
            assert not value.flags.writeable, field.name
        else:
            assert value == original
    copy.validate()


def test_deep_chain_depths():
    """Pointer-jumping depths on a chain of single-token segments, siblings and two roots."""
    parents = [-1, 0, 1, 2, 3, 3, 5, -1, 7]
    depths = [0, 1, 2, 3, 4, 4, 5, 0, 1]
    fields = dict(
        tokens=[1] * 9,
        position_ids=depths,
        segment_starts=list(range(9)),
        segment_lengths=[1] * 9,
        segment_parents=parents,
        token_multiplicity=[1] * 9,
        edge_source=[],
        edge_target=[],
        edge_sequence=[],
        edge_position=[],
        sequence_ids=[],
        sequence_last_index=[],
    )
    assert ForestLayout(**fields).segment_depth.tolist() == depths


def test_no_padding():
    fields = valid_fields()
    for name in ("tokens", "position_ids", "token_multiplicity"):
        fields[name] = fields[name][:6]
    fields["segment_starts"], fields["segment_lengths"] = [0, 2, 3, 5], [2, 1, 2, 1]
    fields["segment_parents"] = [-1, 0, 0, -1]
    layout = ForestLayout(**fields)
    layout.validate()
    assert layout.num_padding == 0


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(tokens=[5, 6, 7]), "dimension T"),
        (dict(edge_target=[6, 7]), "dimension E"),
        (dict(segment_parents=[-1, 0, 2, -1, -1]), "segment_parents"),
        (dict(segment_parents=[-1, -2, 0, -1, -1]), "segment_parents"),
        (dict(segment_lengths=[2, 1, 2, 1, 3]), "segment_lengths"),
        (dict(tokens=np.zeros((2, 4), dtype=np.int64)), "1-D"),
        (dict(tokens=[5.0, 6, 7, 8, 9, 4, 0, 0]), "integers"),
    ],
)
def test_constructor_rejects_malformed_arrays(changes, match):
    with pytest.raises(ValueError, match=match):
        ForestLayout(**dict(valid_fields(), **changes))


@pytest.mark.parametrize(
    "changes, match",
    [
        # Segment 3 claims parent 1, which is not on the DFS path after segment 2.
        (
            dict(segment_parents=[-1, 0, 0, 1, -1], position_ids=[0, 1, 2, 2, 3, 3, 0, 1]),
            "DFS path",
        ),
        (dict(position_ids=[0, 1, 3, 2, 3, 0, 0, 1]), "segment 1: first position"),
        (dict(position_ids=[0, 1, 2, 2, 4, 0, 0, 1]), "increase by one"),
        (dict(token_multiplicity=[3, 3, 1, 1, 1, 1, 0, 0]), "token_multiplicity"),
        (dict(tokens=[5, 6, 7, 8, 9, 4, 1, 0]), "padding"),
        (dict(sequence_ids=[0, 2, 2, 3]), "distinct"),
        (dict(sequence_last_index=[2, 3, 4, 6]), "non-padding"),
        (dict(edge_source=[0, 1, 2, 0, 3]), "edge source"),
        (dict(edge_target=[6, 7, 8, 6, 8]), "edge target"),
        (dict(edge_sequence=[0, 0, 2, 1, 5]), "edge_sequence"),
        (
            dict(
                edge_source=[0, 1, 0, 3, 1],
                edge_target=[6, 7, 6, 9, 8],
                edge_sequence=[0, 0, 1, 1, 2],
                edge_position=[1, 2, 1, 3, 2],
            ),
            "ordered",
        ),
        (dict(edge_position=[1, 2, 2, 1, 4]), "edge position"),
    ],
)
def test_validate_names_the_broken_invariant(changes, match):
    layout = ForestLayout(**dict(valid_fields(), **changes))
    with pytest.raises(ValueError, match=match):
        layout.validate()
