"""Tree attention on CUDA through PyTorch FlexAttention, with a block mask built from the forest.

The mask is the forest's one-line rule ``k <= q < token_subtree_end[k]``. FlexAttention skips tiles
that no query of a block may attend, computes tiles that every query may attend without evaluating
the mask, and evaluates the mask only on the tiles in between, so work follows the attended pairs of
the forest.

The block mask is derived on the host in O(T + (T / block)^2) work, with no [T, T] mask: in DFS
order the queries that may attend a key ``k`` are the contiguous range ``[k, end_k)``, so the
query blocks that may attend key block ``j`` are the contiguous range from ``j`` to the block of
``max end_k - 1``, and those that attend every key of block ``j`` with every query are the blocks
strictly after ``j`` that end before ``min end_k``.

FlexAttention runs at the row length rounded up to a multiple of ``BLOCK_SIZE`` (``run_length``);
a row that already is one (as every row planned with ``pad_multiple=128`` is) is not copied, any
other is zero-padded (one copy of q, k and v). Padded tokens attend nothing and are attended by
nothing; their outputs are sliced off. Two compiled kernels serve all lengths:

* a length that is a bucket (``bucket_length``: at most four per octave of lengths) runs a kernel
  compiled with static shapes for it, the fastest FlexAttention has; each bucket compiles once, and
  ``MAX_COMPILED_KERNELS`` lifts Dynamo's recompile limit around these calls so all stay compiled;
* every other length runs one kernel compiled with dynamic shapes on [T / 128, 128, 1, H, D]
  views of the rows: its dynamic size is the block count, so the compiled length is 128 times a
  symbol, and it is told so (FlexAttention's ``IS_DIVISIBLE``), which a symbolic length does not
  let a compile prove by itself.

Measured on an H200 on 2026-11-29 (bf16, 32 heads x 128, forward+backward): a plain dynamic-shape
compile bounds-checks every tile and ran 23% slower than a static one on a 20480-token row
(``torch._check`` that the length is a multiple of 128 did not change that); with ``IS_DIVISIBLE``
the dynamic kernel gives bitwise the results of the static one (tested) and ran 2-5% slower on rows
of 9K-20K tokens. Padding such rows to the next bucket instead, so that a static kernel could run,
cost 9-19%: the copies of q, k, v and of the output gradient. Contiguous [1, H, T, D] copies were
slower than padding in Megatron's [T, 1, H, D] order. Compiling the layout changes into the graph
(``_flex_attention_rows``) then made both kernels 2-7% faster; docs/benchmarks.md has the table
against stock FlexAttention. Measured there again on 2026-12-04 (bf16, forward+backward, tree rows
of 9216-20480 tokens, 16 query heads over 8 groups and 32 heads without grouping): the dynamic
kernel on a symbolic length took 3-8% longer than the static one, all of it in the backward; on the
block count it takes at most 1.6% longer, with the same bits.

Not used: PyTorch's cuDNN attention, faster than FlexAttention for dense causal attention on an
H200 (the dense baseline of docs/benchmarks.md runs on it), so a tree could be split into dense
cuDNN calls merged by log-sum-exp; but its backward is not reproducible bitwise (measured on the
H200 with torch 2.11: dq differed between four identical runs, for [1, 32, 16384, 128] queries over
4096 keys and for a causal [16, 32, 5120, 128] batch), which the determinism gate does not allow.

Not chosen by ``tree_backend="auto"`` either: the same split on PyTorch's flash attention
(``_flash_attention_forward`` / ``_backward``, varlen), whose backward is reproducible under
deterministic algorithms; flash_backend.py runs it for every forest when asked
(``tree_backend="flash"``), and took 2.4-3.3x this module's time on every row of
tools/bench_attention.py on an H200 (2026-12-02, docs/benchmarks.md). A star is two calls,
completions over the prompt (non-causal) and every segment causally over itself, merged by
log-sum-exp, each backward given the merged output and log-sum-exp. An earlier prototype of it for
stars alone, measured on the H200 (2026-12-01, torch 2.11, bf16, 32 heads x 128, 8 key/value
groups, forward+backward): star P=2048, C=2048, G=8 (18432 tokens) 12.0 ms, 16.5 ms with
deterministic algorithms on, against 9.0 ms here; star P=4096, C=1024, G=16 18.0 / 26.3 ms
(12.4 ms here, docs/benchmarks.md). PyTorch's flash is
FlashAttention 2, which on an H200 ran the dense causal batch of the first star 1.8x slower than
cuDNN (14.2 against 7.9 ms). Its varlen calls take empty segments (output 0, log-sum-exp +inf), but
leave the key gradients past the last key segment unwritten. FlexAttention's own block sizes
changed little on the first star (forward tiles of 128 x 128 with 8 warps: 8.9 against 9.0 ms;
backward tiles 64/128 with 8 warps: 9.0; 32/128 with 4 warps: 23.3).
"""

