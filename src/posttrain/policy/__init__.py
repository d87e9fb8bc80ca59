"""The policy side: per-token logprobs, batching, optimizers and the update step."""
