"""Fixtures of the training tests: short single-process runs of the built-in tiny model on CPU."""

import json

import pytest


@pytest.fixture(autouse=True)
def single_thread():
    """One intra-op thread per test: these tiny kernels gain nothing from more, and spin-waiting
    OpenMP threads on shared cores make runs several times slower (the loop does the same on CPU).
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def train(megatron_world, tmp_path):
    """``train(*flags)`` -> (step metrics, log lines) of a short loop run of the tiny model.

    Defaults: 3 iterations of 8 examples, metrics in ``tmp_path/metrics.jsonl``; flags override.
    """
    from megatron.shared_prefix.training.loop import run

    def run_short(*flags):
        argv = [
            "--train-iters",
            "3",
            "--global-batch-size",
            "8",
            "--lr-warmup-iters",
            "0",
            "--shared-prefix-metrics-jsonl",
            str(tmp_path / "metrics.jsonl"),
            *flags,
        ]
        lines = []
        return run(argv, log=lines.append), lines

    return run_short


@pytest.fixture
def write_jsonl(tmp_path):
    """``write_jsonl(records, name="data.jsonl")`` -> path of a JSONL file holding ``records``
    (dicts are serialized, strings written verbatim as lines)."""

    def write(records, name="data.jsonl"):
        path = tmp_path / name
        path.write_text(
            "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)
        )
        return str(path)

    return write
