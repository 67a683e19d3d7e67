"""Text records through Megatron's tokenizers: chats and RL rollouts as strings (docs/data.md).

Next to the token-id record kinds of data.py, which stay, a JSONL file read with a text tokenizer
(``--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR``, or a SentencePiece or TikToken
type; tokenizer.py) may hold

* SFT chats: ``{"messages": [{"role": "user", "content": "..."}, ...], "weight": 1.0}``, rendered
  with the tokenizer's chat template and tokenized as ``apply_chat_template`` tokenizes them; the
  assistant turns (``--shared-prefix-supervise all-assistant``, default) or only the last one
  (``last-assistant``) are supervised;
* RL groups: ``{"prompt": "..." or [messages], "completions": [{"text": "...", "weight": 0.5,
  "advantages": [...]}]}``: the prompt (a chat rendered with the generation prompt) is shared by
  the group, each completion's text is tokenized on its own and appended, so its tokens are what
  ``tokenizer(text, add_special_tokens=False)`` gives and per-token advantages align with them.

Assistant spans come from the template itself: the character spans of its ``{% generation %}``
blocks when it has them (what ``return_assistant_tokens_mask`` uses), otherwise from the end of
the generation prompt after the earlier messages to where the next message's rendering starts;
a token is supervised when its characters overlap a span (tokenizer.py's ``span_mask``).

Loading (:func:`load_text_dataset`) tokenizes each file once: the examples are cached under a hash
of (file content, tokenizer fingerprint, chat template, supervision flag), written to a temporary
name and renamed when complete; rank 0 writes, the other ranks wait for the file and read it. While
tokenizing, a progress line reports records and examples per second. Every record is checked
before training; errors name ``path:line``. Consecutive chat records where the later one extends the
earlier (conversation snapshots) are checked for sharing their tokens as a prefix, and the loader
reports how many do, why the others do not, and the token saving of the first global batch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time
import uuid
from typing import Any, Callable, Optional, Sequence

import numpy as np

from megatron.shared_prefix.training.data import (
    _IGNORED_KEYS,
    DataError,
    Dataset,
    Example,
    _check_keys,
    _example,
    _jsonl_records,
    _keep,
    _number,
    _numbers,
    parse_record,
)
from megatron.shared_prefix.training.tokenizer import TextTokenizer, is_plain_chat

__all__ = [
    "SUPERVISION",
    "TextDataConfig",
    "TokenizedFile",
    "Progress",
    "SharingReport",
    "tokenize_file",
    "load_text_dataset",
    "cache_path",
]

SUPERVISION = ("all-assistant", "last-assistant")
# Bumped whenever the tokenized representation or its meaning changes (old caches are ignored).
_CACHE_FORMAT = 1
# Records rendered before one batched tokenizer call.
_CHUNK = 256
_TEXT_KINDS = ("messages", "prompt")
_ALL_KINDS = ("input_ids", "turns", "prompt_ids") + _TEXT_KINDS
# Broken-sharing locations kept for the report.
_SHOWN = 5
# Time of import: a failure marker older than this is from an earlier run (see _wait_for_cache).
_STARTED = time.time()


@dataclasses.dataclass(frozen=True)
class TextDataConfig:
    """How text records are tokenized and cached.

    Attributes:
        tokenizer: the Megatron tokenizer (``--tokenizer-type``, ``--tokenizer-model``).
        supervise: ``all-assistant`` or ``last-assistant`` (``--shared-prefix-supervise``).
        cache_dir: where tokenized files are cached (``--data-cache-path``); None: a ``cache``
            directory next to each data file, as Megatron's datasets place their index caches.
        sample_examples: examples of the sample whose token saving is reported (one rank's share of
            a global batch).
        rank: this process's rank; rank 0 tokenizes and writes the cache, the others read it.
        world_size: processes of the job; with more than one, rank 0 leaves a failure marker
            for the others when a record is bad.
    """

    tokenizer: TextTokenizer
    supervise: str = "all-assistant"
    cache_dir: Optional[str] = None
    sample_examples: int = 32
    rank: int = 0
    world_size: int = 1

    def __post_init__(self):
        if self.supervise not in SUPERVISION:
            raise ValueError(f"--shared-prefix-supervise must be one of {SUPERVISION}")


# --------------------------------------------------------------------------------------------------
# Sharing between conversation snapshots
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class SharingReport:
    """Conversation snapshots (chat records extending the previous record) and their token sharing.

    Attributes:
        snapshots: chat records whose messages extend the previous record's messages.
        shared: those whose tokens start with the previous record's tokens.
        broken: ``path:line: cause`` of the first snapshots that do not (at most 5 kept).
        num_broken: all snapshots that do not.
    """

    snapshots: int = 0
    shared: int = 0
    broken: list = dataclasses.field(default_factory=list)
    num_broken: int = 0

    def add(self, other: "SharingReport") -> None:
        """Accumulate another file's report."""
        self.snapshots += other.snapshots
        self.shared += other.shared
        self.num_broken += other.num_broken
        self.broken.extend(other.broken[: max(0, _SHOWN - len(self.broken))])

    def summary(self) -> str:
        """One line for the log."""
        if not self.snapshots:
            return "conversation snapshots: none (no chat record extends the previous record)"
        text = (
            f"conversation snapshots: {self.snapshots} chat records extend the previous record, "
            f"{self.shared} share its tokens as a prefix"
        )
        if self.num_broken:
            shown = "; ".join(self.broken) + ("; ..." if self.num_broken > len(self.broken) else "")
            text += f", {self.num_broken} do not ({shown})"
        return text


