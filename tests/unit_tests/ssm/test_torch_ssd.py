"""Tests of the pure-PyTorch Mamba-2 ops in megatron/shared_prefix/ssm/torch_ssd.py.

* Exactness: against the per-token oracle (reference.py) in float64. Relative error is max|a - b| /
  max|b| over a whole tensor (b the oracle); it must be <= 1e-10 for outputs, final states and the
  gradient of every input, which only holds if both compute the same function (float64 rounding
  alone gives ~1e-15).
* bf16: bf16 inputs run, come back bf16, and match the float32 computation up to bf16 rounding.
* GPU (marked ``gpu``): against mamba_ssm's Triton kernels, when CUDA and mamba_ssm are present.
"""

import inspect

import pytest
import torch
from forest_rows import EXACT, rel_err

from megatron.shared_prefix.ssm import reference, torch_ssd


def sequence_ids(lengths_per_row, first_id=0):
    """[b, l] seq_idx from per-row lists of sequence lengths (ids first_id, first_id + 1, ...)."""
    rows = [
        torch.cat(
            [torch.full((n,), first_id + i, dtype=torch.int32) for i, n in enumerate(lengths)]
        )
        for lengths in lengths_per_row
    ]
    return torch.stack(rows)


def outputs_and_grads(fn, inputs, seed=1):
    """Run fn(**inputs) -> tensor or tuple; return (outputs, gradients of a fixed random projection
    of all outputs with respect to every input that requires grad, keyed by name)."""
    outputs = fn(**inputs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    generator = torch.Generator().manual_seed(seed)
    # float64 weights, so that runs in different dtypes differentiate the same function
    loss = sum(
        (
            out.double()
            * torch.randn(out.shape, generator=generator, dtype=torch.float64).to(out.device)
        ).sum()
        for out in outputs
    )
    names = [name for name, t in inputs.items() if torch.is_tensor(t) and t.requires_grad]
    grads = torch.autograd.grad(loss, [inputs[name] for name in names])
    return outputs, dict(zip(names, grads))


def converted(inputs, dtype):
    """Leaf copies of the floating tensors of ``inputs`` in ``dtype`` (same requires_grad)."""
    return {
        k: (
            v.detach().to(dtype).requires_grad_(v.requires_grad)
            if torch.is_tensor(v) and v.is_floating_point()
            else v
        )
        for k, v in inputs.items()
    }


def assert_all_close(actual, expected, tol, what=""):
    (outs_a, grads_a), (outs_e, grads_e) = actual, expected
    assert len(outs_a) == len(outs_e)
    for i, (a, e) in enumerate(zip(outs_a, outs_e)):
        assert a.shape == e.shape, f"{what} output {i}: shape {a.shape} != {e.shape}"
        assert (
            rel_err(a, e) <= tol
        ), f"{what} output {i}: relative error {rel_err(a, e):.3g} > {tol}"
    assert grads_a.keys() == grads_e.keys()
    for name in grads_e:
        err = rel_err(grads_a[name], grads_e[name])
        assert err <= tol, f"{what} grad of {name}: relative error {err:.3g} > {tol}"


# --------------------------------------------------------------------------------------------------
# mamba_chunk_scan_combined


def scan_inputs(
    *,
    b=2,
    l=37,
    h=4,
    p=3,
    n=5,
    groups=1,
    D="h",
    z=True,
    dt_bias=True,
    softplus=True,
    init=False,
    seq_lens=None,
    first_id=0,
    dtype=torch.float64,
    device="cpu",
    seed=0,
):
    """Random inputs (leaf tensors requiring grad) for mamba_chunk_scan_combined, by argument."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0, shift=0.0):
        t = torch.randn(*shape, generator=g, dtype=torch.float64) * scale + shift
        return t.to(device=device, dtype=dtype).requires_grad_()

    inputs = dict(
        x=rand(b, l, h, p),
        # with softplus: raw dt around -1 (step ~0.3); without: positive steps in [0.02, 0.6]
        dt=rand(b, l, h, scale=0.5, shift=-1.0) if softplus else None,
        A=(-torch.rand(h, generator=g, dtype=torch.float64) - 0.5)
        .to(device, dtype)
        .requires_grad_(),
        B=rand(b, l, groups, n),
        C=rand(b, l, groups, n),
        D={"h": rand(h), "hp": rand(h, p), None: None}[D],
        z=rand(b, l, h, p) if z else None,
        dt_bias=rand(h, scale=0.3) if dt_bias else None,
        initial_states=rand(b, h, p, n) if init else None,
        seq_idx=sequence_ids(seq_lens, first_id).to(device) if seq_lens else None,
        dt_softplus=softplus,
    )
    if not softplus:
        dt = torch.rand(b, l, h, generator=g, dtype=torch.float64) * 0.58 + 0.02
        inputs["dt"] = dt.to(device, dtype).requires_grad_()
    return inputs


def scan_oracle(x, dt, A, B, C, **kwargs):
    return reference.selective_scan_sequential(x, dt, A, B, C, **kwargs)


SCAN_CASES = [
    pytest.param(dict(l=37), 8, {}, id="l-not-multiple-of-chunk"),
    pytest.param(dict(l=5), 16, {}, id="l-shorter-than-chunk"),
    pytest.param(dict(l=1, b=1), 4, {}, id="single-token"),
    pytest.param(dict(l=7), 1, {}, id="chunk-size-1"),
    pytest.param(
        dict(l=32, groups=2, D="hp", z=False, softplus=False),
        8,
        {},
        id="2-groups-D[h,p]-no-z-no-softplus",
    ),
    pytest.param(dict(l=29, D=None, dt_bias=False), 4, {}, id="no-D-no-dt-bias"),
    pytest.param(dict(l=29), 8, dict(dt_limit=(0.2, 0.5)), id="finite-dt-limit"),
    # sequences start mid-chunk, span chunks, have length 1; one boundary is a chunk boundary
    pytest.param(dict(seq_lens=[[3, 10, 1, 9, 14], [8, 12, 17]]), 8, {}, id="seq-idx"),
    pytest.param(
        dict(seq_lens=[[3, 10, 1, 9, 14], [20, 17]], init=True, groups=2),
        8,
        {},
        id="seq-idx-initial-states",
    ),
    # ids from 2: the initial state belongs to id 0, so it reaches no token (as in mamba_ssm)
    pytest.param(
        dict(seq_lens=[[5, 11, 21], [37]], first_id=2, init=True),
        8,
        {},
        id="seq-idx-from-2-drops-initial-states",
    ),
    pytest.param(dict(l=32, b=3, init=True), 8, {}, id="initial-states-batch-3"),
]


@pytest.mark.parametrize("sizes, chunk_size, extra", SCAN_CASES)
def test_chunk_scan_matches_sequential_oracle(sizes, chunk_size, extra):
    inputs = {**scan_inputs(**sizes), **extra}
    expected = outputs_and_grads(scan_oracle, inputs)
    actual = outputs_and_grads(
        lambda **kw: torch_ssd.mamba_chunk_scan_combined(
            chunk_size=chunk_size, return_final_states=True, **kw
        ),
        inputs,
    )
    assert_all_close(actual, expected, EXACT)


def test_chunk_scan_returns_out_alone_by_default():
    inputs = scan_inputs(l=9)
    out = torch_ssd.mamba_chunk_scan_combined(chunk_size=4, **inputs)
    assert torch.is_tensor(out) and out.shape == inputs["x"].shape


def test_varlen_states_are_the_state_at_each_sequence_end():
    lengths = [3, 10, 1, 9, 14]
    inputs = scan_inputs(b=1, seq_lens=[lengths], init=True)
    cu_seqlens = torch.tensor([0, *lengths]).cumsum(0)

    def oracle(x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, dt_softplus):
        y, final = reference.selective_scan_sequential(
            x,
            dt,
            A,
            B,
            C,
            D=D,
            z=z,
            dt_bias=dt_bias,
            dt_softplus=dt_softplus,
            initial_states=initial_states,
            seq_idx=seq_idx,
        )
        ends = []
        for i, (start, stop) in enumerate(zip(cu_seqlens[:-1], cu_seqlens[1:])):
            _, state = reference.selective_scan_sequential(
                x[:, start:stop],
                dt[:, start:stop],
                A,
                B[:, start:stop],
                C[:, start:stop],
                dt_bias=dt_bias,
                dt_softplus=dt_softplus,
                initial_states=initial_states if i == 0 else None,
            )
            ends.append(state[0])
        return y, final, torch.stack(ends)

    expected = outputs_and_grads(oracle, inputs)
    actual = outputs_and_grads(
        lambda **kw: torch_ssd.mamba_chunk_scan_combined(
            chunk_size=8,
            cu_seqlens=cu_seqlens,
            return_final_states=True,
            return_varlen_states=True,
            **kw,
        ),
        inputs,
    )
    assert_all_close(actual, expected, EXACT)

    out, varlen = torch_ssd.mamba_chunk_scan_combined(
        chunk_size=8, cu_seqlens=cu_seqlens, return_varlen_states=True, **inputs
    )
    assert varlen.shape == (len(lengths), 4, 3, 5) and torch.equal(out, actual[0][0])


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(cu_seqlens=torch.tensor([0, 9])), "cu_seqlens"),
        (dict(return_varlen_states=True), "cu_seqlens"),
        (dict(return_varlen_states=True, cu_seqlens=torch.tensor([0, 4, 9]), b=2), "batch size 1"),
        (dict(A=torch.ones(3)), "A must have shape"),
        (dict(D=torch.ones(4, 2)), "D must have shape"),
        (dict(seq_idx=torch.zeros(1, 8, dtype=torch.int32)), "seq_idx must have shape"),
        (dict(B=torch.ones(1, 9, 3, 5)), "multiple of ngroups"),
        (dict(chunk_size=0), "chunk_size"),
    ],
)
def test_chunk_scan_rejects_bad_arguments(change, match):
    change = dict(change)
    inputs = scan_inputs(b=change.pop("b", 1), l=9)
    inputs["C"] = change.get("B", inputs["C"])  # C always has B's shape
    kwargs = {"chunk_size": 4, **inputs, **change}
    with pytest.raises(ValueError, match=match):
        torch_ssd.mamba_chunk_scan_combined(**kwargs)


# --------------------------------------------------------------------------------------------------
# mamba_split_conv1d_scan_combined


def split_inputs(
    *,
    b=2,
    l=29,
    h=4,
    p=3,
    n=4,
    groups=1,
    width=4,
    d_mlp=0,
    D="h",
    conv_bias=True,
    rmsnorm=False,
    outproj=False,
    init=False,
    seq_lens=None,
    dtype=torch.float64,
    param_dtype=None,
    device="cpu",
    seed=0,
):
    """Random inputs for mamba_split_conv1d_scan_combined. param_dtype (default: dtype) is used for
    dt_bias, A, D and initial_states, which Megatron keeps in float32."""
    g = torch.Generator().manual_seed(seed)
    param_dtype = param_dtype or dtype
    dim, conv_dim = h * p, h * p + 2 * groups * n

    def rand(*shape, scale=1.0, shift=0.0, as_param=False):
        t = torch.randn(*shape, generator=g, dtype=torch.float64) * scale + shift
        return t.to(device=device, dtype=param_dtype if as_param else dtype).requires_grad_()

    inputs = dict(
        zxbcdt=rand(b, l, 2 * d_mlp + 2 * dim + 2 * groups * n + h, scale=0.7),
        conv1d_weight=rand(conv_dim, width, scale=0.5),
        conv1d_bias=rand(conv_dim, scale=0.2) if conv_bias else None,
        dt_bias=rand(h, scale=0.3, shift=-1.0, as_param=True),
        A=(-torch.rand(h, generator=g, dtype=torch.float64) - 0.5)
        .to(device, param_dtype)
        .requires_grad_(),
        D=rand(h, as_param=True) if D == "h" else rand(h, p, as_param=True),
        initial_states=rand(b, h, p, n, as_param=True) if init else None,
        seq_idx=sequence_ids(seq_lens).to(device) if seq_lens else None,
        rmsnorm_weight=rand(dim, scale=0.2, shift=1.0) if rmsnorm else None,
        outproj_weight=rand(5, d_mlp + dim, scale=0.3) if outproj else None,
        outproj_bias=rand(5) if outproj else None,
        headdim=p if D == "h" else None,
        ngroups=groups,
    )
    return inputs


SPLIT_CASES = [
    pytest.param(dict(), 8, {}, id="gate-D[h]"),
    pytest.param(
        dict(groups=2, D="hp", rmsnorm=True, init=True, seq_lens=[[3, 10, 1, 15], [29]]),
        8,
        dict(norm_before_gate=True, dt_limit=(0.1, 0.6)),
        id="rmsnorm-before-gate-2-groups-seq-idx-initial-states-dt-limit",
    ),
    pytest.param(
        dict(l=21, rmsnorm=True, outproj=True, d_mlp=3, seq_lens=[[1, 2, 5, 13], [2, 19]]),
        4,
        dict(norm_before_gate=False, activation=None),
        id="rmsnorm-after-gate-outproj-mlp-short-sequences",
    ),
    pytest.param(
        dict(b=1, l=6, conv_bias=False, width=2),
        8,
        dict(activation="swish"),
        id="l-shorter-than-chunk-no-conv-bias",
    ),
]


@pytest.mark.parametrize("sizes, chunk_size, extra", SPLIT_CASES)
def test_split_conv1d_scan_matches_sequential_oracle(sizes, chunk_size, extra):
    inputs = {**split_inputs(**sizes), **extra}
    expected = outputs_and_grads(reference.mamba_split_conv1d_scan_sequential, inputs)
    actual = outputs_and_grads(
        lambda **kw: torch_ssd.mamba_split_conv1d_scan_combined(
            chunk_size=chunk_size, return_final_states=True, **kw
        ),
        inputs,
    )
    assert_all_close(actual, expected, EXACT)


def test_split_conv1d_scan_rejects_bad_arguments():
    inputs = split_inputs(b=1, l=5)
    with pytest.raises(ValueError, match="headdim"):
        torch_ssd.mamba_split_conv1d_scan_combined(chunk_size=4, **{**inputs, "headdim": None})
    with pytest.raises(ValueError, match="zxbcdt width"):
        torch_ssd.mamba_split_conv1d_scan_combined(
            chunk_size=4, **{**inputs, "zxbcdt": inputs["zxbcdt"][..., 1:]}
        )
    with pytest.raises(ValueError, match="activation"):
        torch_ssd.mamba_split_conv1d_scan_combined(chunk_size=4, activation="relu", **inputs)


def test_causal_conv_oracle_matches_conv1d_without_sequences():
    """Pins the conv oracle itself to PyTorch's grouped conv1d (left zero padding)."""
    x, weight, bias = (
        torch.randn(2, 9, 6, dtype=torch.float64),
        torch.randn(6, 4, dtype=torch.float64),
        torch.randn(6, dtype=torch.float64),
    )
    expected = torch.nn.functional.conv1d(
        x.transpose(1, 2), weight[:, None], bias, padding=3, groups=6
    )[..., :9]
    actual = reference.causal_conv1d_sequential(x, weight, bias)
    assert rel_err(actual, expected.transpose(1, 2)) <= EXACT


# --------------------------------------------------------------------------------------------------
# RMSNorm


def test_rmsnorm_module_matches_mamba_ssm_interface():
    norm = torch_ssd.RMSNorm(8, group_size=4, norm_before_gate=False, dtype=torch.bfloat16)
    assert list(norm.state_dict()) == ["weight"] and norm.bias is None
    assert norm.weight.dtype == torch.bfloat16 and torch.equal(
        norm.weight, torch.ones(8, dtype=torch.bfloat16)
    )
    assert (norm.eps, norm.group_size, norm.norm_before_gate) == (1e-5, 4, False)
    with torch.no_grad():
        norm.weight.mul_(3)
    norm.reset_parameters()
    assert torch.equal(norm.weight, torch.ones(8, dtype=torch.bfloat16))
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    assert norm(x, torch.randn_like(x)).dtype == torch.bfloat16


@pytest.mark.parametrize("gate", [None, "before", "after"])
@pytest.mark.parametrize("group_size", [None, 4])
def test_rmsnorm_matches_oracle(gate, group_size):
    norm = torch_ssd.RMSNorm(
        12, eps=1e-3, group_size=group_size, norm_before_gate=gate != "after", dtype=torch.float64
    )
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.3)
    inputs = dict(x=torch.randn(2, 5, 12, dtype=torch.float64, requires_grad=True))
    if gate:
        inputs["z"] = torch.randn(2, 5, 12, dtype=torch.float64, requires_grad=True)
    expected = outputs_and_grads(
        lambda weight_, **kw: reference.rms_norm_gated_reference(
            weight=weight_, eps=1e-3, group_size=group_size, norm_before_gate=gate != "after", **kw
        ),
        {**inputs, "weight_": norm.weight},
    )
    actual = outputs_and_grads(lambda weight_, **kw: norm(**kw), {**inputs, "weight_": norm.weight})
    assert_all_close(actual, expected, EXACT)


