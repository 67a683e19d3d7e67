"""Forward+backward time and peak memory of one tree Mamba mixer against dense and fork baselines
(CUDA).

For each forest it runs one megatron-core Mamba mixer (in_proj, conv, SSD scan, gated norm,
out_proj;
bf16, hidden 2048 by default, head dim 64, state 128, 8 groups), in one process on one GPU, as:

* dense: the stock MambaMixer on the expanded sequences as one right-padded batch [L_max, G, hidden]
  (what a dense trainer runs);
* dense varlen: the expanded sequences packed into one row without padding (every sequence a root
  segment of a flat forest), so that dense pays for exactly its logical tokens;
* tree: TreeMambaMixer on the forest (each unique token once; conv windows and SSM state forked);
* varlen, tree tokens: the same packed row with every segment an independent root: the cost of the
  same number of tokens without the fork. Target: tree within 15% of it;
* dense varlen and tree again with the tree conv's row conv on PyTorch's F.conv1d and SiLU
  (``tree_conv_backend="torch"``) instead of the Triton row conv (ssm/triton_causal_conv.py);
* level-wise fork: the alternative tree_scan.py did not choose: for every depth a batch of that
  depth's segments padded to the longest, scanned with ``initial_states`` = the parent's end state
  and
  the conv window prefixed with the parent's tail (exact, padding has dt = 0).

Reported: median ms of forward+backward over ``--repeats`` runs (GPU time of runs queued back to
back behind a sleep kernel, ``benchmark_report.cuda_time_ms`` with ``host_ahead``: on the smaller
rows the host takes about as long to queue a layer's kernels as the GPU takes to run them, and the
table compares the kernels), peak memory above the inputs (GiB), the token ratio (logical tokens /
tree tokens, the speedup an ideal token-proportional layer gets), tree speedup over both dense
runs, tree / ideal, tree / varlen, and the one-time cost of the forest's index tables (built once
per row, shared by every layer).

The dense runs take megatron's fused path (``use_mamba_mem_eff_path``) when causal-conv1d imports,
its unfused path (F.conv1d + mamba_ssm's chunk scan) otherwise; the table says which.

``--conv`` times the tree conv alone (conv + SiLU, bf16, the mixer's conv width and channels) on
the tree row and the dense varlen row of each forest: PyTorch's F.conv1d, the Triton row conv, and
megatron-core 0.19.2's Triton ``causal_conv1d_varlen_fn`` (forward only: it has no backward; on the
tree row with the segments as its sequences and the parents' tails as their initial states).

``--host-stages`` times the host instead: each forward+backward of the tree and of the same-token
varlen layer is queued behind a sleep kernel, so the host never waits for the GPU, and the host
time of the call and of its stages (the tree conv, mamba_ssm's scan functions, the forked states'
four steps, the projections and the norm; inclusive) are taken with timers wrapped around those
functions for the run. On short rows a Mamba layer's host time can exceed its GPU time, and then
it, not the kernels, sets a synchronized step's time (docs/benchmarks.md).

Usage (writes the table into docs/benchmarks.md when --write is given):
    python tools/bench_mamba.py [--hidden 2048] [--repeats 10] [--write docs/benchmarks.md]
    python tools/bench_mamba.py --check [--device cpu]   # tiny run: all variants agree, then exit
    python tools/bench_mamba.py --profile                # top CUDA kernels: tree vs same-token
    varlen
    python tools/bench_mamba.py --conv [--write docs/benchmarks.md]  # the conv alone, three ways
    python tools/bench_mamba.py --host-stages [--write docs/benchmarks.md]  # host time by stage
"""

import argparse
import collections
import contextlib
import functools
import statistics
import shlex
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from benchmark_report import (
    HOST_AHEAD_CYCLES,
    agent_tree,
    cuda_time_ms,
    device_description,
    host_launch_us,
    kernel_time_differences,
    markdown_table,
    star,
    use_deterministic_mamba_ssm,
    write_section,
)

from megatron.shared_prefix.cpu import install_mamba_ssm_fallback

use_deterministic_mamba_ssm()
install_mamba_ssm_fallback()

