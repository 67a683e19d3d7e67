"""Text records through Megatron's tokenizers: tokens and masks equal the tokenizer's own
apply_chat_template, the snapshot-sharing check, the tokenized-data cache, errors, and packed ==
dense training on CPU. The tokenizer is a small BPE model trained on the fly (chat_tokenizer.py).
"""

import argparse
import io
import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from chat_tokenizer import (
    CHATML,
    CHATML_END_MARKER,
    CHATML_MARKED,
    CHATML_MARKED_HEADER,
    LAST_ONLY,
    PLAIN_BLANK_LINES,
    save_chat_tokenizer,
    save_sentencepiece_model,
    save_tiktoken_vocab,
)

from megatron.shared_prefix.training import text_data
from megatron.shared_prefix.training.config import ConfigError
from megatron.shared_prefix.training.data import DataError, load_jsonl_dataset
from megatron.shared_prefix.training.text_data import (
    TextDataConfig,
    cache_path,
    load_text_dataset,
    tokenize_file,
)
from megatron.shared_prefix.training.tokenizer import (
    TokenizerError,
    build_text_tokenizer,
    tokenizer_arguments,
)

SYSTEM = {"role": "system", "content": "you are a good help"}
TURNS = [
    ("what is the water like", "the water is hot"),
    ("and the sun", "the sun is warm and large"),
    ("why", "because of the light"),
]


def conversation(turns=3, tag=""):
    messages = [SYSTEM]
    for user, assistant in TURNS[:turns]:
        messages += [
            {"role": "user", "content": user + tag},
            {"role": "assistant", "content": assistant},
        ]
    return messages


def snapshots(tag=""):
    """Records of one conversation after each assistant turn (each extends the previous one)."""
    return [{"messages": conversation(n, tag)} for n in (1, 2, 3)]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """``tokenizers(template)`` -> a TextTokenizer of the test BPE model with that template."""
    built = {}

    def get(template):
        if template not in built:
            directory = str(tmp_path_factory.mktemp("tokenizer"))
            save_chat_tokenizer(directory, template)
            built[template] = build_text_tokenizer(tokenizer_flags(directory))
        return built[template]

    return get


def tokenizer_flags(directory):
    """The flags megatron-core's build_tokenizer reads, as pretrain_hybrid.py parses them."""
    return tokenizer_arguments(directory)


def tokenized(path, tokenizer, supervise="all-assistant"):
    config = TextDataConfig(tokenizer=tokenizer, supervise=supervise)
    progress = text_data.Progress(path, 0, stream=io.StringIO())
    return tokenize_file(path, config, progress)


def hf_chat(tokenizer, messages, **kwargs):
    return tokenizer.hf.apply_chat_template(
        messages, tokenize=True, return_dict=True, chat_template=tokenizer.chat_template, **kwargs
    )


@pytest.mark.parametrize("template", [CHATML_MARKED, CHATML_MARKED_HEADER])
def test_tokens_and_masks_equal_apply_chat_template(tokenizers, write_jsonl, template):
    tokenizer = tokenizers(template)
    path = write_jsonl([{"messages": conversation()}])
    expected = hf_chat(tokenizer, conversation(), return_assistant_tokens_mask=True)
    mask = np.asarray(expected["assistant_masks"], dtype=bool)
    (example,) = tokenized(path, tokenizer).examples
    assert example.tokens.tolist() == expected["input_ids"]
    assert example.loss_mask.tolist() == mask.tolist()
    assert 10 < example.num_targets < len(example) - 10
    # Last assistant only: the supervised tokens after the earlier messages.
    earlier = hf_chat(tokenizer, conversation()[:-1])["input_ids"]
    (last,) = tokenized(path, tokenizer, "last-assistant").examples
    assert last.tokens.tolist() == expected["input_ids"]
    assert last.loss_mask.tolist() == [m and j >= len(earlier) for j, m in enumerate(mask)]
    assert 0 < last.num_targets < example.num_targets
    # The role header is a target exactly when the template's generation block holds it.
    header = tokenizer.hf.convert_tokens_to_ids("<|im_start|>")
    header_targets = example.loss_mask[example.tokens == header]
    assert header_targets.sum() == (3 if template == CHATML_MARKED_HEADER else 0)


