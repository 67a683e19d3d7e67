"""Triton kernels of the edge loss (tensor_parallel/triton_cross_entropy.py) and the edge loss
that runs them on CUDA (tensor_parallel/cross_entropy.py).

* Kernels against float64 autograd through ``logsumexp(logits)[slot] - logits[slot, target]``:
  loss and gradient, with several vocabulary blocks and a partial last one, edges sharing a
  source, a repeated (source, target) pair and a source without edges; the gradient written into
  a new tensor and into the logits' own storage (the same bits).
* Vocabulary shards, as under tensor parallelism: each shard's sums with the global maximum, and
  its gradient with the targets of other shards given zero terms, joined, equal the whole
  vocabulary's.
* A source's loss and gradient do not depend on the other rows of the batch (tree and packed
  dense rows hold a source among different rows): bitwise equal on a permuted subset.
* ``edge_cross_entropy`` with the kernels against its PyTorch path.
* After ``cross_entropy.warm_up`` (what ``--shared-prefix-precompile`` runs per output width), the
  loss at other source and edge counts, and at other widths of the same alignment, compiles no
  kernel (GPU).
* CPU: Triton's interpreter (TRITON_INTERPRET=1 must be set before triton compiles anything, hence
  a subprocess running this file), float32. GPU (marked ``gpu``): compiled kernels, float32 and
  bf16, through ``edge_cross_entropy``'s own dispatch.
"""

import pytest
import torch
from triton_interpreter import run_interpreted, triton_compiles

from megatron.shared_prefix.tensor_parallel import cross_entropy


def _edges(sources, vocab, device, seed=0):
    generator = torch.Generator().manual_seed(seed)
    # Every source but the last has an edge; some have several; one (source, target) pair twice.
    slot = torch.cat(
        [
            torch.arange(sources - 1),
            torch.randint(0, sources - 1, (2 * sources,), generator=generator),
        ]
    )
    target = torch.randint(0, vocab, slot.shape, generator=generator)
    slot, target = torch.cat([slot, slot[:1]]), torch.cat([target, target[:1]])
    weights = torch.randn(slot.shape, generator=generator)
    return slot.to(device), target.to(device), weights.to(device)


def _reference(logits, slot, target, weights):
    """float64 loss and gradient of ``sum(weights * loss)``."""
    logits = logits.detach().double().requires_grad_()
    loss = torch.logsumexp(logits, -1)[slot] - logits[slot, target]
    (grad,) = torch.autograd.grad((loss * weights.double()).sum(), logits)
    return loss, grad


def _kernel_loss_and_grad(logits, slot, target, weights, in_place=False):
    """The loss and gradient from the kernels alone, as the one-rank edge loss runs them."""
    from megatron.shared_prefix.tensor_parallel import triton_cross_entropy

    shift = logits.amax(dim=-1).float()
    log_normalizer = triton_cross_entropy.sum_exp(logits, shift).log_().add_(shift)
    loss = log_normalizer[slot] - logits[slot, target].float()
    source_grad = torch.zeros_like(log_normalizer).index_put_((slot,), weights, accumulate=True)
    out = logits.clone() if in_place else torch.empty_like(logits)
    source = out if in_place else logits
    grad = triton_cross_entropy.softmax_grad(
        source, log_normalizer, source_grad, slot, target, -weights, out=out
    )
    assert grad.data_ptr() == out.data_ptr()
    return loss, grad


def _rel_err(actual, expected):
    actual, expected = actual.detach().double(), expected.detach().double()
    return float((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30))


