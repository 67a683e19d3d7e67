"""HybridModel that trains on packed prefix forests (upstream:
megatron/core/models/hybrid/hybrid_model.py).

``SharedPrefixHybridModel.forward(..., shared_prefix_layout=layout)`` runs the model once over the
unique tokens of a forest row and returns the per-edge cross entropy: one value per supervised
target of every original sequence in the row, equal to that sequence's dense per-token loss.
Without a layout the forward is HybridModel.forward, unchanged.

With multi-token prediction (a pattern ``"<main>/<mtp>/..."``), every MTP depth runs on its own
forest row (``megatron.shared_prefix.mtp_layout``, built once per row) through megatron-core's MTP
layers, and its per-edge losses are taken at the main edges' sources. They enter training as in
HybridModel (``process_mtp_loss``, the row being the micro-batch), or are returned per edge with
``shared_prefix_mtp_losses=True`` for the caller to weight.
"""

import dataclasses
from typing import NamedTuple, Optional

import numpy as np
import torch
import torch.utils.checkpoint
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.hybrid.hybrid_model import HybridModel
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.multi_token_prediction import (
    MTPLossAutoScaler,
    MTPLossLoggingHelper,
)
from megatron.core.utils import make_viewless_tensor
from torch import Tensor

from megatron.shared_prefix.context_parallel import context_parallel_edges
from megatron.shared_prefix.layout import ForestLayout
from megatron.shared_prefix.models.hybrid.validation import (
    row_length_multiple,
    validate_forest_forward,
)
from megatron.shared_prefix.mtp_layout import mtp_forests
from megatron.shared_prefix.tensor_parallel import cross_entropy
from megatron.shared_prefix.tensor_parallel.context_parallel import (
    share_over_context_parallel,
    whole_row,
)
from megatron.shared_prefix.tensor_parallel.cross_entropy import (
    vocab_parallel_edge_cross_entropy,
    vocab_parallel_edge_prediction_matches,
)
from megatron.shared_prefix.tensor_parallel.random import bracket_for_recompute
from megatron.shared_prefix.tensors import (
    ForestTable,
    ForestTensors,
    forest_scope,
    host_to_device,
    rank_split,
)


class ForestLosses(NamedTuple):
    """Per-edge losses of a forest forward with ``shared_prefix_mtp_losses=True``.

    ``E`` edges (this rank's ``context_parallel_edges`` under context parallelism), ``D`` MTP
    depths (0 for a model without MTP layers).

    Attributes:
        edge_loss: [E] float32 main loss of every edge (what the forward returns otherwise).
        mtp_edge_loss: [D, E] float32 loss of MTP depth ``d + 1`` for edge ``(s, j)``: the dense
            loss of that depth at position ``j - 2 - d``, which predicts the same target; NaN where
            the edge has no target at that depth (``j <= d + 1``).
        mtp_edge_correct: [D, E] bool, whether that depth's most likely token (full-vocabulary
            argmax, as megatron-core's MTP acceptance rate) is the target; False where NaN above.
    """

    edge_loss: Tensor
    mtp_edge_loss: Tensor
    mtp_edge_correct: Tensor


