"""Forest training steps under TP, SP, EP, DP, PP and CP against the TP = 1 dense reference.

Run by torchrun (test_parallel_forests.py launches it): ``parallel_cases.py OUT.json CASE ...``.
Every case, on every rank:

1. builds the TP = 1 model (megatron's layout TP = PP = EP = 1, each rank a data-parallel replica)
   from the case's seed and computes the dense reference of every row of the batch: the row's
   sequences as one right-padded micro-batch through HybridModel.forward with labels (and
   ``padding_mask`` for MoE), the gradient of ``sum(w * loss)`` over all rows, and, for MoE, the
   expert-bias counts of every sequence run alone;
2. re-initializes megatron's parallel state at the case's layout, builds the same model there,
   loads its shard of the TP = 1 weights (``load_full_tensors``) and wraps it in megatron's DDP;
3. trains one step on forests: each data-parallel rank takes its rows as micro-batches through
   megatron's forward-backward schedule (pipelined for PP > 1), then ``finalize_model_grads``
   (data-parallel, sequence-parallel and embedding reductions, as in megatron.training);
4. gathers full gradients and compares them, the per-edge losses and the MoE counts with the
   reference.

Cases with MTP depths either weight every edge's main and per-depth MTP losses
(``shared_prefix_mtp_losses=True``; the reference reads the dense per-token MTP losses where
``process_mtp_loss`` computes them) or train the MTP loss as HybridModel does (``mtp_path
"megatron"``: MTPLossAutoScaler, the reference is the dense batch's own MTP loss with the rows'
loss masks).

Rank 0 writes {case: {"loss_error", "grad_error", "worst_grad", "counts_equal", ...}}; the pytest
side asserts the tolerances.
"""

import dataclasses
import functools
import json
import os
import sys
from typing import Optional

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

# pylint: disable=wrong-import-position
from megatron.shared_prefix.training.distributed import (  # noqa: E402
    init_parallel,
    shutdown_parallel,
)

init_parallel()

