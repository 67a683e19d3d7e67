"""The upstream PR stack: where each file of this repository lands in Megatron-LM, and in which PR.

tools/export_pr_stack.py builds the stack from this module alone, and docs/upstreaming.md is
generated from it (``export_pr_stack.py --write-docs``; CI runs ``--check-docs``), so the map that
reviewers read is the map that the exporter applies.

* ``PULL_REQUESTS``: the stack, in dependency order; each becomes one commit and one patch.
* ``RULES``: source path (a file, or a directory ending in "/") -> upstream path, PR. The most
  specific rule wins: a file rule over its directory's rule, a deeper directory over a shallower
  one. A directory rule also places files added to that directory later. Every file under
  ``SCOPE`` must match a rule, or the export fails naming it: a new module cannot be dropped from
  the stack silently. ``target=None`` keeps a file out of the stack; its ``note`` says why.
* ``UPSTREAM_EDITS``: the in-place changes to upstream files, each anchored on a short string the
  exporter must find exactly once (else it fails naming the file and the anchor).

Standard library only (the exporter runs before anything is installed).
"""

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class PullRequest:
    """One PR of the stack: the commit message's title and prose.

    The exporter adds what it can measure: the dependencies (from the imports between PRs), the
    test files with their test counts and the commands that run them, and the diffstat.
    """

    number: int
    slug: str
    title: str
    summary: str
    validation: str
    limitations: str


@dataclass(frozen=True)
class Rule:
    """Where a source file (or every file of a source directory) lands upstream.

    source: repository-relative path; a directory ends in "/".
    target: upstream path (a directory ends in "/", like its source), or None: not exported.
    pr: number of the PR that adds it (None with target=None).
    note: how it plugs in upstream, or why it is not exported.
    """

    source: str
    target: Optional[str]
    pr: Optional[int]
    note: str


@dataclass(frozen=True)
class UpstreamEdit:
    """An in-place change of an upstream file, made by replacing ``anchor`` (found exactly once).

    path: upstream path of the file.
    pr: the PR that makes the change.
    anchor: text the file must contain exactly once; the exporter fails naming file and anchor if
        it does not (upstream moved: see docs/upstreaming.md, "When an anchor fails").
    replacement: what replaces the anchor (normally the anchor plus the inserted lines).
    note: what the change does, for docs/upstreaming.md.
    when_missing: the content of the file when the base does not have it at all (the installed
        megatron-core wheel has no pretrain_hybrid.py or tests/); None: a missing file is an error.
    """

    path: str
    pr: int
    anchor: str
    replacement: str
    note: str
    when_missing: Optional[str] = None


# Files the map must account for (directories end in "/").
SCOPE = ("megatron/shared_prefix/", "tests/", "tools/", "examples/", "pretrain_hybrid.py")

