"""Mamba mixer that runs on a prefix forest (upstream: megatron/core/ssm/mamba_mixer.py).

Swapped in through the ``mixer`` submodule of ``hybrid_stack_spec()``; with no forest in scope it is
exactly megatron-core's MambaMixer.
"""

import math

import numpy as np
import torch

from megatron.shared_prefix.cpu import install_mamba_ssm_fallback

install_mamba_ssm_fallback()

# pylint: disable=wrong-import-position,invalid-name
from megatron.core.ssm import mamba_mixer as _core_mixer  # noqa: E402
from megatron.core.ssm.mamba_mixer import MambaMixer  # noqa: E402

from megatron.shared_prefix.ssm.tree_conv import (  # noqa: E402
    CONV_BACKENDS,
    prepare_tree_conv,
    tree_causal_conv1d,
)
from megatron.shared_prefix.ssm.tree_scan import (  # noqa: E402
    TREE_SCAN_BACKENDS,
    packed_chunk_scan,
    prepare_tree_scan,
    split_channels,
    tree_ssd_scan,
)
from megatron.shared_prefix.tensors import ForestTable, ForestTensors, current_forest  # noqa: E402


class TreeMambaMixer(MambaMixer):
    """MambaMixer whose conv window and SSM state follow each token's root path in a forest.

    On a forest (``current_forest()`` is not None) the forward runs megatron-core's unfused steps
    on the packed row [T, 1, hidden]: in_proj, split into z / xBC / dt, the tree causal conv + silu
    (tree_conv.py), split into x / B / C, the tree scan with softplus(dt + dt_bias),
    A = -exp(A_log) and D (tree_scan.py), the gate (``norm(y, z)`` with rmsnorm, else
    ``y * silu(z)``), out_proj. The parameters come from the context-parallel getters as in the
    stock paths. Under context parallelism megatron-core's ``MambaContextParallel`` exchanges
    sequence for heads around the scan (``pre_conv_ssm`` / ``post_conv_ssm``), so the tree conv and
    the forked-state scan see the whole row for this rank's heads; the gate's norm then runs on this
    rank's tokens, as in megatron-core's unfused path. The fused training kernel
    (``use_mamba_mem_eff_path``) computes the same function (``norm(y * silu(z))``) but has no
    per-segment state input, so a forest always takes this path, whatever that setting.

    Args:
        tree_scan_backend: packed-scan backend of the tree scan: "auto" (mamba_ssm's Triton kernel
            for CUDA tensors when it imports, torch otherwise), "torch" or "triton".
        tree_conv_backend: row conv of the tree conv: "auto" (our Triton conv with a backward for
            CUDA tensors and convs of up to 4 taps, PyTorch's conv otherwise), "torch" or "triton"
            (tree_conv.py).
        Everything else is MambaMixer's.
    """

    def __init__(
        self, *args, tree_scan_backend: str = "auto", tree_conv_backend: str = "auto", **kwargs
    ):
        if tree_scan_backend not in TREE_SCAN_BACKENDS:
            raise ValueError(
                f"tree_scan_backend must be one of {TREE_SCAN_BACKENDS}, got {tree_scan_backend!r}"
            )
        if tree_conv_backend not in CONV_BACKENDS:
            raise ValueError(
                f"tree_conv_backend must be one of {CONV_BACKENDS}, got {tree_conv_backend!r}"
            )
        super().__init__(*args, **kwargs)
        self.tree_scan_backend = tree_scan_backend
        self.tree_conv_backend = tree_conv_backend

    def forward(
        self,
        hidden_states,
        inference_context=None,
        *,
        inference_params=None,
        packed_seq_params=None,
    ):
        forest = current_forest()
        if forest is None:
            return super().forward(
                hidden_states,
                inference_context,
                inference_params=inference_params,
                packed_seq_params=packed_seq_params,
            )
        self._check_forest_forward(
            hidden_states, forest, inference_context, inference_params, packed_seq_params
        )
        zxBCdt, _ = self.in_proj(hidden_states)
        y, z = self._tree_ssm(self.cp.pre_conv_ssm(zxBCdt), forest)
        y = self.cp.post_conv_ssm(y)
        if self.rmsnorm:
            y = self.norm(y, self.cp.post_conv_ssm(z))
        return self.out_proj(y)

    def _check_forest_forward(
        self, hidden_states, forest, inference_context, inference_params, packed_seq_params
    ):
        """Raise ValueError, before any compute, for what a forest forward cannot honour."""
        errors = []
        if inference_context is not None or inference_params is not None:
            errors.append(
                "inference_context/inference_params (a forest forward keeps no decode cache)"
            )
        if packed_seq_params is not None:
            errors.append("packed_seq_params (the forest defines the segments)")
        # The mixer gets this rank's T / (cp * sp) tokens; in_proj gathers the sequence-parallel
        # ones, the context-parallel all-to-all the rest, so the scan always sees the whole row.
        tokens = forest.num_tokens // self.cp.cp_size
        tokens //= self.pg_collection.tp.size() if self.config.sequence_parallel else 1
        if hidden_states.dim() != 3 or hidden_states.shape[:2] != (tokens, 1):
            errors.append(
                f"hidden_states of shape {tuple(hidden_states.shape)} "
                f"(expected [{tokens}, 1, hidden] for a row of T={forest.num_tokens} tokens)"
            )
        if errors:
            raise ValueError("TreeMambaMixer cannot run this forest forward: " + "; ".join(errors))

    def forest_tables(self, device: torch.device) -> tuple[ForestTable, ...]:
        """What this layer builds from every forest on ``device`` (``hybrid_model.forest_tables``;
        the scan's Triton tables too where Triton imports, used on CUDA)."""
        return (ForestTable(prepare_tree_scan), ForestTable(prepare_tree_conv, (self.d_conv,)))

    def scan_signature(self) -> tuple:
        """What the kernels of this layer's forest path are compiled for, besides the row: its
        per-rank widths (inner, groups, heads, head dim, state), chunk size, conv width and
        activation, gate, D's shape, scan and conv backends and state dtype. Layers with equal
        signatures run the same kernel variants."""
        return (
            self.cp.d_inner_local_tpcp,
            self.cp.ngroups_local_tpcp,
            self.cp.nheads_local_tpcp,
            self.headdim,
            self.d_state,
            self.chunk_size,
            self.d_conv,
            self.activation,
            self.rmsnorm,
            self.D_has_hdim,
            self.tree_scan_backend,
            self.tree_conv_backend,
            str(self.mamba_training_ssm_states_dtype),
        )

    def warm_up(self, num_tokens: int, *, dtype: torch.dtype, device) -> None:
        """Run this layer's forest path between the projections (tree conv, tree scan, forked
        states, gated norm) forward and backward on a random ``num_tokens``-token row, so that every
        kernel variant it needs at that length is compiled. Only the random input's gradient is
        taken: no parameter gradient is written. The row is a prefix tree of depth three
        (``warmup_forest``), which runs every kernel of the forked states."""
        width = 2 * self.cp.d_inner_local_tpcp + 2 * self.cp.ngroups_local_tpcp * self.d_state
        width += self.cp.nheads_local_tpcp
        generator = torch.Generator(device=device).manual_seed(num_tokens)
        zxBCdt = torch.randn(
            num_tokens, 1, width, generator=generator, device=device, dtype=dtype
        ).requires_grad_()
        y, z = self._tree_ssm(zxBCdt, warmup_forest(num_tokens, device))
        if self.rmsnorm:
            y = self.norm(y, z)
        torch.autograd.grad(y, zxBCdt, grad_outputs=torch.randn_like(y))

    def _tree_ssm(self, zxBCdt, forest: ForestTensors):
        """[T, 1, d_proj] projected inputs of the whole row -> ([T, 1, d_inner] SSM output, gated
        unless the gate is the norm's; [T, 1, d_inner] gate input of the norm, or None)."""
        length = zxBCdt.shape[0]
        heads, groups = self.cp.nheads_local_tpcp, self.cp.ngroups_local_tpcp
        inner, state = self.cp.d_inner_local_tpcp, self.d_state
        zxBCdt = zxBCdt.transpose(0, 1)  # [1, T, d_proj] (b l d)
        z, xBC, dt = zxBCdt.split([inner, inner + 2 * groups * state, heads], dim=-1)

        weight = self.cp.get_conv1d_weight()  # [conv_dim, 1, w]
        xBC = tree_causal_conv1d(
            xBC,
            weight,
            self.cp.get_conv1d_bias(),
            forest,
            activation=self.activation,
            backend=self.tree_conv_backend,
        )
        x, B, C = split_channels(xBC, heads, self.headdim, groups, state)  # views, no copies
        # z stays a view of the projection (strided rows, unit channel stride), as in megatron-core's
        # unfused path: a contiguous copy would be a second [T, d_inner] tensor kept for backward.
        z = z.reshape(1, length, heads, self.headdim)
        D = self.cp.get_D()
        D = D.float().reshape(heads, self.headdim) if self.D_has_hdim else D
        # The state dtype option that the stock paths pass, for the kernel that accepts it.
        scan = packed_chunk_scan(self.tree_scan_backend, x.device)
        scan_kwargs = (
            {"state_dtype": self.mamba_training_ssm_states_dtype}
            if _core_mixer.MAMBA_HAS_STATE_DTYPE and scan is _core_mixer.mamba_chunk_scan_combined
            else {}
        )
        y = tree_ssd_scan(
            x,
            dt,
            -self.cp.get_A_log().float().exp(),
            B,
            C,
            self.chunk_size,
            forest,
            D=D,
            z=None if self.rmsnorm else z,
            dt_bias=self.cp.get_dt_bias().float(),
            dt_softplus=True,
            dt_limit=(0.0, math.inf),
            backend=self.tree_scan_backend,
            scan_kwargs=scan_kwargs,
        )
        # Back to megatron's [T, 1, d_inner] layout, then the stock unfused path's gate and norm.
        y = y.reshape(1, length, inner).transpose(0, 1).contiguous()
        if self.rmsnorm:
            return y, z.reshape(1, length, inner).transpose(0, 1)
        return y, None


