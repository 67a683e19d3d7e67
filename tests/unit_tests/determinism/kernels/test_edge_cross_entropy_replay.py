"""Bitwise replay of the one-rank edge loss (tensor_parallel/cross_entropy.py), forward and
backward: edges sharing a source and a repeated (source, target) pair accumulate with
``index_put_(accumulate=True)``; with ``overwrite_logits`` the gradient is written into the logits'
storage (the model's path). On CUDA the loss runs the Triton kernels of triton_cross_entropy.py
(one program per source row, the row's edges in a stable sort's order); its PyTorch path, which
CPU logits and logits the kernels do not take run, is replayed on both devices: float32 work in
several row chunks (the last one shorter) or in one, each on one float32 copy updated in place."""

import pytest
import torch

from megatron.shared_prefix.tensor_parallel import cross_entropy

from ..replay import assert_bitwise_replay

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ],
    ),
]

# (path, float32 rows per chunk of the PyTorch path)
PATHS = [("torch", 64), ("torch", None), ("kernels", None)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("overwrite", [False, True], ids=["new-gradient", "overwrite-logits"])
@pytest.mark.parametrize(
    "path, chunk_rows", PATHS, ids=["torch-5-chunks", "torch-one-chunk", "kernels"]
)
def test_edge_cross_entropy_replay(monkeypatch, device, dtype, overwrite, path, chunk_rows):
    sources, vocab = 300, 4096
    if path == "kernels":
        if device == "cpu":
            pytest.skip("Triton kernels run on CUDA logits (interpreted: test_triton_cross_entropy)")
        assert cross_entropy._triton_kernels(torch.zeros(1, 1, device=device)) is not None
    else:
        monkeypatch.setattr(cross_entropy, "_triton_kernels", lambda logits: None)
    if chunk_rows is not None:
        monkeypatch.setattr(cross_entropy, "FLOAT32_CHUNK_ELEMENTS", chunk_rows * vocab)
    generator = torch.Generator().manual_seed(0)
    slot = torch.randint(0, sources, (2000,), generator=generator)
    target = torch.randint(0, vocab, (2000,), generator=generator)
    slot, target = torch.cat([slot, slot[:50]]).to(device), torch.cat([target, target[:50]]).to(
        device
    )

    def make_inputs():
        return (torch.randn(sources, vocab, device=device) * 4).to(dtype).requires_grad_()

    def fn(logits):
        # An intermediate, as the output layer's logits: overwrite_logits writes into it.
        return cross_entropy.edge_cross_entropy(
            logits * 1, slot, target, overwrite_logits=overwrite
        )

    assert_bitwise_replay(fn, make_inputs, concurrent_stream_work=device == "cuda")
