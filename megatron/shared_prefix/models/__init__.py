"""Model classes of megatron.shared_prefix (upstream: megatron/core/models/)."""