def test_render_equals_apply_chat_template(tokenizers):
    tokenizer = tokenizers(CHATML_END_MARKER)
    plain = conversation()
    rich = plain[:-1] + [dict(plain[-1], reasoning_content="think", tool_calls=[{"id": "1"}])]
    for messages in (plain, rich):
        for generation_prompt in (False, True):
            expected = tokenizer.hf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt
            )
            assert tokenizer.render(messages, generation_prompt) == expected
    assert tokenizer.render(plain, False).endswith("</s>")


@pytest.mark.parametrize("supervise", ["all-assistant", "last-assistant"])
def test_spans_without_generation_markers_come_from_the_generation_prompt(
    tokenizers, write_jsonl, supervise
):
    path = write_jsonl([{"messages": conversation()}])
    (marked,) = tokenized(path, tokenizers(CHATML_MARKED), supervise).examples
    (found,) = tokenized(path, tokenizers(CHATML), supervise).examples
    assert found.tokens.tolist() == marked.tokens.tolist()
    assert found.loss_mask.tolist() == marked.loss_mask.tolist()
    assert found.num_targets == marked.num_targets > 0


def test_rl_text_group(tokenizers, write_jsonl):
    tokenizer = tokenizers(CHATML)
    prompt = conversation(1)[:-1]
    completions = ["the water is hot<|im_end|>", "it is cold"]
    ids = [tokenizer.hf(text, add_special_tokens=False)["input_ids"] for text in completions]
    record = {
        "prompt": prompt,
        "completions": [
            {"text": completions[0], "weight": -0.5},
            {"text": completions[1], "advantages": [0.25 * (t + 1) for t in range(len(ids[1]))]},
        ],
    }
    path = write_jsonl([record, {"prompt": "the sun", "completions": [{"text": " is warm"}]}])
    first, second, plain = tokenized(path, tokenizer).examples
    prompt_ids = hf_chat(tokenizer, prompt, add_generation_prompt=True)["input_ids"]
    for example, completion in zip((first, second), ids):
        assert example.tokens.tolist() == prompt_ids + completion
        assert example.loss_mask.tolist() == [False] * len(prompt_ids) + [True] * len(completion)
    assert first.target_weights[len(prompt_ids) :].tolist() == [-0.5] * len(ids[0])
    assert second.target_weights[len(prompt_ids) :].tolist() == pytest.approx(
        [0.25 * (t + 1) for t in range(len(ids[1]))]
    )
    assert first.source.endswith(":1 completions[0]") and plain.source.endswith(":2 completions[0]")
    assert (
        plain.tokens.tolist()
        == tokenizer.megatron_tokenizer.tokenize("the sun")
        + tokenizer.hf(" is warm", add_special_tokens=False)["input_ids"]
    )


@pytest.mark.parametrize(
    "template, shared, cause",
    [
        (CHATML, 2, None),
        (PLAIN_BLANK_LINES, 0, "a BPE merge across the turn boundary"),
        (CHATML_END_MARKER, 0, "ends the conversation differently"),
        (LAST_ONLY, 0, "re-renders earlier turns"),
    ],
)
def test_snapshot_sharing_is_checked(tokenizers, write_jsonl, template, shared, cause):
    path = write_jsonl(snapshots() + [{"messages": conversation(2, " again")}])
    report = tokenized(path, tokenizers(template)).sharing
    assert report.snapshots == 2 and report.shared == shared
    assert report.num_broken == 2 - shared
    if cause:
        assert report.broken[0].startswith(f"{path}:2: ") and cause in report.broken[0]
        assert f"{2 - shared} do not" in report.summary()


def test_sharing_report_is_kept_in_the_cache(tokenizers, write_jsonl):
    path = write_jsonl(snapshots())
    first, _ = load([path], tokenizers(PLAIN_BLANK_LINES))
    again, _ = load([path], tokenizers(PLAIN_BLANK_LINES))
    assert "2 do not" in first.notes[0] and f"{path}:2: " in first.notes[0]
    assert again.notes[1] == first.notes[0]