# pylint: disable=wrong-import-position
from megatron.shared_prefix.layout import ForestLayout  # noqa: E402
from megatron.shared_prefix.planning import plan_shared_prefix  # noqa: E402
from megatron.shared_prefix.ssm import tree_conv  # noqa: E402
from megatron.shared_prefix.ssm.tree_conv import _fixup_windows  # noqa: E402
from megatron.shared_prefix.ssm.tree_scan import (  # noqa: E402
    TreeScanPlan,
    packed_chunk_scan,
    process_dt,
    triton_chunk_scan,
)
from megatron.shared_prefix.ssm.triton_inherited_state import ForkedStates  # noqa: E402
from megatron.shared_prefix.tensors import ForestTensors, forest_scope  # noqa: E402
from megatron.shared_prefix.training.distributed import init_single_process  # noqa: E402

SECTION = "Tree Mamba mixer (tools/bench_mamba.py)"


def flat_layout(lengths):
    """A row of independent root segments of the given lengths (a dense varlen batch as a forest)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    starts = np.cumsum(lengths) - lengths
    empty = np.zeros(0, dtype=np.int64)
    return ForestLayout(
        tokens=np.zeros(int(lengths.sum()), dtype=np.int64),
        position_ids=np.concatenate([np.arange(n) for n in lengths]),
        segment_starts=starts,
        segment_lengths=lengths,
        segment_parents=np.full(len(lengths), -1),
        token_multiplicity=np.ones(int(lengths.sum()), dtype=np.int64),
        edge_source=empty,
        edge_target=empty,
        edge_sequence=empty,
        edge_position=empty,
        sequence_ids=np.arange(len(lengths)),
        sequence_last_index=starts + lengths - 1,
    )


# ----------------------------------------------------------------------------------------------------
# the mixer


def causal_conv1d_available():
    try:
        import causal_conv1d  # noqa: F401  pylint: disable=unused-import,import-outside-toplevel
    except ImportError:
        return False
    return True


def build_mixer(args, dtype):
    from megatron.core.process_groups_config import (
        ProcessGroupCollection,  # pylint: disable=import-outside-toplevel
    )
    from megatron.core.ssm.mamba_mixer import (
        MambaMixerSubmodules,  # pylint: disable=import-outside-toplevel
    )
    from megatron.core.tensor_parallel import (  # pylint: disable=import-outside-toplevel
        ColumnParallelLinear,
        RowParallelLinear,
    )
    from megatron.core.transformer import (
        TransformerConfig,  # pylint: disable=import-outside-toplevel
    )

    from megatron.shared_prefix.ssm.mamba_mixer import (
        TreeMambaMixer,  # pylint: disable=import-outside-toplevel
    )

    torch.manual_seed(0)
    config = TransformerConfig(
        num_layers=1,
        hidden_size=args.hidden,
        num_attention_heads=16,
        mamba_state_dim=args.state,
        mamba_head_dim=args.head_dim,
        mamba_num_groups=args.groups,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=args.device == "cpu",
        use_mamba_mem_eff_path=args.device == "cuda" and causal_conv1d_available(),
    )
    mixer = TreeMambaMixer(
        config,
        MambaMixerSubmodules(in_proj=ColumnParallelLinear, out_proj=RowParallelLinear),
        d_model=args.hidden,
        chunk_size=args.chunk,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"]),
    )
    # every parameter in ``dtype``, A_log, D and the gated norm's weight included, as
    # Float16Module casts a --bf16 model
    return mixer.to(args.device, dtype)


class LevelwiseFork:
    """The level-wise alternative to tree_scan.py, exact: one padded batch per depth of the forest.

    Depth d's segments form a batch padded to its longest segment; each row's conv input is prefixed
    with the w - 1 tokens before the segment on its root path (zeros past the root), and its scan
    starts from its parent's end state (``initial_states``; zero for roots). Padding has dt = 0, so
    a
    row's final state is the state after its last real token. Index tables are built once
    (__init__).
    """

    def __init__(self, mixer, layout, forest):
        width = mixer.d_conv
        predecessors = forest.root_path_predecessors(width - 1).cpu().numpy()
        starts, lengths, depth = layout.segment_starts, layout.segment_lengths, layout.segment_depth
        self.mixer, self.width = mixer, width
        self.levels, row_of = [], {}
        for level in range(int(depth.max()) + 1):
            segments = np.flatnonzero(depth == level)
            longest = int(lengths[segments].max())
            grid = np.full((len(segments), width - 1 + longest), -1, dtype=np.int64)
            parent_rows = []
            for row, segment in enumerate(segments):
                first, length = int(starts[segment]), int(lengths[segment])
                grid[row, : width - 1] = predecessors[first][::-1]
                grid[row, width - 1 : width - 1 + length] = np.arange(first, first + length)
                parent = int(layout.segment_parents[segment])
                parent_rows.append(row_of[parent] if parent >= 0 else (-1, -1))
                row_of[int(segment)] = (level, row)
            tokens = torch.as_tensor(grid, device=forest.device)
            self.levels.append((tokens, parent_rows))
        order = np.concatenate(
            [
                grid_tokens[:, width - 1 :].cpu().numpy().reshape(-1)
                for grid_tokens, _ in self.levels
            ]
        )
        real = order >= 0
        self.real = torch.as_tensor(real, device=forest.device)
        self.inverse = torch.as_tensor(np.argsort(order[real]), device=forest.device)

    def __call__(self, hidden_states):
        mixer = self.mixer
        heads, groups, state, head_dim = mixer.nheads, mixer.ngroups, mixer.d_state, mixer.headdim
        inner = heads * head_dim
        zxBCdt, _ = mixer.in_proj(hidden_states)
        z, xBC, dt = zxBCdt[:, 0].split([inner, inner + 2 * groups * state, heads], dim=-1)
        A = -torch.exp(mixer.A_log.float())
        D = mixer.D.float().reshape(heads, head_dim) if mixer.D_has_hdim else mixer.D
        scan = packed_chunk_scan("auto", hidden_states.device)
        finals, outputs = [], []
        for tokens, parent_rows in self.levels:
            rows, length = tokens.shape[0], tokens.shape[1] - (self.width - 1)
            present = (tokens >= 0).unsqueeze(-1)
            window = xBC[tokens.clamp(min=0)] * present  # [rows, w - 1 + L, channels]
            conv = F.conv1d(
                window.transpose(1, 2),
                mixer.conv1d_weight,
                mixer.conv1d_bias,
                groups=window.shape[-1],
            )
            conv = F.silu(conv).transpose(1, 2)  # [rows, L, channels]
            x, B, C = conv.split([inner, groups * state, groups * state], dim=-1)
            segment_tokens, real = (
                tokens[:, self.width - 1 :].clamp(min=0),
                present[:, self.width - 1 :],
            )
            step = (
                process_dt(
                    dt[segment_tokens].float(), mixer.dt_bias.float(), True, (0.0, float("inf"))
                )
                * real
            )
            initial = torch.stack(
                [
                    (
                        finals[level][row]
                        if level >= 0
                        else x.new_zeros(heads, head_dim, state, dtype=torch.float32)
                    )
                    for level, row in parent_rows
                ]
            )
            y, final = scan(
                x.reshape(rows, length, heads, head_dim).contiguous(),
                step,
                A,
                B.reshape(rows, length, groups, state).contiguous(),
                C.reshape(rows, length, groups, state).contiguous(),
                mixer.chunk_size,
                D=D,
                z=(
                    None
                    if mixer.rmsnorm
                    else z[segment_tokens].reshape(rows, length, heads, head_dim)
                ),
                initial_states=initial.to(x.dtype if x.dtype == torch.float64 else torch.float32),
                return_final_states=True,
            )
            finals.append(final)
            outputs.append(y.reshape(rows * length, inner))
        y = torch.cat(outputs)[self.real][self.inverse].unsqueeze(1)  # packed order, [T, 1, inner]
        if mixer.rmsnorm:
            y = mixer.norm(y, z.unsqueeze(1))
        return mixer.out_proj(y)[0]


# ----------------------------------------------------------------------------------------------------
# measurements


def measure(run, repeats, device):
    """(median ms, peak GiB above what was allocated before) of ``run()`` (forward + backward)."""
    if device != "cuda":
        start = time.perf_counter()
        run()
        return 1000 * (time.perf_counter() - start), float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    run()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    return cuda_time_ms(run, repeats, host_ahead=True), peak


def forward_backward(mixer, forward, hidden):
    """A closure: forward(hidden) and backward of a fixed projection, parameter grads reset first."""
    probe = torch.randn_like(hidden)

    def run():
        mixer.zero_grad(set_to_none=True)
        hidden.grad = None
        out = forward(hidden)
        out.backward(probe)
        return out

    return run


def variants(mixer, sequences, dtype, device):
    """name -> (run closure, tokens) for the seven variants, plus the tree's layout and table time."""
    hidden_size = mixer.d_model
    lengths = [len(s) for s in sequences]
    plan = plan_shared_prefix(sequences, capacity=sum(lengths), pad_multiple=1)
    assert len(plan.rows) == 1
    layout = plan.rows[0]
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    forest = ForestTensors.from_layout(layout, device)
    TreeScanPlan.of(forest)
    _fixup_windows(forest, mixer.d_conv)
    if device == "cuda":
        torch.cuda.synchronize()
    tables_ms = 1000 * (time.perf_counter() - start)

    def hidden(*shape):
        return torch.randn(*shape, hidden_size, device=device, dtype=dtype, requires_grad=True)

    def in_forest(scoped_forest):
        def forward(states):
            with forest_scope(scoped_forest):
                return mixer(states)[0]

        return forward

    expanded = ForestTensors.from_layout(flat_layout(lengths), device)
    same_tokens = ForestTensors.from_layout(flat_layout(layout.segment_lengths), device)
    for table_forest in (expanded, same_tokens):
        TreeScanPlan.of(table_forest)
        _fixup_windows(table_forest, mixer.d_conv)
    levelwise = LevelwiseFork(mixer, layout, forest)
    longest = max(lengths)

    def torch_conv(run):
        """``run`` with the tree conv's row conv on PyTorch's F.conv1d (the default on CUDA is
        the Triton conv of triton_causal_conv.py)."""

        def wrapped():
            previous, mixer.tree_conv_backend = mixer.tree_conv_backend, "torch"
            try:
                return run()
            finally:
                mixer.tree_conv_backend = previous

        return wrapped

    runs = {
        "dense": (
            forward_backward(mixer, lambda s: mixer(s)[0], hidden(longest, len(sequences))),
            longest * len(sequences),
        ),
        "dense varlen": (
            forward_backward(mixer, in_forest(expanded), hidden(sum(lengths), 1)),
            sum(lengths),
        ),
        "tree": (
            forward_backward(mixer, in_forest(forest), hidden(layout.num_tokens, 1)),
            layout.num_tokens,
        ),
        "varlen, tree tokens": (
            forward_backward(mixer, in_forest(same_tokens), hidden(layout.num_tokens, 1)),
            layout.num_tokens,
        ),
        "dense varlen, torch conv": (
            torch_conv(forward_backward(mixer, in_forest(expanded), hidden(sum(lengths), 1))),
            sum(lengths),
        ),
        "tree, torch conv": (
            torch_conv(forward_backward(mixer, in_forest(forest), hidden(layout.num_tokens, 1))),
            layout.num_tokens,
        ),
        "level-wise fork": (
            forward_backward(mixer, levelwise, hidden(layout.num_tokens, 1)),
            sum(
                int(t.shape[0]) * (int(t.shape[1]) - mixer.d_conv + 1) for t, _ in levelwise.levels
            ),
        ),
    }
    return runs, layout, tables_ms