import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.distributed import (  # noqa: E402
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler  # noqa: E402
from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler  # noqa: E402
from models.hybrid.dense_reference import (  # noqa: E402
    dense_mtp_losses,
    without_megatron_mtp_gradient,
)
from moe.forests import dense_gather_index, random_sequences, root_paths  # noqa: E402
from tiny import tiny_config  # noqa: E402

from megatron.shared_prefix import (  # noqa: E402
    SharedPrefixHybridModel,
    context_parallel_edges,
    hybrid_stack_spec,
    plan_shared_prefix,
)
from megatron.shared_prefix.moe import TreeTopKRouter  # noqa: E402
from megatron.shared_prefix.tensor_parallel import cross_entropy  # noqa: E402
from megatron.shared_prefix.tensor_parallel.full_tensors import (  # noqa: E402
    gather_full_tensors,
    load_full_tensors,
)

VOCAB = 64
MOE_ROUTING = dict(
    moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"],
    moe_aux_loss_coeff=[1e-2, 2e-2],
    moe_z_loss_coeff=1e-3,
    moe_router_enable_expert_bias=True,
    moe_router_score_function="sigmoid",
)


@dataclasses.dataclass(frozen=True)
class Case:
    """One parallel layout and model; ``pattern`` may hold '|' pipeline-stage boundaries."""

    pattern: str
    tp: int = 1
    sp: bool = False
    ep: int = 1
    etp: Optional[int] = None
    pp: int = 1
    cp: int = 1
    dispatcher: str = "allgather"
    tied: bool = False
    config: tuple = ()
    seed: int = 0
    replay: bool = False
    # "random" forests, or "branch_points": rows whose context-parallel chunk boundaries fall
    # exactly at branch points, one with a root shorter than the Mamba conv window.
    batch: str = "random"
    # MTP: the layer pattern of each depth, the number of depths, and how the loss is trained:
    # "edges" (per-edge MTP losses, weighted by the case) or "megatron" (MTPLossAutoScaler).
    mtp: str = ""
    depths: int = 0
    mtp_path: str = "edges"
    # The parallel model's shared_prefix_output_chunk_tokens (the loss over chunks of sources).
    output_chunk_tokens: int = 0

    @property
    def main_pattern(self) -> str:
        """The decoder's pattern without pipeline-stage boundaries."""
        return self.pattern.replace("|", "")

    def hybrid_layer_pattern(self, parallel: bool) -> str:
        """The model's pattern: the decoder's ('|' boundaries when parallel), MTP depths."""
        main = self.pattern if parallel else self.main_pattern
        return main + "".join("/" + self.mtp for _ in range(self.depths))

    @property
    def equal_rows(self) -> bool:
        """The allgather dispatcher under EP stacks every rank's tokens: rows of one length."""
        return self.ep > 1 and self.dispatcher == "allgather"

    @property
    def moe(self) -> bool:
        return "E" in self.pattern


CASES = {
    "tp2": Case("M*-M*", tp=2, seed=1),
    "tp2_tied_learned": Case("*-M", tp=2, tied=True, seed=2, config=(("learned", True),)),
    "tp2_sp": Case("M*-M*", tp=2, sp=True, seed=3, replay=True),
    "tp2_sp_moe_allgather": Case("M*E-E", tp=2, sp=True, seed=4),
    "tp2_sp_moe_alltoall": Case("*EM", tp=2, sp=True, dispatcher="alltoall", seed=5, replay=True),
    "ep2_dp2_allgather": Case("M*E", ep=2, seed=6),
    "ep2_dp2_alltoall": Case("*E-E", ep=2, dispatcher="alltoall", seed=7),
    "pp2": Case("M*|-M*", pp=2, dispatcher="alltoall", seed=8),
    "pp2_moe_tied": Case("*E|M-", pp=2, tied=True, dispatcher="alltoall", seed=9),
    "dp2": Case("M*-E", seed=10),
    "cp2": Case("M*-M*", cp=2, seed=15, replay=True),
    "cp2_moe_tied": Case("*EM-", cp=2, tied=True, seed=16),
    "cp2_branch_points": Case("M*M", cp=2, seed=17, batch="branch_points"),
    "cp4": Case("M*E", cp=4, seed=18),
    "cp4_branch_points": Case("*M-", cp=4, seed=19, batch="branch_points"),
    "cp2_tp2_sp": Case("M*E-", tp=2, sp=True, cp=2, seed=20),
    "cp2_ep2_alltoall": Case("*E-M", cp=2, ep=2, dispatcher="alltoall", seed=21),
    "tp4": Case("M*-", tp=4, seed=14),
    "tp4_sp_moe": Case("M*E", tp=4, sp=True, seed=11),
    # Experts unsplit (ETP 1): the alltoall dispatcher with EP and ETP > 1 gathers uneven token
    # counts over ETP, which gloo's all_gather cannot do (NCCL can).
    "tp2_sp_ep2_alltoall": Case("M*E-", tp=2, sp=True, ep=2, etp=1, dispatcher="alltoall", seed=12),
    # The allgather dispatcher stacks equal-length rows over TP x EP (rows padded to capacity).
    "tp2_sp_ep2_allgather": Case("*E-M", tp=2, sp=True, ep=2, seed=22),
    "pp2_tp2_sp": Case("M*E|*M", tp=2, sp=True, pp=2, dispatcher="alltoall", seed=13),
    # Multi-token prediction: each depth's row is split and reduced as the main row is.
    "tp2_sp_mtp": Case("M*-", tp=2, sp=True, seed=23, mtp="*M", depths=2),
    "cp2_mtp": Case("*M-", cp=2, seed=24, mtp="M*", depths=2, replay=True),
    "cp2_mtp_megatron": Case("M*-", cp=2, seed=25, mtp="*M", depths=2, mtp_path="megatron"),
    "pp2_mtp": Case("M*|-M", pp=2, dispatcher="alltoall", seed=26, mtp="M*", depths=1),
    # Tied embeddings: the last stage's MTP depths read the embedding of its output-layer copy,
    # whose gradient megatron sums with the first stage's.
    "pp2_mtp_tied": Case(
        "*M|M-", pp=2, tied=True, dispatcher="alltoall", seed=29, mtp="*M", depths=2
    ),
    "cp2_tp2_sp_mtp": Case("*M-", tp=2, sp=True, cp=2, seed=27, mtp="*M", depths=2),
    "tp2_sp_output_chunks": Case("M*-", tp=2, sp=True, seed=28, output_chunk_tokens=6, replay=True),
    "cp2_mtp_output_chunks": Case(
        "*M-", cp=2, seed=29, mtp="M*", depths=2, output_chunk_tokens=5, tied=True
    ),
    "cp2_tp2_sp_output_chunks": Case("M*E-", tp=2, sp=True, cp=2, seed=30, output_chunk_tokens=4),
    # MoE in the MTP depths (alltoall: the depths' rows differ in length between EP ranks). No
    # load-balancing loss: the padded dense reference marks a depth's end positions as padding.
    "ep2_mtp_alltoall": Case(
        "*E-",
        ep=2,
        dispatcher="alltoall",
        seed=28,
        mtp="E*",
        depths=2,
        config=(("moe_aux_loss_coeff", [0.0, 0.0]), ("moe_z_loss_coeff", None)),
    ),
}


def _config(case: Case, parallel: bool):
    extra = dict(case.config)
    extra.pop("learned", None)
    settings = dict(
        num_layers=len(case.main_pattern),
        mtp_num_layers=case.depths or None,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=4 if case.tp == 4 else 2,
        mamba_num_groups=4 if case.tp == 4 else 2,
        # Rows differ in length: a pipeline must send shapes (megatron allows it only with the
        # alltoall dispatcher).
        variable_seq_lengths=parallel and case.pp > 1,
        pipeline_dtype=torch.float32,
        deallocate_pipeline_outputs=True,
        moe_token_dispatcher_type=case.dispatcher,
    )
    if case.moe:
        settings.update(
            num_moe_experts=4,
            moe_router_topk=2,
            add_bias_linear=False,
            **MOE_ROUTING,
        )
    if parallel:
        settings.update(
            tensor_model_parallel_size=case.tp,
            sequence_parallel=case.sp,
            expert_model_parallel_size=case.ep,
            expert_tensor_parallel_size=case.etp or case.tp,
            pipeline_model_parallel_size=case.pp,
            context_parallel_size=case.cp,
        )
    settings.update(extra)
    return tiny_config(**settings)


def _build(case: Case, parallel: bool):
    torch.manual_seed(case.seed)
    model = SharedPrefixHybridModel(
        _config(case, parallel),
        hybrid_stack_spec=hybrid_stack_spec(4 if case.moe else None, mamba_chunk_size=8),
        vocab_size=VOCAB,
        max_sequence_length=256,
        hybrid_layer_pattern=case.hybrid_layer_pattern(parallel),
        position_embedding_type="learned_absolute" if dict(case.config).get("learned") else "rope",
        share_embeddings_and_output_weights=case.tied,
        pre_process=parallel_state.is_pipeline_first_stage() if parallel else True,
        post_process=parallel_state.is_pipeline_last_stage() if parallel else True,
        shared_prefix_output_chunk_tokens=case.output_chunk_tokens if parallel else 0,
    )
    if case.moe:
        with torch.no_grad():
            for router in _routers(model):
                router.weight.normal_()
    return model


def _routers(model):
    return [module for module in model.modules() if isinstance(module, TreeTopKRouter)]


def _batch(case: Case, data_parallel: int):
    """(sequences, rows, edge weights): a multiple of ``data_parallel`` rows, padded for SP."""
    rng = np.random.default_rng(case.seed)
    capacity = 48
    if case.batch == "branch_points":
        # A 32-token star (prompt 8, children 8) and an 8-token tree with a 2-token root.
        prompt = rng.integers(1, VOCAB, 8).tolist()
        sequences = [prompt + rng.integers(1, VOCAB, 8).tolist() for _ in range(3)]
        sequences += [[5, 6] + rng.integers(1, VOCAB, 3).tolist() for _ in range(2)]
        capacity = 32
    else:
        sequences = random_sequences(rng, num_sequences=12, vocab_size=VOCAB, max_len=24)
    multiple = (case.tp if case.sp else 1) * (2 * case.cp if case.cp > 1 else 1)
    plan = plan_shared_prefix(
        sequences, capacity=capacity, pad_multiple=capacity if case.equal_rows else multiple
    )
    rows = plan.rows[: len(plan.rows) - len(plan.rows) % data_parallel]
    assert len(rows) >= data_parallel, (len(plan.rows), data_parallel)
    generator = torch.Generator().manual_seed(case.seed)
    weights = [torch.rand(len(row.edge_source), generator=generator) + 0.5 for row in rows]
    if case.depths:
        # Main and per-depth MTP weights of every edge.
        weights = [(w, torch.rand(case.depths, len(w), generator=generator) + 0.5) for w in weights]
    return sequences, rows, weights


def _weighted(edge_loss, weights, mtp_loss=None, owned=None):
    """sum(w * edge_loss), plus sum(w * MTP loss) over the defined MTP losses (``weights`` a
    (main, [D, E] MTP) pair then); ``owned`` selects this rank's edges."""
    if mtp_loss is None:
        main = weights[0] if isinstance(weights, tuple) else weights
        return (edge_loss * (main if owned is None else main[owned])).sum()
    main, mtp = weights
    if owned is not None:
        main, mtp = main[owned], mtp[:, owned]
    valid = ~torch.isnan(mtp_loss)
    return (edge_loss * main).sum() + torch.where(valid, mtp_loss * mtp, 0.0).sum()


def _dense_row_losses(model, layout, moe: bool):
    """[E] dense losses of the row's edges: its sequences as one right-padded micro-batch (with
    MTP depths: also [D, E], NaN where an edge has no target at a depth; the batch's loss mask
    is the row's edges, which megatron's own MTP loss normalizes by)."""
    index, padding = dense_gather_index(layout)
    tokens = torch.as_tensor(layout.tokens)[index].t()
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    row_of = {int(sequence): k for k, sequence in enumerate(layout.sequence_ids)}
    rows = torch.tensor([row_of[int(s)] for s in layout.edge_sequence])
    columns = torch.as_tensor(layout.edge_position) - 1
    loss_mask = torch.zeros(tokens.shape)
    loss_mask[rows, columns] = 1.0
    routers = _routers(model)
    for router in routers:
        router.enable_expert_bias = False
    try:
        with dense_mtp_losses(model) as mtp:
            loss = model(
                tokens,
                positions,
                None,
                labels=torch.roll(tokens, -1, 1),
                loss_mask=loss_mask if model.config.mtp_num_layers else None,
                padding_mask=padding.t() if moe else None,
            )
    finally:
        for router in routers:
            router.enable_expert_bias = True
    if not model.config.mtp_num_layers:
        return loss[rows, columns]
    # Depth d + 1 predicts the edge's target from position j - 2 - d.
    depth_losses = []
    for depth, depth_loss in enumerate(mtp):
        source = columns - 1 - depth
        picked = depth_loss[rows, source.clamp(min=0)]
        depth_losses.append(torch.where(source >= 0, picked, torch.full_like(picked, float("nan"))))
    return loss[rows, columns], torch.stack(depth_losses)


def _reference(case: Case, rows, weights):
    """TP = 1 model: full weights, per-row dense losses, summed gradients, dense expert counts."""
    init_parallel()
    model = _build(case, parallel=False)
    full_weights = {name: param.detach().clone() for name, param in model.named_parameters()}
    MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1))
    MTPLossAutoScaler.set_loss_scale(torch.ones(1))
    losses = []
    for layout, w in zip(rows, weights):
        if case.depths and case.mtp_path == "edges":
            with without_megatron_mtp_gradient():
                loss, mtp_loss = _dense_row_losses(model, layout, case.moe)
                _weighted(loss, w, mtp_loss).backward()
            losses.append((loss.detach(), mtp_loss.detach()))
        else:
            # "megatron": HybridModel's own MTP loss enters through MTPLossAutoScaler.
            loss = _dense_row_losses(model, layout, case.moe)
            loss = loss[0] if case.depths else loss
            _weighted(loss, w).backward()
            losses.append(loss.detach())
    grads = {name: param.grad.detach().clone() for name, param in model.named_parameters()}
    if case.depths and case.mtp_path == "edges":
        # The MTP argmax matches of the TP = 1 forest forward (checked against megatron's
        # dense acceptance counts in test_mtp_forest.py).
        with torch.no_grad():
            for k, layout in enumerate(rows):
                forest = model(
                    None, None, None, shared_prefix_layout=layout, shared_prefix_mtp_losses=True
                )
                losses[k] = (*losses[k], forest.mtp_edge_correct)
    counts = None
    if case.moe:
        for router in _routers(model):
            router.local_tokens_per_expert.zero_()
        with torch.enable_grad():
            for layout in rows:
                for path in root_paths(layout):
                    tokens = torch.as_tensor(layout.tokens)[path].unsqueeze(0)
                    model(tokens, torch.arange(tokens.shape[1]).unsqueeze(0), None)
        counts = torch.stack([router.local_tokens_per_expert.clone() for router in _routers(model)])
    return full_weights, losses, grads, counts


