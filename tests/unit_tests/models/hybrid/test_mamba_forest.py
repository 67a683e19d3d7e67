"""Mamba layers on prefix forests: TreeMambaMixer alone and in SharedPrefixHybridModel, against dense runs.

* Mixer: the packed forest output, read at every original sequence's root path, equals the stock
  MambaMixer run on that sequence alone (both ``use_mamba_mem_eff_path`` settings, with and without
  rmsnorm, D per head and per channel, 1 and 2 groups); the gradients of a multiplicity-weighted loss
  (input, A_log, D, dt_bias, conv weight and bias, in/out projections, norm) equal the dense ones.
* Model: ``M*-M``, ``MMM`` and ``M*-ME`` (MoE) forests against dense per-sequence HybridModel runs
  (``assert_forest_matches_dense``: per-edge loss rel. L2 <= 1e-5, every gradient <= 1e-4, float32).
* GPU (marked ``gpu``): the bf16 mixer with mamba_ssm's Triton scan against the dense bf16 mixer.
"""

import numpy as np
import pytest
import torch
from dense_reference import (
    GRAD_TOLERANCE,
    LOSS_TOLERANCE,
    assert_forest_matches_dense,
    gradients,
    relative_error,
)

from megatron.shared_prefix.planning import plan_shared_prefix
from megatron.shared_prefix.tensors import ForestTensors, forest_scope


