"""The file names of a Hugging Face safetensors checkpoint. Torch-free: the weight store keys its
arena copy on them (arena_layout.checkpoint_key) without importing torch."""

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
