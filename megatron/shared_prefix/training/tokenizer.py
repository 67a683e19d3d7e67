"""Megatron's tokenizers for text records: set-up from the flags, chat rendering, encoding.

``build_text_tokenizer(args)`` builds the tokenizer of ``--tokenizer-type`` with megatron-core's
own ``build_tokenizer`` (megatron.core.tokenizers), as megatron.training does, so the vocabulary
size and its padding (``args.padded_vocab_size``) come from the tokenizer exactly as in Megatron.
The result is a :class:`TextTokenizer`, the small interface the text loader (text_data.py) needs:

* ``render(messages, add_generation_prompt)``: the chat template's text;
* ``generation_spans(messages)``: character spans of the template's ``{% generation %}`` blocks
  (None when the template has no markers);
* ``encode(texts, special_tokens)``: token ids and per-token character offsets of many texts at once
  (Hugging Face fast tokenizers encode a batch in parallel);
* ``fingerprint``: a digest of everything that decides the tokens (tokenizer files, settings, chat
  template, library versions), part of the tokenized-data cache key.

* ``span_mask(text, ids, offsets, spans)``: which tokens overlap the character spans.

Two kinds are supported:

* ``HuggingFaceTokenizer`` with a local directory (``--tokenizer-model DIR``, a fast tokenizer:
  ``tokenizer.json``): templates are rendered as transformers' ``apply_chat_template`` renders
  them (the tokenizer's special tokens are template variables), chats are tokenized as it
  tokenizes them (no special tokens added around the rendered text), and token offsets come from
  the Rust tokenizer;
* ``SentencePieceTokenizer``, ``GPTSentencePieceTokenizer``, ``Llama2Tokenizer`` (a local
  ``.model`` file) and ``TikTokenizer`` (megatron-core's TikToken vocabulary ``.json``): templates
  (``--chat-template``) are rendered and tokenized as megatron-core's own ``apply_chat_template``
  does (``tokenize`` of the rendered text). SentencePiece normalizes text, so there are no
  character offsets into it: for both, the tokens before a span boundary are those that the text
  before it tokenizes to, as far as they agree with the whole text's tokens.

megatron-core's ``GPT2BPETokenizer`` and ``BertWordPiece*`` types resolve a hub model name even when
given local vocabulary files, so they are refused.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import os
import re
from typing import Optional, Sequence

import numpy as np

__all__ = [
    "TEXT_TOKENIZER_TYPES",
    "TokenizerError",
    "TextTokenizer",
    "HuggingFaceText",
    "SENTENCEPIECE_TYPES",
    "build_text_tokenizer",
    "tokenizer_arguments",
    "is_plain_chat",
    "uses_text_tokenizer",
]

# Megatron tokenizer types that read text records from local files only.
SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
TEXT_TOKENIZER_TYPES = ("HuggingFaceTokenizer", "TikTokenizer") + SENTENCEPIECE_TYPES
# The Python package each tokenizer library needs besides transformers (chat templates).
_PACKAGES = {"TikTokenizer": "tiktoken", **{kind: "sentencepiece" for kind in SENTENCEPIECE_TYPES}}

# Files of a model directory that never influence tokenization (weights); everything else in the
# directory of --tokenizer-model is part of the fingerprint.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")
# Message fields that apply_chat_template copies under each other's names.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")
# Flags that change what build_tokenizer builds.
_TOKENIZER_FLAGS = (
    "tokenizer_type",
    "tokenizer_model",
    "vocab_file",
    "merge_file",
    "special_tokens",
    "tokenizer_hf_no_use_fast",
    "tokenizer_hf_no_include_special_tokens",
    "trust_remote_code",
    "metadata_path",
    "tokenizer_sentencepiece_legacy",
    "tokenizer_sentencepiece_ignore_extra_whitespaces",
    "tiktoken_pattern",
    "tiktoken_num_special_tokens",
    "vocab_size",
)


class TokenizerError(ValueError):
    """The tokenizer flags cannot give a text tokenizer; the message names the flag."""


def uses_text_tokenizer(args: argparse.Namespace) -> bool:
    """True when ``--tokenizer-type`` selects a tokenizer for text records (not NullTokenizer)."""
    return args.tokenizer_type != "NullTokenizer"


def is_plain_chat(messages: Sequence[dict]) -> bool:
    """Whether every message has string fields only and no reasoning field (see ``render``)."""
    return all(
        all(isinstance(v, str) for v in m.values()) and not any(k in m for k in _REASONING_FIELDS)
        for m in messages
    )


def _file_digest(path: str, digest) -> None:
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


class TextTokenizer:
    """A Megatron text tokenizer (megatron.core.tokenizers) as the text loader uses it.

    The base class renders through megatron-core's ``apply_chat_template`` and tokenizes with its
    ``tokenize``; :class:`HuggingFaceText` uses the transformers tokenizer underneath directly.

    Args:
        megatron_tokenizer: what ``build_tokenizer`` returned.
        args: the parsed flags (for the fingerprint).

    Attributes:
        include_special_tokens: whether ``tokenize`` of plain text adds the tokenizer's special
            tokens (``--tokenizer-hf-no-include-special-tokens`` turns it off).
        chat_template, has_generation_markers, vocab_size, fingerprint: as named.
    """

    include_special_tokens = False

    def __init__(self, megatron_tokenizer, args: argparse.Namespace):
        self.megatron_tokenizer = megatron_tokenizer
        self.chat_template: Optional[str] = megatron_tokenizer.chat_template
        self.vocab_size = int(megatron_tokenizer.vocab_size)
        self.has_generation_markers = bool(
            self.chat_template and _GENERATION_MARKER.search(self.chat_template)
        )
        self.fingerprint = self._fingerprint(args)

    def _fingerprint(self, args: argparse.Namespace) -> str:
        digest = hashlib.sha256()
        for name in _TOKENIZER_FLAGS:
            digest.update(f"{name}={getattr(args, name, None)!r}\n".encode())
        paths = [getattr(args, "vocab_file", None), getattr(args, "merge_file", None)]
        model = getattr(args, "tokenizer_model", None)
        if model and os.path.isdir(model):
            paths += [
                os.path.join(model, name)
                for name in sorted(os.listdir(model))
                if os.path.isfile(os.path.join(model, name)) and not name.endswith(_WEIGHT_SUFFIXES)
            ]
        elif model:
            paths.append(model)
        for path in paths:
            if path and os.path.isfile(path):
                digest.update(f"file {os.path.basename(path)}\n".encode())
                _file_digest(path, digest)
        digest.update(f"chat_template={self.chat_template!r}\n".encode())
        digest.update(f"vocab_size={self.vocab_size}\n".encode())
        for package in ("transformers", "tokenizers", "sentencepiece", "tiktoken", "megatron-core"):
            digest.update(f"{package}=={_version(package)}\n".encode())
        return digest.hexdigest()

    @property
    def has_chat_template(self) -> bool:
        """Whether messages can be rendered (the tokenizer's template or ``--chat-template``)."""
        return bool(self.chat_template)

    def _template_variables(self) -> dict:
        """Variables the tokenizer's own apply_chat_template hands the template (none here)."""
        return {}

    def render(
        self, messages: Sequence[dict], add_generation_prompt: bool, plain: Optional[bool] = None
    ) -> str:
        """The chat template's text of ``messages``, as megatron-core's ``apply_chat_template``.

        ``plain`` (see :func:`is_plain_chat`) is used by subclasses that take a faster path for
        plain messages.
        """
        del plain
        return self.megatron_tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def generation_spans(self, messages: Sequence[dict]) -> tuple[str, list[tuple[int, int]]]:
        """Rendered text and the character span of each ``{% generation %}`` block, in order.

        The same rendering and spans as ``apply_chat_template(return_assistant_tokens_mask=True)``
        uses for its ``assistant_masks``.
        """
        from transformers.utils.chat_template_utils import render_jinja_template

        rendered, indices = render_jinja_template(
            conversations=[list(messages)],
            chat_template=self.chat_template,
            return_assistant_tokens_mask=True,
            add_generation_prompt=False,
            **self._template_variables(),
        )
        return rendered[0], [(int(start), int(end)) for start, end in indices[0]]

    def encode(
        self, texts: Sequence[str], special_tokens: bool
    ) -> list[tuple[np.ndarray, Optional[np.ndarray]]]:
        """Token ids and ``[n, 2]`` character offsets (start, end; None here) of each text.

        ``special_tokens=False`` is how a rendered chat is tokenized and how a completion continues
        a prompt; ``True`` adds what the tokenizer adds to plain text (Megatron's ``tokenize``).
        megatron-core's SentencePiece ``tokenize`` adds nothing either way.
        """
        del special_tokens
        return [
            (np.asarray(self.megatron_tokenizer.tokenize(text), dtype=np.int64), None)
            for text in texts
        ]

    def span_mask(
        self,
        text: str,
        ids: np.ndarray,
        offsets: Optional[np.ndarray],
        spans: Sequence[tuple[int, int]],
    ) -> np.ndarray:
        """True for the tokens of ``ids`` (the tokens of ``text``) that overlap a span.

        Without offsets, the tokens wholly before a character position ``c`` are the common
        prefix of ``ids`` and the tokens of ``text[:c]``; a token past that prefix straddles ``c``
        (the overlap rule of ``assistant_masks``, counted as inside the span on either side).
        """
        del offsets
        mask = np.zeros(len(ids), dtype=bool)

        def boundary(position: int, inclusive: bool) -> int:
            """Tokens wholly before ``position``, plus one straddling it when ``inclusive``."""
            if position >= len(text):
                return len(ids)
            prefix = self.megatron_tokenizer.tokenize(text[:position]) if position else []
            common = 0
            for a, b in zip(prefix, ids):
                if a != b:
                    break
                common += 1
            straddles = len(prefix) > common and common < len(ids)
            return common + int(inclusive and straddles)

        for start, end in spans:
            mask[boundary(start, False) : boundary(end, True)] = True
        return mask


class HuggingFaceText(TextTokenizer):
    """``HuggingFaceTokenizer``: rendering, batched encoding and offsets through transformers."""

    def __init__(self, megatron_tokenizer, args: argparse.Namespace):
        # megatron-core's text tokenizer keeps its library wrapper in ``_tokenizer``; the Hugging
        # Face wrapper exposes the transformers tokenizer as ``tokenizer``. Offsets and batched
        # encoding need the transformers object itself.
        wrapper = megatron_tokenizer._tokenizer  # pylint: disable=protected-access
        self.hf = wrapper.tokenizer
        if not getattr(self.hf, "is_fast", False):
            raise TokenizerError(
                f"--tokenizer-type {args.tokenizer_type}: text records need a fast (Rust) Hugging "
                "Face tokenizer for token offsets; drop --tokenizer-hf-no-use-fast or provide a "
                "tokenizer.json"
            )
        super().__init__(megatron_tokenizer, args)
        self.include_special_tokens = bool(wrapper.include_special_tokens)
        self._variables = self._template_variables()
        self._compiled = None
        if self.chat_template:
            # The template as apply_chat_template compiles it (transformers caches the result);
            # megatron-core's own chat-template helper compiles with the same function.
            from transformers.utils.chat_template_utils import _compile_jinja_template

            self._compiled = _compile_jinja_template(self.chat_template)
        # The Rust tokenizer that the transformers object calls, copied so that truncation or
        # padding saved in tokenizer.json cannot cut a text (transformers' __call__ turns both off
        # unless asked for them).
        from tokenizers import Tokenizer

        self._backend = Tokenizer.from_str(self.hf.backend_tokenizer.to_str())
        self._backend.no_truncation()
        self._backend.no_padding()

    def _template_variables(self) -> dict:
        # apply_chat_template passes the special tokens (bos_token, eos_token, ...) to the template.
        return dict(self.hf.special_tokens_map)

    def render(
        self, messages: Sequence[dict], add_generation_prompt: bool, plain: Optional[bool] = None
    ) -> str:
        """The chat template's text of ``messages``, as ``apply_chat_template(tokenize=False)``.

        Messages of string fields only (no reasoning fields, which transformers copies under
        several names) are what apply_chat_template hands its compiled template unchanged, so they
        are rendered with that template directly: transformers' per-call normalization costs more
        than the rendering. Anything else goes through apply_chat_template. ``plain`` (whether
        every message is such) may be given when the caller already knows it.
        """
        if plain is None:
            plain = is_plain_chat(messages)
        if plain:
            return self._compiled.render(
                messages=list(messages),
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self._variables,
            )
        return self.hf.apply_chat_template(
            list(messages),
            chat_template=self.chat_template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )

    def encode(
        self, texts: Sequence[str], special_tokens: bool
    ) -> list[tuple[np.ndarray, Optional[np.ndarray]]]:
        """Token ids and ``[n, 2]`` character offsets of each text, encoded as one batch.

        ``special_tokens=False`` is how ``apply_chat_template`` tokenizes a rendered chat (the
        template writes BOS and the like itself) and how a completion continues a prompt;
        ``True`` adds what the tokenizer adds to plain text (Megatron's ``tokenize``).
        """
        if not texts:
            return []
        encodings = self._backend.encode_batch(list(texts), add_special_tokens=special_tokens)
        return [
            (
                np.asarray(encoding.ids, dtype=np.int64),
                np.asarray(encoding.offsets, dtype=np.int64).reshape(len(encoding.ids), 2),
            )
            for encoding in encodings
        ]

    def span_mask(self, text, ids, offsets, spans) -> np.ndarray:
        """True for tokens whose characters overlap a span (the rule of ``assistant_masks``)."""
        mask = np.zeros(len(ids), dtype=bool)
        for start, end in spans:
            mask |= (offsets[:, 0] < end) & (offsets[:, 1] > start)
        return mask


def _check_tiktoken_vocab_size(args: argparse.Namespace) -> None:
    """megatron-core's TikToken needs ``--vocab-size`` = vocabulary entries + special tokens."""
    import json

    try:
        with open(args.tokenizer_model, encoding="utf-8") as handle:
            entries = len(json.load(handle))
    except (OSError, ValueError) as exc:
        raise TokenizerError(
            f"--tokenizer-model {args.tokenizer_model}: not a TikToken vocabulary ({exc})"
        ) from None
    expected = entries + args.tiktoken_num_special_tokens
    if args.vocab_size != expected:
        raise TokenizerError(
            f"--tokenizer-type TikTokenizer: --vocab-size must be {expected} ({entries} entries of "
            f"--tokenizer-model + --tiktoken-num-special-tokens {args.tiktoken_num_special_tokens})"
            f", got {args.vocab_size}"
        )


def tokenizer_arguments(tokenizer_model: str, **flags) -> argparse.Namespace:
    """The flags :func:`build_text_tokenizer` reads, for a caller outside pretrain_hybrid.py (a
    tool, a test): a HuggingFace tokenizer directory ``tokenizer_model`` with Megatron's defaults,
    one process, no tensor parallelism; ``flags`` override (e.g. ``tokenizer_type=``,
    ``chat_template=``)."""
    defaults = dict(
        tokenizer_type="HuggingFaceTokenizer",
        tokenizer_model=tokenizer_model,
        chat_template=None,
        vocab_file=None,
        merge_file=None,
        special_tokens=None,
        tokenizer_hf_no_use_fast=False,
        tokenizer_hf_no_include_special_tokens=False,
        trust_remote_code=False,
        metadata_path=None,
        pad_vocab_size=True,
        padded_vocab_size=None,
        make_vocab_size_divisible_by=128,
        tensor_model_parallel_size=1,
        rank=0,
    )
    return argparse.Namespace(**{**defaults, **flags})


def build_text_tokenizer(args: argparse.Namespace) -> TextTokenizer:
    """The tokenizer of ``--tokenizer-type`` (megatron-core's ``build_tokenizer``) for text records.

    Sets ``args.padded_vocab_size`` from the tokenizer's vocabulary, as megatron.training does.

    Raises:
        TokenizerError: naming the flag when the type is not supported for text records, a file is
            missing, or the tokenizer cannot be loaded.
    """
    kind = args.tokenizer_type
    if kind not in TEXT_TOKENIZER_TYPES:
        raise TokenizerError(
            f"--tokenizer-type {kind}: text records support {list(TEXT_TOKENIZER_TYPES)} (and "
            "NullTokenizer for token-id records only)"
        )
    model = args.tokenizer_model
    what = {
        "HuggingFaceTokenizer": "a local directory: tokenizer.json, tokenizer_config.json",
        "TikTokenizer": "megatron-core's TikToken vocabulary, a local .json file",
    }.get(kind, "a local SentencePiece .model file")
    if not model:
        placeholder = "DIR" if kind == "HuggingFaceTokenizer" else "FILE"
        raise TokenizerError(
            f"--tokenizer-type {kind} needs --tokenizer-model {placeholder} ({what})"
        )
    if not os.path.exists(model):
        raise TokenizerError(f"--tokenizer-model {model}: no such file or directory")
    for package in ["transformers"] + ([_PACKAGES[kind]] if kind in _PACKAGES else []):
        if importlib.util.find_spec(package) is None:
            raise TokenizerError(
                f"--tokenizer-type {kind} needs the {package} package: pip install "
                "'megatron-shared-prefix[text]'"
            )
    if kind == "TikTokenizer":
        _check_tiktoken_vocab_size(args)
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer

    try:
        megatron_tokenizer = build_tokenizer(args)
    except (ValueError, OSError, AssertionError, RuntimeError) as exc:
        raise TokenizerError(f"--tokenizer-type {kind}: cannot load the tokenizer: {exc}") from None
    if kind == "HuggingFaceTokenizer":
        return HuggingFaceText(megatron_tokenizer, args)
    return TextTokenizer(megatron_tokenizer, args)
