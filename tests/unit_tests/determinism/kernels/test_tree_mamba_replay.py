"""Bitwise replay of the tree Mamba ops (ssm/tree_conv.py, ssm/tree_scan.py, ssm/mamba_mixer.py).

Kernel-determinism coverage (tests/unit_tests/determinism/kernels/manifest.py, docs/determinism.md):
the tree conv (the row conv, F.conv1d or on CUDA the Triton conv of ssm/triton_causal_conv.py;
gathers along root paths; an index_put without accumulation), the tree scan (the
packed chunk scan — torch_ssd on CPU, mamba_ssm's Triton kernel on CUDA, through its forward and
backward functions with the Triton forked-state kernels in one autograd function — a float64
cumulative sum, the forked-state correction)
and the mixer that chains them must give identical bits run after run, forward and backward, under
PyTorch's deterministic settings. The forest has several internal
segments, one-token segments, windows crossing two segment boundaries and padding; lengths are not
multiples of the chunk size. Each replayed run builds the forest's index tables afresh
(``fresh``): they are copied to the device without blocking the host, each group of tables in one
transfer from a pinned staging buffer (``hosts_to_device``), so a run that read a table before its
copy landed would not replay. The conv and scan tests also run once on tables built on the host
beforehand, as DataLoader workers build them, and landed before the run starts (``settled``) and
demand run 0's bits: a staging buffer reused before its copy ran would give every replayed run the
same wrong tables, which replay alone cannot see.
The forked states' backward does not keep the forward's log-decays and input weights: it runs the
segment walk again, which must give the forward's bits whatever else the GPU is doing
(``test_segment_decay_recompute_replay``).
"""

import contextlib

import numpy as np
import pytest
import torch

from megatron.shared_prefix.planning import plan_shared_prefix
from megatron.shared_prefix.ssm import tree_scan
from megatron.shared_prefix.ssm.tree_conv import prepare_tree_conv, tree_causal_conv1d
from megatron.shared_prefix.ssm.tree_scan import TreeScanPlan, prepare_tree_scan, tree_ssd_scan
from megatron.shared_prefix.tensors import ForestTable, ForestTensors, forest_scope, prepare_forest

from ..replay import assert_bitwise_replay, deterministic_settings

GPU = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
DEVICES = ["cpu", pytest.param("cuda", marks=GPU)]
HEADS, HEADDIM, GROUPS, STATE, WIDTH, CHUNK = 4, 8, 2, 8, 4, 16


def replay_forest(device):
    """A depth-3 row with one-token segments, long segments spanning chunks, and padding."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(1, 50, 37).tolist()
    sequences = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 7], [1, 2, 3, 8], [1, 9]]
    sequences += [prompt + rng.integers(1, 50, n).tolist() for n in (1, 23, 40)]
    sequences += [prompt[:20] + rng.integers(1, 50, 30).tolist()]
    layout = plan_shared_prefix(sequences, capacity=512, pad_multiple=16).rows[0]
    return ForestTensors.from_layout(layout, device)


def long_star_forest(device):
    """A GRPO-like row long enough that the token-dimension scans run over thousands of tokens."""
    rng = np.random.default_rng(1)
    prompt = rng.integers(1, 50, 1500).tolist()
    sequences = [prompt + rng.integers(1, 50, 700).tolist() for _ in range(4)]
    layout = plan_shared_prefix(sequences, capacity=8192).rows[0]
    return ForestTensors.from_layout(layout, device)


FORESTS = {"depth-3": replay_forest, "long-star": long_star_forest}


def fresh(forest):
    """A new ForestTensors of ``forest``'s layout: no table cached, each built on first use."""
    return ForestTensors.from_layout(forest.layout, forest.device)


def settled(forest):
    """A new ForestTensors of ``forest``'s layout whose conv, scan and forked-state tables were
    built on the CPU beforehand, as DataLoader workers build them (``prepare_forest``), and moved
    to the device before it is returned (the device synchronized)."""
    tables = (ForestTable(prepare_tree_scan), ForestTable(prepare_tree_conv, (WIDTH,)))
    new = prepare_forest(forest.layout, tables).to(forest.device)
    if new.device.type == "cuda":
        torch.cuda.synchronize()
    return new