@dataclasses.dataclass
class _Chat:
    """What the sharing check keeps of the previous chat record."""

    messages: list
    text: str
    tokens: np.ndarray
    last_turn_end: int  # where the last message's content ends in ``text``


def _sharing_cause(earlier: _Chat, later: _Chat) -> str:
    """Why ``later`` (whose messages extend ``earlier``'s) does not start with its tokens."""
    if later.text.startswith(earlier.text):
        return (
            "the text extends the earlier snapshot but its tokens do not: a BPE merge across the "
            "turn boundary"
        )
    common = os.path.commonprefix([earlier.text, later.text])
    if len(common) >= earlier.last_turn_end:
        return (
            f"the template ends the conversation differently from a continued one (text differs "
            f"at character {len(common)}, after the last message: e.g. an end-of-conversation "
            "marker)"
        )
    return (
        f"the template re-renders earlier turns (text differs at character {len(common)}, "
        "before the end of the earlier snapshot's last message)"
    )


def _check_sharing(
    previous: Optional[_Chat], chat: _Chat, source: str, report: SharingReport
) -> None:
    if previous is None:
        return
    n = len(previous.messages)
    if len(chat.messages) <= n or chat.messages[:n] != previous.messages:
        return
    report.snapshots += 1
    m = len(previous.tokens)
    if len(chat.tokens) >= m and np.array_equal(chat.tokens[:m], previous.tokens):
        report.shared += 1
        return
    report.num_broken += 1
    if len(report.broken) < _SHOWN:
        report.broken.append(f"{source}: {_sharing_cause(previous, chat)}")


# --------------------------------------------------------------------------------------------------
# Record parsing
# --------------------------------------------------------------------------------------------------


def _fail(source: str, message: str):
    raise DataError(f"{source}: {message}")


def _messages(value: Any, field: str, source: str) -> list[dict]:
    """A non-empty list of ``{role, content, ...}`` objects (extra keys go to the template)."""
    if not isinstance(value, list) or not value:
        _fail(source, f"{field} must be a non-empty list of {{role, content}} objects")
    for i, message in enumerate(value):
        where = f"{field}[{i}]"
        if not isinstance(message, dict):
            _fail(source, f"{where} must be an object with role and content")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            _fail(source, f"{where}.role must be a non-empty string, got {role!r}")
        if not isinstance(message.get("content"), str):
            _fail(source, f"{where}.content must be a string, got {message.get('content')!r}")
    return value


