"""tools/bench_model.py: its packed dense baseline computes the tree's losses, and its ideal."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny import tiny_config

from megatron.shared_prefix.planning import plan_shared_prefix

TOOLS = Path(__file__).resolve().parents[3] / "tools"


@pytest.fixture(scope="module")
def tool(load_tool):
    return load_tool("bench_model")


def _batch(forest_sequences):
    sequences = forest_sequences(seed=4, depth=3, max_segment=40)
    masks = [np.arange(len(s)) >= min(3, len(s) - 1) for s in sequences]
    return sequences, masks


def test_dense_rows_give_every_sequence_its_own_root(tool, forest_sequences):
    sequences, masks = _batch(forest_sequences)
    capacity = 256
    rows = tool.dense_rows(sequences, masks, capacity, pad_multiple=16)
    plan = plan_shared_prefix(sequences, masks, capacity=capacity)
    assert sorted(int(i) for row in rows for i in row.sequence_ids) == list(range(len(sequences)))
    for row in rows:
        row.validate()
        assert row.num_tokens <= capacity and row.num_tokens % 16 == 0
        real = row.segment_parents[row.token_segment[: row.num_tokens - row.num_padding]]
        assert (real == -1).all()  # no token is shared
    assert sum(r.num_tokens - r.num_padding for r in rows) == sum(len(s) for s in sequences)
    assert sum(len(r.edge_source) for r in rows) == plan.loss_tokens
    with pytest.raises(ValueError, match="exceeds capacity"):
        tool.dense_rows(sequences, masks, max(len(s) for s in sequences) - 1)


def test_dense_rows_compute_the_tree_losses(tool, forest_sequences, megatron_world):
    """The baseline runs the same edges: per (sequence, position), packed dense == tree."""
    from megatron.shared_prefix import SharedPrefixHybridModel, hybrid_stack_spec

    sequences, masks = _batch(forest_sequences)
    torch.manual_seed(0)
    model = SharedPrefixHybridModel(
        tiny_config(num_layers=4, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32),
        hybrid_stack_spec=hybrid_stack_spec(4, mamba_chunk_size=8),
        vocab_size=64,
        max_sequence_length=512,
        hybrid_layer_pattern="M*-E",
        position_embedding_type="rope",
    )

    def losses(rows):
        out = {}
        with torch.no_grad():
            for row in rows:
                loss = model(None, None, None, shared_prefix_layout=row)
                for s, j, value in zip(row.edge_sequence, row.edge_position, loss.tolist()):
                    out[(int(s), int(j))] = value
        return out

    tree = losses(plan_shared_prefix(sequences, masks, capacity=256, pad_multiple=16).rows)
    dense = losses(tool.dense_rows(sequences, masks, 256, pad_multiple=16))
    assert tree.keys() == dense.keys()
    keys = sorted(tree)
    expected = torch.tensor([dense[k] for k in keys])
    actual = torch.tensor([tree[k] for k in keys])
    assert (
        float(torch.linalg.vector_norm(actual - expected) / torch.linalg.vector_norm(expected))
        < 1e-5
    )


def test_padded_micro_batches_mask_the_supervised_targets(tool):
    sequences = [np.arange(1, 6), np.arange(1, 4)]
    masks = [np.array([0, 0, 1, 1, 1]), np.array([0, 1, 1])]
    ((tokens, labels, mask),) = tool.padded_micro_batches(sequences, masks, capacity=10)
    assert tokens.shape == (2, 5)
    # Position j - 1 predicts target j: the label there is token j and the mask is mask[j].
    np.testing.assert_array_equal(mask, [[0, 1, 1, 1, 0], [1, 1, 0, 0, 0]])
    np.testing.assert_array_equal(labels[0, :4], sequences[0][1:])
    assert len(tool.padded_micro_batches(sequences, masks, capacity=5)) == 2


def test_component_ideal(tool):
    # All token-wise: the token ratio; all output: 1; a split: the harmonic combination.
    assert tool.component_ideal(100.0, 0.0, 0.0, 4.0, 2.0) == pytest.approx(4.0)
    assert tool.component_ideal(100.0, 0.0, 100.0, 4.0, 2.0) == pytest.approx(1.0)
    assert tool.component_ideal(100.0, 40.0, 10.0, 4.0, 2.0) == pytest.approx(
        100.0 / (50.0 / 4.0 + 40.0 / 2.0 + 10.0)
    )
    with pytest.raises(ValueError, match="exceed the step"):
        tool.component_ideal(10.0, 8.0, 5.0, 4.0, 2.0)


def test_attention_pairs_count_root_paths(tool):
    plan = plan_shared_prefix([[1, 2, 3, 4], [1, 2, 5]], capacity=16, pad_multiple=8)
    # Prefix [1, 2] once (1 + 2 pairs), then 3: 3 + 4 pairs, and 5: 3 pairs.
    assert tool.attention_pairs(plan.rows) == 1 + 2 + 3 + 4 + 3


def test_mtp_option_builds_the_mtp_model(tool, megatron_world):
    """--mtp-num-layers N appends N depths of --mtp-pattern, and the model trains them: a forest
    step's gradient reaches the MTP layers."""
    from types import SimpleNamespace

    args = SimpleNamespace(
        mtp_num_layers=2, mtp_pattern="*-", hidden=256, heads=4, query_groups=2, vocab=128
    )
    pattern = tool.model_pattern("moe", args)
    assert pattern == tool.PATTERNS["moe"] + "/*-/*-"
    config = tool.model_config(pattern, 256, 4, 2)
    assert config.num_layers == len(tool.PATTERNS["moe"]) and config.mtp_num_layers == 2
    assert tool.model_config(tool.PATTERNS["moe"], 256, 4, 2).mtp_num_layers is None
    model = tool.build_model("M*/*-", args, "cpu")
    # as Float16Module casts a --bf16 model: the norms' weights, A_log and D included
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    sequences = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8]]
    masks = [np.arange(len(s)) >= 2 for s in sequences]
    tool.forest_step(model, plan_shared_prefix(sequences, masks, capacity=16).rows)()
    mtp_grads = [p.grad for name, p in model.named_parameters() if name.startswith("mtp.")]
    assert mtp_grads and all(g is not None and g.abs().sum() > 0 for g in mtp_grads)


