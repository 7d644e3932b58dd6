"""Error feedback + block quantization in one pass: (g + e) -> payload, scales and the new error."""