def test_a_conversation_may_open_with_an_assistant_message(tokenizers, write_jsonl):
    greeting = [{"role": "assistant", "content": "how can I help"}] + conversation(1)[1:]
    path = write_jsonl([{"messages": greeting}])
    (last,) = tokenized(path, tokenizers(CHATML), "last-assistant").examples
    (marked,) = tokenized(path, tokenizers(CHATML_MARKED)).examples
    expected = hf_chat(tokenizers(CHATML_MARKED), greeting, return_assistant_tokens_mask=True)
    assert marked.loss_mask.tolist() == [bool(m) for m in expected["assistant_masks"]]
    assert 0 < last.num_targets < marked.num_targets
    with pytest.raises(DataError, match="the first token is supervised"):
        tokenized(path, tokenizers(CHATML_MARKED_HEADER))


def test_turns_records_supervise_only_the_last_assistant_turn(tokenizers, write_jsonl):
    turns = [
        {"role": "user", "input_ids": [5, 6]},
        {"role": "assistant", "input_ids": [7, 8]},
        {"role": "user", "input_ids": [9]},
        {"role": "assistant", "input_ids": [10, 11, 12]},
    ]
    path = write_jsonl([{"turns": turns}])
    (every,) = tokenized(path, tokenizers(CHATML)).examples
    (last,) = tokenized(path, tokenizers(CHATML), "last-assistant").examples
    assert every.loss_mask.tolist() == [0, 0, 1, 1, 0, 1, 1, 1]
    assert last.loss_mask.tolist() == [0, 0, 0, 0, 0, 1, 1, 1]


def load(paths, tokenizer, capacity=256, **kwargs):
    lines = []
    config = TextDataConfig(tokenizer=tokenizer, **kwargs)
    dataset = load_text_dataset(
        paths, config, capacity=capacity, drop_overlong=False, log=lines.append
    )
    return dataset, lines


def test_cache_is_written_once_and_reused(tokenizers, write_jsonl, tmp_path, capfd):
    tokenizer = tokenizers(CHATML)
    path = write_jsonl(snapshots() * 3)
    first, lines = load([path], tokenizer, sample_examples=9)
    assert any("tokenized" in line and "cached as" in line for line in lines)
    assert "examples/s" in capfd.readouterr().err  # the progress line
    final = cache_path(path, TextDataConfig(tokenizer=tokenizer))
    assert os.listdir(os.path.dirname(final)) == [os.path.basename(final)]  # no temporary left
    again, lines = load([path], tokenizer, sample_examples=9)
    assert not lines and "from the cache" in again.notes[0]
    assert [e.tokens.tolist() for e in again.examples] == [
        e.tokens.tolist() for e in first.examples
    ]
    assert [e.loss_mask.tolist() for e in again.examples] == [
        e.loss_mask.tolist() for e in first.examples
    ]
    assert [e.source for e in again.examples] == [e.source for e in first.examples]
    assert again.notes[1:] == first.notes
    assert "6 share its tokens" in first.notes[0]
    saving = first.notes[1]
    assert "first 9 examples" in saving and float(saving.split("= ")[1].split("x")[0]) > 1.5
    # Another supervision flag or other file content is another cache entry.
    other = TextDataConfig(tokenizer=tokenizer, supervise="last-assistant")
    assert cache_path(path, other) != final
    with open(path, "a") as handle:
        handle.write(json.dumps({"messages": conversation(1)}) + "\n")
    assert cache_path(path, TextDataConfig(tokenizer=tokenizer)) != final
    _, lines = load([path], tokenizer, cache_dir=str(tmp_path / "elsewhere"))
    assert any(str(tmp_path / "elsewhere") in line for line in lines)


