"""The megatron.training glue on CPU: fixed micro-batch counts, per-token-loss reduction, metrics.

Megatron's schedule is emulated as it uses the forward step with ``--calculate-per-token-loss``:
every rank runs ``num_microbatches`` forward steps, backpropagates each returned loss sum, and the
gradients are divided by the units summed over micro-batches and data-parallel ranks. Two ranks run
one after the other on one model, so their gradients add up as the data-parallel all-reduce would.
"""

import dataclasses
import json
import os

import numpy as np
import pytest
import torch

from megatron.shared_prefix.training.arguments import parse_arguments
from megatron.shared_prefix.training.batching import build_step_batch
from megatron.shared_prefix.training.config import ConfigError, RunConfig
from megatron.shared_prefix.training.data import ExampleStream
from megatron.shared_prefix.training.loop import train_step
from megatron.shared_prefix.training import megatron_integration
from megatron.shared_prefix.training.megatron_integration import (
    MegatronSession,
    RowIterator,
    StepMeter,
    pad_rows,
)
from megatron.shared_prefix.training.metrics import MetricsWriter
from megatron.shared_prefix.training.model import (
    build_model,
    report_mtp_losses,
    transformer_config,
)

CPU = torch.device("cpu")


def setup(flags, data_parallel_size):
    args = parse_arguments(
        ["--global-batch-size", "8", "--no-check-for-nan-in-loss-and-grad", *flags]
    )
    config = RunConfig.from_args(args, trainer="megatron", data_parallel_size=data_parallel_size)
    torch.manual_seed(0)
    model = build_model(args, transformer_config(args, portable=True))
    return config, config.data.load(), model


class Written:
    """A metrics writer that keeps what it is given."""

    def __init__(self):
        self.metrics = []

    def write(self, metrics):
        self.metrics.append(metrics)


def meter_for(writer=None):
    return StepMeter(
        writer=writer,
        train_iters=1,
        iteration=0,
        consumed_samples=0,
        global_batch_size=8,
        learning_rate=None,
        group=None,
        device=CPU,
    )


@pytest.mark.parametrize("packing", ["--shared-prefix-packing", "--no-shared-prefix-packing"])
@pytest.mark.parametrize(
    "flags",
    [
        ("--shared-prefix-loss-normalization", "token"),
        ("--shared-prefix-loss-normalization", "sequence"),
        ("--mtp-num-layers", "2"),
    ],
    ids=["token", "sequence", "mtp"],
)
def test_megatron_reduction_equals_the_loop(megatron_world, packing, flags):
    from megatron.core.transformer.multi_token_prediction import (
        MTPLossAutoScaler,
        MTPLossLoggingHelper,
    )

    config, dataset, model = setup([packing, *flags], 2)
    num_micro_batches = config.batch.micro_batches_per_step
    assert num_micro_batches == 4  # 8 examples / (micro-batch 1 x 2 ranks)
    # What megatron's schedule sets with --calculate-per-token-loss (a dense micro-batch's MTP
    # loss is attached inside HybridModel.forward); the tracker is sized by this model.
    MTPLossAutoScaler.set_loss_scale(torch.ones(1))
    MTPLossLoggingHelper.tracker.clear()

    model.zero_grad()
    loss_sum = units = 0.0
    for rank in range(2):
        session = MegatronSession(config, dataset, device=CPU)
        written = Written()
        session.meter = meter_for(written)
        rows = RowIterator(
            ExampleStream(dataset, 8),
            config.batch,
            rank=rank,
            consumed_samples=0,
            meter=session.meter,
        )
        for _ in range(num_micro_batches):
            losses, loss_function = session.forward_step(rows, model)
            micro_loss, micro_units, report = loss_function(losses)
            micro_loss.backward()
            main_loss = report["lm loss"][0].item()
            assert report["lm loss"][1].item() == micro_units.item()
            if "--mtp-num-layers" in flags and packing == "--shared-prefix-packing":
                # A row's MTP loss joins what is backpropagated, not the lm loss report.
                assert micro_loss.item() > main_loss or not micro_units.item()
            else:
                assert micro_loss.item() == pytest.approx(main_loss)
            loss_sum += main_loss
            units += float(micro_units)
        assert not rows._pending  # exactly num_micro_batches micro-batches per step
        session.meter.finish()
        if "--mtp-num-layers" in flags:
            # The JSONL's mtp_k loss is what megatron.training's log reports (which then clears
            # the helper, as here).
            logged = report_mtp_losses(2, num_micro_batches, 1)
            assert len(logged) == 2 and min(logged) > 0
            assert written.metrics[0].mtp_losses == pytest.approx(logged, rel=1e-6)
        else:
            assert written.metrics[0].mtp_losses == ()
    megatron_grads = [p.grad / units for p in model.parameters()]
    if "--mtp-num-layers" in flags:
        assert any(p.grad is not None for n, p in model.named_parameters() if n.startswith("mtp."))
    MTPLossLoggingHelper.tracker.clear()

    model.zero_grad()
    step = build_step_batch(
        ExampleStream(dataset, 8).global_batch(0),
        packing=config.batch.packing,
        capacity=config.batch.capacity,
        micro_batch_size=1,
        normalization=config.batch.normalization,
    )
    loop_loss, _ = train_step(model, step, clip_grad=0.0, device=CPU)
    assert loss_sum / units == pytest.approx(loop_loss, rel=1e-5)
    for megatron_grad, param in zip(megatron_grads, model.parameters()):
        torch.testing.assert_close(megatron_grad, param.grad, rtol=1e-4, atol=1e-7)


