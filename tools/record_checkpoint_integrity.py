#!/usr/bin/env python3
"""Check a checkpoint against its integrity record, or write the record of one that has none.

    python tools/record_checkpoint_integrity.py DIR               # the iteration the tracker names
    python tools/record_checkpoint_integrity.py DIR --iteration N

pretrain_hybrid.py refuses to load a checkpoint without an integrity record (a missing record
means an unfinished save). A checkpoint written before records existed, or converted or copied
from elsewhere, has none: after checking it by other means, record it with this tool to load it.
An iteration that has a record is verified instead, never rewritten.

Exit status: 0 intact (or recorded now), 1 not intact, 2 usage error.
"""

import argparse
import os
import sys

from megatron.shared_prefix.training.integrity import (
    RECORD_NAME,
    CheckpointError,
    iteration_dir,
    tracked_iteration,
    verify_iteration,
    write_integrity_record,
)


def main(argv=None) -> int:
    """Verify or record one iteration of a checkpoint directory; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("directory", help="checkpoint directory (what --load names)")
    parser.add_argument("--iteration", type=int, help="iteration (default: the tracker's)")
    args = parser.parse_args(argv)
    try:
        iteration = (
            args.iteration if args.iteration is not None else tracked_iteration(args.directory)
        )
    except CheckpointError as error:
        parser.error(str(error))
    if iteration is None:
        parser.error(f"{args.directory} has no tracker; give --iteration")
    root = iteration_dir(args.directory, iteration)
    if not os.path.isdir(root):
        parser.error(f"{root} does not exist")
    if os.path.isfile(os.path.join(root, RECORD_NAME)):
        problem = verify_iteration(args.directory, iteration)
        print(problem or f"{root}: intact")
        return 1 if problem else 0
    path = write_integrity_record(root, iteration)
    print(f"{root}: recorded {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
