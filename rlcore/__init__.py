"""The algorithm and the loop: config, batches, advantages and losses, data, rewards, placement, the
trainer. Nothing in this package imports megatron-core or vLLM."""
