"""Tests of plan_shared_prefix: trie, loss edges, packing, canonical order, errors, unpacking."""

import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from megatron.shared_prefix.layout import ForestLayout
from megatron.shared_prefix.planning import SharedPrefixPlan, plan_shared_prefix

SETTINGS = settings(max_examples=120, deadline=None)


# --------------------------------------------------------------------------------------------------
# Oracles
# --------------------------------------------------------------------------------------------------


def dense_masks(sequences, loss_masks):
    if loss_masks is None:
        return [np.arange(len(s)) >= 1 for s in sequences]
    return [np.asarray(m, dtype=bool) for m in loss_masks]


def share_limit(mask, share_supervised):
    """Leading tokens a sequence may share: all, or those before its first edge source."""
    targets = np.flatnonzero(mask)
    return len(mask) if share_supervised or len(targets) == 0 else int(targets[0]) - 1


def expected_unique_tokens(sequences, masks, ids, share_supervised):
    """Unique tokens of the minimal trie of sequences ``ids`` under the sharing rule."""
    keys = set()
    for i in ids:
        seq = list(sequences[i])
        limit = share_limit(masks[i], share_supervised)
        for p in range(len(seq)):
            keys.add(("shared", tuple(seq[: p + 1])) if p < limit else ("own", i, p))
    return len(keys)


def check_plan(plan, sequences, loss_masks, *, capacity, share_supervised=True, pad_multiple=1):
    """Every property the planner promises, checked against the dense batch."""
    masks = dense_masks(sequences, loss_masks)
    assert isinstance(plan, SharedPrefixPlan)
    placed = []
    for row in plan.rows:
        assert isinstance(row, ForestLayout)
        row.validate()
        assert row.num_tokens <= capacity
        assert row.num_tokens % pad_multiple == 0 and row.num_padding < pad_multiple
        real = row.num_tokens - row.num_padding
        ids = row.sequence_ids.tolist()
        assert real == expected_unique_tokens(sequences, masks, ids, share_supervised)
        paths = []
        for k, sid in enumerate(ids):
            seq = np.asarray(sequences[sid])
            path = row.root_path(k)
            paths.append(path)
            np.testing.assert_array_equal(row.tokens[path], seq)
            np.testing.assert_array_equal(row.position_ids[path], np.arange(len(seq)))
            assert row.sequence_last_index[k] == path[-1]
            sel = row.edge_sequence == sid
            j = np.flatnonzero(masks[sid])
            np.testing.assert_array_equal(row.edge_position[sel], j)
            np.testing.assert_array_equal(row.edge_source[sel], path[j - 1])
            np.testing.assert_array_equal(row.edge_target[sel], seq[j])
        counts = np.bincount(np.concatenate(paths), minlength=row.num_tokens)
        np.testing.assert_array_equal(row.token_multiplicity, counts)
        # DFS layout: parents first, subtrees contiguous (validate() checks the full invariant).
        assert np.all(row.segment_parents < np.arange(len(row.segment_parents)))
        if not share_supervised:
            pairs = set(zip(row.edge_source.tolist(), row.edge_sequence.tolist()))
            sources = [src for src, _ in pairs]
            assert len(sources) == len(set(sources)), "a token is the edge source of two sequences"
        placed.extend(ids)
    assert sorted(placed) == list(range(len(sequences))), "every sequence is placed exactly once"
    assert plan.logical_tokens == sum(len(s) for s in sequences)
    assert plan.executed_tokens == sum(row.num_tokens for row in plan.rows)
    assert plan.loss_tokens == sum(int(m.sum()) for m in masks)
    assert plan.sequences_without_targets == tuple(i for i, m in enumerate(masks) if not m.any())


ROW_ARRAYS = (
    "tokens",
    "position_ids",
    "segment_starts",
    "segment_lengths",
    "segment_parents",
    "token_multiplicity",
    "edge_source",
    "edge_target",
    "edge_position",
    "sequence_last_index",
)


def assert_same_rows(plan_a, plan_b, names=ROW_ARRAYS):
    assert len(plan_a.rows) == len(plan_b.rows)
    for row_a, row_b in zip(plan_a.rows, plan_b.rows):
        for name in names:
            np.testing.assert_array_equal(getattr(row_a, name), getattr(row_b, name), err_msg=name)


