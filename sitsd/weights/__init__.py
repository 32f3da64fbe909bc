"""Model weights: checkpoint loaders (Hugging Face safetensors, GGUF), tokenizer, chat templates.

`load_checkpoint(path)` gives a `Checkpoint` (architecture, HF-named tensors, `Tokenizer`);
`resolve_model_path("default")` finds the embedded SmolLM2. Hot-swap pieces (watcher, stager,
slots) live in sibling modules and are imported from there, not re-exported here.
"""

from __future__ import annotations

from sitsd.weights.chat_template import ChatTemplateError
from sitsd.weights.checkpoint import Checkpoint, CheckpointError
from sitsd.weights.formats import load_checkpoint, resolve_model_path
from sitsd.weights.tokenizer import Tokenizer

__all__ = [
    "ChatTemplateError",
    "Checkpoint",
    "CheckpointError",
    "Tokenizer",
    "load_checkpoint",
    "resolve_model_path",
]
