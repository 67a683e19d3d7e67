"""Training-step speed of a whole SharedPrefixHybridModel on prefix forests against packed dense and
a plain padded batch, with a component ideal, peak memory and first-step (compile) times (CUDA).

For each layer pattern and batch, in one process on one GPU (bf16, forward+backward of every row of
the batch, gradients accumulated as in a training step, no optimizer), three ways of training the
same sequences on the same weights:

* tree: the batch planned as prefix forests (``plan_shared_prefix``, rows of at most
  ``--capacity`` tokens, padded to a multiple of 128), one forest forward per row;
* packed dense: the same model on the same sequences with every sequence its own root (what THD
  packing computes), packed first-fit into rows of the same capacity;
* padded: megatron-core's plain ``HybridModel.forward`` (the same model without a layout: stock
  DotProductAttention, the unfused Mamba path, the output layer over every position) on
  right-padded micro-batches of ``capacity // longest`` sequences; "OOM" where memory does not
  allow it.

Columns: logical tokens / s of each (logical = the sum of the sequence lengths, what a dense batch
runs); speedup (tree over packed dense); token ratio (logical tokens / tree tokens); the component
ideal, the speedup an exact implementation whose every component scales with its work would reach:

    ideal = dense / (token-wise / token ratio + attention / pair ratio + output),

where the three terms partition the packed dense step's time, measured: attention = the core
attention of every attention layer (FlexAttention forward+backward at the dense rows' shapes),
output = the output layer and loss over the edges (the same supervised targets in both, ratio 1),
token-wise = the rest (Mamba, MLP, MoE, linears, norms, embedding); pair ratio = dense query-key
pairs / tree pairs. tree / ideal = speedup / ideal (goal >= 0.95). The same decomposition of the
tree step is reported per component against its ideal (the JSON log), which is where a shortfall
is located; tree / ideal per layer kind times one layer of each token-wise kind (M Mamba, - MLP,
E MoE) alone, forward+backward on random hidden states of the rows' shapes (``layer_times``), as
dense / token ratio over tree. Peak memory: above the model state (weights and gradients), with
MiB per 1K tokens of the longest row.

First step: ``--first-step`` runs one pattern in fresh processes (``subprocess``), each timing
its start-up: imports, model build, the first step of the GRPO star batch, then the first step of
rows of a length not seen before and a second one. The first process runs with empty Inductor and
Triton caches (cold), the second with the caches the first left (warm). With
``--first-step-processes N``, N processes start together for each cache state, on the same cache
directories, as the ranks of a job sharing a cache (section of its own).

Times are wall-clock milliseconds of a whole step (synchronized at its end, so host work inside the
step counts), the median of ``--repeats`` steps after two warm-up steps; the set-up line gives the
machine's host cost of one kernel launch with the GPU busy (``benchmark_report.host_launch_us``),
since a short row's synchronized step can follow the host. The "steps queued"
columns time the same steps queued back to back without that synchronization (``queued``), as the
micro-batches of a training step run, where a step's host work overlaps the previous step's GPU
work. The "tables from workers" columns time the synchronized steps with every row's forest tables
built beforehand on the CPU (``tensors.prepare_forest``), as DataLoader workers build them.

Usage:
    python tools/bench_model.py [--patterns moe,nemotron] [--repeats 5] [--first-step moe]
        [--mtp-num-layers N [--mtp-pattern '*-']] [--write docs/benchmarks.md] [--json log.json]
        [--profile] [--kept-memory] [--output-chunk-tokens N] [--attention-backend flash]
        [--first-step moe --first-step-processes N]

With ``--mtp-num-layers N`` every pattern gets N multi-token prediction depths (the cost of MTP:
tree against packed dense, both with MTP on), written to a section of its own; so does
``--output-chunk-tokens N`` (the model's ``shared_prefix_output_chunk_tokens``, tree and packed
dense alike: the time and peak memory of the chunked, recomputed loss), and so does
``--attention-backend flash`` (tree attention on flash_backend). ``--kept-memory`` times
nothing: it tabulates, per layer kind, the memory that autograd keeps for backward on the longest
tree and packed dense rows (``kept_for_backward``), where a difference in peak memory per token is
located.
"""

import argparse
import dataclasses
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

_PROCESS_START = time.perf_counter()

# pylint: disable=wrong-import-position
import numpy as np  # noqa: E402
import torch  # noqa: E402
from benchmark_report import (  # noqa: E402
    agent_tree,
    device_description,
    host_launch_us,
    markdown_table,
    star,
    use_deterministic_mamba_ssm,
    write_section,
)

from megatron.shared_prefix.layout import ForestLayout  # noqa: E402
from megatron.shared_prefix.planning import plan_shared_prefix  # noqa: E402

SECTION = "Whole model (tools/bench_model.py)"
MTP_SECTION = "Whole model with MTP (tools/bench_model.py --mtp-num-layers)"
CHUNK_SECTION = "Whole model with output chunks (tools/bench_model.py --output-chunk-tokens)"
FLASH_SECTION = "Whole model with flash attention (tools/bench_model.py --attention-backend flash)"
FIRST_STEP_SECTION = "Whole model: first step and compilation (tools/bench_model.py --first-step)"
SHARED_CACHE_SECTION = (
    "Whole model: first step of processes sharing a cache (tools/bench_model.py "
    "--first-step-processes)"
)
KEPT_SECTION = "Whole model: memory kept for backward (tools/bench_model.py --kept-memory)"

# Layer patterns: attention + MoE heavy, and a Mamba-heavy Nemotron-H-like one (mostly M and -,
# one attention layer in 13).
PATTERNS = {"moe": "M*-ME*-M", "nemotron": "M-M-M*-M-M-M-"}