def test_other_ranks_wait_for_rank_zero(tokenizers, write_jsonl):
    tokenizer = tokenizers(CHATML)
    path = write_jsonl(snapshots())
    result = {}

    def rank_one():
        result["dataset"], result["lines"] = load([path], tokenizer, rank=1, world_size=2)

    waiting = threading.Thread(target=rank_one)
    waiting.start()
    time.sleep(0.6)
    assert waiting.is_alive()  # nothing to read until rank 0 writes the cache
    dataset, _ = load([path], tokenizer, rank=0, world_size=2)
    waiting.join(timeout=30)
    assert not waiting.is_alive() and result["lines"] == []
    assert [e.tokens.tolist() for e in result["dataset"].examples] == [
        e.tokens.tolist() for e in dataset.examples
    ]


def test_other_ranks_get_rank_zeros_data_error(tokenizers, write_jsonl):
    tokenizer = tokenizers(CHATML)
    path = write_jsonl(snapshots() + [{"messages": [{"role": "user", "content": "hi"}]}])
    errors = []

    def rank_one():
        try:
            load([path], tokenizer, rank=1, world_size=2)
        except DataError as error:
            errors.append(str(error))

    waiting = threading.Thread(target=rank_one)
    waiting.start()
    with pytest.raises(
        DataError, match=r"data.jsonl:4: messages has no assistant message"
    ) as error:
        load([path], tokenizer, rank=0, world_size=2)
    waiting.join(timeout=30)
    assert errors == [str(error.value)]
    assert not os.path.exists(cache_path(path, TextDataConfig(tokenizer=tokenizer)))


@pytest.mark.parametrize(
    "record, message",
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, "messages has no assistant message"),
        (
            {"messages": [{"role": "assistant", "content": "hi"}]},
            "messages[0] is a supervised assistant message",
        ),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content must be a string"),
        (
            {"messages": conversation(1), "input_ids": [1, 2]},
            "exactly one of 'messages' (SFT chat)",
        ),
        (
            {"prompt": "the sun", "completions": [{"text": "is warm", "advantages": [1.0]}]},
            "completions[0].advantages has 1 values, but completions[0].text is 3 tokens",
        ),
        ({"prompt": "the sun", "completions": [{"txt": "is"}]}, "unknown key(s) ['txt']"),
        ({"input_ids": [1, 2, 700]}, "input_ids has token id 700 outside [0, 600)"),
    ],
)
def test_bad_text_records_name_file_and_line(tokenizers, write_jsonl, record, message):
    path = write_jsonl([{"messages": conversation(1)}, record])
    with pytest.raises(DataError) as error:
        tokenized(path, tokenizers(CHATML))
    assert str(error.value).startswith(f"{path}:2: ") and message in str(error.value)


def test_chat_records_need_a_chat_template(tokenizers, write_jsonl):
    path = write_jsonl([{"messages": conversation(1)}])
    with pytest.raises(DataError, match="data.jsonl:1: chat records need a chat template"):
        tokenized(path, tokenizers(""))


def test_chat_template_flag_replaces_the_tokenizers_template(tmp_path):
    directory = save_chat_tokenizer(str(tmp_path / "tokenizer"), CHATML)
    flags = tokenizer_flags(directory)
    flags.chat_template = CHATML_MARKED
    tokenizer = build_text_tokenizer(flags)
    assert tokenizer.chat_template == CHATML_MARKED and tokenizer.has_generation_markers
    assert build_text_tokenizer(tokenizer_flags(directory)).fingerprint != tokenizer.fingerprint


def test_plain_prompts_need_no_chat_template(tokenizers, write_jsonl):
    path = write_jsonl([{"prompt": "the sun", "completions": [{"text": " is warm"}]}])
    (example,) = tokenized(path, tokenizers("")).examples
    assert example.num_targets == len(
        tokenizers("").hf(" is warm", add_special_tokens=False)["input_ids"]
    )


def test_capacity_rule_applies_after_tokenization(tokenizers, write_jsonl):
    path = write_jsonl(snapshots())
    with pytest.raises(
        DataError, match=r"data.jsonl:1: sequence of \d+ tokens is longer than the row"
    ):
        load([path], tokenizers(CHATML), capacity=8)