def _relative_error(actual, expected):
    actual, expected = actual.double(), expected.double()
    return float(torch.linalg.vector_norm(actual - expected) / torch.linalg.vector_norm(expected))


def _forest_step(case: Case, model, rows, weights):
    """One training step on forests through megatron's schedule; returns this rank's losses."""
    ddp = DistributedDataParallel(
        model.config,
        DistributedDataParallelConfig(grad_reduce_in_fp32=True),
        model,
    )
    data_parallel = parallel_state.get_data_parallel_world_size()
    mine = list(range(parallel_state.get_data_parallel_rank(), len(rows), data_parallel))
    losses = {}

    cp_group = parallel_state.get_context_parallel_group()

    per_edge_mtp = case.depths and case.mtp_path == "edges"

    def forward_step(data_iterator, chunk):
        k = next(data_iterator)
        output = chunk(
            None,
            None,
            None,
            shared_prefix_layout=rows[k],
            shared_prefix_mtp_losses=bool(per_edge_mtp),
        )
        owned = context_parallel_edges(rows[k], cp_group.size(), cp_group.rank())

        def loss_func(output):
            # The schedule multiplies by the context-parallel size, DDP averages over DP x CP.
            if per_edge_mtp:
                losses[k] = (
                    output.edge_loss.detach().clone(),
                    output.mtp_edge_loss.detach().clone(),
                    output.mtp_edge_correct.clone(),
                )
                return _weighted(output.edge_loss, weights[k], output.mtp_edge_loss, owned), {}
            losses[k] = output.detach().clone()
            return _weighted(output, weights[k], owned=owned), {}

        return output, loss_func

    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(mine),
        model=[ddp],
        num_microbatches=len(mine),
        seq_length=max(rows[k].num_tokens for k in mine),
        micro_batch_size=1,
        forward_only=False,
    )
    counts = None
    if case.moe and _routers(model):
        counts = torch.stack([router.local_tokens_per_expert.clone() for router in _routers(model)])
    finalize_model_grads([ddp])
    return losses, counts, len(mine) * data_parallel


