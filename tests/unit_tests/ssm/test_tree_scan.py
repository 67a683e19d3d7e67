"""Tree SSD scan (megatron/shared_prefix/ssm/tree_scan.py) against its oracle, dense runs and mamba_ssm.

* Oracle: ``reference.tree_selective_scan_sequential`` runs the recurrence token by token, each token
  starting from the state after its root-path predecessor. float64, relative error (max|a - b| /
  max|b|) <= 1e-10 for y and for the gradient of every input (x, dt, A, B, C, D, z, dt_bias), which
  includes everything that reaches a child through its inherited state.
* Dense: every original sequence of the row run alone through torch_ssd's chunked scan (zero initial
  state); the packed tokens must equal their values in every sequence, and the gradients of a
  multiplicity-weighted loss the dense ones.
* GPU (marked ``gpu``): the Triton backend against the torch backend, and against dense mamba_ssm
  runs of the expanded sequences.
Forests: random (depth 1..4, skewed segment lengths, one-token segments, segments and rows whose
lengths are not multiples of the chunk size), a hand-made chain of short segments, padded rows.
"""

import contextlib
import math

import numpy as np
import pytest
import torch
from forest_rows import EXACT, SHORT_CHAIN, make_forest, rel_err

from megatron.shared_prefix.ssm import reference, torch_ssd, tree_scan
from megatron.shared_prefix.ssm.tree_scan import TreeScanPlan, tree_ssd_scan, triton_chunk_scan


def scan_inputs(
    num_tokens,
    *,
    h=4,
    p=3,
    n=5,
    groups=1,
    D="h",
    z=True,
    dt_bias=True,
    softplus=True,
    dtype=torch.float64,
    device="cpu",
    seed=0,
):
    """Random leaf inputs of tree_ssd_scan for one packed row, keyed by argument name."""
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0, shift=0.0):
        t = torch.randn(*shape, generator=generator, dtype=torch.float64) * scale + shift
        return t.to(device=device, dtype=dtype).requires_grad_()

    inputs = dict(
        x=rand(1, num_tokens, h, p),
        # with softplus: raw dt around -1 (step ~0.3); without: positive steps in [0.02, 0.6]
        dt=rand(1, num_tokens, h, scale=0.5, shift=-1.0),
        A=(-torch.rand(h, generator=generator, dtype=torch.float64) - 0.5)
        .to(device, dtype)
        .requires_grad_(),
        B=rand(1, num_tokens, groups, n),
        C=rand(1, num_tokens, groups, n),
        D={"h": lambda: rand(h), "hp": lambda: rand(h, p), None: lambda: None}[D](),
        z=rand(1, num_tokens, h, p) if z else None,
        dt_bias=rand(h, scale=0.3) if dt_bias else None,
        dt_softplus=softplus,
    )
    if not softplus:
        dt = torch.rand(1, num_tokens, h, generator=generator, dtype=torch.float64) * 0.58 + 0.02
        inputs["dt"] = dt.to(device, dtype).requires_grad_()
    return inputs


def leaves(inputs):
    return {name: t for name, t in inputs.items() if torch.is_tensor(t) and t.requires_grad}


def grads_of(output, inputs, probe):
    names = list(leaves(inputs))
    return dict(zip(names, torch.autograd.grad((output * probe).sum(), [inputs[k] for k in names])))


CASES = [
    # (forest spec or None for SHORT_CHAIN, pad_multiple, chunk_size, input options, extra kwargs)
    pytest.param(dict(seed=1, depth=1), 1, 4, dict(), {}, id="depth-1-no-internal-segments"),
    pytest.param(
        dict(seed=13, depth=2),
        1,
        8,
        dict(groups=2, D="hp", z=False),
        {},
        id="depth-2-groups-2-D[h,p]",
    ),
    pytest.param(
        dict(seed=3, depth=3, max_segment=20),
        8,
        16,
        dict(groups=2, D=None, softplus=False, dt_bias=False),
        {},
        id="depth-3-padded-no-D-no-softplus",
    ),
    pytest.param(
        dict(seed=17, depth=4, max_children=2),
        1,
        4,
        dict(h=6, groups=3),
        dict(dt_limit=(0.1, 0.6)),
        id="depth-4-dt-limit",
    ),
    pytest.param(None, 1, 8, dict(groups=2, D="hp"), {}, id="short-chain"),
    pytest.param(
        dict(seed=12, depth=3, max_segment=3),
        1,
        16,
        dict(D="h"),
        {},
        id="depth-3-one-token-segments",
    ),
    pytest.param(dict(seed=4, depth=4), 1, 8, dict(groups=2), {}, id="depth-4-wide"),
]
DENSE_CASES = CASES[1:6]


