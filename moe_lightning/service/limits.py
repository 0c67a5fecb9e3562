"""Message limits every gRPC end shares, in a module light enough for the HTTP gateway (no torch)."""

MAX_MESSAGE_BYTES = 64 * 1024 * 1024

# The hand-off channels' defaults (moe_lightning/handoff.py): here so that the orchestrator, which
# only plans micro-batches to fit them, need not import the hand-off's tensors (torch)
DEFAULT_SLOTS = 4  # per direction: attention works on up to this many micro-batches ahead
DEFAULT_MAX_TOKENS = 8192  # tokens of one micro-batch (a slot's size)
