"""Batch jobs over a Ray cluster: one stack per node, the input split into parts, each part written
once (docs/cluster.md). Needs the `ray` extra; nothing else in the package imports this."""
