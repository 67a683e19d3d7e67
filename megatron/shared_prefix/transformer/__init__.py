"""Transformer building blocks that the local (non-TE) spec needs beyond megatron-core."""
