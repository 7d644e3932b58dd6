"""Output projection fused with cross-entropy and z-loss,
never materializing [tokens, vocab] logits."""
