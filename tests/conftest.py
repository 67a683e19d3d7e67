"""Session setup shared by every test: CPU enablement and a single-process megatron-core world."""

import os

import pytest


def pytest_configure(config):
    """Environment defaults, set before any test module imports torch (explicit settings win).

    CPU runs disable torch.compile (an inductor build per process costs ~20 s and the CPU paths do
    not compile). A GPU run (``-m gpu``) compiles FlexAttention, as training does, and skips
    mamba_ssm's autotuning (``MAMBA_DETERMINISTIC=1``; minutes otherwise).
    """
    if "gpu" in (config.option.markexpr or "") and "not gpu" not in config.option.markexpr:
        os.environ.setdefault("TORCH_COMPILE_DISABLE", "0")
        os.environ.setdefault("MAMBA_DETERMINISTIC", "1")
    else:
        os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
    # megatron-core's Mamba mixer binds mamba_ssm's kernels when it is first imported, and test
    # modules reach it in many orders (megatron.training imports it too): where mamba_ssm is
    # missing, provide the pure-torch fallback before any test module is collected.
    from megatron.shared_prefix.cpu import install_mamba_ssm_fallback

    install_mamba_ssm_fallback()


def pytest_collection_modifyitems(config, items):
    """Skip `gpu`-marked tests where CUDA is absent."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def megatron_world():
    """torch.distributed with one process and megatron-core's parallel state (TP = PP = 1)."""
    import torch

    from megatron.shared_prefix.training.distributed import init_single_process

    init_single_process("cuda" if torch.cuda.is_available() else "cpu")
    yield


def random_forest_sequences(
    rng, *, depth, vocab_size=64, max_children=3, max_segment=9, prefix_ends=True
):
    """Token sequences whose trie is a random forest of the given depth.

    Segment lengths are drawn skewed (many 1-token segments, a few long ones); each leaf path is a
    sequence, and with ``prefix_ends`` some inner nodes also end a sequence (a sequence that is a
    prefix of another) and one sequence is duplicated.

    Returns:
        list of lists of token ids (ids in [1, vocab_size)).
    """

    def segment():
        length = 1 if rng.random() < 0.3 else int(rng.integers(1, max_segment + 1))
        return [int(t) for t in rng.integers(1, vocab_size, size=length)]

    sequences = []

    def grow(prefix, level):
        path = prefix + segment()
        if level == depth:
            sequences.append(path)
            return
        if prefix_ends and rng.random() < 0.25:
            sequences.append(path)
        for _ in range(int(rng.integers(1, max_children + 1))):
            grow(path, level + 1)

    for _ in range(int(rng.integers(1, 3))):
        grow([], 1)
    if prefix_ends:
        sequences.append(list(sequences[int(rng.integers(len(sequences)))]))
    return [s if len(s) >= 2 else s + [1] for s in sequences]


@pytest.fixture
def forest_sequences():
    """``forest_sequences(seed, depth, **kw)`` -> random sequences whose trie has that depth."""
    import numpy as np

    return lambda seed, depth, **kw: random_forest_sequences(
        np.random.default_rng(seed), depth=depth, **kw
    )