# --------------------------------------------------------------------------------------------------
# Strategies
# --------------------------------------------------------------------------------------------------


@st.composite
def batches(draw, max_sequences=10):
    """Sequences over a tiny alphabet, many built by extending a prefix of an earlier one.

    This yields deep tries, single-token segments, identical duplicates and sequences that are
    prefixes of others. Returns (sequences, loss_masks or None, capacity, pad_multiple,
    share_supervised).
    """
    n = draw(st.integers(1, max_sequences))
    sequences = []
    for _ in range(n):
        prefix = []
        if sequences and draw(st.booleans()):
            base = draw(st.sampled_from(sequences))
            prefix = base[: draw(st.integers(0, len(base)))]
        tail = draw(st.lists(st.integers(0, 3), min_size=0 if prefix else 1, max_size=6))
        sequences.append(prefix + tail)
    loss_masks = None
    if draw(st.booleans()):
        loss_masks = [
            [False] + draw(st.lists(st.booleans(), min_size=len(s) - 1, max_size=len(s) - 1))
            for s in sequences
        ]
    pad_multiple = draw(st.integers(1, 3))
    longest = max(len(s) for s in sequences)
    smallest = math.ceil(longest / pad_multiple) * pad_multiple
    capacity = draw(st.integers(smallest, max(smallest, sum(len(s) for s in sequences) + 3)))
    return sequences, loss_masks, capacity, pad_multiple, draw(st.booleans())


@st.composite
def forests(draw):
    """A random forest of depth 1..4 with distinct first tokens among siblings.

    Returns (sequences, ends, num_children): ends[i] is the node (tuple of child indices from the
    top) where sequence i ends; num_children maps every node, and the top (), to its number of
    children. Leaves always end a sequence, inner nodes sometimes; some sequences are duplicated.
    """
    depth = draw(st.integers(1, 4))
    sequences, ends, num_children = [], [], {}

    def grow(node, prefix):
        if node == ():
            count = draw(st.integers(1, 3))
        else:
            count = draw(st.integers(0, 3)) if len(node) < depth else 0
        firsts = draw(st.lists(st.integers(0, 5), min_size=count, max_size=count, unique=True))
        num_children[node] = count
        for c, first in enumerate(firsts):
            child = node + (c,)
            tokens = prefix + [first] + draw(st.lists(st.integers(0, 5), max_size=3))
            grow(child, tokens)
            copies = draw(st.integers(1 if num_children[child] == 0 else 0, 2))
            sequences.extend([tokens] * copies)
            ends.extend([child] * copies)

    grow((), [])
    return sequences, ends, num_children


# --------------------------------------------------------------------------------------------------
# Properties
# --------------------------------------------------------------------------------------------------


@SETTINGS
@given(batches())
def test_random_batches(case):
    sequences, loss_masks, capacity, pad_multiple, share_supervised = case
    plan = plan_shared_prefix(
        sequences,
        loss_masks,
        capacity=capacity,
        share_supervised=share_supervised,
        pad_multiple=pad_multiple,
    )
    check_plan(
        plan,
        sequences,
        loss_masks,
        capacity=capacity,
        share_supervised=share_supervised,
        pad_multiple=pad_multiple,
    )


@SETTINGS
@given(batches(), st.randoms(use_true_random=False))
def test_deterministic_and_permutation_invariant(case, rnd):
    sequences, loss_masks, capacity, pad_multiple, share_supervised = case
    kwargs = dict(capacity=capacity, share_supervised=share_supervised, pad_multiple=pad_multiple)
    plan = plan_shared_prefix(sequences, loss_masks, **kwargs)
    again = plan_shared_prefix(sequences, loss_masks, **kwargs)
    assert_same_rows(plan, again, ROW_ARRAYS + ("sequence_ids", "edge_sequence"))

    perm = list(range(len(sequences)))
    rnd.shuffle(perm)
    shuffled = [sequences[i] for i in perm]
    shuffled_masks = None if loss_masks is None else [loss_masks[i] for i in perm]
    permuted = plan_shared_prefix(shuffled, shuffled_masks, **kwargs)
    assert_same_rows(plan, permuted)
    masks = dense_masks(sequences, loss_masks)
    for row, row_p in zip(plan.rows, permuted.rows):
        for sid, sid_p in zip(row.sequence_ids.tolist(), row_p.sequence_ids.tolist()):
            # Only sequence ids differ: the slot holds an identical sequence and mask.
            assert list(sequences[sid]) == list(sequences[perm[sid_p]])
            np.testing.assert_array_equal(masks[sid], masks[perm[sid_p]])