PAD_MULTIPLE = 128


def batches():
    """name -> (sequences, loss masks): the benchmark batches (loss on everything after the
    shared root prompt, as GRPO and agent training supervise completions and turns)."""

    def masked(sequences, prompts):
        return sequences, [np.arange(len(s)) >= p for s, p in zip(sequences, prompts)]

    rng = np.random.default_rng(0)
    mix, mix_prompts = [], []
    for group in range(8):
        prompt = int(rng.integers(512, 4097))
        completions = [int(c) for c in rng.integers(64, 2049, size=8)]
        mix += star(prompt, completions, seed=group + 1)
        mix_prompts += [prompt] * len(completions)
    return {
        "GRPO star P=4096, C=1024, G=16": masked(star(4096, [1024] * 16), [4096] * 16),
        "star P=2048, C=2048, G=8": masked(star(2048, [2048] * 8), [2048] * 8),
        "agent depth 3, P=2048, 4 x 512, 4 x 512": masked(agent_tree(2048, 512, 4, 4), [2048] * 16),
        "GRPO mix, 8 prompts x 8 (P 512-4096, C 64-2048)": masked(mix, mix_prompts),
    }


def _concatenate(layouts, pad_multiple):
    """One row holding ``layouts`` side by side (each a forest of its own), padded with one trailing
    root segment of padding to a multiple of ``pad_multiple``."""
    tokens, positions, multiplicity = [], [], []
    starts, lengths, parents = [], [], []
    edges = {name: [] for name in ("source", "target", "sequence", "position")}
    sequence_ids, last_index = [], []
    offset = segments = 0
    for layout in layouts:
        tokens.append(layout.tokens)
        positions.append(layout.position_ids)
        multiplicity.append(layout.token_multiplicity)
        starts.append(layout.segment_starts + offset)
        lengths.append(layout.segment_lengths)
        parents.append(np.where(layout.segment_parents >= 0, layout.segment_parents + segments, -1))
        edges["source"].append(layout.edge_source + offset)
        edges["target"].append(layout.edge_target)
        edges["sequence"].append(layout.edge_sequence)
        edges["position"].append(layout.edge_position)
        sequence_ids.append(layout.sequence_ids)
        last_index.append(layout.sequence_last_index + offset)
        offset += layout.num_tokens
        segments += len(layout.segment_lengths)
    padding = -offset % pad_multiple
    if padding:
        tokens.append(np.zeros(padding, dtype=np.int64))
        positions.append(np.arange(padding))
        multiplicity.append(np.zeros(padding, dtype=np.int64))
        starts.append([offset])
        lengths.append([padding])
        parents.append([-1])
    return ForestLayout(
        tokens=np.concatenate(tokens),
        position_ids=np.concatenate(positions),
        segment_starts=np.concatenate(starts),
        segment_lengths=np.concatenate(lengths),
        segment_parents=np.concatenate(parents),
        token_multiplicity=np.concatenate(multiplicity),
        edge_source=np.concatenate(edges["source"]),
        edge_target=np.concatenate(edges["target"]),
        edge_sequence=np.concatenate(edges["sequence"]),
        edge_position=np.concatenate(edges["position"]),
        sequence_ids=np.concatenate(sequence_ids),
        sequence_last_index=np.concatenate(last_index),
    )


def dense_rows(sequences, loss_masks, capacity, pad_multiple=PAD_MULTIPLE):
    """Rows of the packed dense baseline: every sequence its own root (no token shared), packed
    first-fit in input order into rows of at most ``capacity`` tokens once padded to
    ``pad_multiple``.

    Edge ``(s, j)`` has the same target and context as in the tree plan, so both compute the same
    losses; ``edge_sequence`` indexes ``sequences``.
    """

    def padded(tokens):
        return tokens + (-tokens % pad_multiple)

    rows, used = [], []
    for index, (sequence, mask) in enumerate(zip(sequences, loss_masks)):
        alone = plan_shared_prefix([sequence], [mask], capacity=len(sequence)).rows[0]
        alone = dataclasses.replace(
            alone,
            edge_sequence=np.full_like(alone.edge_sequence, index),
            sequence_ids=np.array([index]),
        )
        if padded(len(sequence)) > capacity:
            raise ValueError(
                f"sequence {index} ({len(sequence)} tokens) exceeds capacity {capacity}"
            )
        slot = next(
            (i for i, tokens in enumerate(used) if padded(tokens + len(sequence)) <= capacity),
            None,
        )
        if slot is None:
            rows.append([])
            used.append(0)
            slot = len(rows) - 1
        rows[slot].append(alone)
        used[slot] += len(sequence)
    return [_concatenate(row, pad_multiple) for row in rows]


def attention_pairs(rows) -> int:
    """Query-key pairs the tree mask admits over ``rows``: each real token attends its root path
    (position + 1 keys)."""
    return int(
        sum((row.position_ids[: row.num_tokens - row.num_padding] + 1).sum() for row in rows)
    )


def component_ideal(dense_ms, attention_ms, output_ms, token_ratio, pair_ratio):
    """The speedup over packed dense of an implementation whose token-wise work scales with the
    token ratio, attention with the pair ratio, and the output layer not at all (same targets).

    ``attention_ms`` and ``output_ms`` are the packed dense step's attention and output-layer
    times; the rest of ``dense_ms`` is token-wise.
    """
    token_wise = dense_ms - attention_ms - output_ms
    if token_wise < 0:
        raise ValueError(
            f"components exceed the step: attention {attention_ms} + output {output_ms} > "
            f"{dense_ms} ms"
        )
    return dense_ms / (token_wise / token_ratio + attention_ms / pair_ratio + output_ms)


