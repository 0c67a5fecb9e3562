"""moe-lightning: high-throughput MoE inference on memory-constrained GPUs."""