def run_case(case: Case) -> dict:
    """Run one case on every rank; the result (identical on every rank) as a dict."""
    data_parallel = dist.get_world_size() // (case.tp * case.pp * case.cp)
    sequences, rows, weights = _batch(case, data_parallel)
    del sequences
    full_weights, ref_losses, ref_grads, ref_counts = _reference(case, rows, weights)

    init_parallel(
        tensor_model_parallel_size=case.tp,
        pipeline_model_parallel_size=case.pp,
        expert_model_parallel_size=case.ep,
        expert_tensor_parallel_size=case.etp,
        context_parallel_size=case.cp,
    )
    model = _build(case, parallel=True)
    load_full_tensors(model, full_weights)
    losses, counts, num_rows = _forest_step(case, model, rows, weights)
    replay_bitwise = None
    if case.replay:
        # Kernel-determinism replay of the parallel step (manifest: tree_mamba_scan).
        again = _build(case, parallel=True)
        load_full_tensors(again, full_weights)
        losses_again = _forest_step(case, again, rows, weights)[0]
        replay_bitwise = all(
            torch.equal(torch.nan_to_num(a.float()), torch.nan_to_num(b.float()))
            for k in losses
            for a, b in zip(_loss_tensors(losses[k]), _loss_tensors(losses_again[k]))
        ) and all(
            torch.equal(a.main_grad, b.main_grad)
            for a, b in zip(model.parameters(), again.parameters())
        )

    # Losses: every row's, from the last stage of the rank that ran it (the same on every TP rank).
    # At CP > 1 each rank's losses are those of its own edges; together, every edge once.
    cp_size = parallel_state.get_context_parallel_world_size()
    cp_rank = parallel_state.get_context_parallel_rank()
    last = parallel_state.is_pipeline_last_stage()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (cp_rank, losses if last else {}))
    loss_error, tp_ranks_agree = 0.0, True
    edges_seen = {}
    mtp_agree = True
    for rank_cp, rank_losses in everyone:
        for k, loss in rank_losses.items():
            owned = context_parallel_edges(rows[k], cp_size, rank_cp)
            if len(owned):
                if isinstance(loss, tuple):
                    (loss, mtp_loss, correct), (ref_loss, ref_mtp, ref_correct) = (
                        loss,
                        ref_losses[k],
                    )
                    ref_mtp = ref_mtp[:, owned]
                    valid = ~torch.isnan(ref_mtp)
                    mtp_agree &= bool(torch.equal(valid, ~torch.isnan(mtp_loss)))
                    mtp_agree &= bool(torch.equal(correct, ref_correct[:, owned]))
                    if valid.any():
                        loss_error = max(
                            loss_error, _relative_error(mtp_loss[valid], ref_mtp[valid])
                        )
                    loss_error = max(loss_error, _relative_error(loss, ref_loss[owned]))
                else:
                    loss_error = max(loss_error, _relative_error(loss, ref_losses[k][owned]))
            edges_seen.setdefault(k, set()).update((rank_cp, int(e)) for e in owned)
    every_edge_once = all(
        sorted(e for _, e in edges_seen.get(k, ())) == list(range(len(rows[k].edge_source)))
        for k in range(len(rows))
    )
    tp_group = parallel_state.get_tensor_model_parallel_group()
    for k, loss in losses.items():
        for value in _loss_tensors(loss):
            value = torch.nan_to_num(value.float(), nan=-1.0)
            gathered = [torch.empty_like(value) for _ in range(tp_group.size())]
            dist.all_gather(gathered, value, group=tp_group)
            tp_ranks_agree &= all(torch.equal(g, value) for g in gathered)

    # Gradients: megatron divides the step's loss by micro-batches x data-parallel size.
    main_grads = {name: param.main_grad for name, param in model.named_parameters()}
    full_grads = gather_full_tensors(model, main_grads)
    grad_errors = {
        name: _relative_error(full_grads[name] * num_rows, expected)
        for name, expected in ref_grads.items()
        if expected.abs().max() > 0
    }
    worst = max(grad_errors, key=grad_errors.get)
    result = dict(
        loss_error=loss_error,
        grad_error=grad_errors[worst],
        worst_grad=worst,
        grads_compared=len(grad_errors),
        missing_grads=sorted(set(ref_grads) - set(full_grads)),
        tp_ranks_agree=bool(tp_ranks_agree),
        every_edge_once=bool(every_edge_once),
        mtp_agree=bool(mtp_agree),
        rows=len(rows),
    )
    if replay_bitwise is not None:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, replay_bitwise)
        result["replay_bitwise"] = all(everyone)
    if case.moe:
        local = counts if counts is not None else torch.zeros(0, dtype=torch.int64)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, local)
        # Sum over the TP x DP ranks of each stage; stages hold different layers.
        stage = parallel_state.get_pipeline_model_parallel_rank()
        stages = [None] * dist.get_world_size()
        dist.all_gather_object(stages, stage)
        totals = {}
        for rank_stage, rank_counts in zip(stages, everyone):
            if rank_counts.numel():
                totals[rank_stage] = totals.get(rank_stage, 0) + rank_counts
        tree_counts = torch.cat([totals[s] for s in sorted(totals)])
        result["counts_equal"] = bool(torch.equal(tree_counts, ref_counts))
    return result


