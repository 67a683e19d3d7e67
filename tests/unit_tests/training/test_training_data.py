"""JSONL records, their errors, the capacity rule and the built-in dataset (host side, no model)."""

import os
from pathlib import Path

import numpy as np
import pytest

from megatron.shared_prefix import plan_shared_prefix
from megatron.shared_prefix.training.data import (
    DataError,
    ExampleStream,
    builtin_dataset,
    load_jsonl_dataset,
    parse_record,
)

# The checkout root (the directory holding tests/unit_tests), wherever this file is moved to.
REPO = str(
    next(p for p in Path(__file__).resolve().parents if (p / "tests" / "unit_tests").is_dir())
)


def load(path, capacity=64, drop_overlong=False, vocab_size=64):
    return load_jsonl_dataset(
        [path], vocab_size=vocab_size, capacity=capacity, drop_overlong=drop_overlong
    )


def test_sft_tokens_record():
    (example,) = parse_record(
        {"input_ids": [1, 5, 6, 7], "loss_mask": [0, 0, 1, 1], "weight": 2.0}, "f:1", 64
    )
    assert example.tokens.tolist() == [1, 5, 6, 7]
    assert example.loss_mask.tolist() == [False, False, True, True]
    assert example.target_weights.tolist() == [0.0, 0.0, 2.0, 2.0]
    (default,) = parse_record({"input_ids": [1, 5, 6]}, "f:2", 64)
    assert default.loss_mask.tolist() == [False, True, True]


def test_sft_turns_supervise_assistant_turns():
    record = {
        "turns": [
            {"role": "system", "input_ids": [4, 11]},
            {"role": "user", "input_ids": [5, 20]},
            {"role": "assistant", "input_ids": [6, 21, 3]},
            {"role": "user", "input_ids": [5, 22]},
            {"role": "assistant", "input_ids": [6, 23, 3]},
        ]
    }
    (example,) = parse_record(record, "f:1", 64)
    assert example.tokens.tolist() == [4, 11, 5, 20, 6, 21, 3, 5, 22, 6, 23, 3]
    assert np.flatnonzero(example.loss_mask).tolist() == [4, 5, 6, 9, 10, 11]


def test_rl_group_weights_and_advantages():
    record = {
        "prompt_ids": [1, 7, 20, 2],
        "completions": [
            {"completion_ids": [20, 3], "weight": -0.5},
            {"completion_ids": [21, 22, 3], "weight": 2.0, "advantages": [1.0, 0.5, 0.0]},
        ],
    }
    first, second = parse_record(record, "rl.jsonl:3", 64)
    assert first.tokens.tolist() == [1, 7, 20, 2, 20, 3]
    assert first.loss_mask.tolist() == [False] * 4 + [True] * 2
    assert first.target_weights.tolist() == [0, 0, 0, 0, -0.5, -0.5]
    assert second.target_weights[4:].tolist() == [2.0, 1.0, 0.0]
    assert second.source == "rl.jsonl:3 completions[1]"


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"text": "hi"}', "exactly one of"),
        ('{"input_ids": [1, 2], "prompt_ids": [1]}', "exactly one of"),
        ('{"input_ids": []}', "non-empty list"),
        ('{"input_ids": [1, 2.5]}', "flat list of integers"),
        ('{"input_ids": [1, 64]}', "token id 64 outside [0, 64)"),
        ('{"input_ids": [1, -1]}', "token id -1"),
        ('{"input_ids": [1, 2], "loss_mask": [0]}', "loss_mask must be a list of 2"),
        ('{"input_ids": [1, 2], "loss_mask": [0, 2]}', "0/1"),
        ('{"input_ids": [1, 2], "loss_mask": [1, 1]}', "loss_mask[0] is 1"),
        (
            '{"input_ids": [1, 2], "loss_maks": [0, 1]}',
            "unknown key(s) ['loss_maks'] (allowed: ['input_ids', 'loss_mask', 'weight'], and id "
            "and metadata, which are ignored)",
        ),
        ('{"input_ids": [1, 1e32]}', "input_ids has token id 1e+32 outside [0, 64)"),
        ('{"input_ids": [1, 100000000000000000000]}', "token id 100000000000000000000 outside"),
        ('{"input_ids": [1, [2, 3], [4]]}', "input_ids[1] is [2, 3]: input_ids must be a flat"),
        ('{"input_ids": [1, 2], "weight": 1e39}', "weight must be a finite number, got 1e+39"),
        ('{"input_ids": [1, 2], "weight": 1' + "0" * 400 + "}", "weight must be a finite number"),
        ('{"input_ids": [1, 2], "loss_mask": [0, [1]]}', "loss_mask must hold 0/1"),
        ('{"input_ids": [1, 2, 3', "not valid JSON (Expecting ',' delimiter at column 23)"),
        ('{"input_ids": [1, 2], "weight": "high"}', "weight must be a finite number"),
        (
            '{"turns": [{"role": "assistant", "input_ids": [6, 7]}]}',
            "turns[0] is an assistant turn",
        ),
        ('{"turns": [{"role": "user", "input_ids": [5, 7]}]}', "no assistant turn"),
        ('{"turns": [{"role": "bot", "input_ids": [5]}]}', "turns[0].role is 'bot'"),
        ('{"prompt_ids": [1], "completions": []}', "completions must be a non-empty list"),
        (
            '{"prompt_ids": [1], "completions": [{"completion_ids": [2], "advantages": [1, 2]}]}',
            "advantages must be a list of 1",
        ),
        (
            '{"prompt_ids": [1], "completions": [{"completion_ids": [2], "weight": NaN}]}',
            "completions[0].weight must be a finite number",
        ),
    ],
)
def test_malformed_record_names_file_and_line(write_jsonl, line, message):
    path = write_jsonl(['{"input_ids": [1, 2, 3]}', "", line])
    with pytest.raises(DataError) as error:
        load(path)
    assert f"{path}:3" in str(error.value)
    assert message in str(error.value)