PULL_REQUESTS = (
    PullRequest(
        1,
        "planner-and-layout",
        "Shared-prefix packing: prefix-forest planner and ForestLayout",
        "Adds megatron/core/models/hybrid/shared_prefix/ with the host-side half of shared-prefix "
        "training. plan_shared_prefix(sequences, loss_masks, capacity=...) builds the trie of a "
        "batch (GRPO groups, agent trajectories, SFT chats that share prefixes), compresses it into "
        "segments in DFS order and packs trees into rows of at most `capacity` tokens, splitting "
        "oversized trees at branch points. Each row is an immutable ForestLayout: packed tokens, "
        "original position ids, segments, token multiplicities and one loss edge per supervised "
        "target; SharedPrefixPlan.unpack_edges maps per-edge values back to the sequences. numpy "
        "only: nothing here imports torch.",
        "On a 2-core host (tools/bench_planner.py, numpy inputs, capacity 16384): a 64K-token GRPO "
        "batch plans in 0.98 ms (median of 21), a 1M-token batch in 25.6 ms; targets 5 ms / 50 ms.",
        "A tree larger than `capacity` is split at branch points and repeats its ancestor path in "
        "each part; a single chain longer than `capacity` is an error naming the sequence.",
    ),
    PullRequest(
        2,
        "forest-tensors-and-recompute-scope",
        "Shared-prefix packing: forest tensors and a forest scope that survives recompute",
        "ForestTensors copies a ForestLayout to the device once per forward, with the tables the "
        "layers share (the tree mask `k <= q < token_subtree_end[k]`, distinct edge sources, cached "
        "key blocks and root-path predecessors). forest_scope() publishes it through a contextvars "
        "variable, so megatron-core's layer call signatures stay unchanged: a tree-aware submodule "
        "reads current_forest() and is exactly the stock module when none is in scope. "
        "megatron/core/tensor_parallel/shared_prefix/random.py brackets the stack with two identity "
        "autograd nodes that re-open the scope in the backward pass, so activation recompute "
        "(CheckpointFunction re-running layers inside backward) sees the same forest; no change to "
        "CheckpointFunction itself.",
        "ForestTensors' tables are tested in the tree-attention PR against its dense mask "
        "reference (tests/unit_tests/models/hybrid/shared_prefix/test_tensors.py); the recompute "
        "brackets end to end by the HybridModel tests of the integration PR (activation "
        "recompute on, gradients equal to dense training).",
        "One forest per forward: nested forests in one scope are not supported.",
    ),
    PullRequest(
        3,
        "mamba-fork",
        "Mamba on prefix forests: tree conv, forked-state scan and TreeMambaMixer",
        "TreeMambaMixer (megatron/core/ssm/shared_prefix/), selected as the Mamba layer spec's "
        "mixer, follows each token's root path: tree_conv.py runs one causal conv over the packed "
        "row (on CUDA triton_causal_conv.py, forward and backward with the SiLU fused: "
        "megatron-core's Triton causal-conv1d kernels are forward-only) and recomputes the first "
        "d_conv - 1 tokens of every segment from their root-path window; tree_scan.py runs one "
        "packed scan with seq_idx = segment plus the exact linear correction "
        "C_t . exp(cum_t) h_parent_end for the tokens of every child, parents first. On "
        "CUDA the packed scan is mamba_ssm's Triton kernel and the correction our Triton kernels "
        "(triton_inherited_state.py, a fixed number of launches per layer), run with mamba_ssm's "
        "forward and backward functions in one autograd function that adds the correction into "
        "the scan's output and its gradients into the scan's; elsewhere torch_ssd.py, "
        "a pure-torch SSD that is also the kernels' oracle. cpu.py makes HybridModel build and "
        "train without CUDA (and registers torch_ssd under mamba_ssm's names when mamba_ssm is "
        "absent); megatron/core/ssm/mamba_mixer.py gains one hook: without CUDA and mamba_ssm it "
        "binds that torch SSD itself, so any import order works. distributed.py sets up the "
        "one-process world that CPU tests and the single-process trainer use, and on CUDA pins "
        "the ptxas that Triton compiles with, so that Triton's cache serves every process.",
        "H200, bf16, hidden 2048, 64 heads (tools/bench_mamba.py --repeats 5): the tree layer takes "
        "1.05-1.06x the time of a varlen scan over the same packed tokens (the fork's 0.6-0.8 ms), "
        "3.6-5.0x less than the same sequences packed as a varlen row and 5.2-9.2x less than "
        "the dense padded batch on the three benchmark forests; the Triton row conv makes the "
        "layer 27-29% faster than PyTorch's conv, tree and dense alike.",
        "The fused training kernel (use_mamba_mem_eff_path) has no per-segment state input, so a "
        "forest always takes the unfused path. Context parallelism (cp_size > 1) is rejected.",
    ),
    PullRequest(
        4,
        "tree-attention",
        "Tree attention: DotProductAttention over each token's root path",
        "TreeDotProductAttention (megatron/core/transformer/tree_attention/), selected as the "
        "attention layer spec's core_attention, runs tree attention when a forest is in scope and "
        "is DotProductAttention otherwise. Two backends share one mask: torch_backend (block-sparse "
        "over the keys each query block can see; CPU, and the oracle) and flex_backend "
        "(FlexAttention with a block mask built from the forest; CUDA). Rows run at their length "
        "rounded up to 128: a length that is a bucket (<= 4 per octave) runs a kernel compiled with "
        "static shapes, every other length one dynamic-shape kernel (IS_DIVISIBLE), so a run "
        "compiles once per bucket it meets, however row lengths vary. Opt-in (tree_backend="
        "'flash'): flash_backend runs rows on torch's flash attention, a varlen pass per segment "
        "and one per ancestor depth, merged by log-sum-exp, each pass's backward given the merged "
        "output.",
        "H200, bf16, forward+backward, 5 benchmark forests (tools/bench_attention.py --repeats 10 "
        "--rounds 3): tree/flex static 0.95-1.00, tree/flex dynamic 0.75-0.78, speedup over dense "
        "SDPA 0.94-3.30x (cuDNN); 0.99-1.06 of the attention-pair ratio against FlexAttention on "
        "the same sequences packed dense and 1.38-1.50 against deterministic SDPA; flash_backend "
        "2.4-3.3x slower than flex_backend; static and dynamic kernels agree bitwise (GPU test). "
        "With 32 query heads over 8 key/value heads (tools/bench_attention.py --query-groups 8), "
        "repeating the keys and values to the query heads before the kernel, as flex_backend does "
        "from 4 heads per group, took 1-18% less time than FlexAttention's grouped-query kernel.",
        "Causal self-attention only: no sliding window, softcapping, attention bias or MLA. The "
        "FlexAttention path needs CUDA; CPU uses the torch backend.",
    ),
    PullRequest(
        5,
        "moe-multiplicities",
        "MoE on prefix forests: routing statistics weighted by token multiplicity",
        "TreeTopKRouter (megatron/core/transformer/moe/shared_prefix/), selected as the MoE spec's "
        "router, counts every packed token once per sequence through it: int64 expert-bias counts, "
        "and aux / seq-aux / global-aux and z losses equal to those of the dense micro-batch "
        "holding the row's sequences (values and gradients). The gating GEMM runs in fixed row "
        "blocks, so a token's routing does not depend on where it is packed. On a forest the MoE "
        "layer never waits for the GPU: TreeMoELayer's all-gather dispatcher sizes the "
        "permutation on the host (tokens x topk: nothing is dropped) and leaves the per-expert "
        "counts on the device, where ForestSequentialMLP runs the experts as two grouped GEMMs "
        "(SequentialMLP's parameters and checkpoints). tree_moe_module_spec is "
        "get_moe_module_spec with these; validation.py names router settings a forest cannot "
        "reproduce.",
        "Every statistic is checked against a dense-expansion oracle (reference.py) and against a "
        "dense MoE model on random forests (depth 1..4); the sync-free layer against megatron-core's "
        "MoELayer with the same weights, and on CUDA under torch.cuda.set_sync_debug_mode('error').",
        "Token dropping (capacity factor) and router settings that see the packed row as one "
        "sequence are rejected with the setting named.",
    ),
    PullRequest(
        6,
        "hybrid-model-integration",
        "HybridModel runs prefix forests: forward(..., shared_prefix_layout=layout)",
        "HybridModel.forward gains `shared_prefix_layout`: with a ForestLayout it hands the call to "
        "shared_prefix/hybrid_model.py:forest_forward, which validates configuration and "
        "arguments (validation.py: every reason the forward could not be exact is a ValueError "
        "naming the setting), runs the embedding and the stack over the packed row inside the "
        "forest scope, gathers hidden states at the distinct edge sources before the output "
        "layer and returns the float32 cross entropy of every loss edge. hybrid_stack_spec() "
        "selects the tree-aware submodules of PRs 3-5 (and builds without Transformer Engine). "
        "Multi-token prediction: every MTP depth runs megatron-core's MTP layers on its own "
        "forest row (mtp_layout.py: one token per distinct prefix the depth's state depends on, "
        "so MTP is shared as the main model is), with per-edge losses at the main edges' sources; "
        "they are attached as process_mtp_loss attaches them, or returned per edge "
        "(shared_prefix_mtp_losses=True). "
        "Under tensor parallelism the edge loss is vocab-parallel; pipeline stages pass hidden "
        "states as HybridModel does; under context parallelism each rank holds megatron-core's "
        "chunks of the row and the loss edges whose sources it holds (context_parallel_edges). "
        "The public API is megatron.core.models.hybrid.shared_prefix: plan_shared_prefix, "
        "SharedPrefixPlan, ForestLayout, hybrid_stack_spec, enable_cpu, context_parallel_edges "
        "(SharedPrefixHybridModel "
        "remains as HybridModel plus a check that every pattern layer has a module).",
        "Model-level parity on random forests (depth 1..4, single-token segments, skewed siblings): "
        "per-edge losses and gradients equal to dense training within the tolerances of the "
        "tests (float32 on CPU), with M, *, -, E layers, tied and untied embeddings, activation "
        "recompute; MTP depths' per-edge losses, gradients and MoE counts against dense "
        "HybridModel with MTP, and the attached MTP loss against megatron's own; multi-process "
        "gloo jobs under TP, SP, CP, EP, DP and PP (MTP under TP + SP, CP and PP) against the "
        "TP = 1 dense reference (losses rel 1e-5, gradients rel 1e-4, MoE counts equal).",
        "CUDA graphs, FP8/FP4, dropout, sliding windows, MLA and inference caches are rejected "
        "by validation with the setting named, and so are MTP layers away from the loss stage "
        "or fewer than mtp_num_layers; TP with MoE needs sequence parallelism, PP needs "
        "variable_seq_lengths, CP needs rows that split into equal chunks and heads that divide "
        "over the ranks.",
    ),
    PullRequest(
        7,
        "determinism-gate",
        "Kernel determinism manifest, coverage checker and CI gate",
        "tests/unit_tests/determinism/kernels/manifest.py registers every file of this stack that "
        "launches a kernel or uses an order-sensitive op, with the bitwise replay tests "
        "(determinism/replay.py) that pin it. tools/check_kernel_determinism_coverage.py fails when "
        "a kernel-bearing file is unregistered, a registered test does not exist, or (with "
        "--base-ref) a kernel source changed without one of its tests changing; "
        ".github/workflows/kernel-determinism.yml runs it on pull requests.",
        "The checker's rules are unit-tested on temporary git repositories; on this stack "
        "`python tools/check_kernel_determinism_coverage.py --base-ref <base>` passes.",
        "GPU replays (FlexAttention, Triton forked-state kernels, mamba_ssm) run only with CUDA; "
        "on CPU the torch paths and the block-mask construction are replayed.",
    ),
    PullRequest(
        8,
        "training-entry-and-data",
        "pretrain_hybrid.py --shared-prefix-packing: data, batching, loss and trainers",
        "megatron/training/shared_prefix/ trains HybridModel on prefix forests: JSONL SFT and RL "
        "records (or a built-in dataset), batching into planned rows with per-target loss "
        "coefficients (token / sequence normalization, RL weights), the model from Megatron's "
        "flags, megatron.training providers and forward step (each step planned ahead in "
        "--num-workers DataLoader workers), a single-process loop for CPU, "
        "metrics and checkpoints. pretrain_hybrid.py hands any --shared-prefix-* invocation to it "
        "before its own imports; without those flags it is unchanged.",
        "`python pretrain_hybrid.py --shared-prefix-packing --train-iters 20` trains the built-in "
        "tiny model on CPU; the training tests cover the flags, data errors, batching, loss "
        "normalization, the loop and the megatron.training integration.",
        "One global batch maps onto Megatron's fixed micro-batch count by padding with one-token "
        "empty rows. Without CUDA only the single-process loop runs.",
    ),
)

