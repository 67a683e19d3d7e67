"""Bitwise replay of tree attention through two flash attention passes (attention/flash_backend.py).

torch's flash backward accumulates dq over key blocks, deterministically only under
``torch.use_deterministic_algorithms``, which flash_backend turns on around its backward calls. The
GPU test replays a forest of stars forward and backward in bf16 with GQA, three times against
concurrent stream work, rebuilding the forest every run so that the pass tables (cached on the
forest) are replayed too; the merge of the passes and the gradients' scatter back to the row run in
the same test. On CPU the passes run as plain torch math; the CPU test replays that path.
"""

import numpy as np
import pytest
import torch

from megatron.shared_prefix.attention import flash_backend
from megatron.shared_prefix.planning import plan_shared_prefix
from megatron.shared_prefix.tensors import ForestTensors

from ..replay import assert_bitwise_replay


def _star_sequences(prompt, completion, group):
    rng = np.random.default_rng(1)
    shared = rng.integers(1, 100, prompt).tolist()
    stars = [shared + rng.integers(1, 100, completion).tolist() for _ in range(group)]
    other = rng.integers(1, 100, prompt // 2).tolist()
    return stars + [other + rng.integers(1, 100, completion).tolist() for _ in range(2)]


def _replay(device, dtype, sequences, head_dim):
    capacity = sum(len(s) for s in sequences) + 128

    def make_inputs():
        (layout,) = plan_shared_prefix(sequences, capacity=capacity, pad_multiple=128).rows
        forest = ForestTensors.from_layout(layout, device)
        assert flash_backend.star_passes(forest).leaves is not None
        qkv = (
            torch.randn(layout.num_tokens, 1, heads, head_dim, device=device, dtype=dtype)
            for heads in (8, 2, 2)
        )
        return (*(t.requires_grad_() for t in qkv), forest)

    def fn(query, key, value, forest):
        return flash_backend.tree_attention(query, key, value, forest, softmax_scale=0.125)

    assert_bitwise_replay(fn, make_inputs, concurrent_stream_work=device == "cuda")


def test_flash_tree_attention_replay_cpu():
    _replay("cpu", torch.float32, _star_sequences(40, 9, 4), head_dim=16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_flash_tree_attention_replay_gpu():
    _replay("cuda", torch.bfloat16, _star_sequences(1500, 700, 6), head_dim=64)