def kernel_errors(device, dtype):
    """Relative errors of the kernels' loss and gradient against float64 (logits of several
    vocabulary blocks, the last partial), and whether the in-place gradient is bitwise the new
    tensor's."""
    from megatron.shared_prefix.tensor_parallel.triton_cross_entropy import BLOCK_V

    sources, vocab = 13, 2 * BLOCK_V + 123
    generator = torch.Generator().manual_seed(1)
    logits = (torch.randn(sources, vocab, generator=generator) * 4).to(device=device, dtype=dtype)
    slot, target, weights = _edges(sources, vocab, device)
    loss, grad = _kernel_loss_and_grad(logits, slot, target, weights)
    _, grad_in_place = _kernel_loss_and_grad(logits, slot, target, weights, in_place=True)
    expected_loss, expected_grad = _reference(logits, slot, target, weights)
    assert not grad[-1].any() and expected_grad[-1].abs().max() == 0  # the source without edges
    return (
        _rel_err(loss, expected_loss),
        _rel_err(grad, expected_grad),
        torch.equal(grad, grad_in_place),
    )


def shard_errors(device):
    """Two vocabulary shards, as the tensor-parallel edge loss runs them: each shard's sum of
    exponentials with the global maximum (summed over shards), and each shard's gradient with
    the targets it does not hold given a zero term; relative errors of the joined loss and
    gradient against the whole vocabulary's kernels."""
    from megatron.shared_prefix.tensor_parallel import triton_cross_entropy

    sources, shard = 9, 700
    logits = torch.randn(sources, 2 * shard, generator=torch.Generator().manual_seed(2)) * 4
    logits = logits.to(device)
    slot, target, weights = _edges(sources, 2 * shard, device, seed=3)
    whole_loss, whole_grad = _kernel_loss_and_grad(logits, slot, target, weights)
    shards = logits.split(shard, dim=1)
    shift = torch.stack([s.amax(dim=-1) for s in shards]).amax(dim=0).float()
    sum_exp = sum(triton_cross_entropy.sum_exp(s.contiguous(), shift) for s in shards)
    log_normalizer = sum_exp.log_().add_(shift)
    loss = log_normalizer[slot] - logits[slot, target].float()
    source_grad = torch.zeros_like(log_normalizer).index_put_((slot,), weights, accumulate=True)
    grads = []
    for rank, logits_shard in enumerate(shards):
        local = target - rank * shard
        owned = (local >= 0) & (local < shard)
        grads.append(
            triton_cross_entropy.softmax_grad(
                logits_shard.contiguous(),
                log_normalizer,
                source_grad,
                slot,
                local.clamp(0, shard - 1),
                torch.where(owned, -weights, 0.0),
                out=torch.empty_like(logits_shard),
            )
        )
    return _rel_err(loss, whole_loss), _rel_err(torch.cat(grads, dim=1), whole_grad)


def batch_independent(device, dtype):
    """Whether a subset of the sources, permuted, gets bitwise the losses and gradient rows it got
    in the whole batch (one edge per source)."""
    sources, vocab = 12, 5000
    generator = torch.Generator().manual_seed(4)
    logits = (torch.randn(sources, vocab, generator=generator) * 4).to(device=device, dtype=dtype)
    slot = torch.arange(sources, device=device)
    target = torch.randint(0, vocab, (sources,), generator=generator).to(device)
    weights = torch.randn(sources, generator=generator).to(device)
    loss, grad = _kernel_loss_and_grad(logits, slot, target, weights)
    keep = torch.tensor([7, 2, 11, 5], device=device)
    part_loss, part_grad = _kernel_loss_and_grad(
        logits[keep].contiguous(),
        torch.arange(len(keep), device=device),
        target[keep],
        weights[keep],
    )
    return torch.equal(part_loss, loss[keep]) and torch.equal(part_grad, grad[keep])