def bench_forest(name, sequences, mixer, args, dtype):
    runs, layout, tables_ms = variants(mixer, sequences, dtype, args.device)
    results = {key: measure(run, args.repeats, args.device) for key, (run, _) in runs.items()}
    logical = sum(len(s) for s in sequences)
    ideal = logical / layout.num_tokens
    ms = {key: value[0] for key, value in results.items()}
    row = {
        "forest": name,
        "tokens logical/tree": f"{logical}/{layout.num_tokens}",
        "level-wise tokens": runs["level-wise fork"][1],
    }
    for key in runs:
        row[f"{key} ms"] = ms[key]
    for key in runs:
        row[f"{key} GiB"] = results[key][1]
    row.update(
        {
            "token ratio": ideal,
            "speedup vs dense": ms["dense"] / ms["tree"],
            "speedup vs dense varlen": ms["dense varlen"] / ms["tree"],
            "tree / ideal": (ms["dense varlen"] / ms["tree"]) / ideal,
            "tree / varlen": ms["tree"] / ms["varlen, tree tokens"],
            "tree / ideal, torch conv": (ms["dense varlen, torch conv"] / ms["tree, torch conv"])
            / ideal,
            "tables ms (once per row)": tables_ms,
        }
    )
    return row


def markdown(rows, command, args, mixer):
    path = "fused (mem-eff)" if mixer.use_mem_eff_path else "unfused (causal-conv1d absent)"
    description = (
        f"Device: {torch.cuda.get_device_name() if args.device == 'cuda' else args.device}; one Mamba "
        f"mixer, hidden {args.hidden}, {mixer.nheads} heads x {args.head_dim}, state {args.state}, "
        f"{args.groups} groups, chunk {args.chunk}, bf16, forward+backward; dense path: {path}. "
        f"ms: GPU time, median of {args.repeats} runs queued back to back behind a sleep kernel "
        "(the host has queued them all before the GPU reaches them); GiB: peak memory above "
        "the inputs. Token ratio = logical / tree tokens; tree / ideal = (dense varlen / tree "
        "time) / token ratio; tree / varlen = tree time over the same packed tokens without the "
        "fork (target <= 1.05). The forest runs (dense varlen, tree, varlen tree tokens) use the "
        "Triton row conv (ssm/triton_causal_conv.py); *torch conv*: the same runs with PyTorch's "
        "F.conv1d and SiLU (`tree_conv_backend=\"torch\"`)."
    )
    return section_markdown(SECTION, command, description, rows)