_HYBRID = "megatron/core/models/hybrid/shared_prefix/"
_HYBRID_TESTS = "tests/unit_tests/models/hybrid/shared_prefix/"

RULES = (
    # PR 1: planner and layout.
    Rule(
        "megatron/shared_prefix/__init__.py",
        _HYBRID + "__init__.py",
        1,
        "the public API; each PR's commit lists the names whose modules exist at that commit",
    ),
    Rule("megatron/shared_prefix/layout.py", _HYBRID + "layout.py", 1, "plain data"),
    Rule("megatron/shared_prefix/planning.py", _HYBRID + "planning.py", 1, "plain data"),
    Rule("tests/unit_tests/test_layout.py", _HYBRID_TESTS + "test_layout.py", 1, "test"),
    Rule("tests/unit_tests/test_planning.py", _HYBRID_TESTS + "test_planning.py", 1, "test"),
    # PR 2: forest tensors and recompute scope.
    Rule(
        "megatron/shared_prefix/tensors.py",
        _HYBRID + "tensors.py",
        2,
        "contextvars scope read by the tree-aware submodules",
    ),
    Rule(
        "megatron/shared_prefix/context_parallel.py",
        _HYBRID + "context_parallel.py",
        2,
        "host-side split of a row's tokens and loss edges over context-parallel ranks",
    ),
    Rule(
        "megatron/shared_prefix/tensor_parallel/",
        "megatron/core/tensor_parallel/shared_prefix/",
        2,
        "autograd brackets around the stack; CheckpointFunction unchanged",
    ),
    # PR 3: Mamba fork, CPU enablement, test fixtures.
    Rule(
        "megatron/shared_prefix/ssm/",
        "megatron/core/ssm/shared_prefix/",
        3,
        "mixer submodule of the Mamba layer spec, and its ops",
    ),
    Rule(
        "megatron/shared_prefix/cpu.py",
        _HYBRID + "cpu.py",
        3,
        "run-time CPU adaptation (upstream would guard the CUDA-only calls instead)",
    ),
    Rule(
        "megatron/shared_prefix/training/distributed.py",
        _HYBRID + "distributed.py",
        3,
        "torch.distributed and parallel state outside megatron.training (tests, loop trainer)",
    ),
    Rule("tests/unit_tests/ssm/", "tests/unit_tests/ssm/shared_prefix/", 3, "tests"),
    Rule(
        "tests/unit_tests/triton_interpreter.py",
        "tests/unit_tests/ssm/shared_prefix/triton_interpreter.py",
        3,
        "runs a test file's Triton checks under the interpreter, first used by the Mamba tests",
    ),
    Rule(
        "tests/unit_tests/tiny.py",
        _HYBRID_TESTS + "tiny.py",
        3,
        "tiny test configs and a model's seeded initialization, first used by the Mamba tests",
    ),
    Rule(
        "tests/conftest.py",
        "tests/unit_tests/shared_prefix_fixtures.py",
        3,
        "fixtures of the shared-prefix tests, imported by tests/unit_tests/conftest.py",
    ),
    # PR 4: tree attention.
    Rule(
        "megatron/shared_prefix/attention/",
        "megatron/core/transformer/tree_attention/",
        4,
        "core_attention submodule of the attention layer spec",
    ),
    Rule("tests/unit_tests/attention/", "tests/unit_tests/transformer/tree_attention/", 4, "tests"),
    Rule("tests/unit_tests/test_tensors.py", _HYBRID_TESTS + "test_tensors.py", 4, "test"),
    Rule(
        "tests/unit_tests/test_context_parallel.py",
        _HYBRID_TESTS + "test_context_parallel.py",
        3,
        "test (its forest fixtures arrive with PR 3)",
    ),
    # PR 5: MoE multiplicities.
    Rule(
        "megatron/shared_prefix/moe/",
        "megatron/core/transformer/moe/shared_prefix/",
        5,
        "router submodule of the MoE spec",
    ),
    Rule("tests/unit_tests/moe/", "tests/unit_tests/transformer/moe/shared_prefix/", 5, "tests"),
    Rule(
        "tests/unit_tests/determinism/__init__.py",
        "tests/unit_tests/determinism/__init__.py",
        5,
        "test package",
    ),
    Rule(
        "tests/unit_tests/determinism/replay.py",
        "tests/unit_tests/determinism/replay.py",
        5,
        "bitwise replay harness, first used by the router tests",
    ),
    Rule(
        "tests/unit_tests/determinism/test_replay_harness.py",
        "tests/unit_tests/determinism/test_replay_harness.py",
        5,
        "test",
    ),
    # PR 6: HybridModel integration and validation.
    Rule(
        "megatron/shared_prefix/models/hybrid/",
        _HYBRID,
        6,
        "forest forward called by HybridModel.forward, stack, specs, validation",
    ),
    Rule(
        "megatron/shared_prefix/models/__init__.py",
        None,
        None,
        "package docstring only; megatron/core/models/__init__.py exists upstream",
    ),
    Rule(
        "megatron/shared_prefix/models/hybrid/__init__.py",
        None,
        None,
        "installs the mamba_ssm fallback on import; upstream the modules that import the Mamba "
        "mixer do it themselves",
    ),
    Rule(
        "megatron/shared_prefix/transformer/",
        "megatron/core/transformer/shared_prefix/",
        6,
        "sequence-parallel torch norm of the local spec (upstream: WrappedTorchNorm could take it) "
        "and the MTP layer that runs one depth of a forest",
    ),
    Rule(
        "megatron/shared_prefix/tensor_parallel/cross_entropy.py",
        "megatron/core/tensor_parallel/shared_prefix/cross_entropy.py",
        6,
        "vocab-parallel cross entropy of the loss edges",
    ),
    Rule(
        "megatron/shared_prefix/tensor_parallel/triton_cross_entropy.py",
        "megatron/core/tensor_parallel/shared_prefix/triton_cross_entropy.py",
        6,
        "Triton kernels of the edge loss on CUDA",
    ),
    Rule(
        "tests/unit_tests/tensor_parallel/",
        "tests/unit_tests/tensor_parallel/shared_prefix/",
        6,
        "tests",
    ),
    Rule(
        "megatron/shared_prefix/tensor_parallel/full_tensors.py",
        "megatron/core/tensor_parallel/shared_prefix/full_tensors.py",
        6,
        "full parameter tensors of a sharded model and back (parallel parity tests)",
    ),
    Rule(
        "megatron/shared_prefix/mtp_layout.py",
        _HYBRID + "mtp_layout.py",
        6,
        "host-side rows of the MTP depths of a forest row, read by the forest forward",
    ),
    Rule("tests/unit_tests/test_mtp_layout.py", _HYBRID_TESTS + "test_mtp_layout.py", 6, "test"),
    Rule("tests/unit_tests/models/hybrid/", _HYBRID_TESTS, 6, "tests"),
    Rule(
        "tests/unit_tests/distributed/",
        "tests/unit_tests/distributed/shared_prefix/",
        6,
        "multi-process gloo parity tests (TP, SP, EP, DP, PP)",
    ),
    Rule(
        "tests/unit_tests/moe/test_moe_forest_model.py",
        "tests/unit_tests/transformer/moe/shared_prefix/test_moe_forest_model.py",
        6,
        "MoE HybridModel against the dense batch",
    ),
    Rule("tests/unit_tests/test_cpu.py", _HYBRID_TESTS + "test_cpu.py", 6, "test"),
    # PR 7: determinism manifest, checker and CI gate.
    Rule("tests/unit_tests/determinism/", "tests/unit_tests/determinism/", 7, "manifest, replays"),
    Rule(
        "tools/check_kernel_determinism_coverage.py",
        "tools/check_kernel_determinism_coverage.py",
        7,
        "CI gate",
    ),
    Rule("tests/unit_tests/tools/__init__.py", "tests/unit_tests/tools/__init__.py", 7, "package"),
    Rule(
        "tests/unit_tests/tools/test_check_kernel_determinism_coverage.py",
        "tests/unit_tests/tools/test_check_kernel_determinism_coverage.py",
        7,
        "test",
    ),
    # PR 8: training entry and data.
    Rule(
        "megatron/shared_prefix/training/",
        "megatron/training/shared_prefix/",
        8,
        "data, batching, loss, trainers for pretrain_hybrid.py",
    ),
    Rule(
        "pretrain_hybrid.py",
        "megatron/training/shared_prefix/pretrain.py",
        8,
        "entry point; upstream pretrain_hybrid.py hands --shared-prefix-* runs to it",
    ),
    Rule("examples/", "examples/", 8, "JSONL examples of docs/data.md, read by the training tests"),
    Rule("tests/unit_tests/training/", "tests/unit_tests/training/shared_prefix/", 8, "tests"),
    Rule(
        "tests/unit_tests/chat_tokenizer.py",
        "tests/unit_tests/training/shared_prefix/chat_tokenizer.py",
        8,
        "small chat tokenizers trained on the fly for the text-data tests",
    ),
    Rule(
        "tools/record_checkpoint_integrity.py",
        "tools/record_checkpoint_integrity.py",
        8,
        "adopts or verifies the integrity record of a training checkpoint",
    ),
    Rule(
        "tests/unit_tests/tools/test_record_checkpoint_integrity.py",
        "tests/unit_tests/tools/test_record_checkpoint_integrity.py",
        8,
        "test",
    ),
    # Not exported.
    Rule(
        "tests/unit_tests/test_readme.py",
        None,
        None,
        "runs this repository's README example and checks its docs' citations",
    ),
    Rule(
        "tests/unit_tests/test_packaging.py",
        None,
        None,
        "tests this repository's wheel next to megatron-core; upstream is megatron-core itself",
    ),
    Rule(
        "tools/",
        None,
        None,
        "benchmarks and the exporter stay here; commit messages quote the benchmark numbers",
    ),
    Rule(
        "tests/unit_tests/tools/test_export_pr_stack.py",
        None,
        None,
        "tests the exporter, which is not part of the stack",
    ),
    Rule(
        "tests/unit_tests/tools/test_bench_model.py",
        None,
        None,
        "tests the whole-model benchmark's baselines, which stay here with the tool",
    ),
    Rule(
        "tests/unit_tests/tools/test_bench_mamba.py",
        None,
        None,
        "tests the Mamba mixer benchmark's model, which stays here with the tool",
    ),
    Rule(
        "tests/unit_tests/tools/test_bench_attention.py",
        None,
        None,
        "tests the tree attention benchmark's sections, which stay here with the tool",
    ),
    Rule(
        "tests/unit_tests/tools/test_bench_planner.py",
        None,
        None,
        "tests the planner benchmark's data-loader timing, which stays here with the tool",
    ),
    Rule(
        "tests/unit_tests/tools/conftest.py",
        None,
        None,
        "loads the benchmarks for their tests, which stay here with the tools",
    ),
)

