"""Command line of pretrain_hybrid.py: Megatron's own arguments plus a ``--shared-prefix-*`` group.

Both trainers (megatron.training on CUDA, the single-process loop elsewhere) read the same
namespace, parsed by Megatron's parser with :func:`add_shared_prefix_args` as its
``extra_args_provider``.

Defaults come in two layers, both applied with ``parser.set_defaults`` so that any flag given on the
command line wins:

* :data:`SCRIPT_DEFAULTS` always: settings a forest requires (dropout 0) or this script's data path
  relies on (pre-tokenized data, per-token loss reduction, external data iterator);
* :data:`TINY_MODEL_PRESET` only when no model-size flag (:data:`MODEL_SHAPE_FLAGS`) is given: the
  built-in tiny model, batch and schedule, so that ``python pretrain_hybrid.py`` trains out of the
  box (``--hybrid-layer-pattern`` alone keeps the tiny sizes with another layer mix;
  ``--mtp-num-layers N`` alone gives it N MTP depths of :data:`DEFAULT_MTP_LAYER_PATTERN`). Give any
  model-size flag and you configure a real model with Megatron's usual defaults and requirements.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import os
from typing import Optional, Sequence

__all__ = [
    "DEFAULT_LAYER_PATTERN",
    "DEFAULT_MTP_LAYER_PATTERN",
    "SCRIPT_DEFAULTS",
    "TINY_MODEL_PRESET",
    "MODEL_SHAPE_FLAGS",
    "TRAINERS",
    "add_shared_prefix_args",
    "extra_args_provider",
    "uses_tiny_model",
    "parse_arguments",
    "megatron_argument_dump",
    "parse_without_validation",
    "IRRELEVANT_WARNINGS",
    "hide_irrelevant_warnings",
]

# Every layer type a forest supports, once each: Mamba (M), attention (*), MLP (-) and MoE (E).
DEFAULT_LAYER_PATTERN = "M*-E"
# The layers of each MTP depth the tiny model gets with --mtp-num-layers N (attention and MoE).
DEFAULT_MTP_LAYER_PATTERN = "*E"

TRAINERS = ("auto", "megatron", "loop")

SCRIPT_DEFAULTS = {
    # A packed token stands for every sequence through it: dropout masks cannot differ between them.
    "attention_dropout": 0.0,
    "hidden_dropout": 0.0,
    # The loss function returns (weighted loss sum, units); Megatron divides by the global units.
    "calculate_per_token_loss": True,
    # The data iterator yields packed rows built by this package, not Megatron's indexed datasets.
    "dataloader_type": "external",
    "eval_iters": 0,
    "eval_interval": 1000,
    # Token-id records need no tokenizer (only --vocab-size); text records need a real one
    # (--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR, text_data.py).
    "tokenizer_type": "NullTokenizer",
    # megatron-core's local modules (hybrid_stack_spec(use_te=False)); TE fused RoPE is not used.
    "transformer_impl": "local",
    "apply_rope_fusion": False,
    "no_persist_layer_norm": True,
    # Fused weight-gradient accumulation needs Apex's CUDA extension with the local linear layers.
    "gradient_accumulation_fusion": importlib.util.find_spec("fused_weight_gradient_mlp_cuda")
    is not None,
}

TINY_MODEL_PRESET = {
    "hybrid_layer_pattern": DEFAULT_LAYER_PATTERN,
    "hidden_size": 128,
    "ffn_hidden_size": 256,
    "num_attention_heads": 8,
    "group_query_attention": True,
    "num_query_groups": 2,
    "num_experts": 4,
    "moe_ffn_hidden_size": 128,
    "moe_router_topk": 2,
    # megatron-core's local SequentialMLP experts on CPU need bias-free linear layers.
    "add_bias_linear": False,
    "mamba_state_dim": 16,
    "mamba_head_dim": 16,
    "mamba_num_groups": 2,
    "position_embedding_type": "rope",
    "normalization": "RMSNorm",
    "vocab_size": 64,
    "make_vocab_size_divisible_by": 64,
    "seq_length": 256,
    "max_position_embeddings": 256,
    "micro_batch_size": 1,
    "global_batch_size": 32,
    "train_iters": 300,
    "lr": 3e-3,
    "min_lr": 3e-4,
    "lr_decay_style": "cosine",
    "lr_warmup_iters": 10,
    "log_interval": 20,
}

# Flags that size the network; giving any of them turns the tiny-model preset off.
MODEL_SHAPE_FLAGS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_experts",
)


def add_shared_prefix_args(
    parser: argparse.ArgumentParser, preset: Optional[dict] = None
) -> argparse.ArgumentParser:
    """Add the ``--shared-prefix-*`` flags and this script's defaults to Megatron's parser.

    Args:
        parser: Megatron's parser (its arguments already added).
        preset: extra defaults (the tiny-model preset, or None).
    """
    group = parser.add_argument_group("shared-prefix", "shared-prefix packing (docs/training.md)")
    group.add_argument(
        "--shared-prefix-packing",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Pack each global batch as prefix forests so shared prefixes are computed once "
        "(default). --no-shared-prefix-packing runs the same data dense, one padded micro-batch of "
        "--micro-batch-size sequences at a time, with the same loss normalization.",
    )
    group.add_argument(
        "--shared-prefix-capacity",
        type=int,
        default=None,
        help="Token capacity of one packed row (one micro-batch); default --seq-length. A sequence "
        "longer than this is an error (see --shared-prefix-drop-overlong).",
    )
    group.add_argument(
        "--shared-prefix-loss-normalization",
        choices=("token", "sequence"),
        default="token",
        help="token: weighted target losses summed and divided by the loss tokens of the global "
        "batch; sequence: per-sequence mean, then mean over the sequences of the global batch.",
    )
    group.add_argument(
        "--shared-prefix-drop-overlong",
        action="store_true",
        help="Drop sequences longer than --shared-prefix-capacity instead of failing; they are "
        "counted and reported when the data is loaded.",
    )
    group.add_argument(
        "--shared-prefix-metrics-jsonl",
        type=str,
        default=os.path.join("runs", "pretrain_hybrid", "metrics.jsonl"),
        help="Write one JSON object of step metrics per iteration here ('' disables). Truncated at "
        "the start of a fresh run, and to the resumed iteration when resuming with --load.",
    )
    group.add_argument(
        "--shared-prefix-supervise",
        choices=("all-assistant", "last-assistant"),
        default="all-assistant",
        help="Which assistant turns of a conversation record are supervised: every one (default) "
        "or only the last. Applies to 'messages' and 'turns' records read with a text tokenizer "
        "(--tokenizer-type other than NullTokenizer).",
    )
    group.add_argument(
        "--shared-prefix-precompile",
        choices=("off", "dynamic", "buckets"),
        default="off",
        help="Compile the tree attention (FlexAttention) kernels, the Mamba layers' Triton "
        "kernels and the edge loss's before the first step, so that no row length compiles "
        "during training: dynamic: one dynamic-shape attention kernel that every row runs "
        "(one compile); buckets: also a static attention kernel, up to about 2% faster, for "
        "each of the about four bucket lengths per octave up to the row capacity (one compile "
        "each; kept in the Inductor and Triton caches for later runs); the Mamba kernels are "
        "compiled for every "
        "class of row length either way, and rows are padded to a multiple of 16 tokens where "
        "the capacity is one (fewer classes: one Mamba warm-up row per chunk count), and the "
        "edge loss's kernels at the output layer's width; off (default): kernels compile when "
        "a row first needs them.",
    )
    group.add_argument(
        "--shared-prefix-attention-backend",
        choices=("auto", "flex", "torch", "flash"),
        default="auto",
        help="Tree attention backend of the attention layers: auto (default: FlexAttention on "
        "CUDA, torch elsewhere), flex, torch, or flash (torch's flash attention kernels, one pass "
        "per segment and one per ancestor depth, merged by log-sum-exp; bf16/fp16 on CUDA, auto "
        "elsewhere).",
    )
    group.add_argument(
        "--shared-prefix-output-chunk-tokens",
        type=int,
        default=0,
        metavar="N",
        help="Run the output layer and loss of each row over N loss-source tokens at a time, "
        "recomputing each chunk in the backward: a row holds one chunk's logits (N x vocabulary "
        "/ TP) instead of those of all its supervised tokens, for one more output-layer forward. "
        "0 (default): one chunk. For rows with many supervised tokens at a large vocabulary, "
        "whose logits dominate their memory.",
    )
    group.add_argument(
        "--shared-prefix-trainer",
        choices=TRAINERS,
        default="auto",
        help="megatron: megatron.training.pretrain (needs CUDA); loop: the single-process loop "
        "of megatron/shared_prefix/training/loop.py; auto: megatron when CUDA is available, "
        "else loop.",
    )
    group.add_argument(
        "--shared-prefix-verbose",
        action="store_true",
        help="Print Megatron's dump of every argument and the library warnings that do not apply "
        "to this script (CUDA extensions not installed, --split, ...), which are hidden otherwise.",
    )
    parser.set_defaults(**SCRIPT_DEFAULTS, **(preset or {}))
    _escape_bare_percent_signs(parser)
    return parser


def _escape_bare_percent_signs(parser: argparse.ArgumentParser) -> None:
    """Let ``--help`` work: argparse %-formats help strings, some of Megatron's hold a bare '%'."""
    for action in parser._actions:  # pylint: disable=protected-access
        if not action.help:
            continue
        try:
            _ = action.help % dict(vars(action), prog=parser.prog)
        except (ValueError, TypeError, KeyError):
            action.help = action.help.replace("%", "%%")


