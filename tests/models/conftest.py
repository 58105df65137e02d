"""Model tests never reach a hub: set before transformers / huggingface_hub are imported."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
