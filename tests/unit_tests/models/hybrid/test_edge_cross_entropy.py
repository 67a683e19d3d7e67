"""The one-rank edge loss (tensor_parallel/cross_entropy.py) against autograd through the formula."""

import pytest
import torch

from megatron.shared_prefix.tensor_parallel import cross_entropy


def _edges(sources, vocab, seed):
    generator = torch.Generator().manual_seed(seed)
    # Several edges per source, and one (source, target) pair twice (a duplicated sequence).
    slot = torch.cat(
        [torch.arange(sources), torch.randint(0, sources, (2 * sources,), generator=generator)]
    )
    target = torch.randint(0, vocab, slot.shape, generator=generator)
    slot, target = torch.cat([slot, slot[:1]]), torch.cat([target, target[:1]])
    weights = torch.randn(slot.shape, generator=generator, dtype=torch.float64)
    return slot, target, weights


def _reference(logits, slot, target, weights):
    logits = logits.detach().double().requires_grad_()
    loss = torch.logsumexp(logits, -1)[slot] - logits[slot, target]
    (grad,) = torch.autograd.grad((loss * weights).sum(), logits)
    return loss, grad


@pytest.mark.parametrize("chunk_elements", [22, 1 << 26], ids=["2-row chunks", "one chunk"])
def test_float32_loss_and_gradient(monkeypatch, chunk_elements):
    monkeypatch.setattr(cross_entropy, "FLOAT32_CHUNK_ELEMENTS", chunk_elements)
    sources, vocab = 7, 11
    slot, target, weights = _edges(sources, vocab, seed=0)
    logits = (torch.randn(sources, vocab, dtype=torch.float64) * 3).float().requires_grad_()
    loss = cross_entropy.edge_cross_entropy(logits, slot, target)
    assert loss.dtype == torch.float32
    (grad,) = torch.autograd.grad((loss.double() * weights).sum(), logits)
    expected_loss, expected_grad = _reference(logits, slot, target, weights)
    torch.testing.assert_close(loss.double(), expected_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad.double(), expected_grad, rtol=1e-5, atol=1e-6)


def test_bf16_gradient_is_the_float32_gradient_rounded_once(monkeypatch):
    """bf16 logits: float32 math, one rounding of the gradient to bf16 (as autograd's cast does)."""
    monkeypatch.setattr(cross_entropy, "FLOAT32_CHUNK_ELEMENTS", 3 * 64)
    sources, vocab = 9, 64
    slot, target, weights = _edges(sources, vocab, seed=1)
    logits = torch.randn(sources, vocab).mul(4).bfloat16().requires_grad_()
    loss = cross_entropy.edge_cross_entropy(logits, slot, target)
    (grad,) = torch.autograd.grad((loss * weights.float()).sum(), logits)
    assert grad.dtype == torch.bfloat16
    expected_loss, expected_grad = _reference(logits, slot, target, weights)
    torch.testing.assert_close(loss.double(), expected_loss, rtol=1e-6, atol=1e-6)
    # Within one bf16 rounding of the exact gradient (2^-8 relative), plus float32 noise.
    torch.testing.assert_close(grad.double(), expected_grad, rtol=2**-8, atol=1e-6)


def test_no_edges():
    logits = torch.randn(0, 5, requires_grad=True)
    empty = torch.zeros(0, dtype=torch.int64)
    loss = cross_entropy.edge_cross_entropy(logits, empty, empty)
    loss.sum().backward()
    assert loss.shape == (0,) and logits.grad.shape == (0, 5)
