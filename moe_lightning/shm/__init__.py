"""The data plane: named POSIX shared-memory segments (segment, no torch) and one-writer/one-reader
tensor channels over them (channel)."""