# --------------------------------------------------------------------------------------------------
# interface and bf16


def test_signatures_match_mamba_ssm_2_3_2():
    """The lead registers these under mamba_ssm's names, so names, order and defaults must match."""
    inf = float("inf")
    expected = {
        torch_ssd.mamba_chunk_scan_combined: [
            ("x", None),
            ("dt", None),
            ("A", None),
            ("B", None),
            ("C", None),
            ("chunk_size", None),
            ("D", None),
            ("z", None),
            ("dt_bias", None),
            ("initial_states", None),
            ("seq_idx", None),
            ("cu_seqlens", None),
            ("dt_softplus", False),
            ("dt_limit", (0.0, inf)),
            ("return_final_states", False),
            ("return_varlen_states", False),
        ],
        torch_ssd.mamba_split_conv1d_scan_combined: [
            ("zxbcdt", None),
            ("conv1d_weight", None),
            ("conv1d_bias", None),
            ("dt_bias", None),
            ("A", None),
            ("D", None),
            ("chunk_size", None),
            ("initial_states", None),
            ("seq_idx", None),
            ("dt_limit", (0.0, inf)),
            ("return_final_states", False),
            ("activation", "silu"),
            ("rmsnorm_weight", None),
            ("rmsnorm_eps", 1e-6),
            ("outproj_weight", None),
            ("outproj_bias", None),
            ("headdim", None),
            ("ngroups", 1),
            ("norm_before_gate", True),
        ],
        torch_ssd.RMSNorm.__init__: [
            ("self", None),
            ("hidden_size", None),
            ("eps", 1e-5),
            ("group_size", None),
            ("norm_before_gate", True),
            ("device", None),
            ("dtype", None),
        ],
    }
    for fn, params in expected.items():
        actual = [
            (name, None if p.default is inspect.Parameter.empty else p.default)
            for name, p in inspect.signature(fn).parameters.items()
        ]
        assert actual == params, fn.__qualname__


