"""``shared_prefix_output_chunk_tokens``: the output layer and edge loss over chunks of sources,
each recomputed in the backward, against the unchunked loss of the same model (the unchunked loss
is checked against dense elsewhere)."""

import numpy as np
import pytest
import torch
from dense_reference import gradients, relative_error
from tiny import GPU_BF16_MODEL, seed_initialization, tiny_config

from megatron.shared_prefix import SharedPrefixHybridModel, hybrid_stack_spec, plan_shared_prefix


def _build(pattern, chunk, *, vocab=64, tied=False, seed=0, mamba_chunk_size=8, **config):
    depths = pattern.count("/")
    seed_initialization(seed)
    return SharedPrefixHybridModel(
        tiny_config(
            num_layers=len(pattern.split("/")[0]), mtp_num_layers=depths or None, **config
        ),
        hybrid_stack_spec=hybrid_stack_spec(None, mamba_chunk_size=mamba_chunk_size),
        vocab_size=vocab,
        max_sequence_length=512,
        hybrid_layer_pattern=pattern,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=tied,
        shared_prefix_output_chunk_tokens=chunk,
    )


@pytest.mark.parametrize("chunk", [1, 7, 1000], ids=["1-token", "7-token", "one-chunk"])
@pytest.mark.parametrize(
    "pattern,tied", [("M*-", False), ("*-/M*/M*", True)], ids=["untied", "tied-mtp"]
)
def test_chunked_loss_equals_the_unchunked(megatron_world, forest_sequences, chunk, pattern, tied):
    """Per-edge losses (main, every MTP depth, the MTP argmax matches) and every gradient."""
    row = plan_shared_prefix(forest_sequences(seed=5, depth=3), capacity=512).rows[0]
    weights = torch.randn(len(row.edge_target), generator=torch.Generator().manual_seed(1))
    results = []
    for tokens in (0, chunk):
        model = _build(pattern, tokens, tied=tied)
        losses = model(None, None, None, shared_prefix_layout=row, shared_prefix_mtp_losses=True)
        (weights * losses.edge_loss).sum().add(torch.nansum(losses.mtp_edge_loss * weights)).backward()
        results.append((losses, gradients(model)))
    (plain, plain_grads), (chunked, chunked_grads) = results
    assert relative_error(chunked.edge_loss, plain.edge_loss) <= 1e-6
    torch.testing.assert_close(chunked.mtp_edge_loss, plain.mtp_edge_loss, equal_nan=True)
    assert torch.equal(chunked.mtp_edge_correct, plain.mtp_edge_correct)
    assert plain_grads.keys() == chunked_grads.keys()
    for name, grad in plain_grads.items():
        assert relative_error(chunked_grads[name], grad) <= 1e-5, name


def test_chunks_bound_the_step_memory(megatron_world):
    """A whole forward + backward holds one chunk's logits instead of every source's."""
    from test_edge_cross_entropy import _peak_bytes

    vocab = 8192
    rng = np.random.default_rng(0)
    prompt = rng.integers(1, vocab, 16).tolist()
    sequences = [prompt + rng.integers(1, vocab, 24).tolist() for _ in range(8)]
    masks = [[False] * 16 + [True] * 24 for _ in sequences]
    row = plan_shared_prefix(sequences, masks, capacity=512).rows[0]
    logits_bytes = 8 * 24 * vocab * 4  # 192 sources, float32
    peaks = {}
    for chunk in (0, 32):
        model = _build("*-", chunk, vocab=vocab)

        def step(model=model):
            model(None, None, None, shared_prefix_layout=row).sum().backward()

        _, peaks[chunk] = _peak_bytes(step)
    assert peaks[0] >= logits_bytes
    # 32 of 192 sources: a sixth of the logits, plus activations and weight gradients.
    assert peaks[32] < peaks[0] - logits_bytes / 2, peaks


