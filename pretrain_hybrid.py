"""Train a Megatron hybrid model (Mamba / attention / MLP / MoE layers) with shared-prefix packing.

    python pretrain_hybrid.py --shared-prefix-packing            # built-in tiny model and data
    torchrun --nproc-per-node 8 pretrain_hybrid.py --data-path rl.jsonl --hybrid-layer-pattern ... \
        --hidden-size ... --micro-batch-size 1 --global-batch-size 256 --train-iters ... --lr ...

Megatron's arguments configure the model, batch, optimizer, schedule and checkpoints; the
``--shared-prefix-*`` flags configure packing (docs/training.md lists them all, docs/data.md the
JSONL formats). With CUDA, training runs through ``megatron.training.pretrain``; without it, the
same model, data and loss run through a single-process loop (``--shared-prefix-trainer`` chooses).
"""

import os
import sys
import warnings

# mamba_ssm fixes its kernels' configurations when they are first imported (with the imports below):
# unless the environment says otherwise, they run in its deterministic mode, one fixed configuration
# each, so that runs and ranks give the same bits and no process autotunes (docs/training.md).
os.environ.setdefault("MAMBA_DETERMINISTIC", "1")

# Import-time warnings of optional extensions (and mamba_ssm's advice on cached autotuning) stay
# quiet unless asked for; main() then filters the run's own.
with warnings.catch_warnings():
    if "--shared-prefix-verbose" not in sys.argv:
        warnings.simplefilter("ignore")
    # pylint: disable=wrong-import-position
    from megatron.shared_prefix.training.arguments import TRAINERS, hide_irrelevant_warnings
    from megatron.shared_prefix.training.config import ConfigError
    from megatron.shared_prefix.training.data import DataError


def _trainer(argv: list[str]) -> str:
    """The trainer that ``--shared-prefix-trainer`` asks for; ``auto`` follows CUDA availability."""
    import argparse

    import torch

    probe = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    probe.add_argument("--shared-prefix-trainer", choices=TRAINERS, default="auto")
    choice = probe.parse_known_args(argv)[0].shared_prefix_trainer
    if choice == "auto":
        return "megatron" if torch.cuda.is_available() else "loop"
    if choice == "megatron" and not torch.cuda.is_available():
        raise SystemExit(
            "--shared-prefix-trainer megatron: megatron.training needs CUDA, which is not available"
        )
    return choice


def main() -> None:
    """Train with the trainer that fits; a bad flag or data record exits 2 with its message."""
    argv = sys.argv[1:]
    if "--shared-prefix-verbose" not in argv:
        hide_irrelevant_warnings()
    try:
        if _trainer(argv) == "megatron":
            from megatron.shared_prefix.training.megatron_integration import pretrain_with_megatron

            pretrain_with_megatron()
        else:
            from megatron.shared_prefix.training.loop import run

            run(argv)
    except (ConfigError, DataError) as exc:
        print(f"pretrain_hybrid.py: error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
