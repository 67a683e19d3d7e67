"""TreeDotProductAttention's kernel signature and the model-level precompile of its kernels."""

import math

import pytest
import torch
from tiny import tiny_config

from megatron.shared_prefix.attention import dot_product_attention, flex_backend


def build(attention_backend="auto", **config):
    from megatron.shared_prefix import SharedPrefixHybridModel, hybrid_stack_spec

    return SharedPrefixHybridModel(
        tiny_config(num_layers=3, **config),
        hybrid_stack_spec=hybrid_stack_spec(attention_backend=attention_backend),
        vocab_size=64,
        max_sequence_length=256,
        hybrid_layer_pattern="*M*",
        position_embedding_type="rope",
    )


def attention_layers(model):
    return [
        m for m in model.modules() if isinstance(m, dot_product_attention.TreeDotProductAttention)
    ]


@pytest.mark.parametrize("layer_scaling", [False, True])
def test_kernel_signature_is_what_the_backend_is_called_with(
    megatron_world, monkeypatch, layer_scaling
):
    """(heads, groups, head dim, scale) of the tree backend's rows: tiny_config's 4 heads of 8 in 2
    groups; query-key layer scaling divides the scale by the layer number, the backend multiplies
    it back."""
    from megatron.shared_prefix.planning import plan_shared_prefix
    from megatron.shared_prefix.tensors import ForestTensors, forest_scope

    model = build(apply_query_key_layer_scaling=layer_scaling, fp16=layer_scaling)
    layers = attention_layers(model)
    assert len(layers) == 2
    assert {layer.kernel_signature() for layer in layers} == {(4, 2, 8, 1 / math.sqrt(8))}
    seen = []
    forest = ForestTensors.from_layout(plan_shared_prefix([[1, 2, 3]], capacity=8).rows[0], "cpu")

    def backend(query, key, value, forest, *, softmax_scale):
        seen.append((query.shape[2], key.shape[2], query.shape[3], softmax_scale))
        return query.reshape(query.shape[0], 1, -1)

    monkeypatch.setattr(dot_product_attention.torch_backend, "tree_attention", backend)
    query = torch.zeros(3, 1, 4, 8)
    key = value = torch.zeros(3, 1, 2, 8)
    with forest_scope(forest):
        for layer in layers:
            layer(query, key, value, None)
    assert [pytest.approx(s) for s in seen] == [layer.kernel_signature() for layer in layers]


def test_precompile_tree_attention_compiles_each_signature_once(megatron_world, monkeypatch):
    calls = []
    monkeypatch.setattr(
        flex_backend, "precompile", lambda max_tokens, **kwargs: calls.append((max_tokens, kwargs))
    )
    model = build()
    dot_product_attention.precompile_tree_attention(
        model, 512, mode="buckets", dtype="bf16", device="cpu"
    )
    assert calls == [
        (
            512,
            dict(
                mode="buckets",
                num_heads=4,
                num_groups=2,
                head_dim=8,
                softmax_scale=1 / math.sqrt(8),
                dtype="bf16",
                device="cpu",
                no_grad_forward=False,
            ),
        )
    ]
    calls.clear()
    recomputing = build(recompute_granularity="selective")
    dot_product_attention.precompile_tree_attention(
        recomputing, 512, mode="dynamic", dtype="bf16", device="cpu"
    )
    assert calls[0][1]["no_grad_forward"] and calls[0][1]["mode"] == "dynamic"


def test_precompiled_kernel_serves_the_models_rows(megatron_world, monkeypatch):
    """A static kernel compiled on precompile's inputs (``warmup_row``) is the one the model's
    forward then runs at that length: Dynamo compiles no new graph. megatron-core's value is a
    strided view into the fused QKV projection, and a static compile is specialized on strides,
    so this fails unless tree_attention hands every kernel contiguous inputs.

    On CPU (FlexAttention has no CPU backward): forward only, through Dynamo's eager backend, which
    guards and recompiles exactly as the Inductor one does.
    """
    import numpy as np
    from torch._dynamo.utils import counters

    from megatron.shared_prefix import SharedPrefixHybridModel, hybrid_stack_spec
    from megatron.shared_prefix.planning import plan_shared_prefix

    torch._dynamo.reset()
    monkeypatch.setattr(
        flex_backend,
        "_compiled_kernels",
        {True: torch.compile(flex_backend._flex_attention_rows, dynamic=False, backend="eager")},
    )
    model = SharedPrefixHybridModel(
        tiny_config(num_layers=2),
        hybrid_stack_spec=hybrid_stack_spec(attention_backend="flex"),
        vocab_size=64,
        max_sequence_length=512,
        hybrid_layer_pattern="*M",
        position_embedding_type="rope",
    )
    (layer,) = attention_layers(model)
    heads, groups, head_dim, scale = layer.kernel_signature()
    num_tokens = 256
    assert flex_backend.run_length(num_tokens) == (num_tokens, True)
    with torch.no_grad(), torch._dynamo.config.patch(disable=False):
        forest, query, key, value = flex_backend.warmup_row(
            num_tokens,
            heads,
            groups,
            head_dim,
            dtype=torch.float32,
            device="cpu",
            requires_grad=False,
        )
        flex_backend.tree_attention(query, key, value, forest, softmax_scale=scale)
        graphs = counters["stats"]["unique_graphs"]
        rng = np.random.default_rng(0)
        sequences = [rng.integers(1, 64, 200).tolist(), rng.integers(1, 64, 56).tolist()]
        row = plan_shared_prefix(sequences, capacity=num_tokens, pad_multiple=num_tokens).rows[0]
        assert row.num_tokens == num_tokens
        model(None, None, None, shared_prefix_layout=row)
    assert counters["stats"]["unique_graphs"] == graphs
    torch._dynamo.reset()


def test_precompile_skips_layers_that_run_flash_attention(megatron_world, monkeypatch):
    """tree_backend "flash" layers compile no FlexAttention kernel where flash_backend runs their
    rows (flash attention is not compiled), and are precompiled as usual where it does not."""
    from megatron.shared_prefix.attention import flash_backend

    calls = []
    monkeypatch.setattr(flex_backend, "precompile", lambda max_tokens, **kw: calls.append(kw))
    model = build(attention_backend="flash")
    monkeypatch.setattr(flash_backend, "supports", lambda device, dtype, head_dim: True)
    compiled = dot_product_attention.precompile_tree_attention(
        model, 512, mode="dynamic", dtype=torch.bfloat16, device="cpu"
    )
    assert calls == [] and compiled == ()
    monkeypatch.setattr(flash_backend, "supports", lambda device, dtype, head_dim: False)
    dot_product_attention.precompile_tree_attention(
        model, 512, mode="dynamic", dtype=torch.bfloat16, device="cpu"
    )
    assert len(calls) == 1 and calls[0]["num_heads"] == 4