def _loss_tensors(loss):
    """The tensors of a row's recorded losses: [E], or ([E], [D, E] MTP, [D, E] argmax matches)."""
    return loss if isinstance(loss, tuple) else (loss,)


def reject_ep2_allgather_unequal_rows() -> dict:
    """The allgather dispatcher under EP with rows of different lengths on the two EP ranks is
    rejected before any compute, on every rank, naming the dispatcher."""
    case = Case("*E", ep=2, seed=20)
    init_parallel(expert_model_parallel_size=2)
    model = _build(case, parallel=True)
    length = 8 + 2 * parallel_state.get_expert_model_parallel_rank()
    layout = plan_shared_prefix([list(range(1, length + 1))], capacity=64).rows[0]
    calls = []
    model.embedding.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        model(None, None, None, shared_prefix_layout=layout)
    except ValueError as error:
        rejected = "moe_token_dispatcher_type='allgather'" in str(error) and not calls
    else:
        rejected = False
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, rejected)
    return {"rejected": all(everyone)}


def vocab_parallel_edge_loss(tp: int) -> dict:
    """The vocab-parallel edge loss on its own at TP ``tp``: per-edge losses and each rank's
    logits-shard gradient against float64 autograd over the full vocabulary, with and without
    ``overwrite_logits``; edges share sources and one (source, target) pair repeats. Both paths:
    PyTorch's with the float32 work in several chunks, and the Triton kernels that CUDA logits
    run (triton_cross_entropy.py), here interpreted (the job runs under TRITON_INTERPRET=1)."""
    from megatron.shared_prefix.tensor_parallel import triton_cross_entropy

    init_parallel(tensor_model_parallel_size=tp)
    group = parallel_state.get_tensor_model_parallel_group()
    rank = group.rank()
    sources, vocab = 13, 16 * tp
    shard = vocab // tp
    generator = torch.Generator().manual_seed(7)
    full = torch.randn(sources, vocab, generator=generator, dtype=torch.float64) * 3
    slot = torch.cat([torch.arange(sources), torch.randint(0, sources, (40,), generator=generator)])
    target = torch.randint(0, vocab, slot.shape, generator=generator)
    slot, target = torch.cat([slot, slot[:1]]), torch.cat([target, target[:1]])
    weights = torch.randn(slot.shape, generator=generator, dtype=torch.float64)
    reference = full.clone().requires_grad_()
    expected = torch.logsumexp(reference, -1)[slot] - reference[slot, target]
    (expected_grad,) = torch.autograd.grad((expected * weights).sum(), reference)
    expected_shard = expected_grad[:, rank * shard : (rank + 1) * shard]
    chunk_elements, choose_kernels = (
        cross_entropy.FLOAT32_CHUNK_ELEMENTS,
        cross_entropy._triton_kernels,  # pylint: disable=protected-access
    )
    cross_entropy.FLOAT32_CHUNK_ELEMENTS = 4 * shard
    errors = {}
    same = []
    try:
        for path, kernels in (("torch", None), ("kernels", triton_cross_entropy)):
            cross_entropy._triton_kernels = lambda logits, k=kernels: k
            grads = []
            for overwrite in (False, True):
                leaf = full[:, rank * shard : (rank + 1) * shard].float().requires_grad_()
                logits = leaf * 1  # not a leaf: overwrite_logits writes into it
                loss = cross_entropy.vocab_parallel_edge_cross_entropy(
                    logits, slot, target, group, overwrite_logits=overwrite
                )
                (loss.double() * weights).sum().backward()
                grads.append(leaf.grad)
                errors[f"{path}_loss_error"] = max(
                    errors.get(f"{path}_loss_error", 0.0), _rel_error(loss, expected)
                )
                errors[f"{path}_grad_error"] = max(
                    errors.get(f"{path}_grad_error", 0.0), _rel_error(leaf.grad, expected_shard)
                )
            same.append(float(torch.equal(*grads)))
    finally:
        cross_entropy.FLOAT32_CHUNK_ELEMENTS = chunk_elements
        cross_entropy._triton_kernels = choose_kernels
    worst = torch.tensor(list(errors.values()), dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    same = torch.tensor(min(same))
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    return {**dict(zip(errors, map(float, worst))), "overwrite_bitwise": bool(same)}


def _rel_error(actual, expected):
    return float((actual.double() - expected).abs().max() / expected.abs().max())


# Checks whose results are not a model case's (test_parallel_forests.py asserts them by name).
REJECTIONS = {"reject_ep2_allgather_unequal_rows": reject_ep2_allgather_unequal_rows}
FUNCTIONS = {
    f"vocab_parallel_edge_loss_tp{tp}": functools.partial(vocab_parallel_edge_loss, tp)
    for tp in (2, 4)
}


def main(out_path: str, names: list[str]) -> None:
    results = {}
    for name in names:
        try:
            check = {**REJECTIONS, **FUNCTIONS}.get(name)
            results[name] = check() if check else run_case(CASES[name])
        except Exception as error:  # pylint: disable=broad-exception-caught
            results[name] = {"error": f"{type(error).__name__}: {error}"}
            if os.environ.get("SHARED_PREFIX_RAISE"):
                raise
    if dist.get_rank() == 0:
        with open(out_path, "w", encoding="utf-8") as out:
            json.dump(results, out, indent=1)
    shutdown_parallel()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