def _megatron_parser(preset: Optional[dict]) -> argparse.ArgumentParser:
    """Megatron's parser with this script's flags and defaults (and ``preset``)."""
    from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser(
        description="pretrain_hybrid.py (Megatron-LM arguments)", allow_abbrev=False
    )
    add_megatron_arguments(parser)
    return add_shared_prefix_args(parser, preset)


def _probe(argv: Sequence[str]) -> argparse.Namespace:
    return _megatron_parser(None).parse_known_args(list(argv))[0]


def uses_tiny_model(argv: Sequence[str]) -> bool:
    """True when ``argv`` gives none of :data:`MODEL_SHAPE_FLAGS` (the tiny preset applies)."""
    args = _probe(argv)
    return all(getattr(args, name) is None for name in MODEL_SHAPE_FLAGS)


def _preset(argv: Sequence[str]) -> Optional[dict]:
    """The tiny-model preset if ``argv`` selects it, else None. With a text tokenizer the
    vocabulary comes from the tokenizer, so the preset's ``--vocab-size`` is left out."""
    args = _probe(argv)
    if not all(getattr(args, name) is None for name in MODEL_SHAPE_FLAGS):
        return None
    preset = dict(TINY_MODEL_PRESET)
    if args.mtp_num_layers and args.hybrid_layer_pattern is None:
        preset["hybrid_layer_pattern"] = DEFAULT_LAYER_PATTERN + "".join(
            "/" + DEFAULT_MTP_LAYER_PATTERN for _ in range(args.mtp_num_layers)
        )
    if args.tokenizer_type != SCRIPT_DEFAULTS["tokenizer_type"]:
        del preset["vocab_size"]
    return preset