def section_markdown(title, command, description, rows):
    """A ``## title`` section of docs/benchmarks.md: its command, its set-up, its table."""
    lines = [f"## {title}", "", f"Command: `{command}`", "", description, ""]
    return "\n".join(lines + markdown_table(rows)) + "\n"


def check(args):
    """Tiny configuration: every variant computes the same per-token function as the tree."""
    dtype = torch.float32
    mixer = build_mixer(args, dtype)
    sequences = agent_tree(13, 6, 2, 2) + star(9, [1, 4, 20])
    print(bench_forest("check", sequences, mixer, args, dtype))  # every variant runs
    layout = plan_shared_prefix(sequences, capacity=sum(len(s) for s in sequences)).rows[0]
    forest = ForestTensors.from_layout(layout, args.device)
    states = torch.randn(layout.num_tokens, 1, mixer.d_model, device=args.device, dtype=dtype)
    with torch.no_grad():
        with forest_scope(forest):
            tree = mixer(states)[0]
        levelwise = LevelwiseFork(mixer, layout, forest)(states)
        paths = [
            torch.as_tensor(layout.root_path(k), device=args.device)
            for k in range(len(layout.sequence_ids))
        ]
        dense = [mixer(states[path])[0] for path in paths]
    tree_paths = [tree[path] for path in paths]
    errors = {
        "level-wise": float((levelwise - tree).norm() / tree.norm()),
        "dense": float(
            (torch.cat(dense) - torch.cat(tree_paths)).norm() / torch.cat(tree_paths).norm()
        ),
    }
    # float32: exact up to rounding on CPU; on CUDA, Triton's tl.dot rounds float32 to TF32 (~5e-4
    # per product) and the variants chunk differently, so allow what test_torch_ssd.py allows.
    tolerance = 1e-5 if args.device == "cpu" else 5e-3
    print(f"relative errors against the tree: {errors} (tolerance {tolerance})")
    assert all(error < tolerance for error in errors.values()), errors