def warmup_forest(num_tokens: int, device) -> ForestTensors:
    """A ``num_tokens``-token row (at least 5) of three sequences that share a prefix, two of them
    a second segment as well: a root, one internal child with two leaves, and a leaf."""
    from megatron.shared_prefix.planning import plan_shared_prefix

    branch = max(1, num_tokens // 8)
    prefix = np.zeros(num_tokens - 4 * branch, dtype=np.int64)
    segment = [np.full(branch, token, dtype=np.int64) for token in (1, 2, 3, 4)]
    sequences = [
        np.concatenate([prefix, segment[0], segment[1]]),
        np.concatenate([prefix, segment[0], segment[2]]),
        np.concatenate([prefix, segment[3]]),
    ]
    (row,) = plan_shared_prefix(sequences, capacity=num_tokens).rows
    return ForestTensors.from_layout(row, device)


def _twos(value: int) -> int:
    """Factors of 2 in ``value``, counted up to 4."""
    return min(4, (value & -value).bit_length() - 1)


def scan_warmup_lengths(chunk_size: int, max_tokens: int, multiple: int = 1) -> tuple[int, ...]:
    """Row lengths, up to ``max_tokens`` and multiples of ``multiple`` (the planner's
    ``pad_multiple``), that give mamba_ssm's scan kernels every class of their integer arguments
    that such rows can have: for chunk counts 1, 2, 3, every power of two and the count of
    ``max_tokens`` itself, the longest length of that chunk count with each number of factors of
    2 (0 to 4 or more) that a multiple of ``multiple`` can have.

    Triton compiles a variant of a kernel per combination of the classes of its integer arguments
    (1, a multiple of 16, anything else). The scan's arguments include the row length, strides that
    are its products with the layer's widths (a multiple of 16 or not according to the factors of 2
    of the length), the chunk count, and values that mamba_ssm derives from the chunk count and the
    GPU's number of multiprocessors (heads per program of some backward kernels, which grow with the
    chunk count up to the heads per group), hence the doubling chunk counts. Rows of a multiple of
    16 tokens have one class of factors of 2, so one length per chunk count covers them.
    """
    if not isinstance(multiple, int) or multiple < 1:
        raise ValueError(f"multiple must be a positive int (the rows' pad_multiple): {multiple!r}")
    num_chunks = -(-max_tokens // chunk_size)
    counts = sorted({1, 2, 3, num_chunks} | {1 << j for j in range(num_chunks.bit_length())})
    possible_classes = 5 - _twos(multiple)
    lengths = []
    for chunks in (count for count in counts if count <= num_chunks):
        top = min(chunks * chunk_size, max_tokens) // multiple * multiple
        classes = {}
        for length in range(top, max((chunks - 1) * chunk_size, 4), -multiple):
            classes.setdefault(_twos(length), length)
            if len(classes) == possible_classes:
                break
        lengths += sorted(classes.values(), reverse=True)
    return tuple(lengths)


def precompile_tree_mamba(
    model: torch.nn.Module, max_tokens: int, *, dtype: torch.dtype, device, multiple: int = 1
) -> tuple[int, ...]:
    """Compile, before training, the Triton kernels that the model's Mamba layers run on forest
    rows of up to ``max_tokens`` tokens, each a multiple of ``multiple`` tokens (the planner's
    ``pad_multiple``): one ``TreeMambaMixer.warm_up`` per distinct ``scan_signature`` at each of
    ``scan_warmup_lengths``, so that a row of a new length compiles nothing in these layers (the
    forked-state kernels are not specialized on the forest's counts, ssm/triton_inherited_state.py;
    docs/training.md has what was measured). On CPU (the torch scan) it compiles nothing and only
    runs the layers.

    Returns:
        The row lengths run (empty when the model has no Mamba layer).
    """
    mixers = {}
    for module in model.modules():
        if isinstance(module, TreeMambaMixer):
            mixers.setdefault(module.scan_signature(), module)
    lengths = {}  # every length run, in order (layers of other chunk sizes add theirs)
    for mixer in mixers.values():
        for num_tokens in scan_warmup_lengths(mixer.chunk_size, max_tokens, multiple):
            mixer.warm_up(num_tokens, dtype=dtype, device=device)
            lengths[num_tokens] = None
    return tuple(lengths)
