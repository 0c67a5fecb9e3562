"""Loads a checkpoint into a paged shared-memory arena and serves its page table."""
