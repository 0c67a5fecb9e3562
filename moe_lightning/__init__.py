"""moe-lightning: high-throughput MoE inference on memory-constrained GPUs."""

__version__ = "0.1.0"
