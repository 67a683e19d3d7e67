"""Transformer building blocks the local (non-Transformer-Engine) spec needs beyond megatron-core."""
