"""Owns the accelerator: dense weights, resident and streamed experts; runs pre/post-attention and the head."""
