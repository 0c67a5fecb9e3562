"""Owns the paged KV cache in host memory and runs attention for ragged prefill/decode micro-batches."""
