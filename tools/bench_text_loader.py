"""Throughput of the text loader: tokenizing a generated chat file, and reading it from the cache.

Generates ``--conversations`` chat records (a system prompt, then 1-4 user/assistant turns of random
words), tokenizes the file with ``load_text_dataset`` as pretrain_hybrid.py does (chat template,
assistant spans, snapshot check, cache write), then loads it again from the cache. Prints a
markdown table of records/s, examples/s and tokens/s.

The tokenizer is ``--tokenizer-model DIR`` (a Hugging Face tokenizer directory with a chat
template) or, by default, the small BPE tokenizer of the tests trained on the fly
(tests/unit_tests/chat_tokenizer.py) with a ChatML template, without generation markers (spans from
the generation prompt) or with them (``--marked``).

Usage:
    PYTHONPATH=. python tools/bench_text_loader.py [--conversations 100000] [--marked] \
        [--supervise last-assistant] [--tokenizer-model DIR] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402

_TESTS = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "unit_tests"
)


def write_conversations(path: str, count: int, words: list[str], seed: int = 0) -> int:
    """``count`` chat records of random words; returns the file size in bytes."""
    rng = np.random.default_rng(seed)

    def sentence(low, high):
        return " ".join(words[i] for i in rng.integers(0, len(words), int(rng.integers(low, high))))

    with open(path, "w", encoding="utf-8") as handle:
        for _ in range(count):
            messages = [{"role": "system", "content": "you are a good help"}]
            for _ in range(int(rng.integers(1, 5))):
                messages.append({"role": "user", "content": sentence(4, 20) + "?"})
                messages.append({"role": "assistant", "content": sentence(8, 40) + "."})
            handle.write(json.dumps({"messages": messages}) + "\n")
    return os.path.getsize(path)


def main() -> None:
    """Generate the file, load it twice, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
    parser.add_argument("--conversations", type=int, default=100_000)
    parser.add_argument("--marked", action="store_true", help="template with generation markers")
    parser.add_argument("--supervise", default="all-assistant")
    parser.add_argument("--tokenizer-model", default=None)
    parser.add_argument("--workdir", default=None, help="default: a temporary directory")
    options = parser.parse_args()

    sys.path.insert(0, _TESTS)
    from chat_tokenizer import CHATML, CHATML_MARKED, corpus_words, save_chat_tokenizer

    from megatron.shared_prefix.training.text_data import TextDataConfig, load_text_dataset
    from megatron.shared_prefix.training.tokenizer import build_text_tokenizer, tokenizer_arguments

    workdir = options.workdir or tempfile.mkdtemp(prefix="bench_text_loader_")
    directory = options.tokenizer_model or save_chat_tokenizer(
        os.path.join(workdir, "tokenizer"), CHATML_MARKED if options.marked else CHATML
    )
    tokenizer = build_text_tokenizer(tokenizer_arguments(directory))
    path = os.path.join(workdir, "conversations.jsonl")
    size = write_conversations(path, options.conversations, corpus_words())
    config = TextDataConfig(
        tokenizer=tokenizer, supervise=options.supervise, cache_dir=os.path.join(workdir, "cache")
    )
    rows = []
    for label in ("tokenize + write cache", "read cache"):
        start = time.perf_counter()
        dataset = load_text_dataset(
            [path], config, capacity=1 << 20, drop_overlong=False, log=lambda _: None
        )
        seconds = time.perf_counter() - start
        rows.append(
            f"| {label} | {seconds:.2f} | {dataset.num_records / seconds:,.0f} | "
            f"{len(dataset.examples) / seconds:,.0f} | {dataset.num_tokens / seconds:,.0f} |"
        )
    print(
        f"\n{options.conversations} conversations ({size / 1e6:.1f} MB, "
        f"{dataset.num_tokens:,} tokens, {dataset.num_targets:,} supervised), template "
        f"{'with' if tokenizer.has_generation_markers else 'without'} generation markers, "
        f"--shared-prefix-supervise {options.supervise}\n"
    )
    print("| pass | seconds | records/s | examples/s | tokens/s |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