def case_forest(spec, pad_multiple, forest_sequences):
    sequences = SHORT_CHAIN if spec is None else forest_sequences(**spec)
    return make_forest(sequences, pad_multiple)


@pytest.mark.parametrize("spec, pad_multiple, chunk_size, options, extra", CASES)
def test_tree_scan_matches_oracle(forest_sequences, spec, pad_multiple, chunk_size, options, extra):
    layout, forest = case_forest(spec, pad_multiple, forest_sequences)
    inputs = {**scan_inputs(layout.num_tokens, **options), **extra}
    actual = tree_ssd_scan(chunk_size=chunk_size, forest=forest, **inputs)
    args = [inputs[k] for k in ("x", "dt", "A", "B", "C")]
    kwargs = {k: v for k, v in inputs.items() if k not in ("x", "dt", "A", "B", "C")}
    expected = reference.tree_selective_scan_sequential(*args, layout, **kwargs)
    assert actual.shape == inputs["x"].shape and actual.dtype == torch.float64
    assert rel_err(actual, expected) <= EXACT
    probe = torch.randn(
        actual.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64
    )
    actual_grads, expected_grads = grads_of(actual, inputs, probe), grads_of(
        expected, inputs, probe
    )
    for name, want in expected_grads.items():
        assert rel_err(actual_grads[name], want) <= EXACT, name


@pytest.mark.parametrize("spec, pad_multiple, chunk_size, options, extra", DENSE_CASES)
@pytest.mark.parametrize(
    "dtype, tol", [(torch.float64, EXACT), (torch.float32, 2e-5)], ids=["fp64", "fp32"]
)
def test_tree_scan_matches_dense_sequences(
    forest_sequences, spec, pad_multiple, chunk_size, options, extra, dtype, tol
):
    """Each sequence scanned alone (zero initial state) gives the tree's values on its root path."""
    layout, forest = case_forest(spec, pad_multiple, forest_sequences)
    inputs = {**scan_inputs(layout.num_tokens, dtype=dtype, **options), **extra}
    probe = torch.randn(inputs["x"].shape, generator=torch.Generator().manual_seed(2), dtype=dtype)
    multiplicity = torch.tensor(layout.token_multiplicity, dtype=dtype)[None, :, None, None]
    tree = tree_ssd_scan(chunk_size=chunk_size, forest=forest, **inputs)
    tree_grads = grads_of(tree * multiplicity, inputs, probe)

    dense_loss = 0.0
    per_token = ("x", "dt", "B", "C", "z")
    for k in range(len(layout.sequence_ids)):
        path = torch.as_tensor(layout.root_path(k))
        sequence = {
            name: (value[:, path] if name in per_token and value is not None else value)
            for name, value in inputs.items()
        }
        dense = torch_ssd.mamba_chunk_scan_combined(chunk_size=chunk_size, **sequence)
        assert rel_err(tree[:, path], dense) <= tol
        dense_loss = dense_loss + (dense * probe[:, path]).sum()
    names = list(leaves(inputs))
    dense_grads = dict(zip(names, torch.autograd.grad(dense_loss, [inputs[k] for k in names])))
    for name, want in dense_grads.items():
        assert rel_err(tree_grads[name], want) <= tol, name


def test_float32_decays_do_not_cancel_on_long_rows():
    """A child segment far into a long row: its inherited decays must not lose float32 precision.

    The cumulative log-decay before the second tree is about -3000 here. Subtracting float32 prefix
    sums would leave errors of ~ulp(3000) = 2.4e-4 in every inherited log-decay; the float64 segmented
    cumulative sum keeps the float32 tree scan within float32 rounding of the float64 one.
    """
    rng = np.random.default_rng(0)
    flat = rng.integers(1, 60, 2000).tolist()  # a root with no children: only moves the prefix sum
    prompt = rng.integers(1, 60, 300).tolist()
    sequences = [flat] + [prompt + rng.integers(1, 60, 40).tolist() for _ in range(3)]
    layout, forest = make_forest(sequences)
    inputs = scan_inputs(layout.num_tokens, h=2, p=2, n=4, z=False, dt_bias=False, softplus=False)
    with torch.no_grad():
        inputs["dt"].mul_(0.0).add_(1.5)  # large steps: log-decay ~ -1.5 * |A| per token
    exact = tree_ssd_scan(chunk_size=64, forest=forest, **inputs).detach()
    single = {k: (v.detach().float() if torch.is_tensor(v) else v) for k, v in inputs.items()}
    approx = tree_ssd_scan(chunk_size=64, forest=forest, **single)
    children = TreeScanPlan.of(forest).all_child_tokens
    assert len(children) == 120
    # Measured: ~1.5e-7 here, 2e-5 (first child tokens) with float32 prefix sums minus offsets.
    first_tokens = torch.as_tensor(layout.segment_starts[layout.segment_parents >= 0])
    assert rel_err(approx[0, first_tokens], exact[0, first_tokens]) <= 1e-6
    assert rel_err(approx[0, children], exact[0, children]) <= 1e-6


