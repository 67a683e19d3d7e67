"""Small tokenizers with chat templates, trained on the fly (no download).

``save_chat_tokenizer(directory, template)`` trains a BPE model with the ``tokenizers`` package on a
fixed English corpus, wraps it in transformers' ``PreTrainedTokenizerFast`` with the chat template
and saves it, so that ``--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR`` loads it as it
would load any Hugging Face tokenizer directory. ``save_sentencepiece_model(path)`` trains a
SentencePiece BPE model on the same corpus, for ``--tokenizer-type SentencePieceTokenizer
--tokenizer-model FILE --chat-template ...``; ``save_tiktoken_vocab(path, directory)`` writes the
BPE model of a saved tokenizer directory as megatron-core's TikToken vocabulary file (a JSON list
of ``{rank, token_bytes, token_str}``, the 256 single bytes first, then one token per merge). Used
by the text-data tests and tools/bench_text_loader.py.
"""

from __future__ import annotations

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]

# ChatML; the role header is not part of the assistant span, and nothing marks it: the loader finds
# the span from the generation prompt.
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# The same rendering, with generation markers around the assistant content and its end of turn.
CHATML_MARKED = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>\n"
    "{% endgeneration %}{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Generation markers that include the role header in the assistant span.
CHATML_MARKED_HEADER = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}"
    "{% generation %}<|im_start|>assistant\n{{ m['content'] }}<|im_end|>\n{% endgeneration %}"
    "{% else %}<|im_start|>{{ m['role'] }}\n"
    "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Plain-text turns ending in a blank line, after a BOS token. The byte-level pre-tokenizer keeps a
# trailing "\n\n" as one piece (one BPE token) but splits "\n\n" before the next turn's text, so a
# later snapshot does not start with the earlier snapshot's tokens.
PLAIN_BLANK_LINES = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
)

# ChatML that writes an end-of-conversation token after the last turn.
CHATML_END_MARKER = CHATML + "{% if not add_generation_prompt %}</s>{% endif %}"

# Re-renders history: only the last assistant message keeps its content, earlier ones become "...".
LAST_ONLY = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and not loop.last %}...{% else %}{{ m['content'] }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_WORDS = (
    "the a an of to and in is it you that he was for on are with as his they be at one have "
    "this from or had by hot word but what some we can out other were all there when up use "
    "your how said each she which do their time if will way about many then them write would "
    "like so these her long make thing see him two has look more day could go come did number "
    "sound no most people my over know water than call first who may down side been now find "
    "any new work part take get place made live where after back little only round man year "
    "came show every good me give our under name very through just form sentence great think "
    "say help low line differ turn cause much mean before move right boy old too same tell "
    "does set three want air well also play small end put home read hand port large spell add "
    "even land here must big high such follow act why ask men change went light kind off need "
    "house picture try us again animal point mother world near build self earth father head "
    "stand own page should country found answer school grow study still learn plant cover "
    "food sun four between state keep eye never last let thought city tree cross farm hard "
    "start might story saw far sea draw left late run while press close night real life few "
    "north open seem together next white children begin got walk example ease paper group "
    "always music those both mark often letter until mile river car feet care second book "
    "carry took science eat room friend began idea fish mountain stop once base hear horse "
    "cut sure watch color face wood main enough plain girl usual young ready above ever red "
    "list though feel talk bird soon body dog family direct pose leave song measure door "
    "product black short numeral class wind question happen complete ship area half rock "
    "order fire south problem piece told knew pass since top whole king space heard best hour "
    "better true during hundred five remember step early hold west ground interest reach fast "
    "verb sing listen six table travel less morning ten simple several vowel toward war lay "
    "against pattern slow center love person money serve appear road map rain rule govern "
    "pull cold notice voice unit power town fine certain fly fall lead cry dark machine note "
    "wait plan figure star box noun field rest correct able pound done beauty drive stood "
    "contain front teach week final gave green oh quick develop ocean warm free minute strong "
    "special mind behind clear tail produce fact street inch multiply nothing course stay "
    "wheel full force blue object decide surface deep moon island foot system busy test "
    "record boat common gold possible plane stead dry wonder laugh thousand ago ran check "
    "game shape equate"
).split()


def corpus_words() -> list[str]:
    """The vocabulary of the training corpus (also used to generate conversations)."""
    return list(_WORDS)


def _corpus() -> list[str]:
    lines = []
    for i in range(0, len(_WORDS), 7):
        chunk = " ".join(_WORDS[i : i + 12])
        lines += [
            chunk,
            chunk.capitalize() + ".",
            f"user: {chunk}?\n\n",
            f"assistant: {chunk}!\n\n",
        ]
    return lines * 3


def save_chat_tokenizer(directory: str, template: str = CHATML, vocab_size: int = 600) -> str:
    """Train a byte-level BPE tokenizer, save it with ``template`` to ``directory``; return it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    wrapped.chat_template = template
    wrapped.save_pretrained(directory)
    return directory


def save_sentencepiece_model(path: str, vocab_size: int = 400) -> str:
    """Train a SentencePiece BPE model (ChatML markers as single pieces), save it to ``path``."""
    import io

    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(_corpus()),
        model_writer=model,
        vocab_size=vocab_size,
        user_defined_symbols=["<|im_start|>", "<|im_end|>"],
        model_type="bpe",
        minloglevel=2,
    )
    with open(path, "wb") as handle:
        handle.write(model.getvalue())
    return path


def _byte_of_char() -> dict[str, int]:
    """The byte each character of a byte-level BPE vocabulary stands for (GPT-2's mapping:
    printable Latin-1 bytes are their own character, the others are shifted past 255)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    mapping, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            mapping[chr(byte)] = byte
        else:
            mapping[chr(256 + shifted)] = byte
            shifted += 1
    return mapping


def save_tiktoken_vocab(path: str, directory: str) -> int:
    """Write the byte-level BPE of ``directory`` as a TikToken vocabulary; returns its size."""
    import base64
    import json

    with open(f"{directory}/tokenizer.json", encoding="utf-8") as handle:
        merges = json.load(handle)["model"]["merges"]
    byte_of = _byte_of_char()
    tokens = [bytes([b]) for b in range(256)]
    for merge in merges:
        left, right = merge.split(" ") if isinstance(merge, str) else merge
        tokens.append(bytes(byte_of[c] for c in left + right))
    vocab = [
        {
            "rank": rank,
            "token_bytes": base64.b64encode(token).decode(),
            "token_str": token.decode("utf-8", errors="replace"),
        }
        for rank, token in enumerate(tokens)
    ]
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(vocab, handle)
    return len(vocab)