def extra_args_provider(argv: Sequence[str]):
    """The ``extra_args_provider`` for ``argv``: our flags, and the tiny preset when it applies."""
    return functools.partial(add_shared_prefix_args, preset=_preset(argv))


def apply_pipeline_defaults(args: argparse.Namespace) -> None:
    """Settings a pipeline of forest rows needs, after Megatron's ``validate_args``.

    Packed rows differ in length, so with ``--pipeline-model-parallel-size`` > 1 the schedule
    must send each micro-batch's shape (``variable_seq_lengths``, which ``validate_args`` always
    resets). megatron-core rejects variable lengths with the allgather MoE dispatcher even in a
    model without experts, so such a model is given the (unused) alltoall dispatcher; with experts
    the choice stays the user's and an allgather one is rejected by RunConfig.
    """
    if args.shared_prefix_packing and args.pipeline_model_parallel_size > 1:
        args.variable_seq_lengths = True
        if not args.num_experts:
            args.moe_token_dispatcher_type = "alltoall"


def parse_arguments(argv: Sequence[str]) -> argparse.Namespace:
    """Parse and validate ``argv`` as Megatron does, without touching Megatron's global state.

    Used by the single-process loop (megatron.training parses sys.argv itself). Megatron's
    ``validate_args`` derives the remaining fields (``num_layers`` from the pattern, dtypes, weight
    decay range, ...); flag values it would reject with a bare assert are reported first, naming
    the flag (``check_flags_before_megatron``).

    Raises:
        ConfigError: naming the flag.
    """
    from megatron.training.arguments import validate_args

    from megatron.shared_prefix.cpu import enable_cpu

    enable_cpu()
    args = parse_without_validation(argv)
    args.rank = int(os.getenv("RANK", "0"))
    args.world_size = int(os.getenv("WORLD_SIZE", "1"))
    with megatron_argument_dump(args.shared_prefix_verbose):
        validate_args(args)
    apply_pipeline_defaults(args)
    return args


