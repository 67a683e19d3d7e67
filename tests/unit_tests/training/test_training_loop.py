"""The single-process loop on CPU: learning, packed == dense, checkpoints, metrics, early errors."""

import json
import math
import os
import re
from pathlib import Path

import pytest

from megatron.shared_prefix.training.checkpointing import (
    NonFiniteStateError,
    TrainingPosition,
    save_checkpoint,
)
from megatron.shared_prefix.training.config import ConfigError
from megatron.shared_prefix.training.data import DataError
from megatron.shared_prefix.training.distributed import mamba_ssm_kernels

# Bookkeeping tests run attention + MoE only; learning and packed == dense use the default (M*-E).
FAST = ("--hybrid-layer-pattern", "*-E")


def relative_error(actual, expected):
    return abs(actual - expected) / abs(expected)


def test_short_run_lowers_the_loss(train):
    history, lines = train(
        "--train-iters", "24", "--global-batch-size", "16", "--log-interval", "8"
    )
    losses = [m.loss for m in history]
    assert len(history) == 24
    assert sum(losses[-4:]) / 4 < 0.9 * sum(losses[:4]) / 4
    trainer = next(line for line in lines if "single-process loop on cpu" in line)
    assert trainer.endswith(f"| Mamba kernels: {mamba_ssm_kernels()}")
    assert sum(" iteration " in line for line in lines) == 4  # iterations 1, 8, 16, 24


def test_output_chunks_follow_the_unchunked_run(train):
    """--shared-prefix-output-chunk-tokens: the loss over 5-source chunks, recomputed in the
    backward, gives the unchunked run's trajectory (main and MTP losses, gradient norms)."""
    flags = ("--train-iters", "2", "--global-batch-size", "12", "--mtp-num-layers", "1")
    whole, _ = train(*flags)
    chunked, _ = train(*flags, "--shared-prefix-output-chunk-tokens", "5")
    for mine, reference in zip(chunked, whole):
        assert relative_error(mine.loss, reference.loss) <= 1e-5
        assert relative_error(mine.mtp_losses[0], reference.mtp_losses[0]) <= 1e-5
        assert relative_error(mine.grad_norm, reference.grad_norm) <= 1e-4


@pytest.mark.parametrize("normalization", ["token", "sequence"])
def test_packed_and_dense_first_step_agree(train, normalization):
    flags = (
        "--train-iters",
        "1",
        "--global-batch-size",
        "12",
        "--shared-prefix-loss-normalization",
        normalization,
    )
    (packed,), _ = train(*flags, "--shared-prefix-packing")
    (dense,), _ = train(*flags, "--no-shared-prefix-packing")
    (padded,), _ = train(*flags, "--no-shared-prefix-packing", "--micro-batch-size", "4")
    assert (
        packed.executed_tokens
        < dense.executed_tokens
        == dense.logical_tokens
        == packed.logical_tokens
    )
    assert padded.executed_tokens > dense.executed_tokens
    assert packed.loss_tokens == dense.loss_tokens == padded.loss_tokens
    for other in (packed, padded):
        assert relative_error(other.loss, dense.loss) <= 1e-5
        assert relative_error(other.grad_norm, dense.grad_norm) <= 1e-4


def test_packed_and_dense_first_step_agree_with_mtp(train):
    """--mtp-num-layers 2 gives the tiny model two MTP depths. With the batch in one packed row
    and in one dense micro-batch, megatron's MTP loss has the same micro-batch, so the step's
    main and MTP losses and its gradient (MTP loss included) are the dense ones."""
    flags = ("--train-iters", "1", "--global-batch-size", "12", "--mtp-num-layers", "2")
    (packed,), lines = train(*flags, "--shared-prefix-packing")
    (dense,), _ = train(*flags, "--no-shared-prefix-packing", "--micro-batch-size", "12")
    assert any("pattern M*-E/*E/*E" in line for line in lines)
    assert any("mtp_1 loss: " in line and "mtp_2 loss: " in line for line in lines)
    assert packed.micro_batches == dense.micro_batches == 1
    assert packed.executed_tokens < dense.executed_tokens
    assert relative_error(packed.loss, dense.loss) <= 1e-5
    assert len(packed.mtp_losses) == len(dense.mtp_losses) == 2
    for mine, reference in zip(packed.mtp_losses, dense.mtp_losses):
        assert relative_error(mine, reference) <= 1e-5
    assert relative_error(packed.grad_norm, dense.grad_norm) <= 1e-4
    (without,), _ = train("--train-iters", "1", "--global-batch-size", "12")
    assert without.mtp_losses == () and relative_error(without.loss, packed.loss) <= 1e-5
    assert abs(without.grad_norm - packed.grad_norm) > 1e-3 * packed.grad_norm