# Inserted into upstream's pretrain_hybrid.py before its imports (and the whole file where the base
# has none, as the megatron-core wheel): runs with --shared-prefix-* flags go to our entry point.
_PRETRAIN_HOOK = '''
import sys

# Shared-prefix training (megatron/training/shared_prefix/) has its own data, prefix-forest batching
# and loss; any --shared-prefix-* flag selects it, before the imports below. Only as the program:
# processes that multiprocessing spawns (distributed checkpointing does) import this file too.
if __name__ == "__main__" and any(
    arg.startswith(("--shared-prefix-", "--no-shared-prefix-")) for arg in sys.argv[1:]
):
    import os
    import warnings

    # mamba_ssm fixes its kernels' configurations when first imported: by default they run in its
    # deterministic mode, one fixed configuration each, the same in every run and rank.
    os.environ.setdefault("MAMBA_DETERMINISTIC", "1")

    # Import-time warnings of optional extensions stay quiet unless asked for; the entry point
    # then filters the run's own (--shared-prefix-verbose keeps both).
    with warnings.catch_warnings():
        if "--shared-prefix-verbose" not in sys.argv:
            warnings.simplefilter("ignore")
        from megatron.training.shared_prefix.pretrain import main as shared_prefix_main

    shared_prefix_main()
    sys.exit(0)
'''