def test_plan_lists_internal_segments_parents_first(forest_sequences):
    layout, forest = make_forest(forest_sequences(seed=4, depth=4))
    plan = TreeScanPlan.of(forest)
    assert plan is TreeScanPlan.of(forest)  # cached on the forest
    parents = layout.segment_parents
    internal = [segment for segment, *_ in plan.internal]
    assert internal == sorted(set(parents[parents >= 0].tolist()))
    for slot, (segment, first, end, parent_slot) in enumerate(plan.internal):
        assert (first, end) == (
            layout.segment_starts[segment],
            layout.segment_starts[segment] + layout.segment_lengths[segment],
        )
        assert parent_slot < slot and (parent_slot < 0) == (parents[segment] < 0)
        children = plan.child_tokens[slot].numpy()
        assert np.all(parents[layout.token_segment[children]] == segment)
    chained = {segment: slot for slot, (segment, *_, parent_slot) in enumerate(plan.internal)
               if parent_slot >= 0}  # fmt: skip
    assert chained
    assert plan.segment_chain_slot.tolist() == [
        chained.get(segment, -1) for segment in range(len(parents))
    ]
    # The chain's parents, numbered in slot order: the rows of their kept float32 end states.
    chain_parents = sorted({parent_slot for *_, parent_slot in plan.internal if parent_slot >= 0})
    assert plan.num_chain_parents == len(chain_parents) >= 1
    assert plan.chain_parent_row.tolist() == [
        chain_parents.index(slot) if slot in chain_parents else -1
        for slot in range(len(plan.internal))
    ]
    child_tokens = np.flatnonzero(parents[layout.token_segment] >= 0)
    assert np.array_equal(np.sort(plan.all_child_tokens.numpy()), child_tokens)
    assert plan.seq_idx.dtype == torch.int32 and plan.seq_idx.shape == (1, layout.num_tokens)


def test_without_internal_segments_it_is_the_packed_scan():
    layout, forest = make_forest([[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12, 13, 14, 15]])
    inputs = scan_inputs(layout.num_tokens)
    seq_idx = forest.token_segment.int()[None]
    expected = torch_ssd.mamba_chunk_scan_combined(chunk_size=4, seq_idx=seq_idx, **inputs)
    assert torch.equal(tree_ssd_scan(chunk_size=4, forest=forest, **inputs), expected)


def channel_hook(tensor):
    """A list that receives ``tensor``'s gradient when autograd computes it."""
    captured = []
    tensor.register_hook(captured.append)
    return captured


def test_split_channels_are_views_and_pass_on_a_joint_gradient_whole():
    """x, B and C are views of the conv output's channels; their gradients reach it as one tensor:
    the buffer itself when they are its adjacent views (as the forked scan writes them), else
    their concatenation. Other layouts are not taken for a joint buffer."""
    heads, head_dim, groups, state_dim, length = 3, 2, 2, 4, 5
    width = heads * head_dim + 2 * groups * state_dim
    leaf = torch.randn(1, length, width, dtype=torch.float64, requires_grad=True)
    xBC = leaf * 1.0
    x, B, C = tree_scan.split_channels(xBC, heads, head_dim, groups, state_dim)
    assert (x.shape, B.shape, C.shape) == ((1, length, 3, 2), (1, length, 2, 4), (1, length, 2, 4))
    assert all(t.untyped_storage().data_ptr() == xBC.untyped_storage().data_ptr() for t in (B, C))
    assert torch.equal(torch.cat([x.flatten(2), B.flatten(2), C.flatten(2)], dim=-1), xBC)
    assert tree_scan._channels_of(x, B, C).data_ptr() == xBC.data_ptr()

    joint = torch.randn(1, length, width, dtype=torch.float64)
    grads = tree_scan._channel_views(joint, heads, head_dim, groups, state_dim)
    captured = channel_hook(xBC)
    torch.autograd.backward((x, B, C), grads)
    assert captured[0].data_ptr() == joint.data_ptr() and torch.equal(captured[0], joint)
    assert torch.equal(leaf.grad, joint)

    separate = [g.clone() for g in grads]
    x, B, C = tree_scan.split_channels(leaf * 1.0, heads, head_dim, groups, state_dim)
    leaf.grad = None
    torch.autograd.backward((x, B, C), separate)
    assert torch.equal(leaf.grad, joint)

    assert tree_scan._channels_of(*separate) is None
    x, B, C = tree_scan._channel_views(joint, heads, head_dim, groups, state_dim)
    assert tree_scan._channels_of(x, C, B) is None  # another order
    assert tree_scan._channels_of(x, B, B) is None
    wider = torch.randn(1, length, width + 1, dtype=torch.float64)
    assert tree_scan._channels_of(*tree_scan._channel_views(wider[..., :width], 3, 2, 2, 4)) is None
    with pytest.raises(ValueError, match="split_channels expects"):
        tree_scan.split_channels(wider, heads, head_dim, groups, state_dim)