def test_the_text_examples_load(tokenizers):
    repo = str(
        next(p for p in Path(__file__).resolve().parents if (p / "tests" / "unit_tests").is_dir())
    )
    chats = tokenized(os.path.join(repo, "examples", "chat_text.jsonl"), tokenizers(CHATML))
    assert len(chats.examples) == 9 and chats.sharing.shared == chats.sharing.snapshots == 6
    groups = tokenized(os.path.join(repo, "examples", "rl_text.jsonl"), tokenizers(CHATML))
    assert len(groups.examples) == 10 and groups.num_records == 3


def test_text_records_without_a_tokenizer_name_the_flag(write_jsonl):
    path = write_jsonl([{"messages": conversation(1)}])
    with pytest.raises(DataError, match="data.jsonl:1: text records .* need a tokenizer"):
        load_jsonl_dataset([path], vocab_size=64, capacity=64, drop_overlong=False)


def test_progress_reports_examples_per_second():
    stream = io.StringIO()
    progress = text_data.Progress("data.jsonl", 10, stream=stream, interval=0.0)
    progress.update(5, 15, 300)
    progress.finish(10, 30, 600)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2 and "5/10 records (50%)" in lines[0] and "examples/s" in lines[1]


@pytest.fixture(scope="module")
def chat_tokenizer_dir(tmp_path_factory):
    return save_chat_tokenizer(str(tmp_path_factory.mktemp("chatml")), CHATML)


@pytest.mark.parametrize("supervise", ["all-assistant", "last-assistant"])
def test_text_sft_trains_packed_as_dense(train, write_jsonl, chat_tokenizer_dir, supervise):
    path = write_jsonl(snapshots() + snapshots(" please") + snapshots(" now"))
    flags = (
        "--data-path",
        path,
        "--tokenizer-type",
        "HuggingFaceTokenizer",
        "--tokenizer-model",
        chat_tokenizer_dir,
        "--shared-prefix-supervise",
        supervise,
        "--train-iters",
        "1",
        "--global-batch-size",
        "9",
    )
    (packed,), lines = train(*flags)
    (dense,), _ = train(*flags, "--no-shared-prefix-packing")
    assert packed.logical_tokens == dense.logical_tokens > 1.5 * packed.executed_tokens
    assert packed.loss_tokens == dense.loss_tokens
    assert abs(packed.loss - dense.loss) <= 1e-5 * abs(dense.loss)
    assert abs(packed.grad_norm - dense.grad_norm) <= 1e-4 * dense.grad_norm
    assert any("6 share its tokens as a prefix" in line for line in lines)
    assert any("token saving of the first 9 examples" in line for line in lines)


def test_text_rl_trains_packed_as_dense(train, write_jsonl, chat_tokenizer_dir):
    from transformers import AutoTokenizer

    # One advantage per token of the completion text as the tokenizer encodes it on its own.
    encoded = AutoTokenizer.from_pretrained(chat_tokenizer_dir)(
        "the water", add_special_tokens=False
    )
    advantages = [1.0 / (t + 1) for t in range(len(encoded["input_ids"]))]
    groups = [
        {
            "prompt": [{"role": "user", "content": f"say {word} and the water"}],
            "completions": [
                {"text": f"{word} and the water<|im_end|>", "weight": 1.0},
                {"text": f"{word} or the sun<|im_end|>", "weight": -0.5},
                {"text": "the water", "advantages": advantages},
            ],
        }
        for word in ("hot", "cold", "warm")
    ]
    flags = (
        "--data-path",
        write_jsonl(groups),
        "--tokenizer-type",
        "HuggingFaceTokenizer",
        "--tokenizer-model",
        chat_tokenizer_dir,
        "--hybrid-layer-pattern",
        "M*-E",
        "--train-iters",
        "1",
        "--global-batch-size",
        "9",
    )
    (packed,), _ = train(*flags)
    (dense,), _ = train(*flags, "--no-shared-prefix-packing")
    assert packed.logical_tokens == dense.logical_tokens > 2 * packed.executed_tokens
    assert abs(packed.loss - dense.loss) <= 1e-5 * abs(dense.loss)
    assert abs(packed.grad_norm - dense.grad_norm) <= 1e-4 * dense.grad_norm


