"""Mamba mixer that runs on a prefix forest (upstream: megatron/core/ssm/mamba_mixer.py).

Swapped in through the ``mixer`` submodule of ``hybrid_stack_spec()``; with no forest in scope it is
exactly megatron-core's MambaMixer.
"""

import math

from megatron.shared_prefix.cpu import install_mamba_ssm_fallback

install_mamba_ssm_fallback()

# pylint: disable=wrong-import-position,invalid-name
from megatron.core.ssm import mamba_mixer as _core_mixer  # noqa: E402
from megatron.core.ssm.mamba_mixer import MambaMixer  # noqa: E402

from megatron.shared_prefix.ssm.tree_conv import tree_causal_conv1d  # noqa: E402
from megatron.shared_prefix.ssm.tree_scan import (  # noqa: E402
    TREE_SCAN_BACKENDS,
    packed_chunk_scan,
    tree_ssd_scan,
)
from megatron.shared_prefix.tensors import ForestTensors, current_forest  # noqa: E402


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
        Everything else is MambaMixer's.
    """

    def __init__(self, *args, tree_scan_backend: str = "auto", **kwargs):
        if tree_scan_backend not in TREE_SCAN_BACKENDS:
            raise ValueError(
                f"tree_scan_backend must be one of {TREE_SCAN_BACKENDS}, got {tree_scan_backend!r}"
            )
        super().__init__(*args, **kwargs)
        self.tree_scan_backend = tree_scan_backend

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
            xBC, weight, self.cp.get_conv1d_bias(), forest, activation=self.activation
        )
        x, B, C = xBC.split([inner, groups * state, groups * state], dim=-1)
        x = x.reshape(1, length, heads, self.headdim).contiguous()
        B = B.reshape(1, length, groups, state).contiguous()
        C = C.reshape(1, length, groups, state).contiguous()
        z = z.reshape(1, length, heads, self.headdim).contiguous()
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
            return y, z.reshape(1, length, inner).transpose(0, 1).contiguous()
        return y, None