def assert_settled_tables_agree(run, forest, make_inputs, replayed):
    """``run(forest, *inputs)`` on ``settled(forest)`` gives the replay's run-0 output bits."""
    with deterministic_settings():
        torch.manual_seed(0)  # the replay's seed: the same inputs
        output = run(settled(forest), *make_inputs())
    assert torch.equal(output.detach().view(torch.int32), replayed["output[0]"].view(torch.int32))


def _param(*shape, device, scale=1.0, shift=0.0):
    return (torch.randn(*shape, device=device) * scale + shift).requires_grad_()


@pytest.mark.parametrize(
    "device, backend",
    [
        ("cpu", "torch"),
        pytest.param("cuda", "torch", marks=GPU, id="cuda-torch"),
        pytest.param("cuda", "triton", marks=GPU, id="cuda-triton"),
    ],
)
@pytest.mark.parametrize("row", sorted(FORESTS))
def test_tree_conv_replay(device, backend, row):
    forest = FORESTS[row](device)
    channels = HEADS * HEADDIM + 2 * GROUPS * STATE

    def make_inputs():
        return (
            _param(1, forest.num_tokens, channels, device=device),
            _param(channels, WIDTH, device=device, scale=0.5),
            _param(channels, device=device, scale=0.1),
        )

    def conv(tables, x, weight, bias):
        return tree_causal_conv1d(x, weight, bias, tables, activation="silu", backend=backend)

    def fn(x, weight, bias):
        return conv(fresh(forest), x, weight, bias)

    replayed = assert_bitwise_replay(fn, make_inputs, concurrent_stream_work=device == "cuda")
    assert_settled_tables_agree(conv, forest, make_inputs, replayed)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "gate, channel_views",
    [(True, False), (False, False), (True, True)],
    ids=["z", "no-z", "z-channel-views"],
)
@pytest.mark.parametrize("row", sorted(FORESTS))
def test_tree_scan_replay(device, gate, channel_views, row, monkeypatch):
    """channel_views: x, B and C are views of one tensor's channels (``split_channels``, as the
    mixer passes them), whose gradient is then the one buffer the scan's backward writes."""
    forest = FORESTS[row](device)
    length = forest.num_tokens
    width = HEADS * HEADDIM + 2 * GROUPS * STATE

    def make_inputs():
        if channel_views:  # x, B, C: the whole [1, T, width] tensor, None, None
            x, B, C = _param(1, length, width, device=device), None, None
        else:
            x = _param(1, length, HEADS, HEADDIM, device=device)
            B, C = (_param(1, length, GROUPS, STATE, device=device) for _ in range(2))
        return (
            x,
            _param(1, length, HEADS, device=device, scale=0.5, shift=-1.0),  # dt
            (-torch.rand(HEADS, device=device) - 0.5).requires_grad_(),  # A < 0
            B,
            C,
            _param(HEADS, device=device),  # D
            _param(1, length, HEADS, HEADDIM, device=device),  # z
            _param(HEADS, device=device, scale=0.3),  # dt_bias
        )

    def scan(tables, x, dt, A, B, C, D, z, dt_bias):
        if channel_views:  # x is the whole [1, T, width] tensor
            x, B, C = tree_scan.split_channels(x, HEADS, HEADDIM, GROUPS, STATE)
        return tree_ssd_scan(
            x,
            dt,
            A,
            B,
            C,
            CHUNK,
            tables,
            D=D,
            z=z if gate else None,
            dt_bias=dt_bias,
            dt_softplus=True,
        )

    def fn(*inputs):
        return scan(fresh(forest), *inputs)

    replayed = assert_bitwise_replay(fn, make_inputs, concurrent_stream_work=device == "cuda")
    assert_settled_tables_agree(scan, forest, make_inputs, replayed)
    # What replayed: mamba_ssm's scan and the Triton fork in one function on CUDA, torch_ssd on CPU.
    forked = "_ForkedChunkScanBackward" in _graph_nodes(fn(*make_inputs()))
    assert forked == (device == "cuda")
    if device == "cuda":
        # The fork's state work runs on a stream of its own beside the scan's kernels: the same
        # bits when that stream starts late.
        monkeypatch.setattr(tree_scan, "_fork_stream", _late(tree_scan._fork_stream))
        late = assert_bitwise_replay(fn, make_inputs)
        assert late.keys() == replayed.keys()
        for name, bits in replayed.items():
            if bits is None:  # z's gradient without the gate
                assert late[name] is None, name
            else:
                assert torch.equal(late[name].view(torch.int32), bits.view(torch.int32)), name