def test_the_tiny_preset_leaves_the_vocabulary_to_a_text_tokenizer():
    from megatron.shared_prefix.training.arguments import extra_args_provider

    for argv, vocab_size in (([], 64), (["--tokenizer-type", "HuggingFaceTokenizer"], None)):
        parser = extra_args_provider(argv)(argparse.ArgumentParser())
        assert parser.get_default("vocab_size") == vocab_size
        assert parser.get_default("hidden_size") == 128


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="the CPU loop's gloo runs (CUDA: megatron.training)"
)
def test_two_processes_tokenize_once(tmp_path, write_jsonl, chat_tokenizer_dir):
    """Under torchrun, rank 0 tokenizes and writes the cache, rank 1 waits for it and reads it."""
    import subprocess
    import sys

    root = str(
        next(p for p in Path(__file__).resolve().parents if (p / "tests" / "unit_tests").is_dir())
    )
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_COMPILE_DISABLE="1", PYTHONWARNINGS="ignore")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        os.path.join(root, "pretrain_hybrid.py"),
        "--data-path",
        write_jsonl(snapshots() + snapshots(" please")),
        "--tokenizer-type",
        "HuggingFaceTokenizer",
        "--tokenizer-model",
        chat_tokenizer_dir,
        "--data-cache-path",
        str(tmp_path / "cache"),
        "--hybrid-layer-pattern",
        "*-E",
        "--train-iters",
        "1",
        "--global-batch-size",
        "6",
        "--lr-warmup-iters",
        "0",
        "--shared-prefix-metrics-jsonl",
        str(tmp_path / "metrics.jsonl"),
    ]
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stderr.count("records (100%)") == 1  # one progress line: rank 0's
    assert os.listdir(tmp_path / "cache" / "shared_prefix_text")[0].endswith(".tokens.npz")
    assert len(os.listdir(tmp_path / "cache" / "shared_prefix_text")) == 1
    (record,) = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert record["logical_tokens"] > record["executed_tokens"] > 0


@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory):
    return save_sentencepiece_model(str(tmp_path_factory.mktemp("sentencepiece") / "sp.model"))


def sentencepiece_tokenizer(model, template):
    flags = tokenizer_flags(model)
    flags.tokenizer_type = "SentencePieceTokenizer"
    flags.chat_template = template
    flags.tokenizer_sentencepiece_legacy = False
    flags.tokenizer_sentencepiece_ignore_extra_whitespaces = True
    return build_text_tokenizer(flags)


@pytest.mark.parametrize("supervise", ["all-assistant", "last-assistant"])
def test_sentencepiece_chats(sentencepiece_model, write_jsonl, supervise):
    marked = sentencepiece_tokenizer(sentencepiece_model, CHATML_MARKED)
    path = write_jsonl([{"messages": conversation()}])
    (example,) = tokenized(path, marked, supervise).examples
    (unmarked,) = tokenized(
        path, sentencepiece_tokenizer(sentencepiece_model, CHATML), supervise
    ).examples
    # Tokens as megatron-core's own apply_chat_template gives them; both span methods agree.
    assert example.tokens.tolist() == marked.megatron_tokenizer.apply_chat_template(
        conversation(), tokenize=True
    )
    assert unmarked.tokens.tolist() == example.tokens.tolist()
    assert unmarked.loss_mask.tolist() == example.loss_mask.tolist()
    # Each supervised run decodes to an assistant message and its end of turn.
    edges = np.flatnonzero(np.diff(np.concatenate([[0], example.loss_mask.astype(int), [0]])))
    runs = [
        marked.megatron_tokenizer.detokenize(example.tokens[a:b].tolist())
        for a, b in zip(edges[::2], edges[1::2])
    ]
    answers = [assistant for _, assistant in TURNS]
    expected = answers if supervise == "all-assistant" else answers[-1:]
    assert [run.replace("<|im_end|>", "").strip() for run in runs] == expected


