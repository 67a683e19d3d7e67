"""megatron-core's own HybridModel runs forests where its forward takes ``shared_prefix_layout``.

That is the upstream PR stack (tools/export_pr_stack.py edits HybridModel.forward in place); against
the pinned megatron-core wheel, HybridModel has no such argument and only the subclass runs forests,
so the test skips there.
"""

import inspect

import pytest
import torch
from tiny import tiny_config

from megatron.shared_prefix import SharedPrefixHybridModel, hybrid_stack_spec, plan_shared_prefix


def _build(model_class, pattern, seed):
    torch.manual_seed(seed)
    main = pattern.split("/")[0]
    return model_class(
        tiny_config(num_layers=len(main), mtp_num_layers=pattern.count("/") or None),
        hybrid_stack_spec=hybrid_stack_spec(mamba_chunk_size=8),
        vocab_size=64,
        max_sequence_length=512,
        hybrid_layer_pattern=pattern,
        position_embedding_type="rope",
    )


@pytest.mark.parametrize(
    "pattern,mtp_losses",
    [("M*-M*", False), ("M*-/*M/*M", False), ("M*-/*M/*M", True)],
    ids=["main", "mtp-attached", "mtp-per-edge"],
)
def test_hybrid_model_itself_equals_the_subclass_on_a_forest(
    megatron_world, forest_sequences, pattern, mtp_losses
):
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    if "shared_prefix_layout" not in inspect.signature(HybridModel.forward).parameters:
        pytest.skip("this megatron-core's HybridModel takes no layout (only the subclass does)")
    layout = plan_shared_prefix(forest_sequences(seed=3, depth=3), capacity=512).rows[0]
    losses, grads = [], []
    for model_class in (HybridModel, SharedPrefixHybridModel):
        model = _build(model_class, pattern, seed=7)
        output = model(
            None, None, None, shared_prefix_layout=layout, shared_prefix_mtp_losses=mtp_losses
        )
        loss = torch.nansum(output[1]) + output[0].sum() if mtp_losses else output.sum()
        loss.backward()
        losses.append(output[1].detach() if mtp_losses else output.detach())
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    assert losses[0].shape[-1] == len(layout.edge_source)
    assert torch.equal(torch.nan_to_num(losses[0]), torch.nan_to_num(losses[1]))
    assert len(grads[0]) == len(grads[1]) > 0
    assert all(torch.equal(a, b) for a, b in zip(*grads))