def profile(mixer):
    """torch.profiler tables (kernels by self CUDA time) of one forward+backward: tree vs same-token
    varlen, for the P=4096 star and the depth-3 tree; then, per event name, the tree's self CUDA
    time minus the varlen layer's (the fork's cost, located), every name whose times differ."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    forests = {
        "star P=4096 C=1024 G=16": star(4096, [1024] * 16),
        "agent depth 3": agent_tree(2048, 512, 4, 4),
    }
    for name, sequences in forests.items():
        runs, _, _ = variants(mixer, sequences, torch.bfloat16, "cuda")
        averages = {}
        for key in ("tree", "varlen, tree tokens"):
            run = runs[key][0]
            for _ in range(3):
                run()
            torch.cuda.synchronize()
            with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                run()
                torch.cuda.synchronize()
            averages[key] = prof.key_averages()
            print(f"===== {name}: {key}")
            print(averages[key].table(sort_by="self_cuda_time_total", row_limit=30))
        print(f"===== {name}: tree - varlen, tree tokens (self CUDA us; calls)")
        differences = kernel_time_differences(averages["tree"], averages["varlen, tree tokens"])
        for event, tree_us, varlen_us, extra_us, tree_calls, varlen_calls in differences:
            if extra_us:
                print(
                    f"{extra_us:+10.1f} {tree_us:10.1f} {varlen_us:10.1f} "
                    f"{tree_calls:4d} {varlen_calls:4d}  {event}"
                )


def bench_forests():
    """(name, sequences) of the benchmark's forests."""
    skewed = [int(round(64 * 32 ** (i / 15))) for i in range(16)]  # 64 .. 2048, geometric
    return [
        ("star P=4096 C=1024 G=16", star(4096, [1024] * 16)),
        ("skewed star P=4096 C=64..2048 G=16", star(4096, skewed)),
        ("agent depth 3: P=2048, 4 x 512, 4 x 512", agent_tree(2048, 512, 4, 4)),
    ]