def _late(fork_stream):
    """``tree_scan._fork_stream`` whose stream first runs a sleep kernel of a few milliseconds."""

    @contextlib.contextmanager
    def late_fork_stream(device):
        with fork_stream(device):
            torch.cuda._sleep(20_000_000)  # pylint: disable=protected-access
            yield

    return late_fork_stream


def _graph_nodes(tensor):
    """Names of the autograd nodes behind ``tensor``."""
    names, stack, seen = set(), [tensor.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return names


def _mixer(device, rmsnorm=True):
    """A float32 TreeMambaMixer of HEADS heads on ``device``, seeded; ``rmsnorm=False`` gates the
    scan with silu(z) instead of the norm."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm.mamba_mixer import MambaMixerSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig
    from tiny import seed_initialization

    from megatron.shared_prefix.ssm.mamba_mixer import TreeMambaMixer

    seed_initialization(0)
    config = TransformerConfig(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        mamba_state_dim=STATE,
        mamba_head_dim=HEADDIM,
        mamba_num_groups=GROUPS,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        gradient_accumulation_fusion=False,
    )
    return TreeMambaMixer(
        config,
        MambaMixerSubmodules(in_proj=ColumnParallelLinear, out_proj=RowParallelLinear),
        d_model=32,
        chunk_size=CHUNK,
        rmsnorm=rmsnorm,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"]),
    ).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rmsnorm", [True, False], ids=["norm-gate", "scan-gate"])
def test_tree_mamba_mixer_replay(megatron_world, device, rmsnorm):
    """Both gates take z as a strided view of the input projection (no copy): the norm, or the
    scan and the forked-state correction."""
    forest = replay_forest(device)
    mixer = _mixer(device, rmsnorm)

    def make_inputs():
        return _param(forest.num_tokens, 1, 32, device=device)

    def fn(hidden_states):
        with forest_scope(fresh(forest)):
            return mixer(hidden_states)[0]

    assert_bitwise_replay(fn, make_inputs, module=mixer, concurrent_stream_work=device == "cuda")


@pytest.mark.parametrize("device", DEVICES)
def test_mixer_warm_up_changes_no_bit_of_training(megatron_world, device):
    """``precompile_tree_mamba`` (what ``--shared-prefix-precompile`` runs at start-up: ``warm_up``
    at every warm-up length, for rows of a pad multiple of 16 and of any length) leaves the next
    forward and backward bitwise what they are without it, and no parameter gradient behind."""
    from megatron.shared_prefix.ssm.mamba_mixer import precompile_tree_mamba, scan_warmup_lengths

    forest = replay_forest(device)
    mixer = _mixer(device)
    hidden = _param(forest.num_tokens, 1, 32, device=device)

    def step():
        mixer.zero_grad(set_to_none=True)
        hidden.grad = None
        with forest_scope(fresh(forest)):
            out = mixer(hidden)[0]
        out.backward(torch.cos(out.detach()))
        return [out.detach(), hidden.grad] + [p.grad for p in mixer.parameters()]

    before = step()
    mixer.zero_grad(set_to_none=True)
    lengths = precompile_tree_mamba(mixer, 512, dtype=torch.float32, device=device, multiple=16)
    assert lengths == scan_warmup_lengths(CHUNK, 512, 16) and len(lengths) == 7
    lengths = precompile_tree_mamba(mixer, 512, dtype=torch.float32, device=device)
    assert lengths == scan_warmup_lengths(CHUNK, 512)
    assert len(lengths) == 35
    assert all(p.grad is None for p in mixer.parameters())
    after = step()
    assert all(torch.equal(a, b) for a, b in zip(before, after))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "gate, channel_views", [(True, False), (False, False), (True, True)],
    ids=["z", "no-z", "z-channel-views"],
)  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("row", sorted(FORESTS))
def test_forked_state_kernels_replay(gate, channel_views, dtype, row):
    """mamba_ssm's scan with the fused Triton log-decay, own states, parent chain and correction
    (tree_scan's _ForkedChunkScan, as tree_ssd_scan runs it), at the widths of a real layer. On the
    long star each parent's tokens span several state-sum splits, so the fixed-order split sums
    run; the depth-3 row chains states through parents. channel_views: x, B and C are views of
    one tensor's channels and z of a wider one's, as the mixer passes them: the fork's kernels
    read their rows in place, one token stride apart."""
    from megatron.shared_prefix.ssm import triton_inherited_state
    from megatron.shared_prefix.ssm.tree_scan import (
        TreeScanPlan,
        _ForkedChunkScan,
        scan_functions,
        split_channels,
        triton_chunk_scan,
    )

    functions = scan_functions(triton_chunk_scan())
    assert functions is not None
    forest = FORESTS[row]("cuda")
    chained = TreeScanPlan.of(forest).segment_chain_slot >= 0  # states passed parent to child
    assert bool(chained.any()) == (row == "depth-3")
    length, groups, heads, head_dim, state = forest.num_tokens, 2, 8, 64, 128
    if row == "long-star":
        assert 1500 > triton_inherited_state.TOKENS_PER_BLOCK * triton_inherited_state.SPLIT_BLOCKS

    width = heads * head_dim + 2 * groups * state

    def make_inputs():
        def leaf(*shape, dtype=dtype, scale=1.0):
            return (torch.randn(*shape, device="cuda") * scale).to(dtype).requires_grad_()

        # With channel views, x is the whole [1, T, width] tensor and z [1, T, 2 * h, p].
        x = leaf(1, length, width) if channel_views else leaf(1, length, heads, head_dim)
        return (
            x,
            (torch.rand(1, length, heads, device="cuda") * 0.2).requires_grad_(),  # processed dt
            (-torch.rand(heads, device="cuda") - 0.2).requires_grad_(),  # A
            None if channel_views else leaf(1, length, groups, state),  # B
            None if channel_views else leaf(1, length, groups, state),  # C
            leaf(heads, dtype=torch.float32),  # D
            leaf(1, length, (2 if channel_views else 1) * heads, head_dim),  # z
        )

    def fn(x, dt, A, B, C, D, z):
        if channel_views:
            x, B, C = split_channels(x, heads, head_dim, groups, state)
            z = z[:, :, heads:]  # the second half of the wider tensor's heads
            assert z.stride(1) == 2 * heads * head_dim and x.stride(1) == width
        return _ForkedChunkScan.apply(
            x, dt, A, B, C, D, z if gate else None, fresh(forest), CHUNK, functions, {}
        )

    assert_bitwise_replay(fn, make_inputs, concurrent_stream_work=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("row", sorted(FORESTS))
def test_segment_decay_recompute_replay(row):
    """segment_decay, which the forked states' backward reruns instead of keeping its [T, H]
    outputs, gives the same cum, input weights and segment ends on every run, with a second stream
    busy a different amount each time."""
    # pylint: disable-next=import-outside-toplevel
    from megatron.shared_prefix.ssm.triton_inherited_state import SegmentPieces, segment_decay

    forest = FORESTS[row]("cuda")

    def make_inputs():
        dt = torch.rand(forest.num_tokens, HEADS, device="cuda") * 0.2 + 0.01
        A = -torch.rand(HEADS, device="cuda") - 0.5
        return dt, A, SegmentPieces.of(forest)

    assert_bitwise_replay(segment_decay, make_inputs, concurrent_stream_work=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("row", sorted(FORESTS))
def test_segment_decay_backward_replay(row):
    """The segment walk's backward, two passes (each piece's sums, then each piece's walk reading
    its segment's other pieces' sums), gives the same d dt and d A on every run, with a second
    stream busy a different amount each time; the long star's parent spans several pieces, the
    depth-3 row has a segment whose log-decay gets a gradient from the parent chain."""
    # pylint: disable-next=import-outside-toplevel
    from megatron.shared_prefix.ssm.triton_inherited_state import (
        SegmentPieces,
        segment_decay_backward,
    )

    forest = FORESTS[row]("cuda")
    segment_slot = TreeScanPlan.of(forest).segment_chain_slot
    slots, length = len(TreeScanPlan.of(forest).internal), forest.num_tokens
    if row == "long-star":
        assert int(SegmentPieces.of(forest).pieces.shape[1]) > len(forest.layout.segment_lengths)

    def make_inputs():
        grad_cum, grad_weight = (torch.randn(length, HEADS, device="cuda") for _ in range(2))
        chain_partial = torch.randn(slots, HEADS, 3, device="cuda")
        dt = torch.rand(length, HEADS, device="cuda") * 0.2 + 0.01
        A = -torch.rand(HEADS, device="cuda") - 0.5
        grad_dt = torch.randn(length, HEADS, device="cuda")
        return grad_cum, grad_weight, chain_partial, dt, A, grad_dt

    def fn(grad_cum, grad_weight, chain_partial, dt, A, grad_dt):
        grad_A = segment_decay_backward(
            grad_cum, grad_weight, chain_partial, segment_slot, dt, A, SegmentPieces.of(forest),
            grad_dt=grad_dt,
        )  # fmt: skip
        return grad_dt, grad_A

    assert_bitwise_replay(fn, make_inputs, concurrent_stream_work=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_state_chain_replay():
    """The parent chain of the end states and its backward, at a real layer's widths, 20 runs with
    a second stream busy a different amount each time. Each program reads back states it wrote
    for an earlier slot (the parent's end state, the gradient its children passed up) beside a
    bf16 copy: without a barrier between slots, the compiler's separate layouts for the float32
    and bf16 accesses let a read see another thread's element before its write landed (a scratch
    run on an H200: 36 of 300 forward and 288 of 300 backward calls differed)."""
    # pylint: disable-next=import-outside-toplevel
    from megatron.shared_prefix.ssm.triton_inherited_state import (
        StatePartials,
        chain_states,
        chain_states_backward,
    )

    forest = FORESTS["depth-3"]("cuda")
    plan = TreeScanPlan.of(forest)
    slots, heads, head_dim, state = len(plan.internal), 8, 64, 128
    assert (plan.segment_chain_slot >= 0).any() and slots >= 3 and plan.num_chain_parents >= 1

    # Two splits per slot: the chain adds them as it reads a slot's state.
    bounds = torch.arange(0, 2 * slots + 1, 2, dtype=torch.int32, device="cuda")
    slot_splits = torch.stack([bounds[:-1], bounds[1:]])

    def make_inputs():
        own = torch.randn(2 * slots, heads, head_dim, state, device="cuda")
        cum_end = -torch.rand(len(forest.layout.segment_starts), heads, device="cuda")
        return own, cum_end, torch.randn_like(own)

    def fn(own, cum_end, grad_ends):
        tables = (plan.slot_segment, plan.slot_parent, plan.chain_parent_row)
        copy, parent_ends = chain_states(
            StatePartials(own, slot_splits), cum_end, *tables, plan.num_chain_parents,
            copy_dtype=torch.bfloat16,
        )  # fmt: skip
        grads = chain_states_backward(
            StatePartials(grad_ends, slot_splits), parent_ends, cum_end, *tables,
            copy_dtype=torch.bfloat16,
        )  # fmt: skip
        return copy, parent_ends, *grads

    assert_bitwise_replay(fn, make_inputs, runs=20, concurrent_stream_work=True)