def canonical_key(sequence, mask, share_supervised):
    """The documented sort key: tokens + 1, a 0 separator at the share limit, then the mask."""
    limit = share_limit(mask, share_supervised)
    tokens = tuple(t + 1 for t in sequence[:limit])
    if limit < len(sequence):
        tokens += (0,) + tuple(t + 1 for t in sequence[limit:])
    return tokens, tuple(bool(x) for x in mask)


@SETTINGS
@given(batches())
def test_rows_are_first_fit_decreasing_of_trees(case):
    """Without splits, rows are FFD of whole trees ordered by (size desc, smallest sort key)."""
    sequences, loss_masks, capacity, pad_multiple, share_supervised = case
    masks = dense_masks(sequences, loss_masks)
    n = len(sequences)
    tree = list(range(n))  # union-find over "may share a first token"

    def root(i):
        while tree[i] != i:
            i = tree[i]
        return i

    for i in range(n):
        for j in range(i):
            if min(
                share_limit(masks[i], share_supervised), share_limit(masks[j], share_supervised)
            ):
                if sequences[i][0] == sequences[j][0]:
                    tree[root(i)] = root(j)
    members = {}
    for i in range(n):
        members.setdefault(root(i), []).append(i)
    budget = capacity // pad_multiple * pad_multiple
    trees = []
    for ids in members.values():
        cost = expected_unique_tokens(sequences, masks, ids, share_supervised)
        first = min(canonical_key(sequences[i], masks[i], share_supervised) for i in ids)
        trees.append((-cost, first, sorted(ids)))
    assume(all(-cost <= budget for cost, _, _ in trees))
    rows, used = [], []
    for cost, _, ids in sorted(trees):
        row = next((r for r in range(len(rows)) if used[r] - cost <= budget), len(rows))
        if row == len(rows):
            rows.append([])
            used.append(0)
        rows[row] += ids
        used[row] -= cost

    plan = plan_shared_prefix(
        sequences,
        loss_masks,
        capacity=capacity,
        share_supervised=share_supervised,
        pad_multiple=pad_multiple,
    )
    assert [sorted(row.sequence_ids.tolist()) for row in plan.rows] == [sorted(r) for r in rows]


@settings(max_examples=80, deadline=None)
@given(forests())
def test_random_forests_compress_to_expected_segments(forest):
    sequences, ends, num_children = forest
    total = sum(len(s) for s in sequences)
    plan = plan_shared_prefix(sequences, capacity=total)
    check_plan(plan, sequences, None, capacity=total)
    assert len(plan.rows) == 1
    row = plan.rows[0]

    def starts_segment(node):  # a root, or a child of a branch point
        return len(node) == 1 or num_children[node[:-1]] >= 2

    nodes = [node for node in num_children if node != ()]
    assert len(row.segment_starts) == sum(starts_segment(node) for node in nodes)
    for k, sid in enumerate(row.sequence_ids.tolist()):
        node = ends[sid]
        expected = sum(starts_segment(node[:d]) for d in range(1, len(node) + 1))
        assert len(np.unique(row.token_segment[row.root_path(k)])) == expected
        assert row.segment_depth[row.token_segment[row.sequence_last_index[k]]] == expected - 1

    # Small rows force splits; every invariant still holds.
    longest = max(len(s) for s in sequences)
    small = plan_shared_prefix(sequences, capacity=longest + 1)
    check_plan(small, sequences, None, capacity=longest + 1)


# --------------------------------------------------------------------------------------------------
# Hand cases
# --------------------------------------------------------------------------------------------------