# bf16 keeps 8 significant bits: rounding a float32 result to bf16 moves each element by at most
# 2^-9 of itself. bf16 runs compute in float32 and round only their output, so allow 2^-7 of the
# largest element.
BF16_ROUNDING_TOL = 2.0**-7


def test_bf16_inputs_run_and_round_only_the_output():
    inputs = scan_inputs(l=40, init=True, seq_lens=[[11, 29], [40]], dtype=torch.bfloat16)
    out, final = torch_ssd.mamba_chunk_scan_combined(
        chunk_size=16, return_final_states=True, **inputs
    )
    assert out.dtype == torch.bfloat16 and final.dtype == torch.float32
    as_float = converted(inputs, torch.float32)
    out32, final32 = torch_ssd.mamba_chunk_scan_combined(
        chunk_size=16, return_final_states=True, **as_float
    )
    assert rel_err(out, out32) <= BF16_ROUNDING_TOL
    assert torch.equal(final, final32)  # states stay float32

    sizes = dict(rmsnorm=True, outproj=True, d_mlp=2, init=True, param_dtype=torch.float32)
    inputs = split_inputs(dtype=torch.bfloat16, **sizes)
    out = torch_ssd.mamba_split_conv1d_scan_combined(chunk_size=8, **inputs)
    assert out.dtype == torch.bfloat16
    as_float = converted(inputs, torch.float32)
    out32 = torch_ssd.mamba_split_conv1d_scan_combined(chunk_size=8, **as_float)
    assert rel_err(out, out32) <= BF16_ROUNDING_TOL
    out.float().sum().backward()
    assert all(
        t.grad is not None for t in inputs.values() if torch.is_tensor(t) and t.requires_grad
    )


