"""The torchrun side of test_training_checkpoint_layouts.py: several loop runs in one world.

Usage: ``torchrun --nproc-per-node N checkpoint_layout_runs.py RUNS.json``, where RUNS.json is a
list of argument lists. Every process runs them in order, each through ``loop.run`` (which
rebuilds megatron's parallel state for the run's layout), so the world starts once for all of
them and is shut down after the last. A failing run is printed with its flags and the job stops.
"""

import json
import sys
import traceback

from megatron.shared_prefix.training import loop
from megatron.shared_prefix.training.distributed import init_parallel, shutdown_parallel


def main(path: str) -> None:
    with open(path, encoding="utf-8") as handle:
        runs = json.load(handle)
    init_parallel()
    for argv in runs:
        try:
            loop.run(argv, log=lambda line: None)
        except BaseException:  # pylint: disable=broad-exception-caught
            print(f"run failed: {' '.join(argv)}", flush=True)
            traceback.print_exc()
            sys.exit(1)
    shutdown_parallel()


if __name__ == "__main__":
    main(sys.argv[1])