HOST_SECTION = "Tree Mamba mixer: host time by stage (tools/bench_mamba.py --host-stages)"

# (stage, owner module or class, attribute): the functions whose host time --host-stages takes.
# mamba_ssm's scan functions are timed where they exist (CUDA: the tree scan calls them).
TIMED_FUNCTIONS = (
    ("tree conv forward", tree_conv._TritonTreeConv, "forward"),
    ("tree conv backward", tree_conv._TritonTreeConv, "backward"),
    ("fork: end states", ForkedStates, "states"),
    ("fork: correction", ForkedStates, "correct"),
    ("fork: backward states", ForkedStates, "backward_states"),
    ("fork: backward tokens", ForkedStates, "backward_tokens"),
)
MAMBA_SSM_FUNCTIONS = (
    ("mamba_ssm scan forward", "_mamba_chunk_scan_combined_fwd"),
    ("mamba_ssm scan backward", "_mamba_chunk_scan_combined_bwd"),
)
TIMED_MODULES = ("in_proj", "out_proj", "norm")


@contextlib.contextmanager
def stage_timers(mixer):
    """Yields a dict stage -> inclusive host microseconds, summed over the calls made inside the
    block: the functions of ``TIMED_FUNCTIONS`` (and mamba_ssm's of ``MAMBA_SSM_FUNCTIONS`` when
    its Triton scan imports) are replaced by timed wrappers, and the mixer's projections and norm
    get forward hooks; everything is put back on exit."""
    times = collections.defaultdict(float)
    targets = list(TIMED_FUNCTIONS)
    scan = triton_chunk_scan()
    if scan is not None:
        module = sys.modules[scan.__module__]
        targets += [(stage, module, name) for stage, name in MAMBA_SSM_FUNCTIONS]
    replaced, handles = [], []

    def timed(stage, function):
        @functools.wraps(function)
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                times[stage] += 1e6 * (time.perf_counter() - start)

        return run

    starts = {}
    try:
        for stage, owner, name in targets:
            original = vars(owner)[name]  # KeyError: the benchmark names a function that moved
            is_static = isinstance(original, staticmethod)
            wrapper = timed(stage, original.__func__ if is_static else original)
            setattr(owner, name, staticmethod(wrapper) if is_static else wrapper)
            replaced.append((owner, name, original))
        for name in TIMED_MODULES:
            module = getattr(mixer, name)
            stage = f"{name} forward"
            handles.append(
                module.register_forward_pre_hook(
                    lambda *_, stage=stage: starts.__setitem__(stage, time.perf_counter())
                )
            )
            handles.append(
                module.register_forward_hook(
                    lambda *_, stage=stage: times.__setitem__(
                        stage, times[stage] + 1e6 * (time.perf_counter() - starts[stage])
                    )
                )
            )
        yield times
    finally:
        for owner, name, original in reversed(replaced):
            setattr(owner, name, original)
        for handle in handles:
            handle.remove()


def host_stage_times(run, mixer, repeats, cuda):
    """{stage: median host us of one call} of ``run`` (forward+backward of ``mixer``), ``"whole
    call"`` included, over ``repeats`` calls each made right after a sleep kernel was queued (on
    CUDA: the host never waits for the GPU) and within ``stage_timers``."""
    samples = collections.defaultdict(list)
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda._sleep(HOST_AHEAD_CYCLES)  # pylint: disable=protected-access
        with stage_timers(mixer) as times:
            start = time.perf_counter()
            run()
            whole = 1e6 * (time.perf_counter() - start)
        samples["whole call"].append(whole)
        for stage, value in times.items():
            samples[stage].append(value)
    if cuda:
        torch.cuda.synchronize()
    return {stage: statistics.median(values) for stage, values in samples.items()}