def test_output_chunk_option_builds_the_chunked_model_and_section(tool, megatron_world):
    """--output-chunk-tokens N builds the models with that chunk size and writes its own
    section, whose set-up line says so."""
    from types import SimpleNamespace

    args = SimpleNamespace(
        mtp_num_layers=0, mtp_pattern="*-", hidden=256, heads=4, query_groups=2, vocab=128
    )
    assert tool.build_model("M*", args, "cpu").shared_prefix_output_chunk_tokens == 0
    args.output_chunk_tokens = 3
    assert tool.build_model("M*", args, "cpu").shared_prefix_output_chunk_tokens == 3
    assert (
        tool._section(args, {"moe": []}) == tool.CHUNK_SECTION
    )  # pylint: disable=protected-access


def test_attention_backend_option_builds_flash_layers_and_section(tool, megatron_world):
    """--attention-backend flash builds every attention layer with tree_backend 'flash' and writes
    its own section."""
    from types import SimpleNamespace

    from megatron.shared_prefix.attention.dot_product_attention import TreeDotProductAttention

    args = SimpleNamespace(
        mtp_num_layers=0, mtp_pattern="*-", hidden=256, heads=4, query_groups=2, vocab=128
    )
    layers = lambda model: [  # noqa: E731
        m.tree_backend for m in model.modules() if isinstance(m, TreeDotProductAttention)
    ]
    assert layers(tool.build_model("M*-*", args, "cpu")) == ["auto", "auto"]
    args.attention_backend = "flash"
    assert layers(tool.build_model("M*-*", args, "cpu")) == ["flash", "flash"]
    assert (
        tool._section(args, {"moe": []}) == tool.FLASH_SECTION
    )  # pylint: disable=protected-access


def test_component_times_run_every_component(tool, megatron_world):
    """The attention and output-layer timings run (on CPU here) on rows of the model."""
    from types import SimpleNamespace

    args = SimpleNamespace(
        mtp_num_layers=0, mtp_pattern="*-", hidden=256, heads=4, query_groups=2, vocab=128
    )
    model = tool.build_model("M*", args, "cpu")
    sequences = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8]]
    rows = plan_shared_prefix(sequences, capacity=16).rows
    attention, output = tool.component_times(model, rows, repeats=1, device="cpu")
    assert attention > 0 and output > 0