@pytest.mark.parametrize("chunk", [-1, True, 2.0, "8"])
def test_rejects_a_chunk_size_that_is_not_a_count(megatron_world, chunk):
    with pytest.raises(ValueError, match="shared_prefix_output_chunk_tokens must be an int >= 0"):
        _build("*-", chunk)


def test_chunk_tables_cover_every_edge_once(megatron_world, forest_sequences):
    """Every edge lands in exactly one chunk, at its own source's row."""
    from megatron.shared_prefix.tensors import ForestTensors

    row = plan_shared_prefix(forest_sequences(seed=2, depth=3), capacity=512).rows[0]
    forest = ForestTensors.from_layout(row, "cpu")
    sources, slots, _ = forest.edge_projection()
    chunks, position = forest.edge_projection_chunks(5)
    assert [(start, stop) for start, stop, _, _ in chunks] == [
        (s, min(s + 5, len(sources))) for s in range(0, len(sources), 5)
    ]
    chunk_slot = torch.cat([start + slot for start, _, slot, _ in chunks])
    chunk_target = torch.cat([target for *_, target in chunks])
    assert torch.equal(chunk_slot[position], slots)
    assert torch.equal(chunk_target[position], forest.edge_target)
    assert torch.equal(torch.sort(position).values, torch.arange(len(slots)))


def test_megatron_overlapped_grad_reduce_takes_any_chunk_count(megatron_world):
    """megatron-core's DDP with overlap_grad_reduce counts each parameter's gradient
    accumulations against the first batch's and refuses to finish the step otherwise; rows with
    different numbers of chunks still accumulate the output weight once per backward (the
    non-reentrant checkpoint), so every step finishes."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    model = _build("*-", 4)
    ddp = DistributedDataParallel(
        model.config,
        DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=True),
        model,
    )
    rng = np.random.default_rng(0)
    for num_sequences in (3, 6, 2):
        sequences = [rng.integers(1, 64, 10 + i).tolist() for i in range(num_sequences)]
        row = plan_shared_prefix(sequences, capacity=512).rows[0]
        ddp.zero_grad_buffer()
        ddp(None, None, None, shared_prefix_layout=row).sum().backward()
        ddp.finish_grad_sync()
        assert model.output_layer.weight.main_grad.abs().sum() > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("pattern", ["*-", "M-M*-"])
def test_chunked_step_on_the_gpu(megatron_world, pattern):
    """A bf16 step over output chunks on CUDA, written as a training loop writes it (the losses a
    temporary of the backward's expression): the same losses and gradients as the unchunked step.
    With checkpoint's early stop, such a step of the whole-model benchmark's model failed on an
    H100 with torch 2.11 (a SystemError from the recomputed edge loss; docs/benchmarks.md)."""
    vocab = 4096
    rng = np.random.default_rng(0)
    prompt = rng.integers(1, vocab, 512).tolist()
    sequences = [prompt + rng.integers(1, vocab, 256).tolist() for _ in range(8)]
    masks = [[False] * 512 + [True] * 256 for _ in sequences]
    row = plan_shared_prefix(sequences, masks, capacity=4096, pad_multiple=128).rows[0]
    results = []
    for chunk in (0, 512):
        model = _build(
            pattern,
            chunk,
            vocab=vocab,
            use_mamba_mem_eff_path=False,
            **GPU_BF16_MODEL,
        ).cuda()
        model(None, None, None, shared_prefix_layout=row).float().sum().backward()
        with torch.no_grad():
            losses = model(None, None, None, shared_prefix_layout=row)
        results.append((losses.float(), gradients(model)))
    (plain, plain_grads), (chunked, chunked_grads) = results
    # bf16: a chunk's logits may come from another GEMM algorithm than the whole projection's
    # (rounding 2**-8), and the output weight's gradient is summed chunk by chunk.
    assert relative_error(chunked, plain) <= 2**-8
    assert plain_grads.keys() == chunked_grads.keys()
    for name, grad in plain_grads.items():
        assert relative_error(chunked_grads[name].float(), grad.float()) <= 2**-6, name