def test_grpo_group_shares_prompt():
    prompt = [5, 6, 7, 8]
    completions = [[1, 2], [1, 3], [4]]
    sequences = [prompt + c for c in completions]
    masks = [[False] * 4 + [True] * len(c) for c in completions]
    plan = plan_shared_prefix(sequences, masks, capacity=64)
    check_plan(plan, sequences, masks, capacity=64)
    (row,) = plan.rows
    # Trie: prompt -> {1 -> {2, 3}, 4}, children in token order.
    assert row.tokens.tolist() == [5, 6, 7, 8, 1, 2, 3, 4]
    assert row.position_ids.tolist() == [0, 1, 2, 3, 4, 5, 5, 4]
    assert row.segment_starts.tolist() == [0, 4, 5, 6, 7]
    assert row.segment_parents.tolist() == [-1, 0, 1, 1, 0]
    assert row.segment_depth.tolist() == [0, 1, 2, 2, 1]
    assert row.token_multiplicity.tolist() == [3, 3, 3, 3, 2, 1, 1, 1]
    assert row.sequence_ids.tolist() == [0, 1, 2]
    assert row.edge_source.tolist() == [3, 4, 3, 4, 3]
    assert row.edge_target.tolist() == [1, 2, 1, 3, 4]
    assert row.edge_position.tolist() == [4, 5, 4, 5, 4]
    assert (plan.logical_tokens, plan.executed_tokens, plan.loss_tokens) == (17, 8, 5)


def test_share_supervised_false_stops_before_first_edge_source():
    prompt = [5, 6, 7, 8]
    sequences = [prompt + [1, 2], prompt + [1, 3]]
    masks = [[False] * 4 + [True, True]] * 2
    plan = plan_shared_prefix(sequences, masks, capacity=64, share_supervised=False)
    check_plan(plan, sequences, masks, capacity=64, share_supervised=False)
    (row,) = plan.rows
    # Positions 0..2 shared; position 3 (the first edge source) and beyond are per sequence.
    assert row.tokens.tolist() == [5, 6, 7, 8, 1, 2, 8, 1, 3]
    assert row.token_multiplicity.tolist() == [2, 2, 2, 1, 1, 1, 1, 1, 1]
    shared = plan_shared_prefix(sequences, masks, capacity=64)
    assert shared.executed_tokens == 7


def test_duplicates_share_path_and_keep_own_edges():
    sequences = [[1, 2, 3], [1, 2, 3]]
    masks = [[False, True, True], [False, False, True]]
    plan = plan_shared_prefix(sequences, masks, capacity=8)
    check_plan(plan, sequences, masks, capacity=8)
    (row,) = plan.rows
    assert row.tokens.tolist() == [1, 2, 3]
    assert row.token_multiplicity.tolist() == [2, 2, 2]
    assert row.sequence_last_index.tolist() == [2, 2]
    # Masks break the tie canonically: the mask [F, F, T] sorts first.
    assert row.sequence_ids.tolist() == [1, 0]
    assert row.edge_sequence.tolist() == [1, 0, 0]
    assert row.edge_source.tolist() == [1, 0, 1]


def test_sequence_that_is_a_prefix_ends_inside_a_segment():
    sequences = [[1, 2, 3, 4], [1, 2]]
    plan = plan_shared_prefix(sequences, capacity=8)
    check_plan(plan, sequences, None, capacity=8)
    (row,) = plan.rows
    assert row.segment_starts.tolist() == [0]  # unbranched: one segment
    assert row.sequence_ids.tolist() == [1, 0]
    assert row.sequence_last_index.tolist() == [1, 3]
    assert row.token_multiplicity.tolist() == [2, 2, 1, 1]


def test_padding_segment():
    plan = plan_shared_prefix([[3, 4, 5], [3, 4, 6]], capacity=8, pad_multiple=3)
    (row,) = plan.rows
    assert row.num_tokens == 6 and row.num_padding == 2
    assert row.tokens.tolist() == [3, 4, 5, 6, 0, 0]
    assert row.position_ids.tolist() == [0, 1, 2, 2, 0, 1]
    assert row.segment_parents.tolist() == [-1, 0, 0, -1] and row.segment_lengths[-1] == 2
    assert row.token_multiplicity.tolist() == [2, 2, 1, 1, 0, 0]
    assert row.segment_depth.tolist() == [0, 1, 1, 0]
    assert plan.padding_tokens == 2 and plan.executed_tokens == 6
    exact = plan_shared_prefix([[3, 4, 5], [3, 4, 6]], capacity=8, pad_multiple=4)
    assert exact.rows[0].num_padding == 0 and len(exact.rows[0].segment_starts) == 3