def parse_without_validation(argv: Sequence[str]) -> argparse.Namespace:
    """``argv`` parsed by Megatron's parser and ours, checked by ``check_flags_before_megatron``
    but not yet by Megatron's ``validate_args``.

    Raises:
        ConfigError: naming the flag.
    """
    from megatron.shared_prefix.training.config import check_flags_before_megatron

    argv = list(argv)
    args = _megatron_parser(_preset(argv)).parse_args(argv)
    check_flags_before_megatron(args)
    return args


@contextlib.contextmanager
def megatron_argument_dump(verbose: bool):
    """Within this context, Megatron's ``validate_args`` prints its argument dump (several hundred
    lines) only when ``verbose`` (``--shared-prefix-verbose``)."""
    from megatron.training import arguments

    printer = arguments._print_args  # pylint: disable=protected-access
    if not verbose:
        arguments._print_args = lambda title, args: None  # pylint: disable=protected-access
    try:
        yield
    finally:
        arguments._print_args = printer  # pylint: disable=protected-access


# Start-up warnings of megatron-core and torch that say nothing about a pretrain_hybrid.py run:
# optional CUDA extensions this script does not use on CPU, and Megatron's indexed-dataset --split
# (this script reads JSONL records, which have no splits), and mamba_ssm's advice to cache its
# autotuning, which its deterministic mode (the script's default) does not run. Regular expressions
# on the message.
IRRELEVANT_WARNINGS = (
    r"Transformer Engine and Apex are not installed",
    r"Apex is not installed",
    r"absl\.logging is not installed",
    r"Only transformer-engine>=\S+ supports MoE experts",
    r"Could not determine rank from torch\.distributed",
    r"Please specify --split when using --data-path",
    r"Deterministic mode: (set TRITON_CACHE_AUTOTUNING=1|upgrade to Triton)",
)


def hide_irrelevant_warnings() -> None:
    """Filter :data:`IRRELEVANT_WARNINGS` and torch's "No CUDA runtime is found" log line, for the
    rest of the process (``--shared-prefix-verbose`` leaves them on)."""
    import logging
    import warnings

    for pattern in IRRELEVANT_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
