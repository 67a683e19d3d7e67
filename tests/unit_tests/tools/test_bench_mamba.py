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


def test_host_stages_time_the_mixer_and_put_every_function_back(
    megatron_world, monkeypatch, load_tool
):
    """--host-stages: the stage timers see the projections and the norm inside the whole call,
    wrap the functions they name (a renamed function fails here, not on the GPU machine) and leave
    every function and hook as it was."""
    monkeypatch.setenv("MAMBA_DETERMINISTIC", os.environ.get("MAMBA_DETERMINISTIC", "1"))
    tool = load_tool("bench_mamba")
    args = SimpleNamespace(hidden=64, head_dim=16, state=8, groups=2, chunk=8, device="cpu")
    mixer = tool.build_mixer(args, torch.float32)
    owners = [owner for _, owner, _ in tool.TIMED_FUNCTIONS]
    names = [name for _, _, name in tool.TIMED_FUNCTIONS]
    originals = [vars(owner)[name] for owner, name in zip(owners, names)]
    with tool.stage_timers(mixer):
        for owner, name, original in zip(owners, names, originals):
            wrapped = vars(owner)[name]
            assert isinstance(wrapped, staticmethod) == isinstance(original, staticmethod)
            function = original.__func__ if isinstance(original, staticmethod) else original
            assert getattr(wrapped, "__func__", wrapped).__wrapped__ is function
    assert [vars(owner)[name] for owner, name in zip(owners, names)] == originals

    sequences = tool.agent_tree(13, 6, 2, 2)
    runs, _, _ = tool.variants(mixer, sequences, torch.float32, "cpu")
    times = tool.host_stage_times(runs["tree"][0], mixer, 2, cuda=False)
    modules = [times[f"{name} forward"] for name in tool.TIMED_MODULES]
    assert all(t > 0 for t in modules) and sum(modules) < times["whole call"]
    assert "fork: end states" not in times  # on CPU the torch correction runs, not the fork's
    assert [vars(owner)[name] for owner, name in zip(owners, names)] == originals
    for name in tool.TIMED_MODULES:
        module = getattr(mixer, name)
        assert not module._forward_hooks and not module._forward_pre_hooks