def test_bf16_inputs_give_bf16_output():
    layout, forest = make_forest(SHORT_CHAIN * 2 + [[1, 2, 3, 4, 5, 6, 11, 12, 13]])
    inputs = scan_inputs(layout.num_tokens, groups=2, dtype=torch.bfloat16)
    for name in ("A", "D", "dt_bias"):  # Megatron keeps these in float32
        inputs[name] = inputs[name].detach().float().requires_grad_()
    out = tree_ssd_scan(chunk_size=8, forest=forest, **inputs)
    assert out.dtype == torch.bfloat16
    exact = tree_ssd_scan(
        chunk_size=8,
        forest=forest,
        **{k: v.double() if torch.is_tensor(v) else v for k, v in inputs.items()},
    )
    assert rel_err(out, exact) <= 2.0**-6
    out.float().sum().backward()
    assert all(t.grad is not None for t in leaves(inputs).values())


def test_step_sizes_skip_only_the_clamp_that_cannot_act():
    """The step size from a bf16 projection and a float32 bias: one add (which converts dt) and
    the softplus, with no clamp node for the default limit (the softplus is never negative), the
    values and the gradient of converting, adding, softplus and clamping; a real limit clamps."""
    torch.manual_seed(0)
    raw = (torch.randn(64, 8) * 10).to(torch.bfloat16).requires_grad_()
    bias = torch.randn(8).requires_grad_()
    steps = tree_scan.process_dt(raw, bias, True, (0.0, math.inf))
    nodes, stack = set(), [steps.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None and node not in nodes:
            nodes.add(node)
            stack += [parent for parent, _ in node.next_functions]
    names = sorted(type(node).__name__ for node in nodes)
    assert not any("Clamp" in name or "ToCopy" in name for name in names), names
    expected = torch.nn.functional.softplus(raw.float() + bias).clamp(min=0.0, max=math.inf)
    assert steps.dtype == torch.float32 and torch.equal(steps, expected)
    probe = torch.randn(64, 8)
    grads = torch.autograd.grad((steps * probe).sum(), (raw, bias))
    expected_grads = torch.autograd.grad((expected * probe).sum(), (raw, bias))
    for actual, wanted in zip(grads, expected_grads):
        assert actual.dtype == wanted.dtype and torch.equal(actual, wanted)
    limited = tree_scan.process_dt(raw.float(), bias, True, (0.5, 2.0))
    assert float(limited.min()) == 0.5 and float(limited.max()) == 2.0


def test_rejects_bad_arguments():
    layout, forest = make_forest(SHORT_CHAIN)
    inputs = scan_inputs(layout.num_tokens)
    with pytest.raises(ValueError, match="backend"):
        tree_ssd_scan(chunk_size=4, forest=forest, backend="cuda", **inputs)
    with pytest.raises(ValueError, match="triton"):
        tree_ssd_scan(chunk_size=4, forest=forest, backend="triton", **inputs)
    with pytest.raises(ValueError, match="x of shape"):
        tree_ssd_scan(chunk_size=4, forest=forest, **{**inputs, "x": inputs["x"][:, 1:]})
    with pytest.raises(ValueError, match="dt must be"):
        tree_ssd_scan(chunk_size=4, forest=forest, **{**inputs, "dt": inputs["dt"][..., 1:]})
    with pytest.raises(ValueError, match="B and C"):
        tree_ssd_scan(
            chunk_size=4, forest=forest, **{**inputs, "B": inputs["B"].repeat(1, 1, 3, 1)}
        )


# ----------------------------------------------------------------------------------------------------
# GPU: mamba_ssm's Triton kernel as the packed scan

needs_triton_scan = pytest.mark.skipif(
    not torch.cuda.is_available() or triton_chunk_scan() is None,
    reason="needs CUDA and mamba_ssm's Triton kernels",
)

# Same bounds as tests/unit_tests/ssm/test_torch_ssd.py's GPU tests, for the same reasons: Triton's
# tl.dot rounds float32 operands to TF32 (~5e-4 per product), and with bf16 inputs the kernel keeps
# C.B, x and the per-chunk states in bf16 (~4e-3 per rounding), gradients accumulating several such
# roundings. The tree correction's Triton kernels round the forked state the same way (to TF32 or bf16
# before the product with C), one more rounding of the same order.
GPU_TOL = {torch.float32: 5e-3, torch.bfloat16: 5e-2}


def gpu_forest(forest_sequences, seed=1):
    """Depth-3 forest with segments up to 120 tokens (spanning several 64-token chunks), padded."""
    sequences = forest_sequences(seed=seed, depth=3, max_segment=120)
    return sequences, *make_forest(sequences, pad_multiple=64, device="cuda")


def gpu_inputs(num_tokens, dtype, **options):
    inputs = scan_inputs(
        num_tokens, h=8, p=32, n=16, groups=2, dtype=dtype, device="cuda", **options
    )
    for name in ("A", "D", "dt_bias"):  # Megatron keeps these in float32
        if inputs[name] is not None:
            inputs[name] = inputs[name].detach().float().requires_grad_()
    return inputs


def as_float64(inputs):
    return {
        k: (
            v.detach().double().requires_grad_(v.requires_grad)
            if torch.is_tensor(v) and v.is_floating_point()
            else v
        )
        for k, v in inputs.items()
    }


@pytest.mark.gpu
@needs_triton_scan
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "options", [dict(D="h"), dict(D="hp", z=False)], ids=["D[h]-z", "D[h,p]-no-z"]
)
def test_triton_backend_matches_torch_backend(forest_sequences, dtype, options):
    _, layout, forest = gpu_forest(forest_sequences)
    inputs = gpu_inputs(layout.num_tokens, dtype, **options)
    probe = torch.randn(
        inputs["x"].shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64
    ).cuda()
    actual = tree_ssd_scan(chunk_size=64, forest=forest, backend="triton", **inputs)
    assert actual.dtype == dtype
    exact_inputs = as_float64(inputs)
    expected = tree_ssd_scan(chunk_size=64, forest=forest, backend="torch", **exact_inputs)
    assert rel_err(actual, expected) <= GPU_TOL[dtype]
    actual_grads = grads_of(actual.double(), inputs, probe)
    expected_grads = grads_of(expected, exact_inputs, probe)
    for name, want in expected_grads.items():
        assert rel_err(actual_grads[name], want) <= GPU_TOL[dtype], name