TIKTOKEN_SPECIALS = ["<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>"]
TIKTOKEN_SPECIALS += ["<|im_start|>", "<|im_end|>"]


def tiktoken_tokenizer(tmp_path, template, vocab_size=None):
    directory = save_chat_tokenizer(str(tmp_path / "bpe"), template)
    entries = save_tiktoken_vocab(str(tmp_path / "tiktoken.json"), directory)
    flags = tokenizer_flags(str(tmp_path / "tiktoken.json"))
    flags.tokenizer_type = "TikTokenizer"
    flags.chat_template = template
    flags.special_tokens = TIKTOKEN_SPECIALS
    flags.tiktoken_pattern = "v2"
    flags.tiktoken_num_special_tokens = 16
    flags.vocab_size = vocab_size or entries + 16
    return build_text_tokenizer(flags)


@pytest.mark.parametrize("template", [CHATML, CHATML_MARKED_HEADER])
def test_tiktoken_chats_match_the_offset_rule(tmp_path, write_jsonl, template):
    tokenizer = tiktoken_tokenizer(tmp_path, template)
    path = write_jsonl([{"messages": conversation()}])
    (example,) = tokenized(path, tokenizer).examples
    megatron = tokenizer.megatron_tokenizer
    assert example.tokens.tolist() == megatron.apply_chat_template(conversation(), tokenize=True)
    # TikToken is lossless, so its own offsets are exact: the prefix-tokenization rule must mark
    # the tokens that overlap the assistant spans.
    text = megatron.apply_chat_template(conversation(), tokenize=False)
    starts = megatron.offsets(example.tokens.tolist(), text)
    ends = starts[1:] + [len(text)]
    spans = [(text.index(a), text.index(a) + len(a) + len("<|im_end|>\n")) for _, a in TURNS]
    if template == CHATML_MARKED_HEADER:
        header = len("<|im_start|>assistant\n")
        spans = [(start - header, end) for start, end in spans]
    expected = [
        any(start < span_end and end > span_start for span_start, span_end in spans)
        for start, end in zip(starts, ends)
    ]
    assert example.loss_mask.tolist() == expected and example.num_targets > 10


def test_tiktoken_needs_its_vocabulary_size(tmp_path):
    with pytest.raises(TokenizerError, match=r"--vocab-size must be \d+ \(\d+ entries"):
        tiktoken_tokenizer(tmp_path, CHATML, vocab_size=100)


def test_sentencepiece_sft_trains_packed_as_dense(train, write_jsonl, sentencepiece_model):
    flags = (
        "--data-path",
        write_jsonl(snapshots() + snapshots(" please")),
        "--tokenizer-type",
        "SentencePieceTokenizer",
        "--tokenizer-model",
        sentencepiece_model,
        "--chat-template",
        CHATML,
        "--hybrid-layer-pattern",
        "*-E",
        "--train-iters",
        "1",
        "--global-batch-size",
        "6",
    )
    (packed,), lines = train(*flags)
    (dense,), _ = train(*flags, "--no-shared-prefix-packing")
    assert packed.logical_tokens == dense.logical_tokens > 1.5 * packed.executed_tokens
    assert abs(packed.loss - dense.loss) <= 1e-5 * abs(dense.loss)
    assert any("4 share its tokens as a prefix" in line for line in lines)


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ("--shared-prefix-supervise", "last-assistant"),
            "--shared-prefix-supervise last-assistant: applies to records read with a text",
        ),
        (("--tokenizer-type", "HuggingFaceTokenizer"), "needs --tokenizer-model DIR"),
        (
            ("--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "/nonexistent"),
            "--tokenizer-model /nonexistent: no such file or directory",
        ),
        (("--tokenizer-type", "BertWordPieceCase"), "--tokenizer-type BertWordPieceCase: text"),
    ],
)
def test_tokenizer_flags_are_named(train, flags, message):
    with pytest.raises(ConfigError) as error:
        train(*flags)
    assert message in str(error.value)