# --------------------------------------------------------------------------------------------------
# GPU: against mamba_ssm's Triton kernels


def _mamba_ssm_triton():
    """mamba_ssm's Triton modules, or None when absent (or when our fallback stands in for them)."""
    try:
        from mamba_ssm.ops.triton import layernorm_gated, ssd_combined
    except Exception:  # pylint: disable=broad-except  # any import failure means "not available"
        return None
    if getattr(ssd_combined, "__shared_prefix_fallback__", False):
        return None
    return ssd_combined, layernorm_gated


needs_mamba_ssm_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or _mamba_ssm_triton() is None,
    reason="needs CUDA and mamba_ssm's Triton kernels",
)

# Tolerances against the Triton kernels (relative error as above; the oracle is torch_ssd in float64
# on the same rounded inputs). float32: Triton's tl.dot rounds float32 operands to TF32 (10-bit
# mantissa, ~5e-4 per product) by default, so errors of 1e-3 order are expected and a 1e-3 bound
# would be too tight. bf16: the kernels keep intermediates (x, C.B, the chunk states fed to tl.dot,
# out_x) in bf16 (8-bit mantissa, ~4e-3 per rounding). Largest errors measured on an H200 (torch
# 2.11, Triton 3.6, mamba_ssm 2.3.2.post1), over outputs, states and all gradients: 2.4e-3 float32,
# 7.7e-3 bf16; bounds are ~3x that.
GPU_TOL = {torch.float32: 7.5e-3, torch.bfloat16: 2.5e-2}