def test_resume_continues_the_same_trajectory(train, tmp_path):
    save = str(tmp_path / "ckpt")
    full, _ = train(*FAST, "--train-iters", "4", "--save", save, "--save-interval", "2")
    assert sorted(os.listdir(save)) == [
        "iter_0000002",
        "iter_0000004",
        "latest_checkpointed_iteration.txt",
    ]
    with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as tracker:
        tracker_text = tracker.read()
    assert tracker_text == "4"
    with open(os.path.join(save, "latest_checkpointed_iteration.txt"), "w") as tracker:
        tracker.write("2")
    resumed, lines = train(*FAST, "--train-iters", "4", "--load", save)
    assert any("resumed from" in line and "iteration 2" in line for line in lines)
    assert [m.iteration for m in resumed] == [3, 4]
    for before, after in zip(full[2:], resumed):
        assert after.consumed_samples == before.consumed_samples
        assert after.learning_rate == before.learning_rate
        assert after.loss == pytest.approx(before.loss, rel=1e-6)
        assert after.grad_norm == pytest.approx(before.grad_norm, rel=1e-5)
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["iteration"] for r in records] == [1, 2, 3, 4]  # truncated to 2, then 3 and 4 again
    assert [r["loss"] for r in records[2:]] == [m.loss for m in resumed]


def test_load_rejects_a_checkpoint_of_another_model(train, tmp_path):
    save = str(tmp_path / "ckpt")
    train(*FAST, "--train-iters", "1", "--save", save, "--save-interval", "1")
    with pytest.raises(ConfigError, match="--untie-embeddings-and-output-weights"):
        train(*FAST, "--train-iters", "2", "--load", save, "--untie-embeddings-and-output-weights")


def test_metrics_jsonl_has_one_record_per_step(train, tmp_path):
    history, _ = train(
        *FAST, "--train-iters", "3", "--lr-decay-style", "linear", "--min-lr", "1e-4"
    )
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["iteration"] for r in records] == [1, 2, 3]
    assert [r["consumed_samples"] for r in records] == [8, 16, 24]
    for record, metrics in zip(records, history):
        assert record["loss"] == metrics.loss
        assert record["saving"] == pytest.approx(
            record["logical_tokens"] / record["executed_tokens"]
        )
        assert record["logical_tokens_per_s"] > record["executed_tokens_per_s"] > 0
        assert record["loss_tokens"] > 0 and record["micro_batches"] >= 1
    assert records[-1]["learning_rate"] == pytest.approx(1e-4)  # linear decay ends at --min-lr


def test_tensorboard_directory(train, tmp_path):
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        _, lines = train(*FAST, "--train-iters", "1", "--tensorboard-dir", str(tmp_path / "tb"))
        assert any("tensorboard package is not installed" in line for line in lines)
    else:
        train(*FAST, "--train-iters", "1", "--tensorboard-dir", str(tmp_path / "tb"))
        assert os.listdir(tmp_path / "tb")


def test_non_finite_loss_stops_before_the_optimizer_step(train, tmp_path):
    with pytest.raises(FloatingPointError, match="iteration 2: lm loss .* is not finite"):
        train(
            *FAST,
            "--lr",
            "1e30",
            "--train-iters",
            "3",
            "--save",
            str(tmp_path / "ckpt"),
            "--save-interval",
            "1",
        )
    assert sorted(os.listdir(tmp_path / "ckpt")) == [
        "iter_0000001",
        "latest_checkpointed_iteration.txt",
    ]


def test_saving_refuses_non_finite_state(train, tmp_path):
    with pytest.raises(NonFiniteStateError, match="refusing to save a checkpoint at iteration 2"):
        train(
            *FAST,
            "--lr",
            "1e30",
            "--train-iters",
            "2",
            "--no-check-for-nan-in-loss-and-grad",
            "--save",
            str(tmp_path / "ckpt"),
            "--save-interval",
            "2",
        )
    assert not os.path.exists(tmp_path / "ckpt" / "iter_0000002")


def test_save_checkpoint_checks_loss_and_gradient_norm(megatron_world, tmp_path):
    import torch

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for loss, grad_norm in ((math.nan, 1.0), (1.0, math.inf)):
        with pytest.raises(NonFiniteStateError):
            save_checkpoint(
                str(tmp_path / "ckpt"),
                TrainingPosition(1, 8),
                model=model,
                optimizer=optimizer,
                scheduler=None,
                signature={},
                layout={},
                loss=loss,
                grad_norm=grad_norm,
            )
    assert not os.path.exists(tmp_path / "ckpt")