def test_rows_are_padded_to_the_micro_batch_count(megatron_world):
    config, dataset, _ = setup([], 1)
    rows = RowIterator(
        ExampleStream(dataset, 8), config.batch, rank=0, consumed_samples=0, meter=meter_for()
    )
    step = rows._next_step()
    assert len(step.micro_batches) == 8
    empty = [row for row in step.micro_batches if len(row.layout.edge_source) == 0]
    assert 0 < len(empty) < 8  # the 8 examples pack into fewer rows; the rest are empty rows
    assert step.executed_tokens == sum(row.num_tokens for row in step.micro_batches)


def assert_same(planned, expected, where="step"):
    """Field by field, arrays bitwise: a step as planned against another."""
    if dataclasses.is_dataclass(expected):
        assert type(planned) is type(expected), where
        for field in dataclasses.fields(expected):
            name = f"{where}.{field.name}"
            assert_same(getattr(planned, field.name), getattr(expected, field.name), name)
    elif isinstance(expected, np.ndarray):
        assert planned.dtype == expected.dtype, where
        np.testing.assert_array_equal(planned, expected, err_msg=where)
    elif isinstance(expected, torch.Tensor):
        assert planned.dtype == expected.dtype and planned.device == expected.device, where
        assert torch.equal(planned, expected), where
    elif isinstance(expected, dict):
        assert planned.keys() == expected.keys(), where
        for key in expected:
            assert_same(planned[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, tuple):
        assert len(planned) == len(expected), where
        for index, (a, b) in enumerate(zip(planned, expected)):
            assert_same(a, b, f"{where}[{index}]")
    else:
        assert planned == expected, where


def rows_of(config, dataset, num_workers, consumed_samples):
    batch = dataclasses.replace(config.batch, num_workers=num_workers)
    return RowIterator(
        ExampleStream(dataset, 8),
        batch,
        rank=1,
        consumed_samples=consumed_samples,
        meter=meter_for(),
    )


@pytest.mark.parametrize("packing", ["--shared-prefix-packing", "--no-shared-prefix-packing"])
def test_worker_planned_steps_equal_the_training_process_steps(
    megatron_world, monkeypatch, packing
):
    """--num-workers N: the steps are planned in N DataLoader workers, not in the training process,
    in order, the same steps (resuming mid-stream too) as planned in the training process."""
    config, dataset, _ = setup([packing, "--num-workers", "2"], 2)
    assert config.batch.num_workers == 2
    expected_rows = rows_of(config, dataset, 0, consumed_samples=16)
    expected = [expected_rows._next_step() for _ in range(5)]
    assert expected_rows.consumed_samples == 16 + 5 * 8

    training_process = os.getpid()
    plan = megatron_integration.rank_step_batch

    def plan_outside_the_training_process(*args, **kwargs):
        assert os.getpid() != training_process, "a step was planned in the training process"
        return plan(*args, **kwargs)

    monkeypatch.setattr(megatron_integration, "rank_step_batch", plan_outside_the_training_process)
    rows = rows_of(config, dataset, 2, consumed_samples=16)
    meter = rows.meter
    micro_batches = config.batch.micro_batches_per_step
    for index, step in enumerate(expected):
        for micro_batch in step.micro_batches:
            assert_same(next(rows), micro_batch, f"step {index}")
        assert not rows._pending
        assert_same(meter.step, step, f"step {index}")  # the meter counts the step as planned
    assert rows.consumed_samples == 16 + 5 * 8 and len(step.micro_batches) == micro_batches
    with pytest.raises(AssertionError, match="planned in the training process"):
        next(rows_of(config, dataset, 0, consumed_samples=16))


def test_workers_prepare_the_rows_forest_tables(megatron_world):
    """With the model's forest tables, workers hand over each packed row's ForestTensors built
    with them, equal table by table to the same preparation in the training process; without
    workers the rows carry none (the forward builds them)."""
    from megatron.shared_prefix.attention.dot_product_attention import prepare_tree_attention
    from megatron.shared_prefix.moe.statistics import forest_routing_tables
    from megatron.shared_prefix.ssm.tree_conv import prepare_tree_conv
    from megatron.shared_prefix.ssm.tree_scan import prepare_tree_scan
    from megatron.shared_prefix.tensors import ForestTable, ForestTensors, prepare_forest

    # What hybrid_model.forest_tables gives an "M*E" model on a GPU.
    tables = (
        ForestTable(ForestTensors.local_tokens, (1, 0, 1, 0)),
        ForestTable(ForestTensors.edge_projection, (1, 0, 1, 0)),
        ForestTable(prepare_tree_scan),
        ForestTable(prepare_tree_conv, (4,)),
        ForestTable(prepare_tree_attention, ("auto", True)),
        ForestTable(forest_routing_tables),
    )
    config, dataset, _ = setup(["--num-workers", "2"], 2)
    in_process = rows_of(config, dataset, 0, consumed_samples=0)
    in_process.forest_tables = tables
    expected = [in_process._next_step() for _ in range(2)]
    assert all(row.forest is None for step in expected for row in step.micro_batches)

    rows = rows_of(config, dataset, 2, consumed_samples=0)
    rows.forest_tables = tables
    prepared = 0
    for step in expected:
        for micro_batch in step.micro_batches:
            row = next(rows)
            assert_same(row.layout, micro_batch.layout)
            assert row.forest is not None and row.forest.layout.num_tokens == row.num_tokens
            assert_same(row.forest, prepare_forest(micro_batch.layout, tables))
            prepared += 1
    assert prepared == 2 * config.batch.micro_batches_per_step


def test_worker_errors_reach_the_training_process(megatron_world):
    """A step that a worker cannot plan fails the training process with the flags to change."""
    config, dataset, _ = setup(
        ["--global-batch-size", "16", "--micro-batch-size", "16", "--shared-prefix-capacity", "96"]
        + ["--num-workers", "1"],
        1,
    )
    rows = RowIterator(
        ExampleStream(dataset, 16), config.batch, rank=0, consumed_samples=0, meter=meter_for()
    )
    with pytest.raises(
        ConfigError, match=r"more than the 1 micro-batches per step .*--micro-batch-size 16"
    ):
        next(rows)


def test_negative_worker_count_is_an_error():
    args = parse_arguments(["--global-batch-size", "8", "--num-workers", "-1"])
    with pytest.raises(ConfigError, match="--num-workers must be >= 0, got -1"):
        RunConfig.from_args(args, trainer="megatron")


def test_too_many_rows_for_the_micro_batch_count_is_an_error(megatron_world):
    config, dataset, _ = setup(
        ["--global-batch-size", "16", "--micro-batch-size", "16", "--shared-prefix-capacity", "96"],
        1,
    )
    assert config.batch.micro_batches_per_step == 1
    step = build_step_batch(
        ExampleStream(dataset, 16).global_batch(0),
        packing=True,
        capacity=96,
        micro_batch_size=16,
        normalization=config.batch.normalization,
    )
    assert len(step.micro_batches) > 1
    with pytest.raises(
        ConfigError, match=r"more than the 1 micro-batches per step .*--micro-batch-size 16"
    ):
        pad_rows(step, 1, config.batch)


def test_step_meter_reports_each_step_once(megatron_world, tmp_path):
    config, dataset, model = setup([], 1)
    path = tmp_path / "metrics.jsonl"
    writer = MetricsWriter(
        log_interval=1, jsonl_path=str(path), resume_iteration=0, log=lambda line: None
    )
    session = MegatronSession(config, dataset, device=CPU)
    session.meter = StepMeter(
        writer=writer,
        train_iters=2,
        iteration=0,
        consumed_samples=0,
        global_batch_size=8,
        learning_rate=lambda: 1e-3,
        group=None,
        device=CPU,
    )
    rows = RowIterator(
        ExampleStream(dataset, 8), config.batch, rank=0, consumed_samples=0, meter=session.meter
    )
    for _ in range(2 * config.batch.micro_batches_per_step):
        losses, loss_function = session.forward_step(rows, model)
        loss_function(losses)
    session.meter.finish()
    writer.close()
    records = [json.loads(line) for line in open(path)]
    assert [r["iteration"] for r in records] == [1, 2]
    assert [r["consumed_samples"] for r in records] == [8, 16]
    assert all(r["learning_rate"] == 1e-3 and r["loss"] > 0 for r in records)
    assert all(r["executed_tokens"] < r["logical_tokens"] + r["micro_batches"] for r in records)


def test_providers_under_megatron_global_args(megatron_world, tmp_path):
    """The providers as pretrain calls them: model from Megatron's args, iterator, loss, meter."""
    from megatron.training.global_vars import set_args

    path = tmp_path / "metrics.jsonl"
    args = parse_arguments(
        ["--global-batch-size", "8", "--no-check-for-nan-in-loss-and-grad", "--log-interval", "1"]
        + ["--shared-prefix-metrics-jsonl", str(path)]
    )
    args.iteration, args.consumed_train_samples = 0, 0  # set by pretrain's checkpoint loading
    config = RunConfig.from_args(args, trainer="megatron", data_parallel_size=1)
    session = MegatronSession(config, config.data.load(), device=CPU)
    set_args(args)
    try:
        model = session.model_provider()
        rows, valid, test = session.datasets_provider([24, 0, 0])
        assert valid is None and test is None
        for _ in range(2 * config.batch.micro_batches_per_step):
            losses, loss_function = session.forward_step(rows, model)
            loss_function(losses)[0].backward()
        session.meter.finish()
    finally:
        set_args(None)
    records = [json.loads(line) for line in open(path)]
    assert [r["iteration"] for r in records] == [1, 2]
    assert [r["micro_batches"] for r in records] == [8, 8]  # padded to 8 / (1 x 1)
    assert records[0]["learning_rate"] == pytest.approx(3e-4)  # warmup step 1 of 10 to 3e-3


def test_megatron_start_up_make_succeeds_on_the_wheel(monkeypatch):
    """initialize_megatron's `make -C megatron/core/datasets` passes with the prebuilt helpers."""
    import importlib.util
    import os

    import megatron.core.datasets as datasets
    from megatron.core.datasets.utils import compile_helpers

    from megatron.shared_prefix.training.megatron_integration import _use_prebuilt_dataset_helpers

    has_makefile = os.path.exists(os.path.join(os.path.dirname(datasets.__file__), "Makefile"))
    if has_makefile or importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is None:
        pytest.skip("megatron-core here is a source checkout or has no prebuilt helpers")
    monkeypatch.setenv("MAKEFILES", "")  # recorded first, so the test leaves the variable as it was
    monkeypatch.delenv("MAKEFILES")
    with pytest.raises(SystemExit):
        compile_helpers()
    _use_prebuilt_dataset_helpers()
    compile_helpers()