@pytest.mark.gpu
@needs_mamba_ssm_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "sizes, extra",
    [
        pytest.param(
            dict(init=True, groups=2, seq_lens=[[50, 130, 1, 119], [300]]),
            {},
            id="seq-idx-initial-states",
        ),
        pytest.param(
            dict(D="hp", z=False, init=True, seq_lens=[[100, 200], [300]], first_id=1),
            {},
            id="ids-from-1",
        ),
        # raw dt in [-0.3, 0.5) without softplus: the kernels clamp negative steps to 0 even with
        # the default limit
        pytest.param(
            dict(softplus=False, dt_bias=False), dict(dt_shift=-0.3), id="negative-dt-clamped"
        ),
        pytest.param(dict(), dict(dt_limit=(0.2, 0.5)), id="finite-dt-limit"),
    ],
)
def test_chunk_scan_matches_mamba_ssm_triton(dtype, sizes, extra):
    ssd_combined, _ = _mamba_ssm_triton()
    extra = dict(extra)
    inputs = scan_inputs(b=2, l=300, h=8, p=32, n=16, dtype=dtype, device="cuda", **sizes)
    if "dt_shift" in extra:
        inputs["dt"] = (inputs["dt"].detach() + extra.pop("dt_shift")).requires_grad_()
    for name in ("A", "dt_bias", "D", "initial_states"):  # Megatron keeps these in float32
        if inputs[name] is not None:
            inputs[name] = inputs[name].detach().float().requires_grad_()
    kwargs = dict(chunk_size=64, return_final_states=True, **extra)
    actual = outputs_and_grads(
        lambda **kw: ssd_combined.mamba_chunk_scan_combined(**kwargs, **kw), inputs
    )
    expected = outputs_and_grads(
        lambda **kw: torch_ssd.mamba_chunk_scan_combined(**kwargs, **kw),
        converted(inputs, torch.float64),
    )
    assert_all_close(actual, expected, GPU_TOL[dtype], what=f"{dtype}")


