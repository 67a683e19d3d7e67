"""Training for pretrain_hybrid.py: data, batching, loss, metrics, checkpoints and the two trainers.

A batch's path, one file per step (docs/training.md):

* ``data.py``: JSONL records or the built-in dataset -> ``Example`` (tokens, supervised positions,
  per-target weights); ``ExampleStream`` hands out global batches in order;
* ``text_data.py``, ``tokenizer.py``: text records (chats, RL rollouts) through Megatron's
  tokenizers -> the same ``Example``s, tokenized once and cached;
* ``batching.py``: global batch -> ``StepBatch`` of planned prefix-forest rows (or dense padded
  batches), each a micro-batch with per-target loss coefficients;
* ``loss.py``: the coefficients and divisor of token / sequence normalization with RL weights;
* ``model.py``: the SharedPrefixHybridModel from Megatron's flags, the forward of one micro-batch;
* ``loop.py``: the single-process trainer (CPU, or one GPU on request);
* ``megatron_integration.py``: model provider, data iterator and forward step for megatron.training;
* ``arguments.py``, ``config.py``: flags, defaults, validation; ``metrics.py``: progress output;
  ``checkpointing.py``: the loop's checkpoints.
"""

# Megatron's argument parser imports megatron-core's Mamba mixer, which binds mamba_ssm's kernels at
# import time: provide the pure-torch fallback first where mamba_ssm is missing (see cpu.py).
from megatron.shared_prefix.cpu import install_mamba_ssm_fallback

install_mamba_ssm_fallback()