def test_kept_for_backward_attributes_every_saved_storage_once(tool, megatron_world):
    """--kept-memory: the components' bytes add up to every distinct storage that autograd saves
    in the forward (parameters excluded), each layer symbol of the pattern gets its layers'
    share, and the hooks are gone afterwards."""
    from types import SimpleNamespace

    args = SimpleNamespace(
        mtp_num_layers=0, mtp_pattern="*-", hidden=256, heads=4, query_groups=2, vocab=128
    )
    model = tool.build_model("M*-E", args, "cpu")
    sequences = [[1, 2, 3, 4, 5, 6, 9, 9], [1, 2, 3, 7, 8], [1, 2, 3, 4, 10]]
    masks = [np.arange(len(s)) >= 2 for s in sequences]
    (row,) = plan_shared_prefix(sequences, masks, capacity=32).rows
    kept = tool.kept_for_backward(model, row)
    assert (
        {"M", "*", "-", "E", "output"} <= set(kept) <= {"M", "*", "-", "E", "output", "embedding"}
    )
    assert all(size > 0 for size in kept.values())

    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(tensor):
        if tensor.untyped_storage().data_ptr() not in parameters:
            saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(None, None, None, shared_prefix_layout=row).sum()
    assert sum(kept.values()) == sum(saved.values())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_kept_for_backward_frees_the_forward(tool, megatron_world):
    """--kept-memory measures one forward after another on a GPU: no output of that forward's graph
    may outlive it (a pack hook returning the tensor itself ties a node that saves its own output
    to that output in a cycle autograd never frees)."""
    import gc
    import weakref
    from types import SimpleNamespace

    args = SimpleNamespace(
        mtp_num_layers=0, mtp_pattern="*-", hidden=256, heads=4, query_groups=2, vocab=128
    )
    model = tool.build_model("M*-E", args, "cpu")
    sequences = [[1, 2, 3, 4, 5, 6, 9, 9], [1, 2, 3, 7, 8]]
    masks = [np.arange(len(s)) >= 2 for s in sequences]
    (row,) = plan_shared_prefix(sequences, masks, capacity=32).rows
    outputs = []

    def keep_reference(module, inputs, output):
        for tensor in output if isinstance(output, tuple) else (output,):
            if isinstance(tensor, torch.Tensor) and tensor.grad_fn is not None:
                outputs.append(weakref.ref(tensor))

    handles = [module.register_forward_hook(keep_reference) for module in model.modules()]
    try:
        tool.kept_for_backward(model, row)
    finally:
        for handle in handles:
            handle.remove()
    gc.collect()
    assert outputs and not [ref for ref in outputs if ref() is not None]


def test_kept_memory_record_compares_tree_and_dense_rows(tool, megatron_world):
    """The --kept-memory row: per component, MiB per 1K tokens of the longest tree and dense rows;
    the output layer keeps more per token on the tree row, whose tokens are mostly supervised."""
    from types import SimpleNamespace

    args = SimpleNamespace(
        mtp_num_layers=0,
        mtp_pattern="*-",
        hidden=256,
        heads=4,
        query_groups=2,
        vocab=128,
        capacity=256,
    )
    model = tool.build_model("M*", args, "cpu")
    prompt = list(range(1, 65))
    sequences = [prompt + [100 + k] * 16 for k in range(4)]
    masks = [np.arange(len(s)) >= len(prompt) for s in sequences]
    record = tool.kept_memory_record(model, "star", sequences, masks, args)
    assert record["tree row tokens"] == 128 and record["dense row tokens"] == 256
    assert list(record)[3:] == [
        "embedding tree/dense",
        "M tree/dense",
        "* tree/dense",
        "output tree/dense",
        "total tree/dense",
    ]
    tree, dense = (float(v) for v in record["output tree/dense"].split("/"))
    assert tree > dense > 0
    args.kept_memory = True
    section = tool._section(args, {"moe": [record]})  # pylint: disable=protected-access
    assert section == tool.KEPT_SECTION