def _torch_causal_conv1d_functions():
    """Stand-ins for causal-conv1d's two CUDA entry points (absent on the GPU machine), built from
    torch_ssd's conv, with the calling convention mamba_ssm's fused split function uses."""

    # pylint: disable=protected-access
    def conv(x, weight, bias, seq_idx, silu):  # x [b, d, s]
        segments = torch_ssd._segment_ids(seq_idx, x.shape[0], x.shape[2], x.device)
        out = torch_ssd._causal_depthwise_conv(
            x.transpose(1, 2).float(),
            weight.float(),
            None if bias is None else bias.float(),
            "silu" if silu else None,
            segments,
        )
        return out.transpose(1, 2)

    def forward(x, weight, bias, seq_idx, initial_states, final_states_out, silu):
        assert initial_states is None and final_states_out is None
        return conv(x, weight, bias, seq_idx, silu).to(x.dtype)

    def backward(
        x,
        weight,
        bias,
        dout,
        seq_idx,
        initial_states,
        dfinal_states,
        dx,
        return_dfinal_states,
        silu,
    ):
        assert initial_states is None and not return_dfinal_states
        leaves = [t.detach().requires_grad_() for t in (x, weight, bias)]
        with torch.enable_grad():  # autograd.Function.backward runs with grad mode off
            grads = torch.autograd.grad(conv(*leaves, seq_idx, silu), leaves, dout.float())
        dx.copy_(grads[0])
        return dx, grads[1].to(weight.dtype), grads[2].to(bias.dtype), None

    return forward, backward