def host_stages(mixer, args):
    """Rows of the --host-stages table: per forest, the tree and the same-token varlen layer."""
    stages = ["whole call"] + [stage for stage, _, _ in TIMED_FUNCTIONS]
    stages += [stage for stage, _ in MAMBA_SSM_FUNCTIONS]
    stages += [f"{name} forward" for name in TIMED_MODULES]
    cuda = args.device == "cuda"
    rows = []
    for name, sequences in bench_forests():
        runs, _, _ = variants(mixer, sequences, torch.bfloat16, args.device)
        for key in ("tree", "varlen, tree tokens"):
            run = runs[key][0]
            for _ in range(3):
                run()
            times = host_stage_times(run, mixer, args.repeats, cuda)
            row = {"forest": name, "run": key}
            row.update((f"{stage} us", times.get(stage, 0.0)) for stage in stages)
            row["GPU ms"] = cuda_time_ms(run, args.repeats, host_ahead=True) if cuda else 0.0
            rows.append(row)
            print(row, flush=True)
    return rows


def host_markdown(rows, command, args, mixer):
    description = (
        f"Device: {device_description(torch.cuda.get_device_name(), host_launch_us())}; one "
        f"Mamba mixer, hidden {args.hidden}, {mixer.nheads} heads x {args.head_dim}, state "
        f"{args.state}, {args.groups} groups, chunk {args.chunk}, bf16, forward+backward of the "
        "tree and of the same packed tokens without the fork (every segment a root). us: host "
        f"microseconds, median of {args.repeats} calls, each made right after a sleep kernel was "
        "queued (the host never waits for the GPU); a stage's time is inclusive (mamba_ssm's "
        "scan functions are inside the tree scan, the fork's steps beside them), 0 where the "
        "run does not call it. GPU ms: GPU time of the same call, median of the same number "
        "queued back to back behind a sleep kernel. Host times differ by up to about 20% between "
        "processes on one machine (docs/benchmarks.md, *Whole model: what the table shows*)."
    )
    return section_markdown(HOST_SECTION, command, description, rows)


CONV_SECTION = "Tree Mamba conv (tools/bench_mamba.py --conv)"


def megatron_varlen_conv(forest, width):
    """A closure ``(x [T, C], weight [C, w], bias [C]) -> [T, C]``: the tree conv + SiLU through
    megatron-core's forward-only Triton ``causal_conv1d_varlen_fn``, with every segment one of its
    sequences and the ``w - 1`` tokens before the segment on its root path (zeros past the root)
    its initial conv state; None when megatron-core does not ship the kernel."""
    try:
        # pylint: disable-next=import-outside-toplevel
        from megatron.core.ssm.ops.causal_conv1d_varlen import causal_conv1d_varlen_fn
    except ImportError:
        return None
    layout = forest.layout
    starts = layout.segment_starts.astype(np.int64)
    cu_seqlens = torch.tensor(
        np.append(starts, forest.num_tokens), dtype=torch.int32, device=forest.device
    )
    before = forest.host_root_path_predecessors(width - 1)[starts][:, ::-1].copy()  # oldest first
    before = torch.as_tensor(before, device=forest.device)

    def run(x, weight, bias):
        states = x[before.clamp(min=0)] * (before >= 0).unsqueeze(-1)  # [S, w - 1, C]
        return causal_conv1d_varlen_fn(
            x.contiguous(),
            weight,
            bias,
            cu_seqlens,
            states.transpose(1, 2).contiguous(),  # its kernel reads the taps at unit stride
            activation="silu",
        )

    return run