def build_mixer(
    *,
    seed=0,
    cls=None,
    device="cpu",
    dtype=torch.float32,
    chunk_size=8,
    mixer_kwargs=None,
    **config,
):
    """A TreeMambaMixer (or ``cls``) of a tiny config, with randomized A_log, D, dt_bias and norm weight."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm.mamba_mixer import MambaMixerSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from tiny import seed_initialization, tiny_config

    from megatron.shared_prefix.ssm.mamba_mixer import TreeMambaMixer

    seed_initialization(seed)
    config = tiny_config(params_dtype=dtype, **config)
    mixer = (cls or TreeMambaMixer)(
        config,
        MambaMixerSubmodules(in_proj=ColumnParallelLinear, out_proj=RowParallelLinear),
        d_model=config.hidden_size,
        chunk_size=chunk_size,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"]),
        **(mixer_kwargs or {}),
    )
    with torch.no_grad():
        mixer.A_log.uniform_(-1.0, 1.5)
        mixer.D.normal_(1.0, 0.5)
        mixer.dt_bias.normal_(-1.0, 0.5)
        mixer.conv1d_bias.normal_(0.0, 0.3)
        if mixer.rmsnorm:
            mixer.norm.weight.normal_(1.0, 0.3)
    return mixer.to(device)


def mixer_forest_and_dense(mixer, layout, seed=0):
    """(tree output, dense outputs on each root path, tree grads, dense grads) of one row.

    Losses: tree sum_t multiplicity_t <out_t, probe_t>; dense sum over the row's sequences and their
    root-path tokens of <out, probe_t>: equal functions of the inputs and parameters.
    """
    device = mixer.A_log.device
    dtype = mixer.in_proj.weight.dtype
    generator = torch.Generator().manual_seed(seed)
    num_tokens, hidden = layout.num_tokens, mixer.d_model
    states = (
        torch.randn(num_tokens, 1, hidden, generator=generator).to(device, dtype).requires_grad_()
    )
    probe = torch.randn(num_tokens, 1, hidden, generator=generator).to(device, dtype)
    multiplicity = torch.tensor(layout.token_multiplicity, device=device, dtype=dtype)[
        :, None, None
    ]
    forest = ForestTensors.from_layout(layout, device)
    leaves = [states] + [p for p in mixer.parameters()]

    with forest_scope(forest):
        tree, bias = mixer(states)
    assert bias is None and tree.shape == states.shape
    tree_grads = torch.autograd.grad((tree.float() * probe * multiplicity).sum(), leaves)

    dense_outputs, dense_loss = [], 0.0
    for k in range(len(layout.sequence_ids)):
        path = torch.as_tensor(layout.root_path(k), device=device)
        out, _ = mixer(states[path])
        dense_outputs.append(out)
        dense_loss = dense_loss + (out.float() * probe[path]).sum()
    dense_grads = torch.autograd.grad(dense_loss, leaves)
    names = ["input"] + [name for name, _ in mixer.named_parameters()]
    return tree, dense_outputs, dict(zip(names, tree_grads)), dict(zip(names, dense_grads))


def paths_of(layout):
    return [torch.as_tensor(layout.root_path(k)) for k in range(len(layout.sequence_ids))]


MIXER_CASES = [
    pytest.param(dict(use_mamba_mem_eff_path=True), {}, id="mem-eff-rmsnorm"),
    pytest.param(dict(use_mamba_mem_eff_path=False), {}, id="unfused-rmsnorm"),
    pytest.param(
        dict(use_mamba_mem_eff_path=True, mamba_num_groups=1),
        dict(rmsnorm=False, D_has_hdim=True),
        id="mem-eff-gate-D[h,p]-1-group",
    ),
    pytest.param(
        dict(use_mamba_mem_eff_path=False),
        dict(rmsnorm=False, D_has_hdim=True),
        id="unfused-gate-D[h,p]",
    ),
]


@pytest.mark.parametrize("config, mixer_kwargs", MIXER_CASES)
def test_mixer_matches_dense_sequences(megatron_world, forest_sequences, config, mixer_kwargs):
    sequences = forest_sequences(seed=7, depth=3, max_children=2, max_segment=12)
    layout = plan_shared_prefix(sequences, capacity=512, pad_multiple=8).rows[0]
    mixer = build_mixer(seed=1, mixer_kwargs=mixer_kwargs, **config)
    tree, dense, tree_grads, dense_grads = mixer_forest_and_dense(mixer, layout)
    paths = paths_of(layout)
    assert relative_error(torch.cat([tree[p] for p in paths]), torch.cat(dense)) <= LOSS_TOLERANCE
    assert tree_grads.keys() == dense_grads.keys()
    for name, expected in dense_grads.items():
        assert expected.abs().max() > 0, name
        assert relative_error(tree_grads[name], expected) <= GRAD_TOLERANCE, name


def test_mem_eff_setting_does_not_change_the_tree_result(megatron_world, forest_sequences):
    layout = plan_shared_prefix(forest_sequences(seed=8, depth=3), capacity=512).rows[0]
    forest = ForestTensors.from_layout(layout, "cpu")
    mixer = build_mixer(seed=2)
    states = torch.randn(layout.num_tokens, 1, mixer.d_model)
    outputs = []
    for mem_eff in (True, False):
        mixer.use_mem_eff_path = mem_eff
        with forest_scope(forest):
            outputs.append(mixer(states)[0])
    assert torch.equal(outputs[0], outputs[1])


def test_without_a_forest_it_is_the_stock_mixer(megatron_world):
    from megatron.core.ssm.mamba_mixer import MambaMixer

    states = torch.randn(13, 2, 32)
    results = []
    for cls in (MambaMixer, None):
        mixer = build_mixer(seed=3, cls=cls)
        leaf = states.clone().requires_grad_()
        out, _ = mixer(leaf)
        out.square().sum().backward()
        results.append((out, leaf.grad, [p.grad for p in mixer.parameters()]))
    (out_a, grad_a, params_a), (out_b, grad_b, params_b) = results
    assert torch.equal(out_a, out_b) and torch.equal(grad_a, grad_b)
    assert all(torch.equal(a, b) for a, b in zip(params_a, params_b))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(inference_context=object()), "inference_context"),
        (dict(inference_params=object()), "inference_context"),
        (dict(packed_seq_params=object()), "packed_seq_params"),
        (dict(states_shape=(4, 1, 32)), "hidden_states"),
    ],
)
def test_rejects_what_a_forest_cannot_honour_before_compute(megatron_world, kwargs, match):
    layout = plan_shared_prefix([[1, 2, 3, 4], [1, 2, 5]], capacity=64).rows[0]
    mixer = build_mixer()
    calls = []
    mixer.in_proj.register_forward_pre_hook(lambda *_: calls.append(1))
    shape = kwargs.pop("states_shape", (layout.num_tokens, 1, 32))
    inference_context = kwargs.pop("inference_context", None)
    with (
        forest_scope(ForestTensors.from_layout(layout, "cpu")),
        pytest.raises(ValueError, match=match),
    ):
        mixer(torch.randn(shape), inference_context, **kwargs)
    assert not calls


def test_rejects_unknown_backend(megatron_world):
    with pytest.raises(ValueError, match="tree_scan_backend"):
        build_mixer(mixer_kwargs=dict(tree_scan_backend="cuda"))
    with pytest.raises(ValueError, match="tree_conv_backend"):
        build_mixer(mixer_kwargs=dict(tree_conv_backend="cudnn"))


MODEL_CASES = [
    pytest.param("M*-M", 2, {}, id="M*-M-depth-2"),
    pytest.param("M*-M", 4, dict(mamba_num_groups=1), id="M*-M-depth-4-1-group"),
    pytest.param("MMM", 3, dict(use_mamba_mem_eff_path=False), id="MMM-depth-3-unfused"),
    pytest.param(
        "M*-ME",
        3,
        dict(num_moe_experts=4, moe_router_topk=2, add_bias_linear=False),
        id="M*-ME-depth-3-moe",
    ),
]


@pytest.mark.parametrize("pattern, depth, config", MODEL_CASES)
def test_model_forest_matches_dense(build_model, forest_sequences, pattern, depth, config):
    sequences = forest_sequences(seed=20 + depth, depth=depth, max_children=2)
    masks = [
        [j > 0 and (j * 7 + i) % 5 != 0 for j in range(len(s))] for i, s in enumerate(sequences)
    ]
    plan = plan_shared_prefix(sequences, masks, capacity=64, pad_multiple=4)
    model = build_model(pattern, seed=depth, mamba_chunk_size=8, **config)
    with torch.no_grad():  # randomize the Mamba parameters megatron initializes to constants
        for name, param in model.named_parameters():
            if name.endswith(("mixer.D", "mixer.norm.weight")):
                param.normal_(1.0, 0.3)
    assert_forest_matches_dense(model, sequences, plan, seed=depth)


def test_recompute_reruns_mamba_layers_on_the_forest(build_model, forest_sequences):
    """Full recompute re-runs the mixer in the backward pass, after the forward's scope closed."""
    layout = plan_shared_prefix(forest_sequences(seed=4, depth=3), capacity=512).rows[0]
    results = []
    for options in (
        {},
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    ):
        model = build_model("M-M", seed=2, **options)
        loss = model(None, None, None, shared_prefix_layout=layout)
        (loss * torch.linspace(0.5, 1.5, len(loss))).sum().backward()
        results.append((loss.detach(), gradients(model)))
    (loss_plain, grads_plain), (loss_recompute, grads_recompute) = results
    assert torch.equal(loss_plain, loss_recompute)
    for name, grad in grads_plain.items():
        assert torch.equal(grad, grads_recompute[name]), name