import numpy as np
import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from torch.utils.checkpoint import checkpoint

from megatron.shared_prefix.tensors import ForestTensors, hosts_to_device

BLOCK_SIZE = 128

# Every bucket a run meets is one more static compile: one more Dynamo cache entry on the code of
# _flex_attention_rows (per dtype, head shape, softmax scale and grad mode). Past
# torch._dynamo.config.recompile_limit (default 8) Dynamo would run flex_attention eagerly, which
# materializes [T, T] scores and runs out of memory on long rows. With four buckets per octave,
# all row lengths up to 2^20 tokens fall into 48 buckets, twice that with activation recompute
# (forward without autograd as well).
MAX_COMPILED_KERNELS = 128

# The forward kernel loads its tiles with TMA (tensor memory accelerator) on Hopper and newer;
# Inductor falls back to plain loads where the GPU or the inputs do not qualify. On an H200 this
# made the forward 3-7% faster on rows of 12K-20K tokens (3% slower on a 9K-token row), with
# bitwise the same results (tested); TMA in the backward as well was slower.
KERNEL_OPTIONS = {"fwd_USE_TMA": True}


def bucket_length(num_tokens: int) -> int:
    """``num_tokens`` rounded up to a multiple of ``max(2 ** (floor(log2(num_tokens)) - 2),
    BLOCK_SIZE)``: the lengths that get a static kernel of their own.

    Every bucket is a multiple of BLOCK_SIZE, and an octave ``[2^e, 2^(e+1))`` holds at most four
    buckets. For example 20480 stays 20480 and 20481 becomes 24576.
    """
    step = max(BLOCK_SIZE, 1 << max(num_tokens.bit_length() - 3, 0))
    return -(-num_tokens // step) * step


# Grouped-query attention: FlexAttention's enable_gqa backward gives each key block of a group one
# program that walks the queries of every head of the group in turn. In a tree the prompt's key
# blocks are attended by every query below them, so those programs are the longest of the launch
# by far, and the blocks of the last heads start late: the launch ends on their tail. Repeating the
# keys and values to the query heads first gives each head its own, shorter, programs. Measured on
# an H200 (2026-12-04, bf16, 128-dim heads, forward+backward; docs/benchmarks.md): with 32 query
# heads over 8 groups the repeat made the tree 1-18% faster on the forests of
# tools/bench_attention.py (10% on star P=2048, C=2048, G=8: 8.62 against 9.63 ms); with 16 heads
# over 8 groups it was 3% faster to 2% slower, and rows with nothing shared ran up to 9% slower
# (their programs are short either way, and the repeat copies k and v).
REPEAT_GROUPS_FROM = 4


def run_length(num_tokens: int) -> tuple[int, bool]:
    """(tokens FlexAttention runs a row of ``num_tokens`` at, whether a static kernel runs it).

    The row is padded to a multiple of BLOCK_SIZE; a padded length that is a bucket runs its static
    kernel, any other the dynamic-shape kernel.
    """
    length = -(-num_tokens // BLOCK_SIZE) * BLOCK_SIZE
    return length, bucket_length(length) == length


def repeats_groups(num_heads: int, num_groups: int) -> bool:
    """Whether tree_attention repeats each key/value head over its ``num_heads // num_groups`` query
    heads before the kernel (from REPEAT_GROUPS_FROM query heads per group on) instead of running
    FlexAttention's grouped-query kernel."""
    return num_heads // num_groups >= REPEAT_GROUPS_FROM


def _repeated_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[T, 1, G, D] -> [T, 1, num_heads, D]: query head h gets group h // (num_heads // G), as
    under FlexAttention's enable_gqa. An expand and one copy; its backward sums each group's
    gradients in a fixed order (no atomics)."""
    num_tokens, batch, num_groups, head_dim = x.shape
    repeats = num_heads // num_groups
    return (
        x.unsqueeze(3)
        .expand(num_tokens, batch, num_groups, repeats, head_dim)
        .reshape(num_tokens, batch, num_heads, head_dim)
    )


def _flex_attention_rows(query, key, value, *, repeat_groups=False, **kwargs):
    """flex_attention on Megatron's [T, 1, H, D] layout: [T, 1, H * D] out; keys and values of
    fewer heads (G) are grouped queries, repeated to H heads first when ``repeat_groups``.

    Compiled as a whole, so the layout changes are inside the graph: the output leaves it, and its
    gradient enters it, contiguous in [T, 1, H * D] order. A graph whose output is FlexAttention's
    [1, H, T, D] view copies the incoming gradient into [1, H, T, D] order first (seen in the
    generated backward of the dynamic-shape kernel). The repeat is inside the graph too, under a
    checkpoint, so that the backward repeats k and v again: the graph otherwise kept the repeated
    tensors for backward (on an H200, 32 query heads over 8 groups, an 18432-token row: 290 MiB
    kept after the forward, 2.2 MiB with the checkpoint, as without the repeat; same gradients
    bitwise, 8.36 against 8.30 ms forward+backward).
    """
    num_tokens, _, num_heads, head_dim = query.shape
    if repeat_groups:
        key, value = (
            checkpoint(_repeated_heads, t, num_heads, use_reentrant=False) for t in (key, value)
        )
    kwargs["enable_gqa"] = key.shape[2] != num_heads
    out = flex_attention(*(t.permute(1, 2, 0, 3) for t in (query, key, value)), **kwargs)
    return out.permute(2, 0, 1, 3).reshape(num_tokens, 1, num_heads * head_dim)


def _flex_attention_blocks(query, key, value, *, kernel_options, **kwargs):
    """``_flex_attention_rows`` of [T / BLOCK_SIZE, BLOCK_SIZE, 1, H, D] views of the rows, told
    that T is a multiple of BLOCK_SIZE (``IS_DIVISIBLE``: no bounds checks on tile loads).

    The dynamic-shape kernel's inputs: its dynamic size is then the block count, and the length
    BLOCK_SIZE times it, so Inductor and Triton know the length's factor 128 as a static kernel
    knows its constant length. Compiled on a symbolic length with ``IS_DIVISIBLE`` alone, the
    same kernel code ran its backward 3-10% slower than the static one (H200, 2026-12-04: the
    offsets of per-query statistics and block rows were then of unknown alignment).
    """
    rows = (t.reshape(t.shape[0] * t.shape[1], *t.shape[2:]) for t in (query, key, value))
    options = {**kernel_options, "IS_DIVISIBLE": True}
    return _flex_attention_rows(*rows, kernel_options=options, **kwargs)


_compiled_kernels = {}  # static: bool -> compiled callable, built on first use

# The lengths that run a static kernel once ``precompile`` has run (a frozenset; None before: every
# bucket compiles on first use). Every other length then runs the dynamic-shape kernel.
_precompiled_static_lengths = None

# The shortest row length that is not a bucket: ``precompile`` compiles the dynamic-shape kernel at
# it (one compile serves every length).
DYNAMIC_WARMUP_TOKENS = 9 * BLOCK_SIZE

PRECOMPILE_MODES = ("off", "dynamic", "buckets")


def _flex_attention_compiled(static: bool, query, key, value, **kwargs):
    """``_flex_attention_rows`` of [T, 1, H, D] rows compiled with static shapes, or with dynamic
    shapes on rows of a multiple of BLOCK_SIZE tokens (``_flex_attention_blocks``: the block count
    dynamic, everything else static), called with Dynamo's recompile limit raised to
    MAX_COMPILED_KERNELS (a scoped config patch) so every bucket stays compiled."""
    if static not in _compiled_kernels:
        _compiled_kernels[static] = (
            torch.compile(_flex_attention_rows, dynamic=False)
            if static
            else torch.compile(_flex_attention_blocks, dynamic=True)
        )
    tensors = (query, key, value)
    if not static:
        tensors = tuple(t.view(t.shape[0] // BLOCK_SIZE, BLOCK_SIZE, *t.shape[1:]) for t in tensors)
        # Only the block count is dynamic: with symbolic head counts Inductor could not lower the
        # backward of repeated groups (torch 2.11: its heads-per-group expression did not print).
        for tensor in tensors:
            for dim in (1, 3, 4):
                torch._dynamo.mark_static(tensor, dim)  # pylint: disable=protected-access
    # pylint: disable-next=no-member,protected-access
    with torch._dynamo.config.patch(recompile_limit=MAX_COMPILED_KERNELS):
        return _compiled_kernels[static](*tensors, **kwargs)


def tree_mask_mod(token_subtree_end: torch.Tensor):
    """FlexAttention mask_mod of a forest: query ``q`` sees key ``k`` iff ``k <= q < end[k]``."""

    def mask_mod(batch, head, q_idx, kv_idx):  # pylint: disable=unused-argument
        return (kv_idx <= q_idx) & (q_idx < token_subtree_end[kv_idx])

    return mask_mod


def block_tiles(token_subtree_end: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """([nb, nb] partial, [nb, nb] full) bool tiles of a row whose tokens have the subtree ends
    ``token_subtree_end`` ([T] host array): query block ``i``, key block ``j``.

    Query block ``i`` sees key block ``j`` iff ``j <= i <= (max end_k - 1) // block_size`` over
    the keys ``k`` of block ``j``; it sees all of it iff ``i > j`` and ``i`` ends (at the row's end
    for the last, ragged block) no later than ``min end_k``. Diagonal tiles stay partial.
    """
    num_tokens = len(token_subtree_end)
    num_blocks = -(-num_tokens // block_size)
    padding = num_blocks * block_size - num_tokens

    def per_block(reduce, neutral):
        # The ragged tail of the last block, past T, holds a value neutral to ``reduce``.
        ends = np.pad(token_subtree_end, (0, padding), constant_values=neutral)
        return reduce(ends.reshape(num_blocks, block_size), axis=1)

    last_any = (per_block(np.max, 0) - 1) // block_size
    min_end = per_block(np.min, num_tokens)
    block_ends = np.minimum(np.arange(1, num_blocks + 1) * block_size, num_tokens)
    q_block = np.arange(num_blocks)[:, None]
    kv_block = np.arange(num_blocks)[None, :]
    visible = (q_block >= kv_block) & (q_block <= last_any[None, :])
    full = (q_block > kv_block) & (block_ends[:, None] <= min_end[None, :])
    return visible & ~full, full


def _ordered_lists(tiles: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """([1, 1, n] int32 count, [1, 1, n, m] int32 indices) per row of [n, m] bool ``tiles``: the
    selected columns first, ascending, then the others, ascending (FlexAttention's order, as its
    own ``BlockMask.from_kv_blocks`` derives the query-side lists)."""
    counts = tiles.sum(axis=1, dtype=np.int32)
    indices = np.argsort(~tiles, axis=1, kind="stable").astype(np.int32)
    return counts[None, None], indices[None, None]


def tree_block_mask(
    forest: ForestTensors, block_size: int = BLOCK_SIZE, num_tokens: int | None = None
) -> BlockMask:
    """FlexAttention BlockMask of the forest over a row of ``num_tokens`` (default and minimum:
    ``forest.num_tokens``).

    Built on the host from the layout (``block_tiles``), key-side and query-side lists alike, and
    copied in one transfer: built on the device, as ``BlockMask.from_kv_blocks`` derives the
    query side, it was some sixty small kernels and a few milliseconds of host work at the start
    of every forward, while the GPU waited (docs/benchmarks.md).

    Tokens from ``forest.num_tokens`` on are padding, with subtree end 0: no query sees a padded key
    (``q < 0`` never holds), and no padded query sees a real key (real ends are at most
    ``forest.num_tokens``). Key blocks of padding alone then have no query block, query blocks of
    padding alone have no key block, and no tile holding a padded key is full.
    """
    num_tokens = forest.num_tokens if num_tokens is None else num_tokens
    end, *lists = tree_block_tables(forest, block_size, num_tokens)
    kv_num, kv_indices, full_kv_num, full_kv_indices, q_num, q_indices, full_q_num, full_q_indices = (
        lists
    )
    return BlockMask(
        seq_lengths=(num_tokens, num_tokens),
        kv_num_blocks=kv_num,
        kv_indices=kv_indices,
        full_kv_num_blocks=full_kv_num,
        full_kv_indices=full_kv_indices,
        q_num_blocks=q_num,
        q_indices=q_indices,
        full_q_num_blocks=full_q_num,
        full_q_indices=full_q_indices,
        BLOCK_SIZE=(block_size, block_size),
        mask_mod=tree_mask_mod(end),
    )


def tree_block_tables(
    forest: ForestTensors, block_size: int = BLOCK_SIZE, num_tokens: int | None = None
) -> tuple[torch.Tensor, ...]:
    """The tensors of ``tree_block_mask`` (the padded subtree ends, then the key-side and
    query-side block counts and indices), cached on the forest: plain tensors, so a DataLoader
    worker can build them ahead (``prepare_tree_attention``); the BlockMask around them is
    built where it runs."""
    num_tokens = forest.num_tokens if num_tokens is None else num_tokens

    def build():
        end = np.pad(forest.host_subtree_end(), (0, num_tokens - forest.num_tokens))
        partial, full = block_tiles(end, block_size)
        lists = [
            *_ordered_lists(partial),
            *_ordered_lists(full),
            *_ordered_lists(partial.T),
            *_ordered_lists(full.T),
        ]
        return hosts_to_device([end.astype(np.int64), *lists], forest.device)

    return forest.derive(("flex_block_tables", block_size, num_tokens), build)


def prepare_tree_attention(forest: ForestTensors) -> None:
    """Build and cache what ``tree_attention`` reads of ``forest`` (a ``ForestTable`` build)."""
    tree_block_tables(forest, BLOCK_SIZE, run_length(forest.num_tokens)[0])


class _FirstTokens(torch.autograd.Function):
    """``x[:num_tokens]`` of a padded [T_run, ...] tensor, whose backward zero-pads the gradient
    in one pass (a slice's backward fills a zero tensor, then copies the gradient into it)."""

    @staticmethod
    def forward(ctx, x, num_tokens):  # pylint: disable=arguments-differ
        ctx.padding = x.shape[0] - num_tokens
        return x[:num_tokens]

    @staticmethod
    def backward(ctx, grad):  # pylint: disable=arguments-differ
        padding = (0, 0) * (grad.dim() - 1) + (0, ctx.padding)
        return torch.nn.functional.pad(grad, padding), None


def _padded(x: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[T, 1, H, D] zero-padded to [num_tokens, 1, H, D] (no copy when T == num_tokens).

    Padded in the same [T, 1, H, D] memory order, so every call hands the compiled kernel the same
    strides (strides are part of what a static compile is specialized on). Zeros rather than
    uninitialized memory: the mask gives padded keys probability 0, but a kernel may still multiply
    that 0 by a product with padded values, and 0 * NaN is NaN.
    """
    if num_tokens > x.shape[0]:
        x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, 0, 0, num_tokens - x.shape[0]))
    return x


def tree_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    forest: ForestTensors,
    *,
    softmax_scale: float,
    compiled: bool = True,
    repeat_groups: bool | None = None,
) -> torch.Tensor:
    """Same contract as ``torch_backend.tree_attention`` ([T, 1, H, D] queries, [T, 1, G, D] keys
    and values, [T, 1, H * D] out).

    Runs at ``run_length(T)`` tokens: q, k, v are zero-padded to a multiple of BLOCK_SIZE when T is
    not one (one copy each; none when it is), padded queries attend nothing (FlexAttention outputs
    zeros there) and are sliced off, so real positions and their gradients are those of the unpadded
    row. The block mask is built once per forest and cached on it. ``compiled=False`` runs
    FlexAttention eagerly (its reference implementation; used on CPU in tests). ``repeat_groups``:
    repeat grouped keys and values to the query heads before the kernel; None decides by
    ``repeats_groups`` (REPEAT_GROUPS_FROM).
    """
    num_tokens, batch, num_heads, _ = query.shape
    if batch != 1 or num_tokens != forest.num_tokens:
        raise ValueError(
            f"tree attention expects [T={forest.num_tokens}, 1, H, D] queries for this forest, "
            f"got {tuple(query.shape)}"
        )
    padded, static = run_length(num_tokens)
    if _precompiled_static_lengths is not None:
        static = padded in _precompiled_static_lengths
    block_mask = forest.derive(
        ("flex_block_mask", BLOCK_SIZE, padded),
        lambda: tree_block_mask(forest, num_tokens=padded),
    )
    # Contiguous: a static compile is specialized on strides, and megatron-core's value is a view
    # into the fused QKV projection (query and key are fresh tensors after RoPE). One stride for
    # every caller lets ``precompile``'s kernels serve the model's rows; the copy also frees the
    # fused projection's output, which the view would keep alive until the backward.
    q, k, v = (_padded(t.contiguous(), padded) for t in (query, key, value))
    if repeat_groups is None:
        repeat_groups = repeats_groups(num_heads, key.shape[2])
    options = {"block_mask": block_mask, "scale": softmax_scale, "repeat_groups": repeat_groups}
    if compiled:
        out = _flex_attention_compiled(static, q, k, v, kernel_options=KERNEL_OPTIONS, **options)
    else:
        out = _flex_attention_rows(q, k, v, **options)
    # [T_run, 1, H * D] -> [T, 1, H * D]
    return _FirstTokens.apply(out, num_tokens) if padded > num_tokens else out


def precompile_lengths(max_tokens: int, mode: str) -> tuple[tuple[int, ...], int]:
    """(static lengths, dynamic length) that ``precompile`` compiles for rows of up to
    ``max_tokens`` tokens: "buckets" every bucket up to ``run_length(max_tokens)``, "dynamic" none;
    both the dynamic-shape kernel at DYNAMIC_WARMUP_TOKENS."""
    if mode not in PRECOMPILE_MODES[1:]:
        raise ValueError(f"precompile mode must be one of {PRECOMPILE_MODES[1:]}, got {mode!r}")
    longest = run_length(max_tokens)[0]
    static = ()
    if mode == "buckets":
        lengths = range(BLOCK_SIZE, longest + 1, BLOCK_SIZE)
        static = tuple(length for length in lengths if bucket_length(length) == length)
    assert bucket_length(DYNAMIC_WARMUP_TOKENS) != DYNAMIC_WARMUP_TOKENS
    return static, DYNAMIC_WARMUP_TOKENS


def warmup_row(num_tokens, num_heads, num_groups, head_dim, *, dtype, device, requires_grad=True):
    """(forest, query, key, value) that ``precompile`` runs at ``num_tokens``: a one-sequence row
    and random contiguous [T, 1, heads | groups, head_dim] inputs, the strides tree_attention
    hands every kernel; ``requires_grad`` as in a training forward (Dynamo guards on it too: a
    forward without autograd gets inputs that do not require grad)."""
    from megatron.shared_prefix.planning import plan_shared_prefix

    row = plan_shared_prefix([np.zeros(num_tokens, dtype=np.int64)], capacity=num_tokens)
    generator = torch.Generator(device=device).manual_seed(num_tokens)
    inputs = (
        torch.randn(
            num_tokens, 1, heads, head_dim, generator=generator, device=device, dtype=dtype
        ).requires_grad_(requires_grad)
        for heads in (num_heads, num_groups, num_groups)
    )
    return (ForestTensors.from_layout(row.rows[0], device), *inputs)


def precompile(
    max_tokens: int,
    *,
    mode: str,
    num_heads: int,
    num_groups: int,
    head_dim: int,
    softmax_scale: float,
    dtype: torch.dtype,
    device: torch.device | str,
    no_grad_forward: bool = False,
) -> tuple[int, ...]:
    """Compile, before training, every FlexAttention kernel that rows of up to ``max_tokens``
    tokens will run, and run only those afterwards: no row length compiles during training.

    Runs tree_attention forward and backward on a one-sequence row of random q, k, v at each
    length of ``precompile_lengths(max_tokens, mode)`` (and, with ``no_grad_forward``, a forward
    without autograd as activation recompute runs first). From then on a row whose length has no
    static kernel compiled here runs the dynamic-shape one (up to about 2% slower than a static
    kernel, flex_backend's docstring): with mode "dynamic" every row does, which costs one compile.
    Kernels are specialized on the head shape, dtype and softmax scale, which must be the ones
    the model's attention layers run with (``TreeDotProductAttention.kernel_signature``); the
    compiled code lands in Inductor's and Triton's caches, shared by later runs that use the same
    cache directories.

    Returns:
        The lengths compiled, static ones first.
    """
    global _precompiled_static_lengths  # pylint: disable=global-statement
    static, dynamic = precompile_lengths(max_tokens, mode)
    compiled = static + (dynamic,)
    # Static kernels only for ``static`` from the first call on, so the dynamic length compiles
    # the dynamic-shape kernel.
    _precompiled_static_lengths = frozenset(static)
    for num_tokens in compiled:
        forest, query, key, value = warmup_row(
            num_tokens, num_heads, num_groups, head_dim, dtype=dtype, device=device
        )
        tree_attention(query, key, value, forest, softmax_scale=softmax_scale).sum().backward()
        if no_grad_forward:
            with torch.no_grad():
                tree_attention(
                    query.detach(),
                    key.detach(),
                    value.detach(),
                    forest,
                    softmax_scale=softmax_scale,
                )
    return compiled