def test_text_that_is_not_utf8_names_file_and_line(tmp_path):
    utf16 = tmp_path / "utf16.jsonl"
    utf16.write_text('{"input_ids": [1, 2, 3]}\n', encoding="utf-16")
    with pytest.raises(DataError) as error:
        load(str(utf16))
    assert str(error.value) == (
        f"{utf16}:1: not UTF-8 text (byte 0xff at column 1); JSONL files must be UTF-8-encoded "
        "(this one looks like UTF-16)"
    )
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b'{"input_ids": [1, 2]}\n{"input_ids": [1, \x93\x00\xfe]}\n')
    with pytest.raises(
        DataError, match=r"binary.jsonl:2: not UTF-8 text \(byte 0x93 at column 19\)"
    ):
        load(str(binary))
    with_bom = tmp_path / "bom.jsonl"
    with_bom.write_text('{"input_ids": [1, 2, 3]}\n', encoding="utf-8-sig")
    assert load(str(with_bom)).num_tokens == 3


def test_overlong_sequence_is_an_error_naming_the_flag(write_jsonl):
    path = write_jsonl([{"input_ids": [1, 2, 3]}, {"input_ids": list(range(10))}])
    with pytest.raises(
        DataError, match=r"data.jsonl:2: sequence of 10 tokens is longer than the row capacity 8"
    ):
        load(path, capacity=8)
    with pytest.raises(DataError, match="--shared-prefix-drop-overlong"):
        load(path, capacity=8)


def test_overlong_sequences_dropped_on_request_are_counted(write_jsonl):
    long_group = {
        "prompt_ids": [1, 2, 3, 4],
        "completions": [{"completion_ids": [5] * 5}, {"completion_ids": [6]}],
    }
    path = write_jsonl([{"input_ids": [1, 2, 3]}, long_group])
    dataset = load(path, capacity=8, drop_overlong=True)
    assert len(dataset.examples) == 2
    assert dataset.dropped == (f"{path}:2 completions[0]",)
    assert "dropped 1 over-long sequences" in dataset.summary()


def test_missing_file_and_blend_weights_are_rejected(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        load(str(tmp_path / "absent.jsonl"))
    with pytest.raises(DataError, match=f"--data-path {tmp_path}: is a directory"):
        load(str(tmp_path))
    with pytest.raises(DataError, match="blend weights are not supported"):
        load_jsonl_dataset(["0.5"], vocab_size=64, capacity=64, drop_overlong=False)


def test_example_files_load():
    for name in ("sft.jsonl", "rl.jsonl"):
        dataset = load(os.path.join(REPO, "examples", name), capacity=256)
        assert dataset.num_targets > 0


def test_builtin_dataset_is_deterministic_and_shares_prefixes():
    first = builtin_dataset(seed=3, vocab_size=64, capacity=256, num_units=16)
    again = builtin_dataset(seed=3, vocab_size=64, capacity=256, num_units=16)
    other = builtin_dataset(seed=4, vocab_size=64, capacity=256, num_units=16)
    assert [e.tokens.tolist() for e in first.examples] == [
        e.tokens.tolist() for e in again.examples
    ]
    assert [e.tokens.tolist() for e in first.examples] != [
        e.tokens.tolist() for e in other.examples
    ]
    kinds = {e.source.split(":")[1].split()[0].rstrip("0123456789.") for e in first.examples}
    assert kinds == {"group", "conversation"}
    weights = np.concatenate([e.target_weights[e.loss_mask] for e in first.examples])
    assert weights.min() == 0.0 and weights.max() > 1.0  # GRPO advantages and per-token credit
    plan = plan_shared_prefix(
        [e.tokens for e in first.examples], [e.loss_mask for e in first.examples], capacity=256
    )
    assert plan.logical_tokens / plan.executed_tokens > 2.0


def test_builtin_dataset_needs_its_vocabulary():
    with pytest.raises(DataError, match="--vocab-size 32"):
        builtin_dataset(seed=0, vocab_size=32, capacity=256)


def test_stream_hands_out_global_batches_in_order_across_epochs(write_jsonl):
    dataset = load(write_jsonl([{"input_ids": [1, i + 2]} for i in range(5)]))
    stream = ExampleStream(dataset, global_batch_size=3)
    assert [int(e.tokens[1]) for e in stream.global_batch(0)] == [2, 3, 4]
    assert [int(e.tokens[1]) for e in stream.global_batch(3)] == [5, 6, 2]