def test_bad_data_fails_before_any_state_changes(train, tmp_path, write_jsonl):
    path = write_jsonl([{"input_ids": [1, 2, 3]}, {"input_ids": [1, 2, 300]}])
    with pytest.raises(DataError, match=r"data.jsonl:2: input_ids has token id 300"):
        train("--data-path", path, "--save", str(tmp_path / "ckpt"), "--save-interval", "1")
    assert not os.path.exists(tmp_path / "ckpt") and not os.path.exists(tmp_path / "metrics.jsonl")


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ("--attention-dropout", "0.1"),
            "--attention-dropout 0.1: must be 0 with --shared-prefix-packing",
        ),
        (("--bf16",), "--bf16 True: not supported by the single-process loop"),
        (("--eval-iters", "5"), "--eval-iters 5: validation data is not supported"),
        (("--vocab-size", "32"), "--vocab-size 32 is below"),
        (("--shared-prefix-capacity", "0"), "--shared-prefix-capacity must be >= 1"),
        (("--shared-prefix-capacity", "8"), "longer than the row capacity 8"),
        (("--global-batch-size", "0"), "--global-batch-size must be >= 1, got 0"),
        (("--global-batch-size", "-4"), "--global-batch-size must be >= 1, got -4"),
        (("--save", "ckpt"), "--save ckpt needs --save-interval N"),
        (("--save", "ckpt", "--save-interval", "0"), "--save-interval must be >= 1, got 0"),
        (("--ckpt-step", "3"), "--ckpt-step 3 needs --load"),
        (
            ("--position-embedding-type", "learned_absolute", "--shared-prefix-capacity", "300"),
            "row capacity 300 (--shared-prefix-capacity, default --seq-length) exceeds "
            "--max-position-embeddings 256",
        ),
        (("--load", "no/such/dir"), "--load no/such/dir: no such directory"),
        (
            ("--mtp-num-layers", "2", "--hybrid-layer-pattern", "*-E"),
            "--mtp-num-layers 2 with --hybrid-layer-pattern '*-E', which has 0 MTP depths",
        ),
        (
            ("--mtp-num-layers", "1", "--hybrid-layer-pattern", "*-E/*E/*E"),
            "--mtp-num-layers 1 with --hybrid-layer-pattern '*-E/*E/*E', which has 2 MTP depths",
        ),
        (
            ("--mtp-num-layers", "1", "--shared-prefix-loss-normalization", "sequence"),
            "--mtp-num-layers 1 with --shared-prefix-loss-normalization sequence",
        ),
        (
            ("--shared-prefix-output-chunk-tokens", "-2"),
            "--shared-prefix-output-chunk-tokens -2: must be >= 0",
        ),
        (
            ("--shared-prefix-output-chunk-tokens", "8", "--no-shared-prefix-packing"),
            "--shared-prefix-output-chunk-tokens with --no-shared-prefix-packing",
        ),
        (
            ("--mtp-num-layers", "1", "--expert-model-parallel-size", "2"),
            "--expert-model-parallel-size 2 with --moe-token-dispatcher-type allgather and MoE "
            "layers in the MTP depths",
        ),
    ],
)
def test_bad_flags_are_named(train, tmp_path, flags, message, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as error:
        train(*flags)
    assert message in str(error.value)
    assert sorted(os.listdir(tmp_path)) == []


def test_load_of_the_save_directory_may_not_exist_yet(train, tmp_path):
    save = str(tmp_path / "ckpt")
    history, lines = train(
        *FAST, "--train-iters", "1", "--save", save, "--save-interval", "1", "--load", save
    )
    assert len(history) == 1 and any("no checkpoint yet" in line for line in lines)
    assert os.path.isdir(save)


def test_jsonl_sft_and_rl_examples_train(train):
    repo = next(
        p for p in Path(__file__).resolve().parents if (p / "tests" / "unit_tests").is_dir()
    )
    for name in ("sft.jsonl", "rl.jsonl"):
        history, lines = train(
            *FAST, "--data-path", os.path.join(repo, "examples", name), "--train-iters", "2"
        )
        assert len(history) == 2 and all(math.isfinite(m.loss) for m in history)
        assert any(f"examples/{name}" in line for line in lines)
        assert not any("warning" in line for line in lines)  # 8 examples of 13 and 16 per step


def test_global_batch_larger_than_the_dataset_is_warned_once(train):
    repo = next(
        p for p in Path(__file__).resolve().parents if (p / "tests" / "unit_tests").is_dir()
    )
    sft = os.path.join(repo, "examples", "sft.jsonl")
    _, lines = train(*FAST, "--data-path", sft, "--global-batch-size", "32", "--train-iters", "2")
    warnings = [line for line in lines if "warning" in line]
    assert len(warnings) == 1
    assert "--global-batch-size 32 is larger than the 13 examples" in warnings[0]
    assert "2.46 times on average" in warnings[0]


@pytest.mark.parametrize(
    "flags,named",
    [
        (("--num-query-groups", "4"), "--num-query-groups: checkpoint 2 vs now 4"),
        (
            ("--hybrid-layer-pattern", "*-E-"),
            "--hybrid-layer-pattern: checkpoint '*-E' vs now '*-E-'",
        ),
    ],
    ids=["query-groups", "pattern"],
)
def test_checkpoint_of_another_network_is_refused_before_anything_is_written(
    train, tmp_path, flags, named
):
    save = str(tmp_path / "ckpt")
    train(*FAST, "--train-iters", "1", "--save", save, "--save-interval", "1")
    listing, metrics = sorted(os.listdir(save)), (tmp_path / "metrics.jsonl").read_bytes()
    with pytest.raises(ConfigError, match=re.escape(named)):
        train(
            *FAST,
            "--train-iters",
            "2",
            "--load",
            save,
            "--save",
            save,
            "--save-interval",
            "1",
            *flags,
        )
    assert sorted(os.listdir(save)) == listing
    assert (tmp_path / "metrics.jsonl").read_bytes() == metrics


def test_padded_vocabulary_of_a_checkpoint_is_kept_or_refused_by_tp_size():
    import argparse

    from megatron.shared_prefix.training.checkpointing import CheckpointHeader
    from megatron.shared_prefix.training.loop import _match_vocabulary

    header = CheckpointHeader(
        "ckpt", "--load", TrainingPosition(4, 32), {"--padded-vocab-size": 96}, layout={}
    )
    args = argparse.Namespace(
        padded_vocab_size=128, tensor_model_parallel_size=2, make_vocab_size_divisible_by=64
    )
    lines = []
    _match_vocabulary(args, header, lines.append)
    assert args.padded_vocab_size == 96 and "keeping its padded vocabulary of 96 rows" in lines[0]
    args = argparse.Namespace(
        padded_vocab_size=128, tensor_model_parallel_size=64, make_vocab_size_divisible_by=2
    )
    with pytest.raises(ConfigError, match="96 rows cannot be split over --tensor-model-parallel"):
        _match_vocabulary(args, header, lines.append)


def test_checkpoint_of_the_earlier_single_file_format_still_resumes(
    megatron_world, train, tmp_path
):
    """A checkpoint written as earlier versions wrote it (iter_*/model_optim_rng.pt, the signature
    of that version) resumes: the next step's loss is that of its weights on the next batch."""
    import torch

    from megatron.shared_prefix.training import loop
    from megatron.shared_prefix.training.arguments import parse_arguments
    from megatron.shared_prefix.training.batching import build_step_batch
    from megatron.shared_prefix.training.config import RunConfig
    from megatron.shared_prefix.training.data import ExampleStream
    from megatron.shared_prefix.training.integrity import (
        TRACKER_NAME,
        iteration_dir,
        write_integrity_record,
    )
    from megatron.shared_prefix.training.model import build_model, transformer_config

    flags = [*FAST, "--train-iters", "3", "--global-batch-size", "8", "--lr-warmup-iters", "0"]
    args = parse_arguments(flags)
    config = RunConfig.from_args(args, trainer="loop")
    torch.manual_seed(5)
    model = build_model(args, transformer_config(args, portable=True))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.01 * torch.randn_like(param))
    optimizer = loop.build_optimizer(model, config.schedule)
    scheduler = loop.build_scheduler(optimizer, config.schedule, 8)
    scheduler.step(increment=16)
    signature = loop.model_signature(args)
    # That version's signature: the pattern as given, the vocabulary padding by its flag.
    signature.update(
        {
            "--padded-vocab-size": None,
            "--make-vocab-size-divisible-by": args.make_vocab_size_divisible_by,
        }
    )
    args.padded_vocab_size = None
    directory = str(tmp_path / "legacy")
    root = iteration_dir(directory, 2)
    os.makedirs(root)
    torch.save(
        {
            "iteration": 2,
            "consumed_samples": 16,
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "lr_scheduler": scheduler.state_dict(),
            "rng": torch.get_rng_state(),
            "signature": signature,
        },
        os.path.join(root, "model_optim_rng.pt"),
    )
    write_integrity_record(root, 2)
    Path(directory, TRACKER_NAME).write_text("2")
    examples = ExampleStream(config.data.load(lambda line: None), 8).global_batch(16)
    step = build_step_batch(
        examples,
        packing=True,
        capacity=config.batch.capacity,
        micro_batch_size=config.batch.micro_batch_size,
        normalization=config.batch.normalization,
    )
    expected, _ = loop.train_step(model, step, clip_grad=1.0, device=torch.device("cpu"))
    resumed, lines = train(*flags, "--load", directory)
    assert any("resumed from" in line and "iteration 2" in line for line in lines)
    assert [m.iteration for m in resumed] == [3]
    assert resumed[0].loss == pytest.approx(expected, rel=1e-6)