def test_layer_times_run_one_layer_of_each_kind(tool, megatron_world):
    """The per-kind timings run one layer of each symbol of the pattern (on CPU here) over the
    rows' shapes, counted once per layer of that symbol."""
    from types import SimpleNamespace

    args = SimpleNamespace(
        mtp_num_layers=0, mtp_pattern="*-", hidden=256, heads=4, query_groups=2, vocab=128
    )
    model = tool.build_model("M*-EM", args, "cpu")
    rows = plan_shared_prefix([[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8]], capacity=16).rows
    times = tool.layer_times(model, rows, repeats=1, device="cpu")
    assert set(times) == {"M", "*", "-", "E"}
    assert all(ms > 0 for ms in times.values())
    mamba = model.decoder.layers[0].mixer.in_proj.weight  # the backward ran: gradients arrived
    assert mamba.grad is not None and mamba.grad.abs().sum() > 0


def test_first_step_table_splits_the_precompile(tool, monkeypatch):
    """The first-step table has the attention part of the precompile as a column of its own, and a
    record without precompiling (no such key) leaves that cell empty."""
    from types import SimpleNamespace

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "test device")
    args = SimpleNamespace(
        mtp_num_layers=0, hidden=256, heads=4, query_groups=2, vocab=128, capacity=4096, repeats=1
    )
    times = dict(imports_s=1.0, model_built_s=2.0, precompiled_s=2.0, first_step_done_s=3.0)
    times.update({f"{key}_extra_s": 0.1 for key, _ in tool.NEW_LENGTHS})
    first = {
        "pattern": "moe",
        "cold, precompile off": times,
        "cold, precompile dynamic": {**times, "attention_precompiled_s": 5.0, "precompiled_s": 9.0},
    }
    section = tool.markdown({}, first, "python tools/bench_model.py", args)
    header = next(line for line in section.splitlines() if line.startswith("| cache"))
    assert "| attention_precompiled_s | precompiled_s |" in header
    assert "| cold, precompile off | 1.00 | 2.00 |  | 2.00 |" in section
    assert "| cold, precompile dynamic | 1.00 | 2.00 | 5.00 | 9.00 |" in section


