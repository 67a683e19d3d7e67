"""The command line: the tiny-model preset, Megatron's own flags, and the script's error exit."""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron.shared_prefix.training.arguments import (
    DEFAULT_LAYER_PATTERN,
    TINY_MODEL_PRESET,
    parse_arguments,
    uses_tiny_model,
)

# The checkout root (the directory holding tests/unit_tests), wherever this file is moved to.
REPO = str(
    next(p for p in Path(__file__).resolve().parents if (p / "tests" / "unit_tests").is_dir())
)

CUSTOM_MODEL = [
    "--hybrid-layer-pattern",
    "*-*-",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "2",
    "--vocab-size",
    "64",
    "--seq-length",
    "128",
    "--max-position-embeddings",
    "128",
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "8",
    "--train-iters",
    "2",
    "--lr",
    "1e-3",
]


def test_no_model_flags_select_the_tiny_model():
    assert uses_tiny_model([]) and uses_tiny_model(["--data-path", "x.jsonl", "--train-iters", "5"])
    assert uses_tiny_model(["--hybrid-layer-pattern", "*-"])  # another layer mix, tiny sizes
    assert not uses_tiny_model(["--hidden-size", "32"])
    args = parse_arguments(["--train-iters", "5"])
    assert args.hybrid_layer_pattern == DEFAULT_LAYER_PATTERN
    assert args.num_layers == len(DEFAULT_LAYER_PATTERN)
    assert args.hidden_size == TINY_MODEL_PRESET["hidden_size"] and args.train_iters == 5
    assert args.attention_dropout == args.hidden_dropout == 0.0
    assert args.calculate_per_token_loss and args.dataloader_type == "external"


def test_model_flags_get_megatron_defaults():
    args = parse_arguments(CUSTOM_MODEL)
    assert args.num_layers == 4 and args.hidden_size == 32
    assert args.ffn_hidden_size == 4 * 32  # Megatron's default, not the preset's
    assert args.num_experts is None and args.lr_decay_style == "linear"
    assert args.position_embedding_type == "learned_absolute"
    assert args.attention_dropout == 0.0  # the script default still applies


def test_custom_model_trains_with_megatron_flags(train):
    history, lines = train(*CUSTOM_MODEL)
    assert len(history) == 2
    assert any("pattern *-*-, hidden 32" in line for line in lines)


def test_script_reports_bad_input_and_exits_2(tmp_path):
    env = dict(os.environ, TORCH_COMPILE_DISABLE="1", PYTHONPATH=REPO)
    missing = str(tmp_path / "missing.jsonl")
    result = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "pretrain_hybrid.py"),
            "--shared-prefix-trainer",
            "loop",
            "--data-path",
            missing,
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=str(tmp_path),
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1] == (
        f"pretrain_hybrid.py: error: --data-path {missing}: no such file"
    )
    # No argument dump, no warnings about CUDA extensions or --split: a few lines, then the error.
    assert len(result.stdout.splitlines()) + len(result.stderr.splitlines()) <= 6, (
        result.stdout + result.stderr
    )
    assert "Warning" not in result.stderr and "arguments ---" not in result.stdout


def test_megatron_argument_dump_only_when_verbose(capsys):
    parse_arguments(["--train-iters", "5"])
    assert (
        "------------------------ arguments ------------------------" not in capsys.readouterr().out
    )
    parse_arguments(["--train-iters", "5", "--shared-prefix-verbose"])
    dump = capsys.readouterr().out
    assert "------------------------ arguments ------------------------" in dump
    assert re.search(r"^  train_iters \.+ 5$", dump, flags=re.MULTILINE)


def test_parallel_flags_set_row_padding_and_pipeline_defaults(monkeypatch):
    from megatron.shared_prefix.training.config import RunConfig

    monkeypatch.setenv("WORLD_SIZE", "8")  # Megatron checks the sizes against the world

    def batch(*flags):
        args = parse_arguments(["--shared-prefix-capacity", "256", *flags])
        return args, RunConfig.from_args(args, trainer="megatron").batch

    _, plain = batch()
    assert plain.pad_multiple == 1
    _, sequence_parallel = batch("--tensor-model-parallel-size", "2", "--sequence-parallel")
    assert sequence_parallel.pad_multiple == 2
    _, context = batch(
        "--tensor-model-parallel-size", "2", "--sequence-parallel", "--context-parallel-size", "2"
    )
    assert context.pad_multiple == 2 * 2 * 2
    _, allgather_experts = batch("--expert-model-parallel-size", "2")
    assert allgather_experts.pad_multiple == 256
    # Precompiling pads rows to a multiple of 16 too (fewer Mamba warm-up rows) where the
    # capacity is one.
    precompile = ("--shared-prefix-precompile", "dynamic")
    _, precompiled = batch("--tensor-model-parallel-size", "2", "--sequence-parallel", *precompile)
    assert precompiled.pad_multiple == 16
    args = parse_arguments(["--shared-prefix-capacity", "264", *precompile])
    assert RunConfig.from_args(args, trainer="megatron").batch.pad_multiple == 1
    args = parse_arguments([*CUSTOM_MODEL, "--pipeline-model-parallel-size", "2"])
    assert args.variable_seq_lengths and args.moe_token_dispatcher_type == "alltoall"