def forest_forward(
    model: HybridModel,
    layout: ForestLayout | ForestTensors,
    *,
    mtp_losses: bool = False,
    **forward_args,
):
    """The forest forward of ``model`` (a HybridModel built from ``hybrid_stack_spec()``).

    A function of the model rather than a method, so that HybridModel.forward can hand a
    ``shared_prefix_layout`` to it directly; the subclass below does the same.

    Args:
        model: the HybridModel.
        layout: the row to run: a ForestLayout, or its ForestTensors built ahead on the CPU with
            the model's ``forest_tables`` (``tensors.prepare_forest``, as DataLoader workers
            build them), moved to the model's device here in one transfer.
        mtp_losses: return :class:`ForestLosses` instead of attaching the MTP loss
            (``shared_prefix_mtp_losses`` of SharedPrefixHybridModel.forward).
        forward_args: HybridModel.forward's other arguments by name (input_ids, position_ids,
            attention_mask, decoder_input, labels, inference_context, inference_params, loss_mask,
            packed_seq_params, padding_mask, runtime_gather_output); everything the layout
            defines must be None.

    Returns:
        On the last pipeline stage the per-edge float32 cross entropy (or :class:`ForestLosses`),
        on the others the stage's output hidden states (see SharedPrefixHybridModel.forward).
    """
    forward_args.pop("runtime_gather_output", None)
    prepared = layout if isinstance(layout, ForestTensors) else None
    layout = layout if prepared is None else prepared.layout
    validate_forest_forward(model, layout, **forward_args)
    if prepared is None:
        forest = ForestTensors.from_layout(layout, _device(model))
    else:
        forest = prepared.to(_device(model))
    with forest_scope(forest):
        hidden_states = _forest_stack(model, forest)
        if not model.post_process:
            # The schedule frees a stage's output after sending it: it must own its storage.
            return make_viewless_tensor(
                hidden_states, requires_grad=hidden_states.requires_grad, keep_graph=True
            )
        edge_loss = _edge_losses(model, hidden_states, forest)[0]
    if getattr(model, "mtp_process", False):
        mtp_loss, mtp_correct = _forest_mtp(model, forest, hidden_states)
    elif mtp_losses:
        mtp_loss = edge_loss.new_empty(0, len(edge_loss))
        mtp_correct = torch.zeros(mtp_loss.shape, dtype=torch.bool, device=edge_loss.device)
    else:
        return edge_loss
    if mtp_losses:
        return ForestLosses(edge_loss, mtp_loss, mtp_correct)
    return _attach_mtp_loss(model, forest, edge_loss, mtp_loss, mtp_correct)


