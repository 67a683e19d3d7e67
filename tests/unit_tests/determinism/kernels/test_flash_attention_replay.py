"""Bitwise replay of tree attention through two flash attention passes (attention/flash_backend.py).

torch's flash backward accumulates dq over key blocks, deterministically only under
``torch.use_deterministic_algorithms``, which flash_backend turns on around its backward calls. The
GPU test replays a row of GRPO stars and a row of depth 3 forward and backward in bf16 with GQA,
three times against concurrent stream work, rebuilding the forest every run so that the pass tables
(cached on the forest) are replayed too; the merges of the passes and the gradients' scatter back
to the row run in the same test. On CPU the passes run as plain torch math; the CPU test replays
that path.
"""

import numpy as np
import pytest
import torch

from megatron.shared_prefix.attention import flash_backend
from megatron.shared_prefix.planning import plan_shared_prefix
from megatron.shared_prefix.tensors import ForestTensors

from ..replay import assert_bitwise_replay


def _sequences(prompt, turns):
    """A prompt branched into two at each of ``turns`` (continuation lengths), and a sequence of
    its own."""
    rng = np.random.default_rng(1)
    sequences = [rng.integers(1, 100, prompt).tolist()]
    for width in turns:
        sequences = [s + rng.integers(1, 100, width).tolist() for s in sequences for _ in range(2)]
    return sequences + [rng.integers(1, 100, prompt // 2).tolist()]


def _replay(device, dtype, sequences, head_dim, depth):
    capacity = sum(len(s) for s in sequences) + 128

    def make_inputs():
        (layout,) = plan_shared_prefix(sequences, capacity=capacity, pad_multiple=128).rows
        forest = ForestTensors.from_layout(layout, device)
        assert len(flash_backend.flash_passes(forest).ancestors) == depth
        qkv = (
            torch.randn(layout.num_tokens, 1, heads, head_dim, device=device, dtype=dtype)
            for heads in (8, 2, 2)
        )
        return (*(t.requires_grad_() for t in qkv), forest)

    def fn(query, key, value, forest):
        return flash_backend.tree_attention(query, key, value, forest, softmax_scale=0.125)

    assert_bitwise_replay(fn, make_inputs, concurrent_stream_work=device == "cuda")


@pytest.mark.parametrize("turns", [(9,), (9, 5)], ids=["star", "depth-3"])
def test_flash_tree_attention_replay_cpu(turns):
    _replay("cpu", torch.float32, _sequences(40, turns), head_dim=16, depth=len(turns))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("turns", [(700,), (400, 300)], ids=["star", "depth-3"])
def test_flash_tree_attention_replay_gpu(turns):
    _replay("cuda", torch.bfloat16, _sequences(1500, turns), head_dim=64, depth=len(turns))