@pytest.mark.parametrize("setting", [None, "0"])
def test_benchmarks_run_mamba_ssm_deterministic_unless_told_otherwise(setting):
    """use_deterministic_mamba_ssm sets MAMBA_DETERMINISTIC=1 for the benchmark and the processes
    it starts, and leaves an explicit setting alone; importing the tool sets nothing (mamba_ssm is
    not imported before its main() calls it)."""
    env = {key: value for key, value in os.environ.items() if key != "MAMBA_DETERMINISTIC"}
    if setting is not None:
        env["MAMBA_DETERMINISTIC"] = setting
    child = (
        "import os, subprocess, sys; import bench_model; "
        "assert 'mamba_ssm' not in sys.modules; "
        "print(os.environ.get('MAMBA_DETERMINISTIC')); "
        "bench_model.use_deterministic_mamba_ssm(); "
        "print(subprocess.run([sys.executable, '-c', "
        "'import os; print(os.environ[\"MAMBA_DETERMINISTIC\"])'], capture_output=True, "
        "text=True, check=True).stdout.strip())"
    )
    result = subprocess.run(
        [sys.executable, "-c", child],
        cwd=TOOLS,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert result.stdout.split() == [str(setting), "1" if setting is None else setting]


def test_device_description_gives_the_host_launch_costs(tool):
    """The set-up line names the device, then, when measured, the host's cost of one Triton and
    one PyTorch launch (a short row's synchronized step follows the host)."""
    describe = sys.modules["benchmark_report"].device_description
    assert describe("NVIDIA H100 80GB HBM3") == "NVIDIA H100 80GB HBM3"
    text = describe("NVIDIA H100 80GB HBM3", {"triton": 17.46, "torch": 5.81})
    assert text.startswith("NVIDIA H100 80GB HBM3 (host, with the GPU busy: ")
    assert "17.5 us per launch of an empty Triton kernel" in text
    assert "5.8 us per small PyTorch op" in text


@pytest.mark.gpu
def test_host_launch_costs_are_measured_with_the_gpu_busy(tool):
    """host_launch_us times both launches (positive, finite) and leaves no work queued."""
    costs = sys.modules["benchmark_report"].host_launch_us(launches=20, rounds=2)
    assert set(costs) == {"triton", "torch"}
    assert all(0 < value < 1e5 for value in costs.values())
    assert torch.cuda.current_stream().query()


def test_kernel_time_differences_locate_what_one_run_adds(tool):
    """The profile difference that bench_mamba --profile prints: on CPU, a run with an extra add
    shows the add first, with its call counts, and names the two runs share with their times."""
    from torch.profiler import ProfilerActivity, profile

    differences = sys.modules["benchmark_report"].kernel_time_differences
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    averages = []
    for extra in (True, False):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            product = a @ b
            if extra:
                product = torch.add(product, product)
        averages.append(prof.key_averages())
    rows = differences(*averages, attribute="self_cpu_time_total")
    by_name = {row[0]: row for row in rows}
    name, with_add, without, extra, calls, reference_calls = by_name["aten::add"]
    assert with_add > 0 and without == 0 and extra == with_add
    assert (calls, reference_calls) == (1, 0)
    assert by_name["aten::mm"][4:] == (1, 1)
    assert [row[3] for row in rows] == sorted((row[3] for row in rows), reverse=True)


def test_shared_cache_processes_run_together_and_get_their_own_section(tool, monkeypatch, tmp_path):
    """--first-step-processes N starts N children per cache state before waiting for any, on one
    pair of cache directories; each gets a row of its own with what the cache gained meanwhile,
    and the markdown goes to the shared-cache section."""
    from types import SimpleNamespace

    started, environments = [], []

    class Child:  # a first-step child that writes one cache file per process
        def __init__(self, command, env, stdout, **_):
            started.append(command)
            environments.append(env)
            self.returncode = 0
            os.makedirs(env["TRITON_CACHE_DIR"], exist_ok=True)
            with open(os.path.join(env["TRITON_CACHE_DIR"], f"k{len(started)}"), "w") as handle:
                handle.write("x")
            stdout.write(f'warning\nFIRST_STEP {{"first_step_done_s": {len(started)}.0}}\n')

        def wait(self, timeout):
            assert len(started) % 2 == 0, "waited before the second process started"

    monkeypatch.setattr(tool.subprocess, "Popen", Child)
    monkeypatch.setattr(tool.tempfile, "mkdtemp", lambda **_: str(tmp_path))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "test device")
    args = SimpleNamespace(
        capacity=4096, mtp_num_layers=0, mtp_pattern="*-", first_step_processes=2, hidden=256,
        heads=4, query_groups=2, vocab=128, repeats=1,
    )
    results = tool._first_steps("moe", "off", args)  # pylint: disable=protected-access
    assert len(started) == 4
    assert len({env["TRITON_CACHE_DIR"] for env in environments}) == 1
    assert sorted(results) == [
        f"{state}, precompile off, process {i} of 2" for state in ("cold", "warm") for i in (1, 2)
    ]
    assert all(r["triton_files_added"] == 2 for r in results.values())
    assert [r["first_step_done_s"] for r in results.values()] == [1.0, 2.0, 3.0, 4.0]
    first = {"pattern": "moe", **results}
    section = tool.markdown({}, first, "python tools/bench_model.py", args)
    assert section.startswith(f"## {tool.SHARED_CACHE_SECTION}")
    assert "2 processes started together" in section
    assert "| triton_files_added | torchinductor_files_added |" in section


def test_queued_steps_run_behind_a_lead_step(tool):
    """--repeats steps are timed after one lead step, none of them synchronized on its own."""
    calls = []
    assert tool.queued(lambda: calls.append(1), 3, "cpu") >= 0
    assert len(calls) == 4


def test_batch_record_reports_queued_steps(tool, megatron_world):
    """A table row carries the queued steps' speedup and tree / ideal, from their own timings."""
    from types import SimpleNamespace

    args = SimpleNamespace(
        mtp_num_layers=0, mtp_pattern="*-", hidden=256, heads=4, query_groups=2, vocab=64,
        capacity=128, repeats=1,
    )  # fmt: skip
    model = tool.build_model("M*", args, "cpu")
    sequences = [np.array([1, 2, 3, 4, 5, 6]), np.array([1, 2, 3, 7, 8, 9])]
    masks = [np.arange(6) >= 2, np.arange(6) >= 2]
    record, timings = tool.bench_batch(model, "star", sequences, masks, args, "cpu")
    queued_speedup = timings["dense_queued_ms"] / timings["tree_queued_ms"]
    assert record["speedup, steps queued"] == pytest.approx(queued_speedup)
    assert record["tree / ideal, steps queued"] == pytest.approx(
        queued_speedup / record["component ideal"]
    )