def _render(
    tokenizer: TextTokenizer, messages, add_generation_prompt: bool, source: str, plain=None
) -> str:
    try:
        return tokenizer.render(messages, add_generation_prompt, plain)
    except Exception as exc:  # pylint: disable=broad-exception-caught
        # Jinja raises its own errors (and templates call raise_exception) for conversations they
        # do not accept; all of them mean this record cannot be rendered.
        raise DataError(
            f"{source}: the chat template cannot render this conversation: {exc}"
        ) from None


def _assistant_spans(
    tokenizer: TextTokenizer, messages: list[dict], supervise: str, source: str
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered chat and the character spans of its supervised assistant turns."""
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not assistant:
        _fail(source, "messages has no assistant message, so nothing would be supervised")
    if tokenizer.has_generation_markers:
        try:
            text, spans = tokenizer.generation_spans(messages)
        except Exception as exc:  # pylint: disable=broad-exception-caught
            _fail(source, f"the chat template cannot render this conversation: {exc}")
        spans = [(s, e) for s, e in spans if e > s]
        if not spans:
            _fail(source, "the chat template's {% generation %} blocks enclose no text here")
        return text, spans[-1:] if supervise == "last-assistant" else spans
    plain = is_plain_chat(messages)
    text = _render(tokenizer, messages, False, source, plain)
    if supervise == "last-assistant":
        assistant = assistant[-1:]
    if assistant[0] == 0:
        _fail(
            source,
            "messages[0] is a supervised assistant message: it has no context to be predicted from "
            "(with --shared-prefix-supervise last-assistant only the last one is supervised)",
        )
    spans = []
    for i in assistant:
        prompt = _render(tokenizer, messages[:i], True, source, plain)
        if not text.startswith(prompt):
            _fail(
                source,
                f"cannot locate assistant message {i}: the chat template's rendering of messages "
                f"[0, {i}) with the generation prompt is not a prefix of the whole conversation "
                "(it renders earlier turns or the assistant header differently); mark assistant "
                "turns with {% generation %} ... {% endgeneration %} in the template",
            )
        if i + 1 == len(messages):
            end = len(text)
        else:
            continued = _render(tokenizer, messages[: i + 1], False, source, plain)
            if text.startswith(continued):
                end = len(continued)
            else:  # the template writes something after a last message (an end marker)
                end = len(os.path.commonprefix([continued, text]))
        if end > len(prompt):
            spans.append((len(prompt), end))
    if not spans:
        _fail(source, "the assistant messages render to no text, so nothing would be supervised")
    return text, spans


@dataclasses.dataclass
class _Pending:
    """A record waiting for its texts to be tokenized.

    Attributes:
        texts: (text, add special tokens) pairs to encode.
        finish: ``finish(encodings) -> (examples, chat)``; ``chat`` (a :class:`_Chat` or None) is
            what the snapshot check compares with the next record.
    """

    texts: list
    finish: Callable


def _chat_record(obj: dict, source: str, config: TextDataConfig) -> _Pending:
    _check_keys(obj, ("messages", "weight"), ("messages",), "chat record", source)
    messages = _messages(obj["messages"], "messages", source)
    weight = _number(obj.get("weight", 1.0), "weight", source)
    text, spans = _assistant_spans(config.tokenizer, messages, config.supervise, source)

    def finish(encodings):
        ((tokens, offsets),) = encodings
        mask = config.tokenizer.span_mask(text, tokens, offsets, spans)
        if not mask.any():
            _fail(source, "no token of the assistant messages remains after tokenization")
        if mask[0]:
            _fail(
                source, "the first token is supervised, but it has no context to be predicted from"
            )
        example = _example(tokens, mask, np.full(len(tokens), weight, np.float32), source)
        content = messages[-1]["content"]
        found = text.rfind(content) if content else -1
        end = found + len(content) if found >= 0 else spans[-1][0]
        return [example], _Chat(messages, text, tokens, end)

    return _Pending([(text, False)], finish)


def _rl_record(obj: dict, source: str, config: TextDataConfig) -> _Pending:
    _check_keys(obj, ("prompt", "completions"), ("prompt", "completions"), "RL record", source)
    prompt = obj["prompt"]
    if isinstance(prompt, str):
        if not prompt:
            _fail(source, "prompt must be a non-empty string or a list of messages")
        prompt_text, prompt_special = prompt, config.tokenizer.include_special_tokens
    else:
        if not config.tokenizer.has_chat_template:
            _no_template(source)
        messages = _messages(prompt, "prompt", source)
        prompt_text, prompt_special = _render(config.tokenizer, messages, True, source), False
    completions = obj["completions"]
    if not isinstance(completions, list) or not completions:
        _fail(
            source, "completions must be a non-empty list of {text, weight?, advantages?} objects"
        )
    entries = []
    for i, completion in enumerate(completions):
        where = f"completions[{i}]"
        if not isinstance(completion, dict):
            _fail(source, f"{where} must be an object with text")
        _check_keys(completion, ("text", "weight", "advantages"), ("text",), where, source)
        if not isinstance(completion["text"], str) or not completion["text"]:
            _fail(source, f"{where}.text must be a non-empty string")
        weight = _number(completion.get("weight", 1.0), f"{where}.weight", source)
        entries.append((where, completion["text"], weight, completion.get("advantages")))

    def finish(encodings):
        (prompt_ids, _), *encoded = encodings
        if prompt_ids.size == 0:
            _fail(source, "prompt tokenizes to no tokens")
        examples = []
        for (where, _, weight, advantages), (ids, _) in zip(entries, encoded):
            if ids.size == 0:
                _fail(source, f"{where}.text tokenizes to no tokens")
            values = np.ones(len(ids), np.float32)
            if advantages is not None:
                if not isinstance(advantages, list) or len(advantages) != len(ids):
                    got = (
                        len(advantages)
                        if isinstance(advantages, list)
                        else type(advantages).__name__
                    )
                    _fail(
                        source,
                        f"{where}.advantages has {got} values, but {where}.text is {len(ids)} "
                        "tokens (one advantage per token of tokenizer(text, "
                        "add_special_tokens=False))",
                    )
                values = _numbers(advantages, f"{where}.advantages", len(ids), source)
            tokens = np.concatenate([prompt_ids, ids])
            mask = np.concatenate([np.zeros(len(prompt_ids), bool), np.ones(len(ids), bool)])
            weights = np.concatenate([np.zeros(len(prompt_ids), np.float32), weight * values])
            examples.append(_example(tokens, mask, weights, f"{source} {where}"))
        return examples, None

    texts = [(prompt_text, prompt_special)] + [(text, False) for _, text, _, _ in entries]
    return _Pending(texts, finish)


def _last_assistant_turn(examples: list[Example], obj: dict, source: str) -> list[Example]:
    """A ``turns`` record with only its last assistant turn supervised."""
    (example,) = examples
    lengths = [len(turn["input_ids"]) for turn in obj["turns"]]
    last = max(i for i, turn in enumerate(obj["turns"]) if turn["role"] == "assistant")
    start = sum(lengths[:last])
    mask = np.zeros(len(example), dtype=bool)
    mask[start : start + lengths[last]] = True
    return [_example(example.tokens.copy(), mask, example.target_weights.copy(), source)]


def _no_template(source: str):
    _fail(
        source,
        "chat records need a chat template: the tokenizer of --tokenizer-model has none (add "
        "chat_template to its tokenizer_config.json, or pass --chat-template)",
    )


def _record(obj: Any, source: str, config: TextDataConfig) -> _Pending:
    if not isinstance(obj, dict):
        _fail(source, f"a record must be a JSON object, got {type(obj).__name__}")
    kinds = [key for key in _ALL_KINDS if key in obj]
    if len(kinds) != 1:
        _fail(
            source,
            "a record must have exactly one of 'messages' (SFT chat), 'prompt' (RL group of "
            "texts), 'input_ids' (SFT tokens), 'turns' (SFT token turns) or 'prompt_ids' (RL "
            f"group of token ids); found {kinds or sorted(set(obj) - set(_IGNORED_KEYS))}",
        )
    if kinds[0] == "messages":
        if not config.tokenizer.has_chat_template:
            _no_template(source)
        return _chat_record(obj, source, config)
    if kinds[0] == "prompt":
        return _rl_record(obj, source, config)
    examples = parse_record(obj, source, config.tokenizer.vocab_size)
    if kinds[0] == "turns" and config.supervise == "last-assistant":
        examples = _last_assistant_turn(examples, obj, source)
    return _Pending([], lambda _: (examples, None))


# --------------------------------------------------------------------------------------------------
# Tokenizing a file
# --------------------------------------------------------------------------------------------------


class Progress:
    """Records and examples per second while a file is tokenized, on stderr.

    On a terminal one line is rewritten about once a second; otherwise a line is printed every
    ``interval`` seconds, and always a final one.
    """

    def __init__(self, name: str, total: int, stream=None, interval: float = 10.0):
        self.name = name
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.interval = 1.0 if self.tty else interval
        self.start = self.last = time.perf_counter()

    def _line(self, records: int, examples: int, tokens: int, now: float) -> str:
        elapsed = max(now - self.start, 1e-9)
        return (
            f"[shared-prefix] tokenizing {self.name}: {records}/{self.total} records "
            f"({100.0 * records / max(self.total, 1):.0f}%) | {examples / elapsed:.0f} examples/s "
            f"| {tokens / elapsed:.0f} tokens/s | {elapsed:.1f} s"
        )

    def update(self, records: int, examples: int, tokens: int) -> None:
        """Report if the interval has passed."""
        now = time.perf_counter()
        if now - self.last < self.interval:
            return
        self.last = now
        end = "\r" if self.tty else "\n"
        print(self._line(records, examples, tokens, now), end=end, file=self.stream, flush=True)

    def finish(self, records: int, examples: int, tokens: int) -> None:
        """The final line."""
        print(
            self._line(records, examples, tokens, time.perf_counter()), file=self.stream, flush=True
        )


@dataclasses.dataclass
class TokenizedFile:
    """The examples of one file in file order, before the capacity rule, and what was measured.

    Attributes:
        examples: every example of the file.
        num_records: records (non-blank lines).
        sharing: the conversation-snapshot check.
        seconds: time spent tokenizing (0 when read from the cache).
        cached: whether the examples came from the cache.
    """

    examples: list[Example]
    num_records: int
    sharing: SharingReport
    seconds: float = 0.0
    cached: bool = False


def _count_lines(path: str) -> int:
    with open(path, "rb") as handle:
        return sum(1 for line in handle if line.strip())


def tokenize_file(
    path: str, config: TextDataConfig, progress: Optional[Progress] = None
) -> TokenizedFile:
    """Parse, render and tokenize every record of ``path`` (no cache).

    Raises:
        DataError: naming ``path:line`` for the first bad record.
    """
    start = time.perf_counter()
    progress = progress or Progress(path, _count_lines(path))
    examples: list[Example] = []
    report = SharingReport()
    state = {"previous": None, "records": 0, "tokens": 0}

    def flush(chunk: list[tuple[str, _Pending]]) -> None:
        encodings = [[None] * len(pending.texts) for _, pending in chunk]
        for special in (False, True):
            slots = [
                (r, t)
                for r, (_, pending) in enumerate(chunk)
                for t, (_, flag) in enumerate(pending.texts)
                if flag is special
            ]
            texts = [chunk[r][1].texts[t][0] for r, t in slots]
            for (r, t), encoding in zip(slots, config.tokenizer.encode(texts, special)):
                encodings[r][t] = encoding
        for (source, pending), encoded in zip(chunk, encodings):
            produced, chat = pending.finish(encoded)
            if chat is not None:
                _check_sharing(state["previous"], chat, source, report)
            state["previous"] = chat
            examples.extend(produced)
            state["tokens"] += sum(len(e) for e in produced)
        state["records"] += len(chunk)
        progress.update(state["records"], len(examples), state["tokens"])

    chunk: list[tuple[str, _Pending]] = []
    for source, obj in _jsonl_records(path):
        chunk.append((source, _record(obj, source, config)))
        if len(chunk) == _CHUNK:
            flush(chunk)
            chunk = []
    flush(chunk)
    progress.finish(state["records"], len(examples), state["tokens"])
    return TokenizedFile(
        examples=examples,
        num_records=state["records"],
        sharing=report,
        seconds=time.perf_counter() - start,
    )


# --------------------------------------------------------------------------------------------------
# Cache
# --------------------------------------------------------------------------------------------------


def _cache_key(path: str, config: TextDataConfig) -> str:
    digest = hashlib.sha256()
    digest.update(f"format {_CACHE_FORMAT}\ntokenizer {config.tokenizer.fingerprint}\n".encode())
    digest.update(f"supervise {config.supervise}\n".encode())
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def cache_path(path: str, config: TextDataConfig) -> str:
    """Where the tokenized examples of ``path`` are cached under ``config``."""
    directory = config.cache_dir or os.path.join(os.path.dirname(os.path.abspath(path)), "cache")
    name = f"{os.path.basename(path)}.{_cache_key(path, config)[:32]}.tokens.npz"
    return os.path.join(directory, "shared_prefix_text", name)


def _write_atomically(final: str, write: Callable) -> None:
    """``write(handle)`` to a temporary name next to ``final``, then rename it to ``final``."""
    temporary = f"{final}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        with open(temporary, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, final)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def _save(final: str, path: str, tokenized: TokenizedFile) -> None:
    examples = tokenized.examples
    lengths = np.fromiter((len(e) for e in examples), np.int64, len(examples))
    # "LINE" or "LINE completions[i]": the path is added back in the spelling of the reading run.
    sources = [e.source[len(path) + 1 :] for e in examples]
    meta = {
        "format": _CACHE_FORMAT,
        "num_records": tokenized.num_records,
        "sources": sources,
        "sharing": dict(
            dataclasses.asdict(tokenized.sharing),
            broken=[entry[len(path) + 1 :] for entry in tokenized.sharing.broken],
        ),
    }
    arrays = {
        "tokens": np.concatenate([e.tokens for e in examples]).astype(np.int32),
        "loss_mask": np.concatenate([e.loss_mask for e in examples]),
        "target_weights": np.concatenate([e.target_weights for e in examples]),
        "offsets": np.concatenate([[0], np.cumsum(lengths)]),
        "meta": np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8),
    }
    _write_atomically(final, lambda handle: np.savez(handle, **arrays))


def _load(final: str, path: str) -> TokenizedFile:
    try:
        with np.load(final, allow_pickle=False) as stored:
            meta = json.loads(stored["meta"].tobytes())
            tokens = stored["tokens"].astype(np.int64)
            masks = stored["loss_mask"]
            weights = stored["target_weights"]
            offsets = stored["offsets"]
    except (OSError, ValueError, KeyError) as exc:
        raise DataError(
            f"{path}: the tokenized cache {final} cannot be read ({exc}); delete it to tokenize "
            "again"
        ) from None
    for array in (tokens, masks, weights):
        array.flags.writeable = False
    # The stored source is "LINE" or "LINE completions[i]"; the path is this run's spelling.
    examples = [
        Example(
            tokens=tokens[offsets[i] : offsets[i + 1]],
            loss_mask=masks[offsets[i] : offsets[i + 1]],
            target_weights=weights[offsets[i] : offsets[i + 1]],
            source=f"{path}:{source}",
        )
        for i, source in enumerate(meta["sources"])
    ]
    sharing = SharingReport(**meta["sharing"])
    sharing.broken = [f"{path}:{entry}" for entry in sharing.broken]
    return TokenizedFile(examples, meta["num_records"], sharing, cached=True)


def _failure_marker(final: str) -> str:
    return final + ".failed"


def _wait_for_cache(final: str, path: str, rank: int, log: Callable[[str], None]) -> TokenizedFile:
    """Ranks other than 0: wait for rank 0 to write ``final`` (or to report the data's error)."""
    marker = _failure_marker(final)
    waited = 0.0
    while not os.path.exists(final):
        if os.path.exists(marker) and os.path.getmtime(marker) >= _STARTED:
            with open(marker, encoding="utf-8") as handle:
                raise DataError(handle.read())
        time.sleep(0.5)
        waited += 0.5
        if waited % 60 == 0:
            log(
                f"[shared-prefix] rank {rank}: waiting {waited:.0f} s for rank 0 to tokenize {path}"
            )
    return _load(final, path)


def _tokenized(
    path: str, final: str, config: TextDataConfig, log: Callable[[str], None]
) -> TokenizedFile:
    if os.path.exists(final):
        return _load(final, path)
    if config.rank != 0:
        return _wait_for_cache(final, path, config.rank, log)
    os.makedirs(os.path.dirname(final), exist_ok=True)
    marker = _failure_marker(final)
    if os.path.exists(marker):
        os.remove(marker)
    try:
        tokenized = tokenize_file(path, config)
    except DataError as error:
        if config.world_size > 1:
            _write_atomically(marker, lambda handle: handle.write(str(error).encode()))
        raise
    _save(final, path, tokenized)
    log(
        f"[shared-prefix] data: tokenized {path} in {tokenized.seconds:.1f} s "
        f"({len(tokenized.examples) / max(tokenized.seconds, 1e-9):.0f} examples/s); cached as "
        f"{final}"
    )
    return tokenized


# --------------------------------------------------------------------------------------------------
# Dataset
# --------------------------------------------------------------------------------------------------


def _check_cache_dir(finals: dict[str, str], config: TextDataConfig) -> None:
    for path, final in finals.items():
        parent = os.path.dirname(final)
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)
        if not os.access(parent, os.W_OK):
            flag = "--data-cache-path" if config.cache_dir else "--data-cache-path DIR"
            raise DataError(
                f"{path}: cannot write the tokenized cache under {parent} (not writable); pass "
                f"{flag} naming a writable directory"
            )


def _saving(examples: Sequence[Example], sample: int, capacity: int) -> str:
    from megatron.shared_prefix.planning import plan_shared_prefix

    chosen = list(examples[:sample])
    plan = plan_shared_prefix(
        [e.tokens for e in chosen], [e.loss_mask for e in chosen], capacity=capacity
    )
    return (
        f"token saving of the first {len(chosen)} examples (one rank's share of a global batch): "
        f"{plan.logical_tokens} logical / {plan.executed_tokens} executed tokens = "
        f"{plan.logical_tokens / max(plan.executed_tokens, 1):.2f}x in {len(plan.rows)} row(s)"
    )


def load_text_dataset(
    paths: Sequence[str],
    config: TextDataConfig,
    *,
    capacity: int,
    drop_overlong: bool,
    log: Callable[[str], None] = print,
) -> Dataset:
    """Read JSONL files holding text and token-id records (in the order given) into one dataset.

    Each file is tokenized once and cached (rank 0 writes, the other ranks read); the capacity
    rule of data.py applies after tokenization. The dataset's notes report the cache use, the
    conversation-snapshot sharing check and the token saving of the first global batch.

    Raises:
        DataError: for a missing file, an unwritable cache directory, or a bad record (the message
            names ``path:line``).
    """
    for path in paths:
        if not os.path.isfile(path):
            raise DataError(f"--data-path {path}: no such file")
    finals = {path: cache_path(path, config) for path in paths}
    _check_cache_dir(finals, config)
    examples: list[Example] = []
    dropped: list[str] = []
    sharing = SharingReport()
    num_records = 0
    cached = []
    for path in paths:
        tokenized = _tokenized(path, finals[path], config, log)
        num_records += tokenized.num_records
        sharing.add(tokenized.sharing)
        if tokenized.cached:
            cached.append(path)
        examples.extend(_keep(tokenized.examples, capacity, drop_overlong, dropped))
    name = " ".join(paths)
    if not examples:
        raise DataError(
            f"{name}: no usable sequences ({num_records} records, {len(dropped)} dropped)"
        )
    notes = []
    if cached:
        notes.append(f"read tokenized examples of {', '.join(cached)} from the cache")
    notes += [sharing.summary(), _saving(examples, config.sample_examples, capacity)]
    return Dataset(
        examples=examples,
        name=name,
        num_records=num_records,
        dropped=tuple(dropped),
        notes=tuple(notes),
    )