@pytest.mark.gpu
@needs_mamba_ssm_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "sizes, extra",
    [
        pytest.param(
            dict(init=True, seq_lens=[[50, 130, 1, 119], [300]]),
            {},
            id="gate-seq-idx-initial-states",
        ),
        pytest.param(
            dict(D="hp", groups=2, rmsnorm=True, outproj=True, d_mlp=16),
            {},
            id="rmsnorm-before-gate-outproj-mlp",
        ),
        pytest.param(
            dict(groups=2, rmsnorm=True),
            dict(norm_before_gate=False, dt_limit=(0.1, 0.6)),
            id="rmsnorm-after-gate",
        ),
    ],
)
def test_split_conv1d_scan_matches_mamba_ssm_triton(dtype, sizes, extra, monkeypatch):
    """mamba_ssm's fused split function, with causal-conv1d's CUDA calls replaced by torch
    stand-ins: its reference function needs causal-conv1d and selective_scan_cuda, both absent on
    the GPU machine. This compares the Triton scan, the Triton gated RMSNorm and mamba_ssm's
    split/gate/projection logic; the conv itself is ours on both sides.
    """
    ssd_combined, _ = _mamba_ssm_triton()
    forward, backward = _torch_causal_conv1d_functions()
    monkeypatch.setattr(ssd_combined, "causal_conv1d_fwd_function", forward)
    monkeypatch.setattr(ssd_combined, "causal_conv1d_bwd_function", backward)
    inputs = split_inputs(
        b=2, l=300, h=8, p=32, n=16, dtype=dtype, param_dtype=torch.float32, device="cuda", **sizes
    )
    kwargs = dict(chunk_size=64, return_final_states=True, **extra)
    actual = outputs_and_grads(
        lambda **kw: ssd_combined.mamba_split_conv1d_scan_combined(**kwargs, **kw), inputs
    )
    expected = outputs_and_grads(
        lambda **kw: torch_ssd.mamba_split_conv1d_scan_combined(**kwargs, **kw),
        converted(inputs, torch.float64),
    )
    assert_all_close(actual, expected, GPU_TOL[dtype], what=f"{dtype}")


@pytest.mark.gpu
@needs_mamba_ssm_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("norm_before_gate", [True, False])
def test_rmsnorm_matches_mamba_ssm_triton(dtype, norm_before_gate):
    _, layernorm_gated = _mamba_ssm_triton()
    options = dict(group_size=64, norm_before_gate=norm_before_gate, device="cuda")
    theirs = layernorm_gated.RMSNorm(256, dtype=dtype, **options)
    ours = torch_ssd.RMSNorm(256, dtype=torch.float64, **options)
    with torch.no_grad():
        theirs.weight.normal_(1.0, 0.3)
        ours.weight.copy_(theirs.weight)
    inputs = dict(
        x=torch.randn(4, 100, 256, device="cuda", dtype=dtype, requires_grad=True),
        z=torch.randn(4, 100, 256, device="cuda", dtype=dtype, requires_grad=True),
    )
    actual = outputs_and_grads(lambda w, **kw: theirs(**kw), {**inputs, "w": theirs.weight})
    expected = outputs_and_grads(
        lambda w, **kw: ours(**kw), {**converted(inputs, torch.float64), "w": ours.weight}
    )
    assert_all_close(actual, expected, GPU_TOL[dtype], what=f"{dtype}")