def test_attention_backend_flag_reaches_every_attention_layer(megatron_world):
    """--shared-prefix-attention-backend: the tree attention backend of every attention layer."""
    from megatron.shared_prefix.attention.dot_product_attention import TreeDotProductAttention
    from megatron.shared_prefix.training.arguments import parse_arguments
    from megatron.shared_prefix.training.model import build_model, transformer_config

    for backend in ("auto", "flash"):
        args = parse_arguments([*FAST, "--shared-prefix-attention-backend", backend])
        model = build_model(args, transformer_config(args, portable=True))
        layers = [m for m in model.modules() if isinstance(m, TreeDotProductAttention)]
        assert layers and {layer.tree_backend for layer in layers} == {backend}


def test_precompile_kernels_compiles_attention_mamba_and_loss_and_reports_each(monkeypatch):
    """--shared-prefix-precompile: attention and Mamba warm-ups for rows up to the capacity, the
    Mamba one for rows of the batch's pad multiple (with Mamba layers in MTP depths, of the
    depths' rows' multiple), then the edge loss's in the parameters' dtype, one log line each;
    off compiles nothing."""
    from types import SimpleNamespace

    import torch

    from megatron.shared_prefix.attention import dot_product_attention
    from megatron.shared_prefix.models.hybrid import hybrid_model
    from megatron.shared_prefix.ssm import mamba_mixer
    from megatron.shared_prefix.training.model import precompile_kernels

    calls = []
    monkeypatch.setattr(
        hybrid_model,
        "precompile_edge_loss",
        lambda model, **kw: calls.append(("loss", kw["dtype"])) or (32768,),
    )
    monkeypatch.setattr(
        dot_product_attention,
        "precompile_tree_attention",
        lambda model, tokens, **kw: calls.append(("attention", tokens, kw["mode"])) or (1024,),
    )
    monkeypatch.setattr(
        mamba_mixer,
        "precompile_tree_mamba",
        lambda model, tokens, **kw: calls.append(("mamba", tokens, kw["dtype"], kw["multiple"]))
        or (128, 127),
    )

    def mixer():
        """A TreeMambaMixer to find by type (never run)."""
        module = mamba_mixer.TreeMambaMixer.__new__(mamba_mixer.TreeMambaMixer)
        torch.nn.Module.__init__(module)
        return module

    model = torch.nn.Module()
    model.config = SimpleNamespace(
        params_dtype=torch.bfloat16,
        sequence_parallel=True,
        tensor_model_parallel_size=2,
        context_parallel_size=1,
    )
    model.decoder = torch.nn.Module()
    model.decoder.mixer = mixer()
    config = SimpleNamespace(
        precompile="dynamic", batch=SimpleNamespace(capacity=4096, pad_multiple=16)
    )
    lines = []
    precompile_kernels(model, config, "cuda", lines.append)
    assert calls == [
        ("attention", 4096, "dynamic"),
        ("mamba", 4096, torch.bfloat16, 16),
        ("loss", torch.bfloat16),
    ]
    assert "precompiled tree attention (dynamic): kernels for 1 row lengths" in lines[0]
    assert "precompiled tree Mamba: rows of 2 lengths [128, 127]" in lines[1]
    assert "precompiled the edge loss: vocabulary widths [32768]" in lines[2]
    calls.clear()
    model.mtp = torch.nn.Module()
    model.mtp.mixer = mixer()
    precompile_kernels(model, config, "cuda", lines.append)
    assert calls[1] == ("mamba", 4096, torch.bfloat16, 2)
    calls.clear()
    precompile_kernels(model, SimpleNamespace(precompile="off"), "cuda", lines.append)
    assert calls == [] and len(lines) == 6
