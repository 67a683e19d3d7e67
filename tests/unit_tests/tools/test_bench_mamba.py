"""tools/bench_mamba.py: its mixer holds what a --bf16 training run holds."""

import os
from types import SimpleNamespace

import torch


def test_mixer_parameters_all_in_the_benchmark_dtype(megatron_world, monkeypatch, load_tool):
    """Float16Module casts every parameter of a --bf16 model, A_log, D and the gated norm's weight
    included; the benchmark's mixer must too, or its norm and scan run on float32 weights."""
    # importing the tool sets MAMBA_DETERMINISTIC unless set: keep that to this test
    monkeypatch.setenv("MAMBA_DETERMINISTIC", os.environ.get("MAMBA_DETERMINISTIC", "1"))
    tool = load_tool("bench_mamba")
    args = SimpleNamespace(hidden=256, head_dim=32, state=16, groups=2, chunk=16, device="cpu")
    for dtype in (torch.bfloat16, torch.float32):
        mixer = tool.build_mixer(args, dtype)
        assert {name: p.dtype for name, p in mixer.named_parameters()} == {
            name: dtype for name, _ in mixer.named_parameters()
        }
