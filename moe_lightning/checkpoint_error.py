"""The error of a checkpoint we cannot read, in a module of its own: the torch-free readers (a GPTQ
checkpoint's config, read by the launcher's checks) raise it too."""


class CheckpointError(ValueError):
    """A checkpoint we cannot read; the message names the tensor and/or file."""