def forest_tables(
    model: HybridModel, device: Optional[torch.device] = None
) -> tuple[ForestTable, ...]:
    """What ``model``'s forest forward builds from every row on ``device`` (default: where its
    parameters are; Megatron's model provider builds a model before moving it), as picklable
    requests (``tensors.ForestTable``), without duplicates: the rank's tokens and edge projection,
    then each tree-aware module's tables (Mamba scan and conv, attention block tables, MoE
    routing). ``tensors.prepare_forest(layout, forest_tables(model))`` builds them ahead, on the
    CPU; with every one of them built, the forward builds no table of a row, only wrappers around
    them such as FlexAttention's BlockMask (MTP depths' rows excepted: they are built in the
    forward).
    """
    split = rank_split(model.config, model.pg_collection.tp, model.pg_collection.cp)
    # The rank's context-parallel tokens, keyed as the router asks for them (sp 1: the same table).
    tables = [ForestTable(ForestTensors.local_tokens, (split[0], split[1], 1, 0))]
    if model.post_process:
        tables.append(ForestTable(ForestTensors.edge_projection, split))
        chunk_tokens = getattr(model, "shared_prefix_output_chunk_tokens", 0)
        if chunk_tokens:
            chunk_rows = max(1, chunk_tokens // split[2])
            tables.append(ForestTable(ForestTensors.edge_projection_chunks, (chunk_rows, *split)))
    for module in model.modules():
        if module is not model and hasattr(module, "forest_tables"):
            tables.extend(module.forest_tables(torch.device(device or _device(model))))
    return tuple(dict.fromkeys(tables))


def _device(model: HybridModel) -> torch.device:
    return next(model.parameters()).device


def _forest_rotary_pos_emb(model: HybridModel, forest: ForestTensors) -> Optional[Tensor]:
    """[T, 1, 1, D] rotary table rows gathered by each token's position (not packed index); this
    context-parallel rank's tokens."""
    if model.position_embedding_type != "rope":
        return None
    # The whole table, cached by RotaryEmbedding: a packed row is not sliced for context
    # parallelism there; the rows of this rank's tokens are gathered below.
    table = model.rotary_pos_emb(int(forest.layout.position_ids.max()) + 1, packed_seq=True)
    positions = forest.position_ids[0].index_select(0, _context_parallel_tokens(model, forest))
    return table.index_select(0, positions)


def _context_parallel_tokens(model: HybridModel, forest: ForestTensors) -> Tensor:
    """[T / cp] packed indices of this context-parallel rank's tokens (all of them at cp 1)."""
    cp_group = model.pg_collection.cp
    return forest.local_tokens(cp_group.size(), cp_group.rank())


def _forest_stack(model: HybridModel, forest: ForestTensors) -> Tensor:
    """This stage's embeddings (first stage) and layers over the packed row.

    Returns [T, 1, hidden] ([T / tp, 1, hidden] under sequence parallelism). A later pipeline
    stage reads its input from ``set_input_tensor``, as HybridStack does.
    """
    enter, leave = bracket_for_recompute(forest, _device(model))
    decoder_input = None
    if model.pre_process:
        decoder_input = enter(_forest_embeddings(model, forest, forest.position_ids))
    else:
        model.decoder.set_input_tensor(enter(model.decoder.input_tensor))
    hidden_states = model.decoder(
        hidden_states=decoder_input,
        attention_mask=None,
        rotary_pos_emb=_forest_rotary_pos_emb(model, forest),
    )
    return leave(hidden_states)


def _forest_embeddings(model: HybridModel, forest: ForestTensors, position_ids: Tensor) -> Tensor:
    """Embeddings of the forest's tokens at ``position_ids`` ([1, T]), this rank's share:
    [T / cp, 1, hidden] ([T / (cp * tp), 1, hidden] under sequence parallelism)."""
    held = _context_parallel_tokens(model, forest)
    embeddings = model.embedding(
        input_ids=forest.input_ids.index_select(1, held),
        position_ids=position_ids.index_select(1, held),
    )
    if model.config.sequence_parallel and not model.embedding.scatter_to_sequence_parallel:
        embeddings = tensor_parallel.scatter_to_sequence_parallel_region(
            embeddings, group=model.pg_collection.tp
        )
    return embeddings


def _edge_losses(
    model: HybridModel,
    hidden_states: Tensor,
    forest: ForestTensors,
    *,
    detach_output_weight: bool = False,
    with_correct: bool = False,
) -> tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    """Project only the distinct edge sources to the vocabulary; float32 cross entropy of the
    edges this rank owns ([E], or the context-parallel rank's ``context_parallel_edges``).

    Under sequence parallelism each rank selects the sources among its own tokens and the
    output layer's all-gather assembles them (``ForestTensors.edge_projection``); the logits
    stay vocab-parallel. With the model's ``shared_prefix_output_chunk_tokens`` the sources are
    projected that many at a time, each chunk's logits freed after its loss and recomputed in the
    backward (``ForestTensors.edge_projection_chunks``).

    Returns:
        ([E_own] losses, [E_own] bool argmax matches or None, [E_own] owned edge indices or None
        when every edge is owned).
    """
    tp_group = model.pg_collection.tp
    split = rank_split(model.config, tp_group, model.pg_collection.cp)
    local_sources, edge_slot, owned_edges = forest.edge_projection(*split)
    source_states = hidden_states.index_select(0, local_sources)
    output_weight = (
        model.shared_embedding_or_output_weight()
        if model.share_embeddings_and_output_weights
        else None
    )
    if detach_output_weight:
        output_weight = (
            output_weight if output_weight is not None else model.output_layer.weight
        ).detach()

    def project_and_loss(states, slot, targets):
        logits, _ = model.output_layer(states, weight=output_weight, runtime_gather_output=False)
        # [U, 1, V / tp] -> [U, V / tp], a view (whose backward, unlike indexing's, allocates
        # nothing).
        logits = model._scale_logits(logits).squeeze(1)  # pylint: disable=protected-access
        correct = None
        if with_correct:
            correct = vocab_parallel_edge_prediction_matches(logits, slot, targets, tp_group)
        # Nothing reads the logits after the loss: its backward writes their gradient in place.
        loss = vocab_parallel_edge_cross_entropy(
            logits, slot, targets, tp_group, overwrite_logits=True
        )
        return loss, correct

    chunk_tokens = getattr(model, "shared_prefix_output_chunk_tokens", 0)
    chunk_rows = max(1, chunk_tokens // split[2])
    if not chunk_tokens or source_states.shape[0] <= chunk_rows:
        targets = forest.edge_target if owned_edges is None else forest.edge_target[owned_edges]
        loss, correct = project_and_loss(source_states, edge_slot, targets)
        return loss, correct, owned_edges
    chunks, position = forest.edge_projection_chunks(chunk_rows, *split)
    losses, matches = [], []
    for start, stop, slot, targets in chunks:
        # Each chunk's logits are freed after its loss and recomputed in the backward. Without
        # early stop: it ends a recomputation by raising from the pack hook of the last saved
        # tensor, here inside the edge loss's autograd Function; on CUDA with torch 2.11 that
        # exception was lost and the backward failed with a SystemError (docs/benchmarks.md). The
        # recomputation ends there anyway.
        with torch.utils.checkpoint.set_checkpoint_early_stop(False):
            loss, correct = torch.utils.checkpoint.checkpoint(
                project_and_loss,
                source_states[start:stop],
                slot,
                targets,
                use_reentrant=False,
                preserve_rng_state=False,
            )
        losses.append(loss)
        matches.append(correct)
    correct = torch.cat(matches)[position] if with_correct else None
    return torch.cat(losses)[position], correct, owned_edges


@dataclasses.dataclass(frozen=True, eq=False)
class _MTPDepth:
    """One MTP depth's row on the device (``mtp_layout.MTPForest``)."""

    depth: int
    forest: ForestTensors
    embedding_position_ids: Tensor  # [1, T_d]
    input_index: Tensor  # [T_d]
    main_edge_slot: Tensor  # [E]


def _mtp_depths(model: HybridModel, forest: ForestTensors) -> tuple[_MTPDepth, ...]:
    """The rows of the model's MTP depths for ``forest``, built once per forest."""
    num_depths = model.config.mtp_num_layers
    multiple = row_length_multiple(model.config)

    def build():
        device = forest.device

        def on_device(array):
            return host_to_device(np.asarray(array, dtype=np.int64), device)

        return tuple(
            _MTPDepth(
                depth=row.depth,
                forest=ForestTensors.from_layout(row.layout, device),
                embedding_position_ids=on_device(row.embedding_position_ids).unsqueeze(0),
                input_index=on_device(row.input_index),
                main_edge_slot=on_device(row.main_edge_slot),
            )
            for row in mtp_forests(forest.layout, num_depths, multiple)
        )

    return forest.derive(("mtp_depths", num_depths, multiple), build)


def _forest_mtp(
    model: HybridModel, forest: ForestTensors, hidden_states: Tensor
) -> tuple[Tensor, Tensor]:
    """Every MTP depth over its own forest row, as MultiTokenPredictionBlock runs them.

    Args:
        model: the HybridModel, with MTP layers on this (the last) pipeline stage.
        forest: the main row.
        hidden_states: the main stack's output, this rank's share of the row.

    Returns:
        ([D, E] float32 losses, NaN where an edge has no target at a depth; [D, E] bool argmax
        matches), over this rank's edges of the main row (``context_parallel_edges``).
    """
    config = model.config
    tp_group, cp_group = model.pg_collection.tp, model.pg_collection.cp
    cp_size, cp_rank, sp_size, sp_rank = rank_split(config, tp_group, cp_group)
    sp_group = tp_group if sp_size > 1 else None
    main_owned = None
    if cp_size > 1:
        main_owned = host_to_device(
            np.asarray(context_parallel_edges(forest.layout, cp_size, cp_rank), dtype=np.int64),
            forest.device,
        )
    if config.mtp_detach_heads:
        hidden_states = hidden_states.detach()
    losses, matches = [], []
    previous = hidden_states
    for depth in _mtp_depths(model, forest):
        layer = model.mtp.layers[0 if config.mtp_use_repeated_layer else depth.depth - 1]
        # A token's state input may sit on any rank: read it from the whole previous row.
        inputs = whole_row(previous, cp_size, cp_group, sp_group).index_select(
            0,
            depth.input_index.index_select(
                0, depth.forest.local_tokens(cp_size, cp_rank, sp_size, sp_rank)
            ),
        )
        with forest_scope(depth.forest):
            enter, leave = bracket_for_recompute(depth.forest, forest.device)
            states = layer.forward_on_forest(
                enter(inputs),
                _forest_embeddings(model, depth.forest, depth.embedding_position_ids),
                _forest_rotary_pos_emb(model, depth.forest),
            )
            states = leave(states)
            loss, correct, owned = _edge_losses(
                model,
                states,
                depth.forest,
                detach_output_weight=config.mtp_detach_heads,
                with_correct=True,
            )
        losses.append(_on_main_edges(loss, owned, depth, main_owned, cp_group, float("nan")))
        matches.append(_on_main_edges(correct, owned, depth, main_owned, cp_group, False))
        previous = states
    return torch.stack(losses), torch.stack(matches)


def _on_main_edges(values, owned, depth: _MTPDepth, main_owned, cp_group, fill) -> Tensor:
    """A depth's per-edge values ([E_d own], in the depth row's edge order) -> [E own] over the
    main row's edges this rank owns, ``fill`` where an edge has no target at the depth.

    Under context parallelism a depth's edge is computed by the rank holding its source in the
    depth's row, usually not the rank owning it in the main row: every rank contributes its
    edges to one [E_d] vector, summed over the context-parallel group in both passes
    (``share_over_context_parallel``), so each value and its gradient reach the main owner.
    """
    slot = depth.main_edge_slot
    if owned is not None:
        full = values.new_zeros(len(depth.forest.edge_target)).index_copy(0, owned, values)
        if values.dtype == torch.bool:
            full = full.to(torch.int32)
            torch.distributed.all_reduce(full, group=cp_group)
            full = full.bool()
        else:
            full = share_over_context_parallel(full, cp_group)
        values, slot = full, slot.index_select(0, main_owned)
    if values.numel() == 0:
        return torch.full(slot.shape, fill, dtype=values.dtype, device=values.device)
    picked = values.index_select(0, slot.clamp(min=0))
    return torch.where(slot >= 0, picked, torch.full_like(picked, fill))


def _attach_mtp_loss(
    model: HybridModel, forest: ForestTensors, edge_loss: Tensor, mtp_loss, mtp_correct
) -> Tensor:
    """megatron-core's ``process_mtp_loss`` for a forest row as the micro-batch: each depth's
    summed loss, normalized by the row's targets at that depth and scaled by
    ``mtp_loss_scaling_factor / mtp_num_layers``, enters the backward pass through
    MTPLossAutoScaler on the returned ``edge_loss``; in training its mean and acceptance counts
    go to MTPLossLoggingHelper.

    The loss mask is the row's edges, so ``original_num_tokens`` is the row's edge count and a
    depth's ``num_tokens`` its edges with a target there, counted over the whole row (every
    rank holds the layout): under context parallelism the ranks' shares add up to the row's
    normalized loss. Without ``calculate_per_token_loss`` a rank's share is scaled by the
    context-parallel size, which the data x context parallel gradient average divides out again,
    as megatron's schedule scales the main loss.
    """
    config = model.config
    num_depths = config.mtp_num_layers
    scale = config.mtp_loss_scaling_factor / num_depths
    cp_group = model.pg_collection.cp
    positions = forest.layout.edge_position
    for index in range(num_depths):
        num_targets = max(int((positions > index + 1).sum()), 1)
        valid = ~torch.isnan(mtp_loss[index])
        total = torch.where(valid, mtp_loss[index], torch.zeros_like(mtp_loss[index])).sum()
        if config.calculate_per_token_loss:
            factor = len(positions) / num_targets
        else:
            factor = cp_group.size() / num_targets
        edge_loss = MTPLossAutoScaler.apply(edge_loss, total * (scale * factor))
        if model.training:
            MTPLossLoggingHelper.save_metrics_to_tracker(
                total.detach() / num_targets,
                mtp_correct[index].sum().float(),
                valid.sum().float(),
                index,
                num_depths,
                reduce_group=cp_group if cp_group.size() > 1 else None,
                avg_group=parallel_state.get_data_parallel_group(),
            )
    return edge_loss


def precompile_edge_loss(
    model: torch.nn.Module, *, dtype: torch.dtype, device
) -> tuple[int, ...]:
    """Compile, before training, the edge loss's kernels for the output layers of ``model``
    (this pipeline stage's; none without one): one ``cross_entropy.warm_up`` per distinct local
    vocabulary width, in the logits' ``dtype``.

    Returns:
        The vocabulary widths run (empty on a stage without an output layer).
    """
    widths = {
        module.output_layer.output_size_per_partition: None
        for module in model.modules()
        if isinstance(module, SharedPrefixHybridModel) and module.post_process
    }
    for width in widths:
        cross_entropy.warm_up(width, dtype=dtype, device=device)
    return tuple(widths)


class SharedPrefixHybridModel(HybridModel):
    """HybridModel with a forest forward; build it with ``hybrid_stack_spec()``.

    Takes HybridModel's constructor arguments. Every layer of the pattern, MTP depths included,
    must have a module in the stack spec (megatron-core would otherwise build an identity for,
    e.g., ``E`` layers of a spec without experts).

    ``shared_prefix_output_chunk_tokens`` (keyword, default 0: off) bounds the loss's logits: the
    output layer and the edge loss run over that many edge sources at a time (per row, summed over
    the sequence-parallel ranks), and each chunk is recomputed in the backward, so a row holds one
    chunk's [N, V / tp] logits instead of all its sources', for one more output-layer forward. A
    forest row concentrates the supervised targets of every sequence through it on few tokens, so
    at a large vocabulary its logits can dominate its memory. Losses and gradients are those of
    the unchunked loss up to float32 summation order.
    """

    def __init__(self, *args, shared_prefix_output_chunk_tokens: int = 0, **kwargs):
        chunk = shared_prefix_output_chunk_tokens
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
            raise ValueError(
                "SharedPrefixHybridModel: shared_prefix_output_chunk_tokens must be an int >= 0 "
                f"(0: off), got {chunk!r}"
            )
        super().__init__(*args, **kwargs)
        self.shared_prefix_output_chunk_tokens = chunk
        stacks = [("", self.decoder)]
        if getattr(self, "mtp_process", False):
            stacks += [
                (f"MTP depth {index + 1} ", layer.mtp_model_layer)
                for index, layer in enumerate(self.mtp.layers)
            ]
        missing = [
            f"{where}{index} ({symbol})"
            for where, stack in stacks
            for index, (symbol, layer) in enumerate(zip(stack.layer_type_list, stack.layers))
            if isinstance(layer, IdentityOp)
        ]
        if missing:
            raise ValueError(
                f"SharedPrefixHybridModel: layers {', '.join(missing)} of hybrid_layer_pattern "
                "have no module in hybrid_stack_spec (E layers need "
                "hybrid_stack_spec(num_experts=...))"
            )

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor,
        attention_mask: Tensor,
        decoder_input: Tensor = None,
        labels: Tensor = None,
        inference_context=None,
        runtime_gather_output: Optional[bool] = None,
        *,
        inference_params=None,
        loss_mask: Optional[Tensor] = None,
        packed_seq_params=None,
        padding_mask: Optional[Tensor] = None,
        shared_prefix_layout: Optional[ForestLayout | ForestTensors] = None,
        shared_prefix_mtp_losses: bool = False,
    ):
        """HybridModel.forward, or with ``shared_prefix_layout`` the [E] float32 per-edge loss.

        With a layout, ``input_ids`` and ``position_ids`` are the layout's ``tokens`` and
        ``position_ids`` as [1, T] tensors (or None); the returned losses follow the layout's edge
        order. Everything that the layout defines (masks, labels, packing) must not be passed.
        ``shared_prefix_layout`` may also be the row's ForestTensors prepared on the CPU
        (``forest_forward``).

        With MTP layers the MTP loss enters the backward pass as in HybridModel (the row as the
        micro-batch: MTPLossAutoScaler, whose scale megatron's schedule sets, and
        MTPLossLoggingHelper); ``shared_prefix_mtp_losses=True`` returns :class:`ForestLosses`
        (main and per-depth losses of every edge) instead and attaches nothing.

        Under tensor parallelism every rank returns the same [E] (the loss is vocab-parallel, so
        ``runtime_gather_output`` has nothing to gather and is not used). Under pipeline
        parallelism every stage is given the same layout; a stage that is not the last returns its
        output hidden states ([T, 1, hidden], or [T / tp, 1, hidden] with sequence parallelism)
        for the next stage, as HybridModel does.
        """
        if shared_prefix_layout is None:
            if shared_prefix_mtp_losses:
                raise ValueError(
                    "shared_prefix_mtp_losses=True without shared_prefix_layout (per-edge MTP "
                    "losses are those of a forest row)"
                )
            with forest_scope(None):
                return super().forward(
                    input_ids,
                    position_ids,
                    attention_mask,
                    decoder_input=decoder_input,
                    labels=labels,
                    inference_context=inference_context,
                    runtime_gather_output=runtime_gather_output,
                    inference_params=inference_params,
                    loss_mask=loss_mask,
                    packed_seq_params=packed_seq_params,
                    padding_mask=padding_mask,
                )
        return forest_forward(
            self,
            shared_prefix_layout,
            mtp_losses=shared_prefix_mtp_losses,
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            decoder_input=decoder_input,
            labels=labels,
            inference_context=inference_context,
            runtime_gather_output=runtime_gather_output,
            inference_params=inference_params,
            loss_mask=loss_mask,
            packed_seq_params=packed_seq_params,
            padding_mask=padding_mask,
        )
