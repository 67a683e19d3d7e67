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


def _peak_bytes(fn):
    """(``fn()``, the peak bytes it allocates above what it starts with): the CPU profiler's
    allocation and free events, in order."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return result, peak


def test_forward_holds_one_float32_copy_of_a_chunk():
    """The forward's only logits-sized temporary is one float32 copy of a chunk (it sits at the end
    of a forest row's forward, where the row's memory peaks): bf16 logits of one chunk allocate at
    most 4 bytes per element plus per-row values, where torch.logsumexp of the float32 logits
    holds two copies."""
    sources, vocab = 64, 4096
    logits = torch.randn(sources, vocab).bfloat16().requires_grad_()
    slot = torch.arange(sources)
    target = torch.randint(0, vocab, (sources,), generator=torch.Generator().manual_seed(0))
    loss, peak = _peak_bytes(lambda: cross_entropy.edge_cross_entropy(logits, slot, target))
    assert peak <= 4 * sources * vocab + 64 * sources, peak
    expected = torch.logsumexp(logits.double(), -1) - logits.double()[slot, target]
    torch.testing.assert_close(loss.double(), expected, rtol=1e-6, atol=1e-6)


def test_overwrite_logits_writes_the_gradient_into_their_storage(monkeypatch):
    """``overwrite_logits``: the same loss and gradient bit for bit, the gradient in the logits'
    own storage, and a backward that allocates no second [U, V] tensor."""
    monkeypatch.setattr(cross_entropy, "FLOAT32_CHUNK_ELEMENTS", 16 * 4096)
    sources, vocab = 256, 4096
    slot, target, weights = _edges(sources, vocab, seed=2)
    weights = weights.float()
    leaf = torch.randn(sources, vocab).mul(4).bfloat16()
    results = {}
    for overwrite in (False, True):
        logits = leaf.clone().requires_grad_() * 1  # an intermediate, as the output layer's
        loss = cross_entropy.edge_cross_entropy(logits, slot, target, overwrite_logits=overwrite)
        (grad,), peak = _peak_bytes(
            lambda: torch.autograd.grad((loss * weights).sum(), logits)  # noqa: B023
        )
        results[overwrite] = (loss.detach(), grad.clone(), grad.data_ptr() == logits.data_ptr(), peak)
    (plain_loss, plain_grad, plain_aliases, plain_peak) = results[False]
    (loss, grad, aliases, peak) = results[True]
    assert torch.equal(loss, plain_loss) and torch.equal(grad, plain_grad)
    assert aliases and not plain_aliases
    logits_bytes = sources * vocab * 2
    # Without overwrite the gradient is a second [U, V]; with it only float32 chunks of 16 rows
    # (256 KiB) and [U]- and [E]-sized tables remain.
    assert plain_peak >= logits_bytes
    assert peak < logits_bytes / 2, (peak, logits_bytes)


def test_model_backward_allocates_no_logits_sized_tensor(monkeypatch, build_model):
    """The forest model's loss backward, from the edge loss through the output layer, allocates
    less than half the [U, V] logits: the gradient is written into the logits (the loss is their
    only reader) and the [U, 1, V] -> [U, V] reshape is a view, whose backward allocates
    nothing (indexing's backward would allocate zeros of the logits' size)."""
    from megatron.shared_prefix.planning import plan_shared_prefix

    vocab = 8192
    monkeypatch.setattr(cross_entropy, "FLOAT32_CHUNK_ELEMENTS", 16 * vocab)
    model = build_model("*-", vocab_size=vocab)
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, vocab, (16,), generator=generator).tolist()
    sequences = [prompt + torch.randint(1, vocab, (24,), generator=generator).tolist()] * 8
    sequences = [s[:16] + [(t + i) % vocab for t in s[16:]] for i, s in enumerate(sequences)]
    masks = [[False] * 16 + [True] * 24 for _ in sequences]
    row = plan_shared_prefix(sequences, masks, capacity=512).rows[0]
    loss = model(None, None, None, shared_prefix_layout=row)
    logits_bytes = 8 * 24 * vocab * 4  # one source per supervised position, float32
    _, peak = _peak_bytes(lambda: loss.sum().backward())
    assert model.output_layer.weight.grad.abs().sum() > 0
    assert peak < logits_bytes / 2, (peak, logits_bytes)


@pytest.mark.parametrize("tied", [False, True], ids=["output-layer", "tied-embeddings"])
def test_precompile_edge_loss_runs_each_output_width_once_and_writes_no_gradient(
    monkeypatch, build_model, tied
):
    """``--shared-prefix-precompile``'s loss warm-up: one ``warm_up`` at the output layer's local
    vocabulary width (the embedding's when tied), in the given dtype; no parameter gradient."""
    from megatron.shared_prefix.models.hybrid.hybrid_model import precompile_edge_loss

    model = build_model("*-", vocab_size=96, tied=tied)
    runs = []
    warm_up = cross_entropy.warm_up
    monkeypatch.setattr(
        cross_entropy,
        "warm_up",
        lambda width, **kw: runs.append((width, kw["dtype"])) or warm_up(width, **kw),
    )
    assert precompile_edge_loss(model, dtype=torch.float32, device="cpu") == (96,)
    assert runs == [(96, torch.float32)]
    assert all(parameter.grad is None for parameter in model.parameters())
    assert precompile_edge_loss(torch.nn.Linear(2, 2), dtype=torch.float32, device="cpu") == ()