@pytest.mark.parametrize(
    "flags,message",
    [
        (("--tensor-model-parallel-size", "2"), "with MoE layers needs --sequence-parallel"),
        (("--pipeline-model-parallel-size", "2"), "--moe-token-dispatcher-type allgather"),
        (
            ("--context-parallel-size", "2", "--no-shared-prefix-packing"),
            "--context-parallel-size 2 with --no-shared-prefix-packing",
        ),
        (
            (
                "--tensor-model-parallel-size",
                "2",
                "--sequence-parallel",
                "--shared-prefix-capacity",
                "255",
            ),
            "--shared-prefix-capacity 255 must be a multiple of 2",
        ),
    ],
    ids=["moe-tp-without-sp", "pipeline-allgather", "cp-dense", "sp-capacity"],
)
def test_parallel_flags_that_cannot_work_are_named(monkeypatch, flags, message):
    """The tiny preset has MoE layers; each combination is refused before anything is built."""
    from megatron.shared_prefix.training.config import ConfigError, RunConfig

    monkeypatch.setenv("WORLD_SIZE", "8")
    args = parse_arguments(list(flags))
    with pytest.raises(ConfigError, match=re.escape(message)):
        RunConfig.from_args(args, trainer="megatron")


def test_experts_not_divisible_by_expert_parallelism_are_named(monkeypatch):
    from megatron.shared_prefix.training.config import ConfigError

    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match="--num-experts 4 is not divisible by --expert-model"):
        parse_arguments(["--expert-model-parallel-size", "3", "--global-batch-size", "12"])


@pytest.mark.parametrize("trainer", ["megatron", "loop"])
def test_a_schedule_megatron_would_assert_on_is_named_for_both_trainers(trainer):
    """megatron.training's scheduler asserts warmup < decay only after initializing; the flags
    are named before anything is built, as the loop names them."""
    from megatron.shared_prefix.training.config import ConfigError, RunConfig

    args = parse_arguments(["--train-iters", "3"])  # the preset warms up for 10 iterations
    with pytest.raises(ConfigError, match="--lr-warmup-iters 10 must be below the decay length 3"):
        RunConfig.from_args(args, trainer=trainer)
    args = parse_arguments(["--train-iters", "3", "--lr-warmup-iters", "1"])
    schedule = RunConfig.from_args(args, trainer=trainer).schedule
    # megatron.training builds its own scheduler from the same flags.
    assert schedule is None if trainer == "megatron" else schedule.lr_warmup_iters == 1


def test_precompile_flag_is_refused_where_nothing_compiles(monkeypatch):
    """--shared-prefix-precompile needs tree attention on CUDA; off (the default) runs anywhere."""
    import torch

    from megatron.shared_prefix.training.config import ConfigError, RunConfig

    assert RunConfig.from_args(parse_arguments([]), trainer="loop").precompile == "off"
    args = parse_arguments(["--shared-prefix-precompile", "dynamic", "--no-shared-prefix-packing"])
    with pytest.raises(ConfigError, match="dynamic with --no-shared-prefix-packing"):
        RunConfig.from_args(args, trainer="megatron")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = parse_arguments(["--shared-prefix-precompile", "buckets"])
    with pytest.raises(ConfigError, match="--shared-prefix-precompile buckets needs CUDA"):
        RunConfig.from_args(args, trainer="loop")
    assert RunConfig.from_args(args, trainer="megatron").precompile == "buckets"


# Runs the script as the program with a --shared-prefix-* flag and prints MAMBA_DETERMINISTIC as it
# was when mamba_ssm was first looked for, stopping there (the training package looks for it on
# import, to provide the CPU fallback; upstream's script, as the PR stack exports it, on importing
# the entry point). --help ends a run that never looks.
_MAMBA_SSM_PROBE = textwrap.dedent(
    """
    import importlib.abc, os, runpy, sys

    seen = []

    class Found(BaseException):
        pass

    class Probe(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "mamba_ssm":
                seen.append(os.environ.get("MAMBA_DETERMINISTIC"))
                raise Found

    sys.meta_path.insert(0, Probe())
    sys.argv = [sys.argv[1], "--shared-prefix-packing", "--help"]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except (Found, SystemExit):
        pass
    print(seen)
    """
)


@pytest.mark.parametrize("given, expected", [(None, "['1']"), ("0", "['0']")])
def test_script_sets_mamba_ssm_deterministic_before_loading_it(tmp_path, given, expected):
    """mamba_ssm reads its mode when its kernels are first imported, so the script must set the
    default before its own imports; an explicit setting is kept."""
    env = dict(os.environ, TORCH_COMPILE_DISABLE="1", PYTHONPATH=REPO)
    env.pop("MAMBA_DETERMINISTIC", None)
    if given is not None:
        env["MAMBA_DETERMINISTIC"] = given
    result = subprocess.run(
        [sys.executable, "-c", _MAMBA_SSM_PROBE, os.path.join(REPO, "pretrain_hybrid.py")],
        capture_output=True,
        text=True,
        env=env,
        cwd=str(tmp_path),
        timeout=120,
        check=True,
    )
    assert result.stdout.splitlines()[-1] == expected
