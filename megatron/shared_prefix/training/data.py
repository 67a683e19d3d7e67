"""Training examples: JSONL readers and the built-in dataset (host side, numpy only).

Every source becomes a list of :class:`Example` (one original token sequence with its supervised
positions and their loss weights), grouped in *units* that are kept adjacent so that related
sequences (the completions of one prompt, the snapshots of one conversation) land in the same
global batch and share their prefix. Examples are consumed in order and the order repeats every
epoch (:class:`ExampleStream`); nothing is shuffled, truncated or dropped silently.

JSONL record kinds (docs/data.md has the full reference):

* SFT tokens: ``{"input_ids": [...], "loss_mask": [0, 0, 1, ...], "weight": 1.0}``
* SFT turns:  ``{"turns": [{"role": "user", "input_ids": [...]}, {"role": "assistant", ...}]}``
* RL group:   ``{"prompt_ids": [...], "completions": [{"completion_ids": [...], "weight": 0.5},
  {"completion_ids": [...], "advantages": [...]}]}``
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Iterable, Sequence

import numpy as np

__all__ = [
    "DataError",
    "Example",
    "Dataset",
    "ExampleStream",
    "parse_record",
    "load_jsonl_dataset",
    "builtin_dataset",
    "BUILTIN_MIN_VOCAB_SIZE",
    "repetition_warning",
]

ROLES = ("system", "user", "assistant", "tool")
_IGNORED_KEYS = ("id", "metadata")


class DataError(ValueError):
    """A data record or file cannot be used; the message starts with ``path:line``."""


@dataclasses.dataclass(frozen=True, eq=False)
class Example:
    """One original sequence.

    Attributes:
        tokens: [L] int64 token ids.
        loss_mask: [L] bool, True at ``j`` when token ``j`` is a supervised target (predicted from
            the tokens before it); always False at 0.
        target_weights: [L] float32 loss weight of each target (RL weight times per-token advantage,
            1.0 for plain SFT); 0 where ``loss_mask`` is False.
        source: where the example comes from (``path:line``, plus the completion of an RL group).
    """

    tokens: np.ndarray
    loss_mask: np.ndarray
    target_weights: np.ndarray
    source: str

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_targets(self) -> int:
        """Supervised targets of the sequence."""
        return int(self.loss_mask.sum())


# --------------------------------------------------------------------------------------------------
# Record parsing
# --------------------------------------------------------------------------------------------------


def _fail(source: str, message: str):
    raise DataError(f"{source}: {message}")


def _check_keys(
    obj: dict, allowed: Sequence[str], required: Sequence[str], where: str, source: str
):
    unknown = sorted(set(obj) - set(allowed) - set(_IGNORED_KEYS))
    if unknown:
        _fail(
            source,
            f"{where} has unknown key(s) {unknown} (allowed: {sorted(allowed)}, and "
            f"{' and '.join(_IGNORED_KEYS)}, which are ignored)",
        )
    missing = [key for key in required if key not in obj]
    if missing:
        _fail(source, f"{where} is missing {missing}")


def _token_ids(value: Any, field: str, source: str, vocab_size: int) -> np.ndarray:
    """A non-empty list of ints in ``[0, vocab_size)`` as an int64 array."""
    if not isinstance(value, list) or not value:
        _fail(source, f"{field} must be a non-empty list of token ids")
    arr = _array(value)
    if arr is None or arr.ndim != 1 or arr.dtype.kind not in "iu":
        _first_bad_token_id(value, field, source, vocab_size)
    low, high = int(arr.min()), int(arr.max())
    if low < 0 or high >= vocab_size:
        _out_of_range(low if low < 0 else high, field, source, vocab_size)
    return arr.astype(np.int64)


def _array(value: list):
    """``np.asarray(value)``, or None where numpy cannot make an array of it (ragged nesting)."""
    try:
        return np.asarray(value)
    except (ValueError, TypeError, OverflowError):
        return None


def _out_of_range(token_id, field: str, source: str, vocab_size: int):
    _fail(
        source,
        f"{field} has token id {token_id} outside [0, {vocab_size}) (--vocab-size {vocab_size})",
    )


def _first_bad_token_id(value: list, field: str, source: str, vocab_size: int):
    """Report the first element of ``value`` that is not a token id: an integer-valued number out
    of range is out of range (``1e32``), anything else is not an integer."""
    for i, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, (int, float)):
            _fail(
                source, f"{field}[{i}] is {_shown(item)}: {field} must be a flat list of integers"
            )
        integral = isinstance(item, int) or (math.isfinite(item) and item == int(item))
        if integral and not 0 <= item < vocab_size:
            _out_of_range(item, field, source, vocab_size)
        if not isinstance(item, int):
            _fail(source, f"{field}[{i}] is {item!r}: {field} must be a flat list of integers")
    _fail(source, f"{field} must be a flat list of integers")


def _shown(item: Any) -> str:
    text = json.dumps(item)
    return text if len(text) <= 40 else text[:37] + "..."


def _number(value: Any, field: str, source: str) -> float:
    finite = isinstance(value, (int, float)) and not isinstance(value, bool)
    try:
        with np.errstate(over="ignore"):
            finite = finite and math.isfinite(value) and math.isfinite(np.float32(value))
    except OverflowError:
        finite = False
    if not finite:
        _fail(source, f"{field} must be a finite number, got {_shown(value)}")
    return float(value)


def _numbers(value: Any, field: str, length: int, source: str) -> np.ndarray:
    if not isinstance(value, list) or len(value) != length:
        _fail(source, f"{field} must be a list of {length} numbers (one per token)")
    arr = _array(value)
    if arr is None or arr.ndim != 1 or arr.dtype.kind not in "iuf":
        _fail(source, f"{field} must hold finite numbers")
    with np.errstate(over="ignore"):
        values = arr.astype(np.float32)
    if not np.all(np.isfinite(values)):
        _fail(source, f"{field} must hold finite numbers")
    return values


def _example(tokens: np.ndarray, mask: np.ndarray, weights: np.ndarray, source: str) -> Example:
    weights = np.where(mask, weights, 0.0).astype(np.float32)
    for arr in (tokens, mask, weights):
        arr.flags.writeable = False
    return Example(tokens=tokens, loss_mask=mask, target_weights=weights, source=source)


def _sft_tokens(obj: dict, source: str, vocab_size: int) -> list[Example]:
    _check_keys(obj, ("input_ids", "loss_mask", "weight"), ("input_ids",), "SFT record", source)
    tokens = _token_ids(obj["input_ids"], "input_ids", source, vocab_size)
    if "loss_mask" in obj:
        raw = obj["loss_mask"]
        if not isinstance(raw, list) or len(raw) != len(tokens):
            _fail(source, f"loss_mask must be a list of {len(tokens)} values (one per input id)")
        arr = _array(raw)
        if (
            arr is None
            or arr.ndim != 1
            or arr.dtype.kind not in "biu"
            or np.any((arr != 0) & (arr != 1))
        ):
            _fail(source, "loss_mask must hold 0/1 or true/false values")
        mask = arr.astype(bool)
        if mask[0]:
            _fail(
                source, "loss_mask[0] is 1, but the first token has no context to be predicted from"
            )
    else:
        mask = np.ones(len(tokens), dtype=bool)
        mask[0] = False
    weight = _number(obj.get("weight", 1.0), "weight", source)
    return [_example(tokens, mask, np.full(len(tokens), weight, np.float32), source)]


def _sft_turns(obj: dict, source: str, vocab_size: int) -> list[Example]:
    _check_keys(obj, ("turns", "weight"), ("turns",), "SFT turns record", source)
    turns = obj["turns"]
    if not isinstance(turns, list) or not turns:
        _fail(source, "turns must be a non-empty list of {role, input_ids} objects")
    pieces, masks = [], []
    for i, turn in enumerate(turns):
        where = f"turns[{i}]"
        if not isinstance(turn, dict):
            _fail(source, f"{where} must be an object with role and input_ids")
        _check_keys(turn, ("role", "input_ids"), ("role", "input_ids"), where, source)
        if turn["role"] not in ROLES:
            _fail(source, f"{where}.role is {turn['role']!r}; expected one of {list(ROLES)}")
        ids = _token_ids(turn["input_ids"], f"{where}.input_ids", source, vocab_size)
        pieces.append(ids)
        masks.append(np.full(len(ids), turn["role"] == "assistant"))
    mask = np.concatenate(masks)
    if mask[0]:
        _fail(
            source,
            "turns[0] is an assistant turn: its first token has no context to be predicted from",
        )
    if not mask.any():
        _fail(source, "turns has no assistant turn, so nothing would be supervised")
    tokens = np.concatenate(pieces)
    weight = _number(obj.get("weight", 1.0), "weight", source)
    return [_example(tokens, mask, np.full(len(tokens), weight, np.float32), source)]


def _rl_group(obj: dict, source: str, vocab_size: int) -> list[Example]:
    _check_keys(
        obj, ("prompt_ids", "completions"), ("prompt_ids", "completions"), "RL record", source
    )
    prompt = _token_ids(obj["prompt_ids"], "prompt_ids", source, vocab_size)
    completions = obj["completions"]
    if not isinstance(completions, list) or not completions:
        _fail(
            source,
            "completions must be a non-empty list of "
            "{completion_ids, weight?, advantages?} objects",
        )
    examples = []
    for i, completion in enumerate(completions):
        where = f"completions[{i}]"
        if not isinstance(completion, dict):
            _fail(source, f"{where} must be an object with completion_ids")
        _check_keys(
            completion,
            ("completion_ids", "weight", "advantages"),
            ("completion_ids",),
            where,
            source,
        )
        ids = _token_ids(
            completion["completion_ids"], f"{where}.completion_ids", source, vocab_size
        )
        weight = _number(completion.get("weight", 1.0), f"{where}.weight", source)
        advantages = np.ones(len(ids), np.float32)
        if "advantages" in completion:
            advantages = _numbers(completion["advantages"], f"{where}.advantages", len(ids), source)
        tokens = np.concatenate([prompt, ids])
        mask = np.concatenate([np.zeros(len(prompt), bool), np.ones(len(ids), bool)])
        weights = np.concatenate([np.zeros(len(prompt), np.float32), weight * advantages])
        examples.append(_example(tokens, mask, weights, f"{source} {where}"))
    return examples


_KINDS = {"input_ids": _sft_tokens, "turns": _sft_turns, "prompt_ids": _rl_group}


def parse_record(obj: Any, source: str, vocab_size: int) -> list[Example]:
    """The examples of one JSON record (one for SFT, one per completion for an RL group).

    Raises:
        DataError: naming ``source`` and the offending field.
    """
    if not isinstance(obj, dict):
        _fail(source, f"a record must be a JSON object, got {type(obj).__name__}")
    kinds = [key for key in _KINDS if key in obj]
    if not kinds and ("messages" in obj or "prompt" in obj):
        _fail(
            source,
            "text records ('messages', 'prompt') need a tokenizer: --tokenizer-type "
            "HuggingFaceTokenizer --tokenizer-model DIR (docs/data.md)",
        )
    if len(kinds) != 1:
        _fail(
            source,
            "a record must have exactly one of 'input_ids' (SFT tokens), 'turns' (SFT "
            f"conversation) or 'prompt_ids' (RL group); found {kinds or sorted(obj)}",
        )
    return _KINDS[kinds[0]](obj, source, vocab_size)


# --------------------------------------------------------------------------------------------------
# Datasets
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class Dataset:
    """Examples in consumption order, plus what loading reported.

    Attributes:
        examples: every kept example; units (one JSONL line, or one built-in group) are contiguous.
        name: where the examples come from (file list or ``builtin``).
        num_records: records (lines or built-in groups) read.
        dropped: sources of sequences dropped for exceeding the row capacity (only with
            ``drop_overlong``).
        notes: further lines for the log (text data: cache use, prefix sharing, token saving).
    """

    examples: list[Example]
    name: str
    num_records: int
    dropped: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def num_tokens(self) -> int:
        """Tokens of all examples."""
        return sum(len(e) for e in self.examples)

    @property
    def num_targets(self) -> int:
        """Supervised targets of all examples."""
        return sum(e.num_targets for e in self.examples)

    def summary(self) -> str:
        """One line for the log: sizes and what was dropped."""
        text = (
            f"{self.name}: {self.num_records} records, {len(self.examples)} sequences, "
            f"{self.num_tokens} tokens, {self.num_targets} supervised targets"
        )
        if self.dropped:
            shown = ", ".join(self.dropped[:5]) + (", ..." if len(self.dropped) > 5 else "")
            text += f"; dropped {len(self.dropped)} over-long sequences ({shown})"
        return text


def _keep(
    examples: list[Example], capacity: int, drop_overlong: bool, dropped: list[str]
) -> list[Example]:
    """Apply the capacity rule: an over-long sequence is an error, or dropped and recorded."""
    kept = []
    for example in examples:
        if len(example) <= capacity:
            kept.append(example)
        elif drop_overlong:
            dropped.append(example.source)
        else:
            _fail(
                example.source,
                f"sequence of {len(example)} tokens is longer than the row capacity {capacity} "
                "(--shared-prefix-capacity); nothing is truncated: raise the capacity or pass "
                "--shared-prefix-drop-overlong to drop (and count) such sequences",
            )
    return kept


def _build(units: Iterable[tuple[str, Any]], name, vocab_size, capacity, drop_overlong) -> Dataset:
    examples: list[Example] = []
    dropped: list[str] = []
    num_records = 0
    for source, obj in units:
        num_records += 1
        examples.extend(
            _keep(parse_record(obj, source, vocab_size), capacity, drop_overlong, dropped)
        )
    if not examples:
        raise DataError(
            f"{name}: no usable sequences ({num_records} records, {len(dropped)} dropped)"
        )
    return Dataset(examples=examples, name=name, num_records=num_records, dropped=tuple(dropped))


def _jsonl_records(path: str) -> Iterable[tuple[str, Any]]:
    """(``path:line``, parsed JSON) of every non-blank line; lines must be UTF-8 (a UTF-8 byte order
    mark at the start of the file is allowed)."""
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            source = f"{path}:{number}"
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(
                    f"{source}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at column "
                    f"{exc.start + 1}); JSONL files must be UTF-8-encoded"
                    + (
                        " (this one looks like UTF-16)"
                        if raw[:2] in (b"\xff\xfe", b"\xfe\xff")
                        else ""
                    )
                ) from None
            line = line.rstrip("\r\n")
            if not line.strip():
                continue
            try:
                yield source, json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(
                    f"{source}: not valid JSON ({exc.msg} at column {exc.colno})"
                ) from None
            except (ValueError, RecursionError) as exc:
                raise DataError(f"{source}: not usable JSON ({exc})") from None


def load_jsonl_dataset(
    paths: Sequence[str], *, vocab_size: int, capacity: int, drop_overlong: bool
) -> Dataset:
    """Read pre-tokenized JSONL files (in the order given) into one dataset.

    Every file is checked before any is read, and every record before training starts.

    Raises:
        DataError: for a missing file, a Megatron blend weight in the path list, or a bad record
            (the message names ``path:line``).
    """
    for path in paths:
        if os.path.isdir(path):
            raise DataError(f"--data-path {path}: is a directory; list the JSONL files in it")
        if not os.path.isfile(path):
            try:
                float(path)
            except ValueError:
                raise DataError(f"--data-path {path}: no such file") from None
            raise DataError(
                f"--data-path {path}: blend weights are not supported; list JSONL files, whose "
                "records are consumed in the order given"
            )

    def records():
        for path in paths:
            yield from _jsonl_records(path)

    return _build(records(), " ".join(paths), vocab_size, capacity, drop_overlong)


# --------------------------------------------------------------------------------------------------
# Built-in dataset
# --------------------------------------------------------------------------------------------------

# Token ids of the built-in dataset. Answers are functions of the prompt's symbols, so the model can
# learn them; system prompts, task prompts and the GRPO prompts of a group are shared prefixes.
_BOS, _SEP, _EOS, _SYSTEM, _USER, _ASSISTANT = 1, 2, 3, 4, 5, 6
_TASKS = {7: "copy", 8: "reverse", 9: "sort", 10: "shift"}
_SYSTEM_PROMPT = [_SYSTEM, 11, 12, 13, 14, 15, 11, 12, 13, _SEP]
_FIRST_SYMBOL, _NUM_SYMBOLS = 16, 32
BUILTIN_MIN_VOCAB_SIZE = _FIRST_SYMBOL + _NUM_SYMBOLS


def _answer(task: int, symbols: list[int]) -> list[int]:
    name = _TASKS[task]
    if name == "copy":
        return list(symbols)
    if name == "reverse":
        return symbols[::-1]
    if name == "sort":
        return sorted(symbols)
    return [_FIRST_SYMBOL + (s - _FIRST_SYMBOL + 1) % _NUM_SYMBOLS for s in symbols]


def _task(rng: np.random.Generator) -> tuple[int, list[int], list[int]]:
    task = int(rng.choice(list(_TASKS)))
    symbols = (_FIRST_SYMBOL + rng.integers(0, _NUM_SYMBOLS, int(rng.integers(3, 9)))).tolist()
    return task, symbols, _answer(task, symbols)


def _grpo_group(rng: np.random.Generator, per_token: bool, group_size: int) -> dict:
    """One prompt with ``group_size`` sampled completions, some of them wrong.

    Per-completion groups carry GRPO advantages clipped at zero (wrong completions get weight 0);
    per-token groups credit each completion token before the first error (advantage 1, then 0).
    """
    task, symbols, answer = _task(rng)
    completions, rewards, first_errors = [], [], []
    for _ in range(group_size):
        sample = answer + [_EOS]
        error = len(sample)
        if rng.random() < 0.5:
            error = int(rng.integers(0, len(answer)))
            sample[error] = (
                _FIRST_SYMBOL
                + (sample[error] - _FIRST_SYMBOL + 1 + int(rng.integers(0, _NUM_SYMBOLS - 1)))
                % _NUM_SYMBOLS
            )
        completions.append(sample)
        first_errors.append(error)
        rewards.append(float(error == len(sample)))
    rewards = np.asarray(rewards)
    advantages = np.maximum(0.0, (rewards - rewards.mean()) / (rewards.std() + 1e-6))
    entries = []
    for sample, error, advantage in zip(completions, first_errors, advantages):
        entry = {"completion_ids": sample}
        if per_token:
            entry["advantages"] = [1.0 if t < error else 0.0 for t in range(len(sample))]
        else:
            entry["weight"] = round(float(advantage), 6)
        entries.append(entry)
    return {"prompt_ids": [_BOS, task] + symbols + [_SEP], "completions": entries}


def _conversation(rng: np.random.Generator, num_turns: int) -> list[dict]:
    """Snapshots of one multi-turn conversation: each later snapshot extends the previous one."""
    turns = [{"role": "system", "input_ids": list(_SYSTEM_PROMPT)}]
    snapshots = []
    for _ in range(num_turns):
        task, symbols, answer = _task(rng)
        turns.append({"role": "user", "input_ids": [_USER, task] + symbols + [_SEP]})
        turns.append({"role": "assistant", "input_ids": [_ASSISTANT] + answer + [_EOS]})
        snapshots.append({"turns": [dict(t) for t in turns]})
    return snapshots


def builtin_dataset(
    *,
    seed: int,
    vocab_size: int,
    capacity: int,
    num_units: int = 512,
    group_size: int = 4,
    num_turns: int = 3,
) -> Dataset:
    """A deterministic dataset with shared structure and learnable answers, generated from ``seed``.

    Half of the units are GRPO-style groups (one prompt, ``group_size`` completions with weights or
    per-token advantages), half are multi-turn conversations (``num_turns`` snapshots sharing one
    system prompt and their earlier turns). Answers copy / reverse / sort / shift the symbols.
    The records go through the same parser as JSONL records.

    Raises:
        DataError: when ``vocab_size`` is below :data:`BUILTIN_MIN_VOCAB_SIZE`.
    """
    if vocab_size < BUILTIN_MIN_VOCAB_SIZE:
        raise DataError(
            f"built-in dataset: --vocab-size {vocab_size} is below its "
            f"{BUILTIN_MIN_VOCAB_SIZE} token ids"
        )
    rng = np.random.default_rng(seed)

    def units():
        for unit in range(num_units):
            if unit % 2 == 0:
                yield f"builtin:group{unit}", _grpo_group(
                    rng, per_token=unit % 4 == 2, group_size=group_size
                )
            else:
                for turn, snapshot in enumerate(_conversation(rng, num_turns)):
                    yield f"builtin:conversation{unit}.{turn}", snapshot

    dataset = _build(units(), "builtin", vocab_size, capacity, drop_overlong=False)
    return dataclasses.replace(dataset, num_records=num_units)


# --------------------------------------------------------------------------------------------------
# Consumption order
# --------------------------------------------------------------------------------------------------


class ExampleStream:
    """Examples in dataset order, repeating every epoch.

    A global batch is a function of the count of consumed examples only, so resuming from a
    checkpoint (which stores the count) gives the same batches as an uninterrupted run.
    """

    def __init__(self, dataset: Dataset, global_batch_size: int):
        self.dataset = dataset
        self.global_batch_size = global_batch_size

    def global_batch(self, consumed_examples: int) -> list[Example]:
        """The ``global_batch_size`` examples that follow the first ``consumed_examples``."""
        examples = self.dataset.examples
        start = consumed_examples
        return [examples[(start + i) % len(examples)] for i in range(self.global_batch_size)]


def repetition_warning(dataset: Dataset, global_batch_size: int) -> str | None:
    """The warning for a global batch larger than the dataset, or None.

    The stream wraps around inside such a batch, so a step holds some examples twice or more:
    they are trained on with the multiplicity they have in the batch, and the repeated copies
    are computed once by the planner, which inflates the logged saving.
    """
    size = len(dataset.examples)
    if global_batch_size <= size:
        return None
    return (
        f"[shared-prefix] warning: --global-batch-size {global_batch_size} is larger than the "
        f"{size} examples of {dataset.name}: the stream wraps around inside every step, so each "
        f"step holds examples {global_batch_size / size:.2f} times on average (weighted by that "
        "count in the loss), and the repeated copies are computed once, which inflates the "
        "logged saving (docs/data.md, Order)"
    )
