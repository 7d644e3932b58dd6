"""Residual add fused with RMSNorm: one read of the two streams, one write of each result."""
