"""ForestTensors: derived tables against the layout, and the token-dimension scan."""

import subprocess
import sys

import numpy as np
import pytest
import torch

from megatron.shared_prefix.attention.reference import tree_attention_allow_mask
from megatron.shared_prefix.planning import plan_shared_prefix
from megatron.shared_prefix.tensors import (
    ForestTensors,
    cumsum_over_tokens,
    current_forest,
    forest_scope,
    hosts_to_device,
)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64])
@pytest.mark.parametrize("shape", [(7,), (7, 3), (7, 2, 5)])
def test_cumsum_over_tokens_is_cumsum_along_dim_0(dtype, shape):
    values = torch.randn(shape, dtype=torch.float64).mul(100).to(dtype)
    assert torch.equal(cumsum_over_tokens(values), torch.cumsum(values, dim=0))


def test_cumsum_over_tokens_gradient():
    values = torch.randn(9, 4, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(cumsum_over_tokens, (values,))


def test_subtree_end_is_the_tree_mask(forest_sequences):
    layout = plan_shared_prefix(
        forest_sequences(seed=11, depth=4), capacity=512, pad_multiple=8
    ).rows[0]
    forest = ForestTensors.from_layout(layout, "cpu")
    end = forest.token_subtree_end.numpy()
    q, k = np.indices((layout.num_tokens, layout.num_tokens))
    np.testing.assert_array_equal((k <= q) & (q < end[k]), tree_attention_allow_mask(layout))


@pytest.mark.parametrize("seed", range(3))
def test_edge_sources_are_the_distinct_sources_and_each_edges_slot(forest_sequences, seed):
    """edge_unique_source holds each loss edge's source once, ascending, and edge_source_slot
    points every edge at its own source (sources shared by several sequences included)."""
    sequences = forest_sequences(seed=seed, depth=3)
    masks = [np.arange(len(s)) >= 1 for s in sequences]
    layout = plan_shared_prefix(sequences, masks, capacity=512).rows[0]
    forest = ForestTensors.from_layout(layout, "cpu")
    assert forest.edge_unique_source.tolist() == sorted(set(layout.edge_source.tolist()))
    assert len(layout.edge_source) > len(forest.edge_unique_source)  # some sources are shared
    assert forest.edge_unique_source[forest.edge_source_slot].tolist() == layout.edge_source.tolist()


def test_root_path_predecessors_follow_the_root_path(forest_sequences):
    layout = plan_shared_prefix(forest_sequences(seed=12, depth=3), capacity=512).rows[0]
    table = ForestTensors.from_layout(layout, "cpu").root_path_predecessors(3).numpy()
    for k in range(len(layout.sequence_ids)):
        path = layout.root_path(k)
        for step, token in enumerate(path):
            expected = [path[step - j] if step - j >= 0 else -1 for j in (1, 2, 3)]
            assert table[token].tolist() == expected


def test_scope_nests_and_restores():
    outer, inner = object(), object()
    assert current_forest() is None
    with forest_scope(outer):
        with forest_scope(inner):
            assert current_forest() is inner
        with forest_scope(None):
            assert current_forest() is None
        assert current_forest() is outer
    assert current_forest() is None


def test_host_tables_equal_the_device_tables(forest_sequences):
    layout = plan_shared_prefix(forest_sequences(seed=13, depth=4), capacity=512).rows[0]
    forest = ForestTensors.from_layout(layout, "cpu")
    np.testing.assert_array_equal(forest.host_subtree_end(), forest.token_subtree_end.numpy())
    np.testing.assert_array_equal(
        forest.host_root_path_predecessors(3), forest.root_path_predecessors(3).numpy()
    )


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
)
def test_hosts_to_device_copies_each_array(device):
    """One transfer, each array back with its dtype, shape and values, whatever its size."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    rng = np.random.default_rng(0)
    arrays = [
        rng.integers(-5, 5, size=(3, 7)).astype(np.int64),
        np.zeros(0, dtype=np.int64),
        rng.integers(0, 9, size=(2, 5)).astype(np.int32).T,  # not contiguous
        np.array([True, False, True]),
        rng.standard_normal(9).astype(np.float32),
        np.arange(1, dtype=np.int16),
    ]
    copies = hosts_to_device(arrays, device)
    for array, copy in zip(arrays, copies):
        assert copy.device.type == device
        assert copy.dtype == torch.from_numpy(array[:0].copy()).dtype
        np.testing.assert_array_equal(copy.cpu().numpy(), array)
    # The copies do not alias the host arrays.
    arrays[0][0, 0] = 99
    assert copies[0][0, 0].item() != 99


def test_hosts_to_device_takes_read_only_arrays_without_warning():
    """Layout tables may be read-only numpy arrays: they are copied, and nothing warns (torch warns
    when it wraps a non-writable array, once per process: hence a fresh one)."""
    script = (
        f"import warnings; import numpy as np; from {hosts_to_device.__module__} import "
        "hosts_to_device\n"
        "table = np.arange(6, dtype=np.int64).reshape(2, 3); table.flags.writeable = False\n"
        "with warnings.catch_warnings():\n"
        "    warnings.simplefilter('error')\n"
        "    (copy,) = hosts_to_device([table], 'cpu')\n"
        "assert copy.tolist() == [[0, 1, 2], [3, 4, 5]], copy"
    )
    child = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=False, timeout=120
    )
    assert child.returncode == 0, child.stderr[-2000:]
