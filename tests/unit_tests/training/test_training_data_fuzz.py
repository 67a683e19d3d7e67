"""Fuzzing the JSONL reader: any bytes and any JSON shape give clean examples or one
``FILE:LINE: ...`` error line (a DataError), never another exception or a malformed example."""

import json
import os
import re
import tempfile

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron.shared_prefix.training.data import DataError, load_jsonl_dataset

VOCAB, CAPACITY = 64, 32
FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def outcome(content: bytes, drop_overlong: bool = False):
    """Load ``content`` as a JSONL file; returns (path, dataset or DataError, number of lines)."""
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "fuzz.jsonl")
        with open(path, "wb") as handle:
            handle.write(content)
        try:
            result = load_jsonl_dataset(
                [path], vocab_size=VOCAB, capacity=CAPACITY, drop_overlong=drop_overlong
            )
        except DataError as error:
            result = error
    return path, result, content.count(b"\n") + 1


def assert_clean(path, result, num_lines):
    if isinstance(result, DataError):
        message = str(result)
        assert "\n" not in message, message
        match = re.match(re.escape(path) + r":(\d+): \S", message)
        if match is None:  # the only error without a line: nothing usable in the whole file
            assert message.startswith(f"{path}: no usable sequences"), message
        else:
            assert 1 <= int(match.group(1)) <= num_lines, message
        return
    assert result.examples
    for example in result.examples:
        assert re.match(re.escape(path) + r":\d+( completions\[\d+\])?$", example.source)
        tokens, mask, weights = example.tokens, example.loss_mask, example.target_weights
        assert tokens.dtype == np.int64 and tokens.ndim == 1 and 1 <= len(tokens) <= CAPACITY
        assert tokens.min() >= 0 and tokens.max() < VOCAB
        assert mask.dtype == np.bool_ and mask.shape == tokens.shape and not mask[0]
        assert weights.dtype == np.float32 and weights.shape == tokens.shape
        assert np.all(np.isfinite(weights)) and np.all(weights[~mask] == 0)


@FUZZ
@given(st.lists(st.binary(max_size=60), max_size=6))
def test_random_bytes(lines):
    assert_clean(*outcome(b"\n".join(lines)))


JSON_LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=5)
)
JSON_VALUES = st.recursive(
    JSON_LEAVES,
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=12,
)
ANY_FLOAT = st.floats(allow_nan=True, allow_infinity=True)
HUGE = st.integers(min_value=-(10**400), max_value=10**400)
TOKEN_ID = st.integers(min_value=-2, max_value=VOCAB + 1)
TOKEN_IDS = (
    st.lists(TOKEN_ID, min_size=1, max_size=8)
    | st.lists(TOKEN_ID | HUGE | ANY_FLOAT | st.lists(TOKEN_ID, max_size=2), max_size=6)
    | JSON_VALUES
)
NUMBERS = st.lists(
    ANY_FLOAT | st.integers(-3, 3) | HUGE | st.lists(ANY_FLOAT, max_size=2), max_size=8
)
WEIGHT = ANY_FLOAT | HUGE | JSON_VALUES
KEYS = ("input_ids", "loss_mask", "weight", "turns", "prompt_ids", "completions", "id", "metadata")
FIELDS = {
    "input_ids": TOKEN_IDS,
    "prompt_ids": TOKEN_IDS,
    "loss_mask": st.lists(st.integers(-1, 2) | st.booleans() | HUGE | NUMBERS, max_size=8)
    | JSON_VALUES,
    "weight": WEIGHT,
    "turns": st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["system", "user", "assistant", "tool", "bot"])},
            optional={"input_ids": TOKEN_IDS, "extra": JSON_VALUES},
        ),
        max_size=4,
    )
    | JSON_VALUES,
    "completions": st.lists(
        st.fixed_dictionaries(
            {"completion_ids": TOKEN_IDS},
            optional={"weight": WEIGHT, "advantages": NUMBERS | JSON_VALUES},
        ),
        max_size=3,
    )
    | JSON_VALUES,
    "id": JSON_VALUES,
    "metadata": JSON_VALUES,
    "extra": JSON_VALUES,
}
# Each record kind with its required and optional keys (plus the ignored ones and a stray key).
KINDS = {
    "input_ids": ((), ("loss_mask", "weight")),
    "turns": ((), ("weight",)),
    "prompt_ids": (("completions",), ()),
}


def record_of_kind(kind):
    required, optional = KINDS[kind]
    return st.fixed_dictionaries(
        {key: FIELDS[key] for key in (kind, *required)},
        optional={key: FIELDS[key] for key in (*optional, "id", "metadata", "extra")},
    )


RECORDS = (
    st.sampled_from(sorted(KINDS)).flatmap(record_of_kind)
    | st.lists(st.sampled_from(KEYS), max_size=4, unique=True).flatmap(
        lambda keys: st.fixed_dictionaries({key: FIELDS[key] for key in keys})
    )
    | JSON_VALUES
)


@FUZZ
@given(st.lists(RECORDS, min_size=1, max_size=4), st.booleans())
def test_random_json_shapes(records, drop_overlong):
    content = "\n".join(json.dumps(r) for r in records).encode()
    assert_clean(*outcome(content, drop_overlong))


def test_fuzzing_reaches_both_outcomes():
    """The record strategy is not all errors: a valid record of each kind loads cleanly."""
    lines = [
        {"input_ids": [1, 2, 3], "id": 7},
        {"turns": [{"role": "user", "input_ids": [5]}, {"role": "assistant", "input_ids": [6]}]},
        {"prompt_ids": [1], "completions": [{"completion_ids": [2], "advantages": [0.5]}]},
    ]
    path, result, num_lines = outcome("\n".join(json.dumps(r) for r in lines).encode())
    assert_clean(path, result, num_lines)
    assert len(result.examples) == 3