# Cycles of the sleep kernel queued on the fork stream: milliseconds on any current GPU, far longer
# than the test row's scan.
FORK_STREAM_DELAY_CYCLES = 20_000_000


@pytest.mark.gpu
@needs_triton_scan
@pytest.mark.parametrize("gate", [True, False], ids=["z", "no-z"])
def test_fork_stream_work_is_joined_before_the_scan_reads_it(forest_sequences, monkeypatch, gate):
    """The forked states' work that runs beside the packed scan (the end states in the forward,
    their gradients in the backward, on the fork stream) is done before the current stream's
    correction and token gradients start, however late the fork stream runs (here behind a sleep
    kernel), and the results are the bits of running everything on one stream."""
    _, layout, forest = gpu_forest(forest_sequences, seed=3)
    inputs = gpu_inputs(layout.num_tokens, torch.bfloat16, D="hp", z=gate)
    probe = torch.randn(inputs["x"].shape, generator=torch.Generator().manual_seed(5)).cuda()

    def run():
        out = tree_ssd_scan(chunk_size=64, forest=forest, backend="triton", **inputs)
        return [out.detach(), *grads_of(out.float(), inputs, probe).values()]

    with monkeypatch.context() as one_stream:
        one_stream.setattr(tree_scan, "_fork_stream", lambda device: contextlib.nullcontext())
        one_stream.setattr(tree_scan, "_join_fork_stream", lambda device: None)
        expected = run()

    from megatron.shared_prefix.ssm.triton_inherited_state import ForkedStates

    def timed():
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    fork_started, fork_slept, readers_started = [], [], []
    fork_stream = tree_scan._fork_stream  # pylint: disable=protected-access

    @contextlib.contextmanager
    def late_fork_stream(device):
        with fork_stream(device):
            fork_started.append(timed())
            torch.cuda._sleep(FORK_STREAM_DELAY_CYCLES)  # pylint: disable=protected-access
            fork_slept.append(timed())
            yield

    def starts_reading(method):
        def wrapped(*args, **kwargs):
            readers_started.append(timed())
            return method(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(tree_scan, "_fork_stream", late_fork_stream)
    monkeypatch.setattr(ForkedStates, "correct", starts_reading(ForkedStates.correct))
    monkeypatch.setattr(
        ForkedStates, "backward_tokens", starts_reading(ForkedStates.backward_tokens)
    )
    actual = run()
    torch.cuda.synchronize()
    assert len(fork_started) == len(readers_started) == 2  # forward and backward
    for started, slept, reader in zip(fork_started, fork_slept, readers_started):
        assert started.elapsed_time(reader) >= started.elapsed_time(slept) > 0
    for want, got in zip(expected, actual, strict=True):
        assert torch.equal(got, want)


@pytest.mark.gpu
@needs_triton_scan
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_tree_is_as_close_to_exact_as_dense_mamba_ssm(forest_sequences, dtype):
    """Tree (one packed Triton scan + correction) vs mamba_ssm run densely on every expanded sequence.

    Both are compared with the float64 dense result; the tree's error (outputs and every gradient) may
    not exceed twice the dense kernel's own error (plus a floor of a quarter of GPU_TOL for errors that
    happen to be tiny): the fork adds no error of the kernel's order.
    """
    _, layout, forest = gpu_forest(forest_sequences, seed=2)
    scan = triton_chunk_scan()
    inputs = gpu_inputs(layout.num_tokens, dtype)
    exact_inputs = as_float64(inputs)
    multiplicity = torch.tensor(layout.token_multiplicity, device="cuda", dtype=torch.float64)[
        None, :, None, None
    ]
    probe = torch.randn(
        inputs["x"].shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64
    ).cuda()
    tree = tree_ssd_scan(chunk_size=64, forest=forest, backend="triton", **inputs)
    tree_grads = grads_of(tree.double() * multiplicity, inputs, probe)

    per_token = ("x", "dt", "B", "C", "z")
    dense_outputs, exact_outputs, dense_loss, exact_loss = [], [], 0.0, 0.0
    for k in range(len(layout.sequence_ids)):
        path = torch.as_tensor(layout.root_path(k), device="cuda")
        for source, outputs, fn in (
            (inputs, dense_outputs, scan),
            (exact_inputs, exact_outputs, torch_ssd.mamba_chunk_scan_combined),
        ):
            sequence = {
                n: (v[:, path] if n in per_token and v is not None else v)
                for n, v in source.items()
            }
            outputs.append(fn(chunk_size=64, **sequence))
        dense_loss = dense_loss + (dense_outputs[-1].double() * probe[:, path]).sum()
        exact_loss = exact_loss + (exact_outputs[-1] * probe[:, path]).sum()
    tree_on_paths = torch.cat(
        [
            tree[:, torch.as_tensor(layout.root_path(k), device="cuda")]
            for k in range(len(dense_outputs))
        ],
        1,
    )
    dense, exact = torch.cat(dense_outputs, 1), torch.cat(exact_outputs, 1)
    floor = GPU_TOL[dtype] / 4
    assert rel_err(tree_on_paths, exact) <= max(2 * rel_err(dense, exact), floor)
    names = list(leaves(inputs))
    dense_grads = dict(zip(names, torch.autograd.grad(dense_loss, [inputs[k] for k in names])))
    exact_grads = dict(
        zip(names, torch.autograd.grad(exact_loss, [exact_inputs[k] for k in names]))
    )
    for name in names:
        tree_error = rel_err(tree_grads[name], exact_grads[name])
        dense_error = rel_err(dense_grads[name], exact_grads[name])
        print(f"{dtype} {name}: tree {tree_error:.2e}, dense {dense_error:.2e}")
        assert tree_error <= max(2 * dense_error, floor), name
    assert math.isfinite(float(tree.float().sum()))


def kept_storages(run):
    """(output of ``run()``, {storage address: bytes} of the distinct storages that autograd keeps
    for backward)."""
    kept = {}

    def pack(tensor):
        kept[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = run()
    return out, kept


@pytest.mark.gpu
@needs_triton_scan
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("gate", [False, True], ids=["no-z", "z"])
def test_forked_scan_of_a_row_of_roots_is_mamba_ssm_scan(forest_sequences, dtype, gate):
    """On a row without internal segments the tree's scan (``_ForkedChunkScan``) runs mamba_ssm's
    forward and backward functions alone: outputs and every gradient bitwise those of mamba_ssm's
    ``mamba_chunk_scan_combined``; without a gate autograd keeps at least the output's size less
    (the stock function keeps its output), with one no more (both keep the ungated output)."""
    sequences = forest_sequences(seed=1, depth=3, max_segment=120)
    roots = [np.concatenate([[10**6 + k], s]) for k, s in enumerate(sequences)]
    layout, forest = make_forest(roots, pad_multiple=64, device="cuda")
    assert not TreeScanPlan.of(forest).internal
    inputs = gpu_inputs(layout.num_tokens, dtype, z=gate, dt_bias=False, softplus=False)
    scan_inputs_ = {k: inputs[k] for k in ("x", "dt", "A", "B", "C", "D", "z")}
    seq_idx = TreeScanPlan.of(forest).seq_idx
    probe = torch.randn(inputs["x"].shape, generator=torch.Generator().manual_seed(5)).cuda()
    stock_scan = triton_chunk_scan()
    functions = tree_scan.scan_functions(stock_scan)
    assert functions is not None
    stock, stock_kept = kept_storages(
        lambda: stock_scan(chunk_size=64, seq_idx=seq_idx, **scan_inputs_)
    )
    forked, forked_kept = kept_storages(
        lambda: tree_scan._ForkedChunkScan.apply(*scan_inputs_.values(), forest, 64, functions, {})
    )
    assert torch.equal(forked, stock)
    if gate:  # both keep the ungated output; the stock function also its chunked decay
        assert sum(forked_kept.values()) <= sum(stock_kept.values())
    else:
        assert stock.untyped_storage().data_ptr() in stock_kept
        assert forked.untyped_storage().data_ptr() not in forked_kept
        assert sum(stock_kept.values()) - sum(forked_kept.values()) >= stock.nbytes
    stock_grads = grads_of(stock.float(), scan_inputs_, probe)
    forked_grads = grads_of(forked.float(), scan_inputs_, probe)
    for name, want in stock_grads.items():
        assert torch.equal(forked_grads[name], want), name


@pytest.mark.gpu
@needs_triton_scan
@pytest.mark.parametrize("tree", [True, False], ids=["tree", "roots"])
def test_channel_views_give_the_bits_of_contiguous_inputs(forest_sequences, monkeypatch, tree):
    """x, B and C as channel views of one tensor (the mixer's conv output, ``split_channels``):
    the forked scan's output and every gradient bitwise those of contiguous copies, and the
    tensor's gradient is the one buffer mamba_ssm's backward wrote x's, B's and C's into."""
    sequences, layout, forest = gpu_forest(forest_sequences)
    if not tree:
        roots = [np.concatenate([[10**6 + k], s]) for k, s in enumerate(sequences)]
        layout, forest = make_forest(roots, pad_multiple=64, device="cuda")
    inputs = gpu_inputs(layout.num_tokens, torch.bfloat16)
    heads, head_dim = inputs["x"].shape[-2:]
    groups, state_dim = inputs["B"].shape[-2:]
    channels = [inputs[name].detach().flatten(2) for name in ("x", "B", "C")]
    xBC_leaf = torch.cat(channels, dim=-1).requires_grad_()
    probe = torch.randn(inputs["x"].shape, generator=torch.Generator().manual_seed(7)).cuda()
    written = []
    joint_grads = tree_scan._joint_channel_grads
    monkeypatch.setattr(
        tree_scan, "_joint_channel_grads", lambda *a: written.append(joint_grads(*a)) or written[-1]
    )

    xBC = xBC_leaf * 1
    captured = channel_hook(xBC)
    x, B, C = tree_scan.split_channels(xBC, heads, head_dim, groups, state_dim)
    viewed = tree_ssd_scan(chunk_size=64, forest=forest, **{**inputs, "x": x, "B": B, "C": C})
    others = {k: v for k, v in leaves(inputs).items() if k not in ("x", "B", "C")}
    viewed_grads = torch.autograd.grad((viewed.float() * probe).sum(), [xBC_leaf, *others.values()])
    assert len(written) == 1 and captured[0].data_ptr() == written[0]["dx"].data_ptr()

    contiguous = tree_ssd_scan(chunk_size=64, forest=forest, **inputs)
    assert torch.equal(viewed, contiguous)
    grads = grads_of(contiguous.float(), inputs, probe)
    assert len(written) == 1  # separate inputs: mamba_ssm allocates its own buffers
    assert torch.equal(viewed_grads[0], torch.cat([grads[k].flatten(2) for k in "xBC"], dim=-1))
    for name, got in zip(others, viewed_grads[1:]):
        assert torch.equal(got, grads[name]), name


@pytest.mark.gpu
@needs_triton_scan
def test_forked_states_keep_little_more_per_token_than_a_row_of_roots(forest_sequences):
    """Memory of the forked states: per token, the Triton tree scan of a depth-3 forest keeps for
    backward (its output included) at most what a row of the same sequences as separate roots
    keeps, plus the correction's [T, h] float32 tables (log-decay and input weight, and slack for
    a third) and its [slots, h, p, n] float32 states. Keeping the uncorrected output as well (the
    stock scan's saved output) would exceed that by the output's size."""
    sequences, layout, forest = gpu_forest(forest_sequences)
    roots = [np.concatenate([[10**6 + k], s]) for k, s in enumerate(sequences)]
    root_layout, root_forest = make_forest(roots, pad_multiple=64, device="cuda")
    assert (root_layout.segment_parents == -1).all()
    per_token = {}
    for name, row, row_forest in (("tree", layout, forest), ("roots", root_layout, root_forest)):
        inputs = gpu_inputs(row.num_tokens, torch.bfloat16, z=False)
        out, kept = kept_storages(
            lambda inputs=inputs, row_forest=row_forest: tree_ssd_scan(
                chunk_size=64, forest=row_forest, backend="triton", **inputs
            )
        )
        kept[out.untyped_storage().data_ptr()] = out.nbytes  # the gate's norm keeps the output
        per_token[name] = sum(kept.values()) / row.num_tokens
    heads, head_dim, state_dim = 8, 32, 16  # gpu_inputs' widths
    slots = len(TreeScanPlan.of(forest).internal)
    allowance = 3 * heads * 4 + slots * heads * head_dim * state_dim * 4 / layout.num_tokens
    assert per_token["tree"] <= per_token["roots"] + allowance, per_token


def test_forked_scan_is_chosen_only_for_mamba_ssm_functions_it_can_call(monkeypatch):
    """``scan_functions`` returns mamba_ssm's (forward, backward) only for the module's own
    ``mamba_chunk_scan_combined`` and only when both functions take the leading arguments that
    ``_ForkedChunkScan`` passes and the keywords of the scan's options (and the backward the
    gradient buffers); otherwise None, and the stock scan runs."""
    import sys
    import types

    from megatron.shared_prefix.ssm import tree_scan

    # pylint: disable=unused-argument
    def forward(x, dt, A, B, C, chunk_size, D=None, z=None, seq_idx=None):
        return None

    def backward(
        dout, x, dt, A, B, C, out, chunk_size, D=None, z=None, seq_idx=None, dx=None, dB=None,
        dC=None,
    ):
        return None

    def bufferless_backward(dout, x, dt, A, B, C, out, chunk_size, D=None, z=None, seq_idx=None):
        return None

    def renamed_backward(dout, x, dt, A, B, C, chunk_size, out, D=None, z=None, seq_idx=None):
        return None

    def ungated_backward(dout, x, dt, A, B, C, out, chunk_size, D=None, seq_idx=None):
        return None

    def scan(*args, **kwargs):
        return None

    module = types.ModuleType("fake_ssd_combined")
    scan.__module__ = module.__name__
    module.mamba_chunk_scan_combined = scan
    module._mamba_chunk_scan_combined_fwd = forward
    module._mamba_chunk_scan_combined_bwd = backward
    monkeypatch.setitem(sys.modules, module.__name__, module)
    assert tree_scan.scan_functions(scan) == (forward, backward)
    assert tree_scan.scan_functions(scan, {}) == (forward, backward)
    assert tree_scan.scan_functions(scan, {"state_dtype": None}) is None  # an option they lack
    assert tree_scan.scan_functions(lambda *a, **k: None) is None  # not the module's
    assert tree_scan.scan_functions(torch_ssd.mamba_chunk_scan_combined) is None
    for other in (renamed_backward, ungated_backward, bufferless_backward):
        monkeypatch.setattr(module, "_mamba_chunk_scan_combined_bwd", other)
        assert tree_scan.scan_functions(scan) is None
    monkeypatch.delattr(module, "_mamba_chunk_scan_combined_bwd")
    assert tree_scan.scan_functions(scan) is None