# ----------------------------------------------------------------------------------------------------
# GPU


def _causal_conv1d_available():
    try:
        import causal_conv1d  # noqa: F401  pylint: disable=unused-import,import-outside-toplevel
    except ImportError:
        return False
    return True


@pytest.mark.gpu
@pytest.mark.parametrize(
    "mixer_kwargs", [{}, dict(rmsnorm=False, D_has_hdim=True)], ids=["rmsnorm", "gate-D[h,p]"]
)
def test_bf16_mixer_on_cuda_is_as_close_to_float32_as_dense(
    megatron_world, forest_sequences, mixer_kwargs
):
    """The bf16 tree mixer (mamba_ssm's Triton scan when it imports) against the bf16 dense mixer.

    Reference: the float32 tree mixer with the torch scan and conv (equal to dense float32 runs,
    tested on CPU above). The bf16 tree output and gradients may differ from it by at most twice the bf16 dense
    mixer's own difference (plus a 2^-8 floor): the fork adds no error of bf16's order. The dense runs
    take the unfused path unless causal-conv1d (which the fused kernel needs) is installed.
    """
    from megatron.shared_prefix.ssm.tree_scan import triton_chunk_scan

    sequences = forest_sequences(seed=1, depth=3, max_segment=120)
    layout = plan_shared_prefix(sequences, capacity=4096, pad_multiple=64).rows[0]
    config = dict(
        hidden_size=256,
        mamba_head_dim=32,
        mamba_state_dim=32,
        use_mamba_mem_eff_path=_causal_conv1d_available(),
    )
    reference_mixer = build_mixer(
        seed=5,
        device="cuda",
        chunk_size=64,
        mixer_kwargs=dict(mixer_kwargs, tree_scan_backend="torch", tree_conv_backend="torch"),
        **config,
    )
    mixer = build_mixer(seed=5, device="cuda", chunk_size=64, mixer_kwargs=mixer_kwargs, **config)
    mixer.load_state_dict(reference_mixer.state_dict())
    mixer = mixer.bfloat16()  # as Float16Module casts a bf16 model (A_log and D included)
    reference, _, reference_grads, _ = mixer_forest_and_dense(reference_mixer, layout)
    tree, dense, tree_grads, dense_grads = mixer_forest_and_dense(mixer, layout)
    paths = [p.cuda() for p in paths_of(layout)]
    expected = torch.cat([reference[p] for p in paths]).float()
    tree_error = relative_error(torch.cat([tree[p] for p in paths]).float(), expected)
    dense_error = relative_error(torch.cat(dense).float(), expected)
    print(
        f"triton scan: {triton_chunk_scan() is not None}; output error tree {tree_error:.2e}, dense {dense_error:.2e}"
    )
    assert tree_error <= max(2 * dense_error, 2.0**-8)
    for name, expected_grad in reference_grads.items():
        tree_error = relative_error(tree_grads[name].float(), expected_grad.float())
        dense_error = relative_error(dense_grads[name].float(), expected_grad.float())
        print(f"{name}: tree {tree_error:.2e}, dense {dense_error:.2e}")
        assert tree_error <= max(2 * dense_error, 2.0**-8), name
    assert np.isfinite(float(tree.float().sum()))