def padded_micro_batches(sequences, loss_masks, capacity):
    """Right-padded micro-batches for the plain HybridModel: (tokens [b, L], labels [b, L],
    label mask [b, L]) of ``capacity // L`` sequences each, L the longest sequence."""
    longest = max(len(s) for s in sequences)
    size = max(1, capacity // longest)
    out = []
    for first in range(0, len(sequences), size):
        chunk = range(first, min(first + size, len(sequences)))
        tokens = np.zeros((len(chunk), longest), dtype=np.int64)
        mask = np.zeros((len(chunk), longest), dtype=np.float32)
        for row, index in enumerate(chunk):
            sequence = np.asarray(sequences[index])
            tokens[row, : len(sequence)] = sequence
            # Position j - 1 predicts target j.
            mask[row, : len(sequence) - 1] = np.asarray(loss_masks[index])[1:]
        labels = np.roll(tokens, -1, axis=1)
        out.append((tokens, labels, mask))
    return out


def model_config(pattern, hidden, heads, groups):
    """bf16 TransformerConfig of the benchmark model (8 experts, top-2; Mamba head dim 64,
    state 128, 8 groups); a pattern ``"<main>/<depth 1>/..."`` adds one MTP depth per ``/``."""
    from megatron.core.transformer import TransformerConfig

    moe = "E" in pattern
    main_layers = pattern.split("/")[0]
    return TransformerConfig(
        num_layers=len(main_layers),
        mtp_num_layers=pattern.count("/") or None,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=128,
        ffn_hidden_size=4 * hidden,
        **(
            {"num_moe_experts": 8, "moe_router_topk": 2, "moe_ffn_hidden_size": hidden}
            if moe
            else {}
        ),
        mamba_state_dim=128,
        mamba_head_dim=64,
        mamba_num_groups=8,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        add_bias_linear=False,
        normalization="RMSNorm",
        bf16=True,
        params_dtype=torch.bfloat16,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        gradient_accumulation_fusion=False,
        # The padded baseline's fused Mamba path needs causal-conv1d; forests never take it.
        use_mamba_mem_eff_path=False,
    )


def model_pattern(name, args):
    """The hybrid_layer_pattern of ``PATTERNS[name]`` with ``args.mtp_num_layers`` MTP depths of
    ``args.mtp_pattern`` each."""
    return PATTERNS[name] + f"/{args.mtp_pattern}" * args.mtp_num_layers


def build_model(pattern, args, device):
    """SharedPrefixHybridModel of ``pattern`` (seed 0) on ``device``, every parameter bf16.

    A Megatron ``--bf16`` run wraps the model in Float16Module, which casts every parameter to
    bf16; ``params_dtype`` alone leaves the RMSNorm weights, A_log and D float32, and a bf16 input
    with a float32 norm weight takes PyTorch's unfused RMSNorm.
    """
    from megatron.shared_prefix import SharedPrefixHybridModel, hybrid_stack_spec

    config = model_config(pattern, args.hidden, args.heads, args.query_groups)
    torch.manual_seed(0)
    model = SharedPrefixHybridModel(
        config,
        hybrid_stack_spec=hybrid_stack_spec(
            config.num_moe_experts, attention_backend=getattr(args, "attention_backend", "auto")
        ),
        vocab_size=args.vocab,
        max_sequence_length=8192,
        hybrid_layer_pattern=pattern,
        position_embedding_type="rope",
        shared_prefix_output_chunk_tokens=getattr(args, "output_chunk_tokens", 0),
    )
    return model.to(device, torch.bfloat16)


def _synchronize(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def forest_step(model, rows):
    """One training step's forward+backward over packed rows (sum of edge losses)."""

    def step():
        for layout in rows:
            model(None, None, None, shared_prefix_layout=layout).sum().backward()

    return step


def padded_step(model, micro_batches, device):
    """One training step's forward+backward of the plain HybridModel over padded micro-batches."""
    tensors = [
        tuple(torch.from_numpy(array).to(device) for array in batch) for batch in micro_batches
    ]

    def step():
        for tokens, labels, mask in tensors:
            positions = torch.arange(tokens.shape[1], device=device).expand_as(tokens)
            losses = model(tokens, positions, None, labels=labels)
            (losses.float() * mask).sum().backward()

    return step


def timed(step, repeats, device, warmup=2):
    """(median wall ms of ``step``, peak bytes above the memory held before it)."""
    for _ in range(warmup):
        step()
    _synchronize(device)
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        held = torch.cuda.memory_allocated()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        _synchronize(device)
        times.append(1000 * (time.perf_counter() - start))
    peak = torch.cuda.max_memory_allocated() - held if cuda else 0
    return statistics.median(times), peak


def queued(step, repeats, device):
    """Milliseconds per step of ``repeats`` steps queued back to back behind a lead step, with no
    synchronization between them.

    The micro-batches of a training step run so (megatron-core's schedules do not synchronize
    between micro-batches), and each step's host work then overlaps the GPU work of the step
    before it; ``timed`` synchronizes after every step, so its forward starts on an idle GPU each
    time. On CUDA the time runs between events recorded after the lead step and after the last
    (GPU time, including any wait for the host); elsewhere it is wall time from the lead step's
    end.
    """
    _synchronize(device)
    step()
    if torch.device(device).type != "cuda":
        start = time.perf_counter()
        for _ in range(repeats):
            step()
        return 1000 * (time.perf_counter() - start) / repeats
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def component_times(model, rows, repeats, device):
    """(attention ms, output ms) of ``rows``: every attention layer's core attention and the output
    layer + loss, forward+backward, on random inputs of the rows' shapes.

    With MTP the output layer runs once more per depth, on the depth's row (the same edges, less
    the first ones of each sequence): the output time counts the main row's once per depth too.
    """
    from megatron.shared_prefix.attention.dot_product_attention import TreeDotProductAttention
    from megatron.shared_prefix.models.hybrid.hybrid_model import _edge_losses
    from megatron.shared_prefix.tensors import ForestTensors, forest_scope

    config = model.config
    attention_layers = [m for m in model.modules() if isinstance(m, TreeDotProductAttention)]
    dtype = config.params_dtype
    attention = output = 0.0
    for layout in rows:
        forest = ForestTensors.from_layout(layout, device)
        tokens = layout.num_tokens

        def make(*shape):
            return torch.randn(*shape, device=device, dtype=dtype, requires_grad=True)

        qkv = (
            make(tokens, 1, config.num_attention_heads, config.kv_channels),
            make(tokens, 1, config.num_query_groups, config.kv_channels),
            make(tokens, 1, config.num_query_groups, config.kv_channels),
        )
        hidden = make(tokens, 1, config.hidden_size)

        def attend(qkv=qkv, forest=forest):
            with forest_scope(forest):
                out = attention_layers[0](*qkv, None)
            out.backward(torch.ones_like(out))

        def project(hidden=hidden, forest=forest):
            with forest_scope(forest):
                _edge_losses(model, hidden, forest)[0].sum().backward()

        if attention_layers:
            attention += len(attention_layers) * timed(attend, repeats, device)[0]
        output += (1 + (config.mtp_num_layers or 0)) * timed(project, repeats, device)[0]
    return attention, output


def layer_times(model, rows, repeats, device):
    """{layer symbol: ms}: forward+backward of one decoder layer of each symbol of the model's
    pattern (M Mamba, * attention, - MLP, E MoE) on random hidden states of ``rows``' shapes,
    times the number of layers of that symbol: the token-wise share of a step split per kind."""
    from megatron.shared_prefix.tensors import ForestTensors, forest_scope

    symbols = model.hybrid_layer_pattern.split("/")[0]
    first = {symbol: model.decoder.layers[symbols.index(symbol)] for symbol in set(symbols)}
    times = dict.fromkeys(first, 0.0)
    for layout in rows:
        forest = ForestTensors.from_layout(layout, device)
        hidden = torch.randn(
            layout.num_tokens,
            1,
            model.config.hidden_size,
            device=device,
            dtype=model.config.params_dtype,
            requires_grad=True,
        )
        for symbol, layer in first.items():

            def run(layer=layer, forest=forest):
                with forest_scope(forest):
                    out = layer(hidden, attention_mask=None)
                out = out[0] if isinstance(out, tuple) else out
                out.backward(torch.ones_like(out))

            times[symbol] += symbols.count(symbol) * timed(run, repeats, device)[0]
    return times


def bench_batch(model, name, sequences, loss_masks, args, device):
    """One table row (and its JSON record) for one batch."""
    from megatron.shared_prefix.models.hybrid.hybrid_model import forest_tables
    from megatron.shared_prefix.tensors import prepare_forest

    logical = sum(len(s) for s in sequences)
    tree_rows = plan_shared_prefix(
        sequences, loss_masks, capacity=args.capacity, pad_multiple=PAD_MULTIPLE
    ).rows
    packed_rows = dense_rows(sequences, loss_masks, args.capacity)
    tree_tokens = sum(row.num_tokens for row in tree_rows)
    results, queued_ms = {}, {}
    # As DataLoader workers hand them over (``--num-workers``): every table built on the CPU
    # beforehand, moved to the GPU in the step.
    tables = forest_tables(model, torch.device(device))
    for method, step in (
        ("tree", forest_step(model, tree_rows)),
        ("packed dense", forest_step(model, packed_rows)),
        (
            "tree, tables from workers",
            forest_step(model, [prepare_forest(row, tables) for row in tree_rows]),
        ),
        (
            "packed dense, tables from workers",
            forest_step(model, [prepare_forest(row, tables) for row in packed_rows]),
        ),
        (
            "padded",
            padded_step(model, padded_micro_batches(sequences, loss_masks, args.capacity), device),
        ),
    ):
        model.zero_grad(set_to_none=False)
        try:
            results[method] = timed(step, args.repeats, device)
            if method in ("tree", "packed dense"):
                queued_ms[method] = queued(step, args.repeats, device)
        except torch.cuda.OutOfMemoryError:
            results[method] = None
        torch.cuda.empty_cache()
    tree_ms, tree_peak = results["tree"]
    dense_ms, dense_peak = results["packed dense"]
    token_ratio = logical / tree_tokens
    pair_ratio = attention_pairs(packed_rows) / attention_pairs(tree_rows)
    dense_attention, dense_output = component_times(model, packed_rows, args.repeats, device)
    tree_attention, tree_output = component_times(model, tree_rows, args.repeats, device)
    ideal = component_ideal(dense_ms, dense_attention, dense_output, token_ratio, pair_ratio)
    prepared_tree_ms = results["tree, tables from workers"][0]
    prepared_dense_ms = results["packed dense, tables from workers"][0]
    prepared_ideal = component_ideal(
        prepared_dense_ms, dense_attention, dense_output, token_ratio, pair_ratio
    )
    dense_layers = layer_times(model, packed_rows, args.repeats, device)
    tree_layers = layer_times(model, tree_rows, args.repeats, device)
    dense_token_wise = dense_ms - dense_attention - dense_output
    record = {
        "batch": name,
        "rows tree/dense": f"{len(tree_rows)}/{len(packed_rows)}",
        "tokens logical/tree": f"{logical}/{tree_tokens}",
        "tree tok/s": logical / tree_ms * 1000,
        "packed dense tok/s": logical / dense_ms * 1000,
        "padded tok/s": (
            "OOM" if results["padded"] is None else logical / results["padded"][0] * 1000
        ),
        "speedup": dense_ms / tree_ms,
        "token ratio": token_ratio,
        "pair ratio": pair_ratio,
        "dense shares tok/attn/out": (
            f"{dense_token_wise / dense_ms:.2f}/{dense_attention / dense_ms:.2f}/"
            f"{dense_output / dense_ms:.2f}"
        ),
        "component ideal": ideal,
        "tree / ideal": dense_ms / tree_ms / ideal,
        "speedup, tables from workers": prepared_dense_ms / prepared_tree_ms,
        "tree / ideal, tables from workers": prepared_dense_ms / prepared_tree_ms / prepared_ideal,
        "speedup, steps queued": queued_ms["packed dense"] / queued_ms["tree"],
        "tree / ideal, steps queued": queued_ms["packed dense"] / queued_ms["tree"] / ideal,
        # Per component: dense time / ratio over the tree's time (1.00 = the component is ideal).
        "tree token-wise / ideal": (dense_token_wise / token_ratio)
        / (tree_ms - tree_attention - tree_output),
        "tree attention / ideal": (
            (dense_attention / pair_ratio) / tree_attention if tree_attention else float("nan")
        ),
        # Per token-wise layer kind, alone on random inputs: dense / token ratio over tree.
        "tree / ideal per layer kind": ", ".join(
            f"{symbol} {dense_layers[symbol] / token_ratio / tree_layers[symbol]:.2f}"
            for symbol in "M-E"
            if symbol in tree_layers
        ),
        "peak GiB tree/dense": f"{tree_peak / 2**30:.1f}/{dense_peak / 2**30:.1f}",
        "peak MiB per 1K tokens tree/dense": (
            f"{tree_peak / 2**20 / max(r.num_tokens for r in tree_rows) * 1000:.0f}/"
            f"{dense_peak / 2**20 / max(r.num_tokens for r in packed_rows) * 1000:.0f}"
        ),
    }
    timings = {
        "tree_ms": tree_ms,
        "dense_ms": dense_ms,
        "padded_ms": None if results["padded"] is None else results["padded"][0],
        "tree_prepared_ms": prepared_tree_ms,
        "dense_prepared_ms": prepared_dense_ms,
        "tree_queued_ms": queued_ms["tree"],
        "dense_queued_ms": queued_ms["packed dense"],
        "dense_attention_ms": dense_attention,
        "dense_output_ms": dense_output,
        "tree_attention_ms": tree_attention,
        "tree_output_ms": tree_output,
        "dense_layer_ms": dense_layers,
        "tree_layer_ms": tree_layers,
        "tree_row_tokens": [int(r.num_tokens) for r in tree_rows],
        "dense_row_tokens": [int(r.num_tokens) for r in packed_rows],
    }
    return record, timings


def kept_for_backward(model, layout):
    """{component: bytes} that autograd keeps for backward after one forest forward of ``layout``
    (what a step holds at its peak besides weights, gradients and the backward's temporaries).

    Every distinct storage that an autograd node saves counts once, for the component that saved
    it first; parameters do not count. The hook keeps a detached alias: the tensor itself would
    tie every node that saves its own output into a cycle that outlives the forward. Components:
    the layer symbols of the model's main pattern (all layers of a symbol together: M Mamba,
    * attention, - MLP, E MoE), "embedding", "MTP" (every depth), and "output" (the final norm,
    the output layer and the loss: the rest of the model).
    """
    main_layers = model.hybrid_layer_pattern.split("/")[0]

    def component(name):
        parts = name.split(".")
        if parts[0] in ("embedding", "rotary_pos_emb"):
            return "embedding"
        if name.startswith("decoder.layers."):
            return main_layers[int(parts[2])]
        return "MTP" if parts[0] == "mtp" else "output"

    owner = {module: component(name) for name, module in model.named_modules()}
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    running, kept = ["output"], {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters and storage.data_ptr() not in kept:
            kept[storage.data_ptr()] = (running[-1], storage.nbytes())
        return tensor.detach()

    def enter(module, _):
        running.append(owner[module])

    def leave(*_):
        running.pop()

    handles = []
    for module in owner:
        handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = model(None, None, None, shared_prefix_layout=layout).sum()
    finally:
        for handle in handles:
            handle.remove()
    del loss
    totals = {}
    for name, size in kept.values():
        totals[name] = totals.get(name, 0) + size
    return totals


def kept_memory_record(model, name, sequences, loss_masks, args):
    """One row of the ``--kept-memory`` table: per component, MiB kept for backward per 1K tokens
    of the longest tree row and of the longest packed dense row."""
    tree_rows = plan_shared_prefix(
        sequences, loss_masks, capacity=args.capacity, pad_multiple=PAD_MULTIPLE
    ).rows
    packed_rows = dense_rows(sequences, loss_masks, args.capacity)
    record = {"batch": name}
    kept = {}
    for method, rows in (("tree", tree_rows), ("dense", packed_rows)):
        longest = max(rows, key=lambda row: row.num_tokens)
        record[f"{method} row tokens"] = longest.num_tokens
        kept[method] = {
            key: value / 2**20 / longest.num_tokens * 1000
            for key, value in kept_for_backward(model, longest).items()
        }
    names = sorted(set(kept["tree"]) | set(kept["dense"]), key=_component_order)
    for key in [*names, "total"]:
        tree, dense = (
            sum(kept[m].values()) if key == "total" else kept[m].get(key, 0.0)
            for m in ("tree", "dense")
        )
        record[f"{key} tree/dense"] = f"{tree:.1f}/{dense:.1f}"
    return record


def _component_order(name):
    order = ["embedding", "M", "*", "-", "E", "MTP", "output"]
    return order.index(name) if name in order else len(order)


def profile_step(model, rows, device, label):
    """Top CUDA kernels and the host synchronizations of one step over ``rows``."""
    from torch.profiler import ProfilerActivity, profile

    step = forest_step(model, rows)
    step()
    _synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        _synchronize(device)
    events = prof.key_averages()
    print(f"--- profile: {label}")
    print(events.table(sort_by="self_cuda_time_total", row_limit=25))
    syncs = {
        e.key: e.count
        for e in events
        if any(word in e.key for word in ("Synchronize", "aten::item", "aten::nonzero", "DtoH"))
        or e.key == "cudaMemcpyAsync"
    }
    print(f"host synchronizations and copies per step: {syncs}")


# New row lengths of the first-step measurement: (key, completion length of a GRPO star of a
# 4096-token prompt and 16 completions). 20096 and 20352 tokens run the dynamic-shape attention
# kernel; 24576 is a bucket, a static kernel of its own.
NEW_LENGTHS = (("new_length", 1000), ("second_new_length", 1010), ("new_bucket_length", 1280))


def first_step_child(pattern, args):
    """Run in a fresh process: seconds from process start to imports, model build, the
    ``--first-step-precompile`` of the attention kernels, the first step, and the first steps at
    new row lengths (as extra seconds over the same step repeated)."""
    from megatron.shared_prefix.attention.dot_product_attention import precompile_tree_attention
    from megatron.shared_prefix.models.hybrid.hybrid_model import precompile_edge_loss
    from megatron.shared_prefix.ssm.mamba_mixer import precompile_tree_mamba
    from megatron.shared_prefix.training.distributed import init_single_process

    times = {"imports_s": time.perf_counter() - _PROCESS_START}
    init_single_process("cuda")
    model = build_model(model_pattern(pattern, args), args, "cuda")
    torch.cuda.synchronize()
    times["model_built_s"] = time.perf_counter() - _PROCESS_START
    if args.first_step_precompile != "off":
        precompile_tree_attention(
            model,
            args.capacity,
            mode=args.first_step_precompile,
            dtype=model.config.params_dtype,
            device="cuda",
        )
        torch.cuda.synchronize()
        times["attention_precompiled_s"] = time.perf_counter() - _PROCESS_START
        precompile_tree_mamba(
            model,
            args.capacity,
            dtype=model.config.params_dtype,
            device="cuda",
            multiple=PAD_MULTIPLE,
        )
        precompile_edge_loss(model, dtype=model.config.params_dtype, device="cuda")
        torch.cuda.synchronize()
    times["precompiled_s"] = time.perf_counter() - _PROCESS_START
    sequences, masks = batches()["GRPO star P=4096, C=1024, G=16"]
    rows = plan_shared_prefix(
        sequences, masks, capacity=args.capacity, pad_multiple=PAD_MULTIPLE
    ).rows
    forest_step(model, rows)()
    torch.cuda.synchronize()
    times["first_step_done_s"] = time.perf_counter() - _PROCESS_START
    for key, completion in NEW_LENGTHS:
        new_sequences = star(4096, [completion] * 16, seed=3)
        new_masks = [np.arange(len(s)) >= 4096 for s in new_sequences]
        new_rows = plan_shared_prefix(
            new_sequences, new_masks, capacity=args.capacity, pad_multiple=PAD_MULTIPLE
        ).rows
        step = forest_step(model, new_rows)
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        first = time.perf_counter() - start
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times[f"{key}_extra_s"] = first - (time.perf_counter() - start)
        times[f"{key}_row_tokens"] = [int(r.num_tokens) for r in new_rows]
    print("FIRST_STEP " + json.dumps(times), flush=True)


def first_steps(pattern, args):
    """Cold- and warm-cache first-step times of ``pattern`` in fresh processes, for each mode of
    ``--first-step-precompile`` (caches of their own per mode)."""
    results = {}
    for mode in args.first_step_precompile.split(","):
        results.update(_first_steps(pattern, mode, args))
    return results


def cache_entries(directory) -> int:
    """Files under ``directory`` (0 if it does not exist): what a phase added to a compile cache."""
    return sum(len(files) for _, _, files in os.walk(directory))


def _first_steps(pattern, mode, args):
    """Cold then warm: ``--first-step-processes`` children started together on one cache."""
    cache = tempfile.mkdtemp(prefix="bench_model_cache_")
    env = dict(
        os.environ,
        TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"),
        TRITON_CACHE_DIR=os.path.join(cache, "triton"),
    )
    processes = getattr(args, "first_step_processes", 1)
    command = [sys.executable, os.path.abspath(__file__), "--first-step-child", pattern]
    command += ["--capacity", str(args.capacity), "--mtp-num-layers", str(args.mtp_num_layers)]
    command += ["--mtp-pattern", args.mtp_pattern, "--first-step-precompile", mode]
    results = {}
    for cache_state in ("cold", "warm"):
        label = f"{cache_state}, precompile {mode}"
        before = {
            kind: cache_entries(env[f"{kind}_CACHE_DIR"]) for kind in ("TRITON", "TORCHINDUCTOR")
        }
        # Output to files, not pipes: a child whose pipe filled while another was waited for
        # would stall, and its times with it.
        logs = [
            (tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in range(processes)
        ]
        children = [
            subprocess.Popen(command, env=env, stdout=stdout, stderr=stderr, text=True)
            for stdout, stderr in logs
        ]
        for child in children:
            child.wait(timeout=900)
        outputs = [tuple(_read_and_close(handle) for handle in pair) for pair in logs]
        added = {
            f"{kind.lower()}_files_added": cache_entries(env[f"{kind}_CACHE_DIR"]) - count
            for kind, count in before.items()
        }
        for index, (child, (stdout, stderr)) in enumerate(zip(children, outputs)):
            name = label if processes == 1 else f"{label}, process {index + 1} of {processes}"
            if child.returncode:
                raise RuntimeError(f"{name} first-step process failed:\n{stderr[-4000:]}")
            line = next(l for l in stdout.splitlines() if l.startswith("FIRST_STEP "))
            results[name] = {**json.loads(line[len("FIRST_STEP ") :]), **added}
            print(name, results[name], flush=True)
    return results


def _read_and_close(handle) -> str:
    """The whole text a child wrote to the temporary file ``handle``, which is then closed."""
    with handle:
        handle.seek(0)
        return handle.read()


def _section(args, tables):
    if getattr(args, "kept_memory", False):
        return KEPT_SECTION
    if args.mtp_num_layers:
        return MTP_SECTION
    if getattr(args, "output_chunk_tokens", 0):
        return CHUNK_SECTION
    if getattr(args, "attention_backend", "auto") == "flash":
        return FLASH_SECTION
    if not tables and getattr(args, "first_step_processes", 1) > 1:
        return SHARED_CACHE_SECTION
    return SECTION if tables else FIRST_STEP_SECTION


def markdown(tables, first, command, args, host_us=None):
    """The benchmark section: command, set-up, one table per pattern, first-step times;
    ``host_us``: the machine's launch costs (``host_launch_us``), written beside the device."""
    device = device_description(torch.cuda.get_device_name(), host_us)
    notes = (
        f" Multi-token prediction: {args.mtp_num_layers} depths of pattern "
        f"`{args.mtp_pattern}`, each on its own forest row; the step includes their losses "
        "(megatron-core's MTP loss scaling), and their output layers count as output in the "
        "component ideal (timed as the main row's output layer)."
        if args.mtp_num_layers
        else ""
    )
    chunks = getattr(args, "output_chunk_tokens", 0)
    if chunks:
        notes += (
            f" Output chunks: the output layer and loss of every forest row (tree and packed "
            f"dense) run over {chunks} sources at a time, each chunk recomputed in the backward."
        )
    if getattr(args, "attention_backend", "auto") == "flash":
        notes += (
            " Attention: tree_backend 'flash', tree and packed dense alike (flash_backend: flash "
            "attention passes, the segments, then one per ancestor depth); the attention share is "
            "timed on the same backend."
        )
    if getattr(args, "kept_memory", False):
        setup = (
            f"Device: {device}. Model as in the whole-model table (hidden "
            f"{args.hidden}, vocabulary {args.vocab}, bf16). MiB that autograd keeps for backward "
            "after the forward of the longest tree row and of the longest packed dense row of "
            "each batch (distinct saved storages, parameters excluded, each counted for the "
            "component that saved it first), per 1K tokens of that row; components: the layer "
            "symbols of the pattern (all layers of a symbol together), embedding, MTP, and "
            "output (final norm, output layer and loss)." + notes
        )
    else:
        setup = (
            f"Device: {device}. Model: hidden {args.hidden}, {args.heads} "
            f"heads x 128 ({args.query_groups} key/value groups), MLP {4 * args.hidden}, 8 "
            f"experts top-2 of {args.hidden}, Mamba 64-dim heads, state 128, 8 groups, "
            f"vocabulary {args.vocab}, bf16; local (non-TE) modules. A step is forward+backward "
            f"of every row of the batch (rows of at most {args.capacity} tokens, padded to a "
            f"multiple of 128), wall time, median of {args.repeats} steps. tree: prefix forests; "
            "packed dense: the same model, every sequence its own root (THD packing); padded: "
            "the plain HybridModel forward on right-padded micro-batches of "
            f"{args.capacity} // longest sequences (stock DotProductAttention, unfused Mamba, "
            "output layer over every position). tok/s: logical tokens per second. component "
            "ideal = dense / (token-wise / token ratio + attention / pair ratio + output), the "
            "packed dense step split into its measured attention (FlexAttention "
            "forward+backward at its row shapes), output layer + loss (same targets: ratio 1; "
            "with MTP once per depth as well) and the rest (dense shares column); tree "
            "token-wise / ideal and tree attention / ideal apply the same split to the tree "
            "step; tables from workers: the same synchronized steps, tree and packed dense, "
            "with every row's forest tables built on the CPU beforehand (as --num-workers "
            "DataLoader workers build them) and moved to the GPU in the step, the ideal "
            "recomputed from that dense step; steps queued: the same steps, tree and packed "
            "dense, queued back to back "
            f"with no synchronization between them ({args.repeats} behind a lead step, GPU time "
            "per step), as the micro-batches of a longer training step run: each step's host "
            "work overlaps the GPU work of the step before it, where the synchronized steps "
            "start their forward on an idle GPU; tree / ideal per layer kind: one layer of each "
            "token-wise kind (M, -, E) timed alone on random inputs of the rows' shapes, dense / token ratio over tree. "
            "Peak: memory above weights and gradients, and per 1K tokens of the longest "
            "row." + notes
        )
    lines = [f"## {_section(args, tables)}", "", f"Command: `{command}`", "", setup, ""]
    for pattern, rows in tables.items():
        lines += [f"Pattern `{model_pattern(pattern, args)}` ({pattern}):", ""]
        lines += markdown_table(rows) + [""]
    if first:
        lines += [
            "First step in a fresh process (`--first-step "
            f"{first['pattern']}`, GRPO star batch; seconds from process start; cold: empty "
            "Inductor and Triton caches, warm: the caches of the cold run of the same mode; "
            "imports_s: the imports of torch, megatron-core, mamba_ssm and this project, before "
            "any of its work; precompile: `--shared-prefix-precompile` of the tree attention "
            "(done by attention_precompiled_s), Mamba and edge-loss kernels (then done by "
            f"precompiled_s) for rows up to {args.capacity} tokens, multiples of {PAD_MULTIPLE} as every row "
            "of the benchmark (as under the flag, where rows are multiples of 16: one Mamba "
            "warm-up row per chunk count); new lengths: extra "
            "seconds of the first step at row lengths not seen before, over the same step "
            "repeated: 20096 and 20352 tokens (not buckets), then 24576 (a bucket)"
            + _processes_note(args)
            + "):",
            "",
        ]
        keys = (
            "imports_s",
            "model_built_s",
            "attention_precompiled_s",
            "precompiled_s",
            "first_step_done_s",
            *(f"{key}_extra_s" for key, _ in NEW_LENGTHS),
            *(
                ("triton_files_added", "torchinductor_files_added")
                if getattr(args, "first_step_processes", 1) > 1
                else ()
            ),
        )
        first_rows = [
            {"cache": label, **{key: values.get(key, "") for key in keys}}
            for label, values in first.items()
            if label != "pattern"
        ]
        lines += markdown_table(first_rows) + [""]
    return "\n".join(lines)


def _processes_note(args):
    processes = getattr(args, "first_step_processes", 1)
    if processes == 1:
        return ""
    return (
        f"; {processes} processes started together on one GPU for each cache state, sharing "
        "one TRITON_CACHE_DIR and TORCHINDUCTOR_CACHE_DIR, as the ranks of a job on a shared "
        "file system; files added: what the cache directories gained while those processes "
        "ran, together"
    )


def main():
    """Benchmark every pattern and batch, then the first steps; print and write the section."""
    use_deterministic_mamba_ssm()  # before anything imports mamba_ssm, here and in the children
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--patterns", default="moe,nemotron", help=f"of {sorted(PATTERNS)}")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--query-groups", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--capacity", type=int, default=32768, help="tokens per row")
    parser.add_argument(
        "--mtp-num-layers", type=int, default=0, help="multi-token prediction depths (0: none)"
    )
    parser.add_argument("--mtp-pattern", default="*-", help="layer pattern of each MTP depth")
    parser.add_argument(
        "--output-chunk-tokens",
        type=int,
        default=0,
        help="the models' shared_prefix_output_chunk_tokens (0: the whole row's loss at once)",
    )
    parser.add_argument(
        "--attention-backend",
        choices=("auto", "flash"),
        default="auto",
        help="the models' tree attention backend (hybrid_stack_spec's attention_backend)",
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--first-step", help="also time fresh processes of this pattern")
    parser.add_argument(
        "--first-step-precompile",
        default="off",
        help="comma-separated --shared-prefix-precompile modes of the first-step processes "
        "(off, dynamic, buckets)",
    )
    parser.add_argument(
        "--first-step-processes",
        type=int,
        default=1,
        help="first-step processes started together on one shared cache (as the ranks of a "
        "job; default 1)",
    )
    parser.add_argument("--first-step-child", help=argparse.SUPPRESS)
    parser.add_argument("--profile", action="store_true", help="profile one tree and dense step")
    parser.add_argument(
        "--kept-memory",
        action="store_true",
        help="instead of timing, tabulate per layer kind the memory kept for backward (tree "
        "and packed dense rows)",
    )
    parser.add_argument("--json", help="write every measurement here")
    parser.add_argument("--write", help="markdown file whose section to replace with the results")
    args = parser.parse_args()
    if args.first_step_processes < 1:
        parser.error(f"--first-step-processes must be >= 1, got {args.first_step_processes}")
    if args.first_step_child:
        first_step_child(args.first_step_child, args)
        return
    from megatron.shared_prefix.training.distributed import init_single_process

    init_single_process("cuda")
    host_us = host_launch_us()
    tables, log = {}, {"patterns": {}, "host_launch_us": host_us}

    def save():
        if args.json:
            with open(args.json, "w", encoding="utf-8") as handle:
                json.dump(log, handle, indent=1)

    for pattern in filter(None, args.patterns.split(",")):
        model = build_model(model_pattern(pattern, args), args, "cuda")
        tables[pattern], log["patterns"][pattern] = [], []
        for name, (sequences, masks) in batches().items():
            if args.kept_memory:
                record = kept_memory_record(model, name, sequences, masks, args)
                tables[pattern].append(record)
                log["patterns"][pattern].append(record)
                save()
                print(pattern, record, flush=True)
                continue
            record, timings = bench_batch(model, name, sequences, masks, args, "cuda")
            tables[pattern].append(record)
            log["patterns"][pattern].append({**record, **timings})
            save()
            print(pattern, record, timings, flush=True)
            if args.profile and name.startswith("GRPO star"):
                tree_rows = plan_shared_prefix(
                    sequences, masks, capacity=args.capacity, pad_multiple=PAD_MULTIPLE
                ).rows
                profile_step(model, tree_rows, "cuda", f"{pattern} tree, {name}")
                profile_step(
                    model, dense_rows(sequences, masks, args.capacity), "cuda", f"{pattern} dense"
                )
        del model
        torch.cuda.empty_cache()
    first = None
    if args.first_step:
        first = {"pattern": args.first_step, **first_steps(args.first_step, args)}
        log["first_step"] = first
        save()
    section = markdown(tables, first, "python " + shlex.join(sys.argv), args, host_us)
    print(section)
    if args.write:
        write_section(args.write, section)


if __name__ == "__main__":
    main()