def dispatch_errors(device, dtype, choose_kernels):
    """Relative errors of ``edge_cross_entropy`` with ``choose_kernels`` as its kernel choice
    (``cross_entropy._triton_kernels``) against its PyTorch path (loss, gradient), with the
    gradient written into the logits as the model's output layer allows."""
    sources, vocab = 40, 3000
    generator = torch.Generator().manual_seed(5)
    leaf = (torch.randn(sources, vocab, generator=generator) * 4).to(device=device, dtype=dtype)
    slot, target, weights = _edges(sources, vocab, device, seed=6)
    results = []
    original = cross_entropy._triton_kernels
    for choice in (choose_kernels, lambda logits: None):
        cross_entropy._triton_kernels = choice
        try:
            logits = leaf.clone().requires_grad_()
            loss = cross_entropy.edge_cross_entropy(
                logits * 1, slot, target, overwrite_logits=True
            )
            (grad,) = torch.autograd.grad((loss * weights).sum(), logits)
        finally:
            cross_entropy._triton_kernels = original
        results.append((loss, grad))
    (loss, grad), (torch_loss, torch_grad) = results
    return _rel_err(loss, torch_loss), _rel_err(grad, torch_grad)


FP32_TOLERANCE = 1e-6


def interpreted_checks():
    """Run in the TRITON_INTERPRET=1 subprocess, float32 on CPU."""
    loss_err, grad_err, in_place_equal = kernel_errors("cpu", torch.float32)
    assert loss_err <= FP32_TOLERANCE and grad_err <= FP32_TOLERANCE, (loss_err, grad_err)
    assert in_place_equal
    errors = shard_errors("cpu")
    assert max(errors) <= FP32_TOLERANCE, errors
    assert batch_independent("cpu", torch.float32)
    from megatron.shared_prefix.tensor_parallel import triton_cross_entropy

    errors = dispatch_errors("cpu", torch.float32, lambda logits: triton_cross_entropy)
    assert max(errors) <= FP32_TOLERANCE, errors
    print("interpreted edge loss kernels within", FP32_TOLERANCE)


def test_interpreted_kernels_match_float64_and_the_torch_path():
    pytest.importorskip("triton")
    assert "interpreted edge loss kernels within" in run_interpreted(__file__)


def test_cpu_logits_take_the_torch_path():
    assert cross_entropy._triton_kernels(torch.zeros(2, 3)) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2**-8)], ids=["fp32", "bf16"]
)
def test_compiled_kernels_match_float64_and_the_torch_path(dtype, tolerance):
    """On CUDA ``edge_cross_entropy`` runs the kernels by itself; they equal float64 and its
    PyTorch path to float32 rounding (bf16: one rounding of each gradient element, which the two
    paths may take on either side)."""
    logits = torch.zeros(2, 8, device="cuda", dtype=dtype)
    assert cross_entropy._triton_kernels(logits) is not None
    loss_err, grad_err, in_place_equal = kernel_errors("cuda", dtype)
    assert loss_err <= 1e-5 and grad_err <= tolerance, (loss_err, grad_err)
    assert in_place_equal
    errors = dispatch_errors("cuda", dtype, cross_entropy._triton_kernels)
    assert errors[0] <= 1e-5 and errors[1] <= tolerance, errors
    assert batch_independent("cuda", dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_warm_up_compiles_what_later_losses_need():
    """``warm_up`` compiles both kernels (float16: a dtype no other test of this file runs), and
    then losses of other source counts, and of other widths that are multiples of 16, as the
    output layer's local widths are, compile nothing."""
    dtype, vocab = torch.float16, 4096
    with triton_compiles() as warm_up_compiled:
        cross_entropy.warm_up(vocab, dtype=dtype, device="cuda")
    assert {"_sum_exp_kernel", "_softmax_grad_kernel"} <= set(warm_up_compiled), warm_up_compiled
    with triton_compiles() as compiled:
        for sources, width in ((3, vocab), (37, vocab), (1000, 2 * vocab + 16)):
            leaf = torch.randn(sources, width, device="cuda", dtype=dtype).requires_grad_()
            slot, target, weights = _edges(sources, width, "cuda")
            loss = cross_entropy.edge_cross_entropy(leaf * 1, slot, target, overwrite_logits=True)
            torch.autograd.grad((loss * weights).sum(), leaf)
    assert compiled == [], compiled


if __name__ == "__main__":  # run by test_interpreted_kernels_match_float64_and_the_torch_path
    interpreted_checks()
