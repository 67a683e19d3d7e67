"""Bitwise replay of the pure-PyTorch SSD ops (megatron/shared_prefix/ssm/torch_ssd.py).

They are the Mamba path of CPU training and the oracle of the GPU kernels, so their results must
not depend on the run: chunked einsums and cumulative sums are reductions whose order a backend
could vary. The inputs cover what training feeds them: a length that is not a multiple of the chunk
size, a sequence boundary inside a chunk (seq_idx), initial states, softplus dt with a bias, D,
gating and grouped B/C.
"""

import pytest
import torch

from megatron.shared_prefix.ssm import torch_ssd

from ..replay import assert_bitwise_replay

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ],
    ),
]

BATCH, LENGTH, HEADS, HEADDIM, GROUPS, STATE, CHUNK = 2, 50, 4, 8, 2, 8, 16


def _seq_idx(device):
    """Two sequences per row, the boundary (position 21) falling inside the second chunk."""
    return (torch.arange(LENGTH, device=device) >= 21).int().expand(BATCH, LENGTH).contiguous()


def _param(*shape, device, scale=1.0):
    return (torch.randn(*shape, device=device) * scale).requires_grad_()


@pytest.mark.parametrize("device", DEVICES)
def test_chunk_scan_replay(device):
    def make_inputs():
        return (
            _param(BATCH, LENGTH, HEADS, HEADDIM, device=device),  # x
            _param(BATCH, LENGTH, HEADS, device=device),  # dt
            (-torch.rand(HEADS, device=device) - 0.5).requires_grad_(),  # A < 0
            _param(BATCH, LENGTH, GROUPS, STATE, device=device),  # B
            _param(BATCH, LENGTH, GROUPS, STATE, device=device),  # C
            _param(HEADS, device=device),  # D
            _param(BATCH, LENGTH, HEADS, HEADDIM, device=device),  # z
            _param(HEADS, device=device, scale=0.1),  # dt_bias
            _param(BATCH, HEADS, HEADDIM, STATE, device=device),  # initial_states
            _seq_idx(device),
        )

    def fn(x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx):
        return torch_ssd.mamba_chunk_scan_combined(
            x,
            dt,
            A,
            B,
            C,
            CHUNK,
            D=D,
            z=z,
            dt_bias=dt_bias,
            initial_states=initial_states,
            seq_idx=seq_idx,
            dt_softplus=True,
            return_final_states=True,
        )

    assert_bitwise_replay(fn, make_inputs, concurrent_stream_work=device == "cuda")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mlp_dim", [0, 8])
def test_split_conv1d_scan_replay(device, mlp_dim):
    dim = HEADS * HEADDIM
    conv_dim = dim + 2 * GROUPS * STATE
    out_features = 24
    width = 2 * mlp_dim + 2 * dim + 2 * GROUPS * STATE + HEADS

    def make_inputs():
        return (
            _param(BATCH, LENGTH, width, device=device),  # zxbcdt
            _param(conv_dim, 4, device=device, scale=0.5),  # conv1d_weight
            _param(conv_dim, device=device, scale=0.1),  # conv1d_bias
            _param(HEADS, device=device, scale=0.1),  # dt_bias
            (-torch.rand(HEADS, device=device) - 0.5).requires_grad_(),  # A < 0
            _param(HEADS, device=device),  # D
            _param(BATCH, HEADS, HEADDIM, STATE, device=device),  # initial_states
            _seq_idx(device),
            _param(dim, device=device),  # rmsnorm_weight
            _param(out_features, mlp_dim + dim, device=device, scale=0.1),  # outproj_weight
            _param(out_features, device=device),  # outproj_bias
        )

    def fn(zxbcdt, conv_w, conv_b, dt_bias, A, D, initial_states, seq_idx, norm_w, proj_w, proj_b):
        return torch_ssd.mamba_split_conv1d_scan_combined(
            zxbcdt,
            conv_w,
            conv_b,
            dt_bias,
            A,
            D,
            CHUNK,
            initial_states=initial_states,
            seq_idx=seq_idx,
            return_final_states=True,
            rmsnorm_weight=norm_w,
            outproj_weight=proj_w,
            outproj_bias=proj_b,
            headdim=HEADDIM,
            ngroups=GROUPS,
            norm_before_gate=False,
        )

    assert_bitwise_replay(fn, make_inputs, concurrent_stream_work=device == "cuda")


@pytest.mark.parametrize("device", DEVICES)
def test_gated_rms_norm_replay(device):
    norm = torch_ssd.RMSNorm(HEADS * HEADDIM, group_size=HEADDIM, device=device)
    with torch.no_grad():
        norm.weight.normal_()

    def make_inputs():
        shape = (BATCH, LENGTH, HEADS * HEADDIM)
        return _param(*shape, device=device), _param(*shape, device=device)

    assert_bitwise_replay(norm, make_inputs, module=norm, concurrent_stream_work=device == "cuda")