_PRETRAIN_ANCHOR = "_PROGRAM_START_TIME = time.time()\n"

_FORWARD_SIGNATURE_ANCHOR = (
    "        padding_mask: Optional[Tensor] = None,\n"
    "    ) -> Tensor:\n"
    '        """Forward function of the Hybrid model.'
)
_FORWARD_DOCSTRING_ANCHOR = (
    "        It either returns the Loss values if labels are given or the final hidden units\n"
    '        """\n'
)

_FIXTURES_IMPORT = (
    "# Fixtures and hooks of the shared-prefix tests (gpu skip, megatron_world, forests), as a\n"
    "# plugin so that its hooks run next to this file's own.\n"
    'pytest_plugins = ["tests.unit_tests.shared_prefix_fixtures"]\n'
)

_MAMBA_SSM_MISSING_ANCHOR = (
    "except ImportError:\n"
    "    mamba_chunk_scan_combined = None\n"
    "    mamba_split_conv1d_scan_combined = None\n"
    "    HAVE_MAMBA_SSM = False\n"
)

UPSTREAM_EDITS = (
    UpstreamEdit(
        "megatron/core/ssm/mamba_mixer.py",
        3,
        anchor=_MAMBA_SSM_MISSING_ANCHOR,
        replacement=_MAMBA_SSM_MISSING_ANCHOR + "    if not torch.cuda.is_available():\n"
        "        # Without CUDA, the pure-torch SSD (megatron/core/ssm/shared_prefix/torch_ssd.py)\n"
        "        # stands in for mamba_ssm's kernels, whatever imports this module first.\n"
        "        from megatron.core.models.hybrid.shared_prefix.cpu import install_mamba_ssm_fallback\n"
        "\n"
        "        install_mamba_ssm_fallback()\n"
        "        from mamba_ssm.ops.triton.layernorm_gated import RMSNorm as RMSNormGated\n"
        "        from mamba_ssm.ops.triton.ssd_combined import (\n"
        "            mamba_chunk_scan_combined,\n"
        "            mamba_split_conv1d_scan_combined,\n"
        "        )\n"
        "\n"
        "        HAVE_MAMBA_SSM = True\n",
        note="without CUDA and mamba_ssm, the mixer binds the pure-torch SSD",
    ),
    UpstreamEdit(
        "tests/unit_tests/conftest.py",
        3,
        anchor="",
        replacement="\n" + _FIXTURES_IMPORT,
        note="registers the shared-prefix fixtures as a plugin (appended)",
        when_missing=_FIXTURES_IMPORT,
    ),
    UpstreamEdit(
        "megatron/core/models/hybrid/hybrid_model.py",
        6,
        anchor=_FORWARD_SIGNATURE_ANCHOR,
        replacement=_FORWARD_SIGNATURE_ANCHOR.replace(
            "    ) -> Tensor:\n",
            "        shared_prefix_layout=None,\n"
            "        shared_prefix_mtp_losses: bool = False,\n"
            "    ) -> Tensor:\n",
        ),
        note="HybridModel.forward takes shared_prefix_layout (and shared_prefix_mtp_losses)",
    ),
    UpstreamEdit(
        "megatron/core/models/hybrid/hybrid_model.py",
        6,
        anchor=_FORWARD_DOCSTRING_ANCHOR,
        replacement=_FORWARD_DOCSTRING_ANCHOR.replace(
            '        """\n',
            "\n"
            "        With ``shared_prefix_layout`` (a ForestLayout of a packed prefix forest, see\n"
            "        megatron.core.models.hybrid.shared_prefix) it returns the [E] float32 loss of\n"
            "        every loss edge of the row instead; the layout defines masks and labels.\n"
            "        With MTP layers the MTP loss is attached as process_mtp_loss attaches it (the\n"
            "        row is the micro-batch); shared_prefix_mtp_losses=True returns ForestLosses\n"
            "        (every edge's main and per-depth MTP losses) instead.\n"
            '        """\n'
            "        if shared_prefix_mtp_losses and shared_prefix_layout is None:\n"
            "            raise ValueError(\n"
            '                "shared_prefix_mtp_losses=True without shared_prefix_layout (per-edge "\n'
            '                "MTP losses are those of a forest row)"\n'
            "            )\n"
            "        if shared_prefix_layout is not None:\n"
            "            from megatron.core.models.hybrid.shared_prefix.hybrid_model import (\n"
            "                forest_forward,\n"
            "            )\n"
            "\n"
            "            return forest_forward(\n"
            "                self,\n"
            "                shared_prefix_layout,\n"
            "                mtp_losses=shared_prefix_mtp_losses,\n"
            "                runtime_gather_output=runtime_gather_output,\n"
            "                input_ids=input_ids,\n"
            "                position_ids=position_ids,\n"
            "                attention_mask=attention_mask,\n"
            "                decoder_input=decoder_input,\n"
            "                labels=labels,\n"
            "                inference_context=inference_context,\n"
            "                inference_params=inference_params,\n"
            "                loss_mask=loss_mask,\n"
            "                packed_seq_params=packed_seq_params,\n"
            "                padding_mask=padding_mask,\n"
            "            )\n",
        ),
        note="with a layout, HybridModel.forward returns forest_forward(...)",
    ),
    UpstreamEdit(
        "pretrain_hybrid.py",
        8,
        anchor=_PRETRAIN_ANCHOR,
        replacement=_PRETRAIN_ANCHOR + _PRETRAIN_HOOK,
        note="--shared-prefix-* runs go to megatron.training.shared_prefix.pretrain",
        when_missing=(
            '"""Pretrain Hybrid with shared-prefix packing.\n\n'
            "This tree was exported against the megatron-core wheel, which ships no pretrain_hybrid.py:\n"
            "only the shared-prefix entry below exists here. Against a Megatron-LM checkout the same\n"
            'block is inserted into upstream\'s pretrain_hybrid.py."""\n'
            + _PRETRAIN_HOOK
            + '\nif __name__ == "__main__":\n'
            + '    sys.exit("pretrain_hybrid.py: only --shared-prefix-* runs exist in this tree")\n'
        ),
    ),
)

# New files that are not moved from this repository: the CI gate of PR 7.
GENERATED_FILES = {
    ".github/workflows/kernel-determinism.yml": (
        7,
        "name: kernel-determinism\n"
        "\n"
        "on:\n"
        "  pull_request:\n"
        "\n"
        "jobs:\n"
        "  coverage:\n"
        "    runs-on: ubuntu-latest\n"
        "    steps:\n"
        "      - uses: actions/checkout@v4\n"
        "        with:\n"
        "          fetch-depth: 0\n"
        "      - uses: actions/setup-python@v5\n"
        "        with:\n"
        '          python-version: "3.12"\n'
        "      - name: Every kernel-bearing file has a bitwise replay test\n"
        "        run: |\n"
        "          base=$(git merge-base origin/${{ github.base_ref }} HEAD)\n"
        '          python tools/check_kernel_determinism_coverage.py --base-ref "$base"\n',
    ),
}