def tiny_mamba_model(pattern="M*M"):
    from tiny import tiny_config

    from megatron.shared_prefix import SharedPrefixHybridModel, hybrid_stack_spec

    torch.manual_seed(0)
    return SharedPrefixHybridModel(
        tiny_config(num_layers=len(pattern)),
        hybrid_stack_spec=hybrid_stack_spec(),
        vocab_size=64,
        max_sequence_length=512,
        hybrid_layer_pattern=pattern,
        position_embedding_type="rope",
    )


def test_precompile_tree_mamba_warms_one_layer_per_signature_and_writes_no_gradient(
    megatron_world, monkeypatch
):
    """``precompile_tree_mamba`` (--shared-prefix-precompile): one layer per scan signature, at
    every warm-up length; the parameters and their gradients are untouched."""
    from megatron.shared_prefix.ssm.mamba_mixer import (
        TreeMambaMixer,
        precompile_tree_mamba,
        scan_warmup_lengths,
    )

    model = tiny_mamba_model()
    mixers = [m for m in model.modules() if isinstance(m, TreeMambaMixer)]
    assert len(mixers) == 2 and len({m.scan_signature() for m in mixers}) == 1
    warmed = []
    real_warm_up = TreeMambaMixer.warm_up

    def recording_warm_up(self, num_tokens, **kwargs):
        warmed.append((self, num_tokens))
        real_warm_up(self, num_tokens, **kwargs)

    monkeypatch.setattr(TreeMambaMixer, "warm_up", recording_warm_up)
    state = {name: p.detach().clone() for name, p in model.named_parameters()}
    lengths = precompile_tree_mamba(model, 300, dtype=torch.float32, device="cpu")
    assert lengths == scan_warmup_lengths(mixers[0].chunk_size, 300) and lengths
    assert warmed == [(mixers[0], n) for n in lengths]
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, state[name]) for name, p in model.named_parameters())
    assert (
        precompile_tree_mamba(tiny_mamba_model("**"), 300, dtype=torch.float32, device="cpu") == ()
    )