def test_split_evenly_17_children_into_9_and_8():
    prompt = list(range(100, 110))
    sequences = [prompt + [c, c] for c in range(17)]
    capacity = len(prompt) + 16 * 2  # room for 16 children
    plan = plan_shared_prefix(sequences, capacity=capacity)
    check_plan(plan, sequences, None, capacity=capacity)
    assert [len(row.sequence_ids) for row in plan.rows] == [9, 8]
    assert [row.sequence_ids.tolist() for row in plan.rows] == [list(range(9)), list(range(9, 17))]
    assert all(row.tokens[:10].tolist() == prompt for row in plan.rows)  # the ancestor path repeats


def test_split_recurses_and_places_sequences_ending_at_branch_points_once():
    prompt = [9, 9, 9]
    big = [prompt + [1, 1] + [c] * 3 for c in range(4)]  # child [1, 1] with 4 grandchildren
    small = [prompt + [2, c] for c in range(3)]
    # Two copies of the prompt end at the root's branch point, prompt + [1, 1] at the next one.
    sequences = big + small + [prompt, prompt, prompt + [1, 1]]
    capacity = 11
    plan = plan_shared_prefix(sequences, capacity=capacity)
    check_plan(plan, sequences, None, capacity=capacity)
    holders = [r for r in plan.rows if {7, 8} & set(r.sequence_ids.tolist())]
    assert len(holders) == 1 and {7, 8, 9} <= set(holders[0].sequence_ids.tolist())
    # The root splits into child [1, 1] (too big: split again, 2 + 2 grandchildren) and child [2].
    assert [r.num_tokens for r in plan.rows] == [11, 11, 7]


def test_first_fit_decreasing_order():
    sequences = [[1] * 3, [2] * 5, [3] * 3, [4] * 4]
    plan = plan_shared_prefix(sequences, capacity=8)
    check_plan(plan, sequences, None, capacity=8)
    assert [sorted(r.sequence_ids.tolist()) for r in plan.rows] == [[0, 1], [2, 3]]


def test_sub_forests_of_one_tree_share_a_row_when_they_fit():
    prompt = [7] * 4
    deep = [
        prompt + [1] + [c] * 3 for c in (3, 4, 5)
    ]  # child [1]: 1 + 3 * 3 tokens, split in 2 + 1
    sequences = deep + [prompt + [2, 2]]
    plan = plan_shared_prefix(sequences, capacity=12)
    check_plan(plan, sequences, None, capacity=12)
    # Pieces cost 11, 8 and 6 standalone; the last shares the prompt with the second: 8 + 2 tokens.
    assert [r.num_tokens for r in plan.rows] == [11, 10]


def test_sequence_without_targets_is_allowed_and_reported():
    sequences = [[1, 2, 3], [1, 2, 4], [1, 2]]
    masks = [[False, True, True], [False, False, True], [False, False]]
    plan = plan_shared_prefix(sequences, masks, capacity=16, share_supervised=False)
    check_plan(plan, sequences, masks, capacity=16, share_supervised=False)
    assert plan.sequences_without_targets == (2,)
    assert plan_shared_prefix([[4]], capacity=1).sequences_without_targets == (0,)


def test_input_types_give_the_same_plan():
    lists = [[5, 6, 7], [5, 6, 8, 9], [1]]
    reference = plan_shared_prefix(lists, capacity=16)
    variants = [
        [tuple(s) for s in lists],
        [np.asarray(s, dtype=np.int32) for s in lists],
        [np.asarray(s, dtype=np.uint16) for s in lists],
        tuple(np.asarray(s, dtype=np.int64) for s in lists),
    ]
    for sequences in variants:
        assert_same_rows(
            reference, plan_shared_prefix(sequences, capacity=16), ROW_ARRAYS + ("sequence_ids",)
        )
    masks = [np.array([0, 1, 1]), np.array([0, 0, 1, 1.0]), [False]]
    with_masks = plan_shared_prefix(lists, masks, capacity=16)
    assert with_masks.loss_tokens == 4


def test_rows_are_read_only():
    row = plan_shared_prefix([[1, 2, 3]], capacity=4).rows[0]
    with pytest.raises(ValueError):
        row.tokens[0] = 7
    with pytest.raises(AttributeError):
        row.tokens = np.zeros(3, dtype=np.int64)


# --------------------------------------------------------------------------------------------------
# unpack_edges
# --------------------------------------------------------------------------------------------------