def conv_comparison(mixer, args):
    """Rows of the ``--conv`` table: forward and forward+backward ms of the three convs."""
    from megatron.shared_prefix.ssm.tree_conv import (  # pylint: disable=import-outside-toplevel
        tree_causal_conv1d,
    )

    channels, width = mixer.conv1d_weight.shape[0], mixer.d_conv
    projected = mixer.in_proj.weight.shape[0]  # xBC is a strided slice of the projection
    generator = torch.Generator(device="cuda").manual_seed(0)
    weight = (
        torch.randn(channels, width, device="cuda", generator=generator) / width
    ).to(torch.bfloat16).requires_grad_()
    bias = torch.randn(channels, device="cuda", generator=generator).to(torch.bfloat16)
    bias.requires_grad_()
    rows = []
    for name, sequences in bench_forests():
        layout = plan_shared_prefix(
            sequences, capacity=sum(map(len, sequences)), pad_multiple=1
        ).rows[0]
        dense = flat_layout([len(s) for s in sequences])
        for label, row in (("tree", layout), ("dense varlen", dense)):
            forest = ForestTensors.from_layout(row, "cuda")
            _fixup_windows(forest, width)
            wide = torch.randn(
                forest.num_tokens, projected, device="cuda", generator=generator
            ).to(torch.bfloat16)
            x = wide[:, :channels].requires_grad_()
            probe = torch.randn(forest.num_tokens, channels, device="cuda", generator=generator)
            probe = probe.to(torch.bfloat16)
            record = {"forest": name, "row": label, "tokens": forest.num_tokens}
            outputs = {}
            for backend in ("torch", "triton"):

                def forward(backend=backend, forest=forest, x=x):
                    return tree_causal_conv1d(
                        x[None], weight, bias, forest, "silu", backend=backend
                    )[0]

                def forward_backward_conv(forward=forward):
                    forward().backward(probe)

                outputs[backend] = forward().detach()
                with torch.no_grad():
                    record[f"{backend} forward ms"] = cuda_time_ms(
                        forward, args.repeats, host_ahead=True
                    )
                record[f"{backend} forward+backward ms"] = cuda_time_ms(
                    forward_backward_conv, args.repeats, host_ahead=True
                )
            varlen = megatron_varlen_conv(forest, width)
            if varlen is not None:
                with torch.no_grad():
                    outputs["megatron-core"] = varlen(x.detach(), weight.detach(), bias.detach())
                    record["megatron-core varlen forward ms"] = cuda_time_ms(
                        lambda: varlen(x.detach(), weight.detach(), bias.detach()),
                        args.repeats,
                        host_ahead=True,
                    )
            reference = outputs.pop("torch").float()
            for key, value in outputs.items():
                error = (value.float() - reference).abs().max() / reference.abs().max()
                record[f"{key} vs torch max rel. diff"] = f"{float(error):.1e}"
            rows.append(record)
            print(record, flush=True)
    return rows


def conv_markdown(rows, command, args, mixer):
    description = (
        f"Device: {torch.cuda.get_device_name()}; the tree conv of one Mamba mixer alone (hidden "
        f"{args.hidden}: {mixer.conv1d_weight.shape[0]} channels, width {mixer.d_conv}, SiLU, "
        "bf16; "
        "input a strided slice of a projection-wide tensor, as Mamba's xBC is). ms: GPU time, "
        f"median of {args.repeats} runs queued back to back behind a sleep kernel (the host has "
        "queued them all before the GPU reaches them). torch: F.conv1d over the row, then "
        "the SiLU, then the first w - 1 tokens of each segment recomputed from their root-path "
        "windows; triton: the Triton conv with the SiLU fused (ssm/triton_causal_conv.py), each "
        "token's taps read from the forest's table of them (those windows in it). "
        "megatron-core varlen: megatron-core 0.19.2's `causal_conv1d_varlen_fn` (forward only, no "
        "backward: training cannot use it), every segment one of its sequences with the parent's "
        "tail as its initial state. max rel. diff: max |a - torch| / max |torch| of the outputs."
    )
    return section_markdown(CONV_SECTION, command, description, rows)


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--state", type=int, default=128)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--chunk", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--check", action="store_true", help="tiny correctness run of every variant, then exit"
    )
    parser.add_argument("--write", help="markdown file whose section to replace with the results")
    parser.add_argument(
        "--conv",
        action="store_true",
        help="time the tree conv alone: PyTorch, the Triton row conv, megatron-core's varlen "
        "kernel",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="print torch.profiler's top CUDA kernels of the tree and the same-token varlen run",
    )
    parser.add_argument(
        "--host-stages",
        action="store_true",
        help="host time of the tree and the same-token varlen layer, by stage",
    )
    args = parser.parse_args()
    init_single_process(args.device)
    if args.check:
        args.hidden, args.head_dim, args.state, args.groups, args.chunk = 32, 8, 8, 2, 8
        check(args)
        return
    if args.device != "cuda":
        raise SystemExit(
            "the benchmark needs a CUDA device (use --check for a CPU correctness run)"
        )
    mixer = build_mixer(args, torch.bfloat16)
    if args.profile:
        profile(mixer)
        return
    command = "python " + shlex.join(sys.argv)
    if args.host_stages:
        section = host_markdown(host_stages(mixer, args), command, args, mixer)
    elif args.conv:
        section = conv_markdown(conv_comparison(mixer, args), command, args, mixer)
    else:
        rows = []
        for name, sequences in bench_forests():
            rows.append(bench_forest(name, sequences, mixer, args, torch.bfloat16))
            print(rows[-1], flush=True)
        section = markdown(rows, command, args, mixer)
    print(section)
    if args.write:
        write_section(args.write, section)


if __name__ == "__main__":
    main()
