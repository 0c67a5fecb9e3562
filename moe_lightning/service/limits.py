"""Message limits every gRPC end shares, in a module light enough for the HTTP gateway (no torch)."""

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