def _unpack_case():
    sequences = [[5, 6, 7, 1], [5, 6, 7, 2], [3, 3], [5, 6]]
    masks = [[False, False, True, True], [False, True, False, True], [False, True], [False, False]]
    plan = plan_shared_prefix(sequences, masks, capacity=6)
    assert len(plan.rows) == 2
    # Value of an edge: 10 * original sequence + position, so the expected result is easy to write.
    values = [(10 * row.edge_sequence + row.edge_position).astype(np.float32) for row in plan.rows]
    nan = np.nan
    expected = [[nan, nan, 2, 3], [nan, 11, nan, 13], [nan, 21], [nan, nan]]
    return plan, values, expected


def test_unpack_edges_numpy():
    plan, values, expected = _unpack_case()
    out = plan.unpack_edges(values)
    assert len(out) == 4
    for got, want in zip(out, expected):
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, np.asarray(want, dtype=np.float32))
    ints = plan.unpack_edges([v.astype(np.int64) for v in values])
    assert ints[0].dtype == np.float64


def test_unpack_edges_torch():
    torch = pytest.importorskip("torch")
    plan, values, expected = _unpack_case()
    tensors = [torch.tensor(v, dtype=torch.float64, requires_grad=True) for v in values]
    out = plan.unpack_edges(tensors)
    for got, want in zip(out, expected):
        assert isinstance(got, torch.Tensor) and got.dtype == torch.float64
        np.testing.assert_array_equal(got.detach().numpy(), np.asarray(want))
    torch.nansum(torch.cat(out)).backward()
    assert all(torch.all(t.grad == 1) for t in tensors)


def test_unpack_edges_rejects_wrong_shapes():
    plan, values, _ = _unpack_case()
    with pytest.raises(ValueError, match="one per row"):
        plan.unpack_edges(values[:1])
    with pytest.raises(ValueError, match=r"values\[1\].*row 1"):
        plan.unpack_edges([values[0], values[1][:-1]])
    with pytest.raises(ValueError, match=r"values\[0\]"):
        plan.unpack_edges([values[0][None], values[1]])


# --------------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sequences, loss_masks, kwargs, match",
    [
        ([], None, {}, "sequences is empty"),
        ([[1], []], None, {}, "sequence 1 is empty"),
        ([[1, 2], [1, -3]], None, {}, "sequence 1 has a negative token id -3 at position 1"),
        ([[1, 2], [1.5, 2]], None, {}, r"sequence 1 has non-integer token ids"),
        ([[1, 2], ["a"]], None, {}, r"sequence 1 has non-integer token ids"),
        ([[1, 2], [True, False]], None, {}, r"sequence 1 has non-integer token ids"),
        ([[1, 2], [[1, 2]]], None, {}, r"sequence 1 must be 1-D"),
        ([[1, 2], [1, 2**64]], None, {}, r"sequence 1"),
        ([[1, 2], [1] * 9], None, {}, "sequence 1 has 9 tokens, more than the row budget of 8"),
        (
            [[1] * 7],
            None,
            dict(pad_multiple=3),
            "sequence 0 has 7 tokens, more than the row budget of 6",
        ),
        ([[1]], None, dict(capacity=0), "capacity"),
        ([[1]], None, dict(capacity=2.0), "capacity"),
        ([[1]], None, dict(pad_multiple=0), "pad_multiple"),
        ([[1]], None, dict(capacity=2, pad_multiple=3), "capacity=2.*pad_multiple=3"),
        ([[1]], None, dict(share_supervised="yes"), "share_supervised"),
        ([[1, 2]], [[0, 1], [0, 1]], {}, "loss_masks has 2 entries for 1 sequences"),
        ([[1, 2], [3, 4]], [[0, 1], [0, 1, 1]], {}, r"loss mask of sequence 1 has shape \(3,\)"),
        ([[1, 2], [3, 4]], [[0, 1], [1, 1]], {}, "loss mask of sequence 1 marks position 0"),
        ([[1, 2], [3, 4]], [[0, 1], [0, 2]], {}, "loss mask of sequence 1 must hold booleans"),
    ],
)
def test_errors_name_the_sequence_or_argument(sequences, loss_masks, kwargs, match):
    kwargs = dict(dict(capacity=8), **kwargs)
    with pytest.raises(ValueError, match=match):
        plan_shared_prefix(sequences, loss_masks, **kwargs)
