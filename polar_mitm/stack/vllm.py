"""vLLM's start settings, from one source: VLLMSettings. `polar-mitm up`, `polar-mitm rollout`
and `polar-train loop` take their options from it (vllm_options, generated from its fields, as
trainer_options is from TrainConfig), and the stack starts vLLM with them (launch.start_vllm).

The chat template follows the tokenizer: polar-mitm's tool-aware template for the embedded
model and every checkpoint of it (polar-train copies the tokenizer into each), the model's
own template for any other model."""

from __future__ import annotations

import filecmp
import functools
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

import click

from ..models import default_model_dir

TOOLS_TEMPLATE = Path(__file__).resolve().parents[1] / "templates" / "smollm2_tools.jinja"

# The worker extension that pulls weights from the trainer's memory (`/collective_rpc
# polar_pull_weights`): its folder goes on vLLM's PYTHONPATH (vLLM's Python lacks polar_mitm).
WORKER_EXTENSION_DIR = Path(__file__).resolve().parents[1] / "vllm_ext"
WORKER_EXTENSION = "weight_pull.WeightPull"
# --enable-scale-out: /inference/v1/generate (per-token weight versions), render and derender
RL_ARGS = ["--worker-extension-cls", WORKER_EXTENSION, "--enable-scale-out"]


def _option(help: str) -> dict[str, Any]:
    return {"help": help}


@dataclass(frozen=True)
class VLLMSettings:
    # the fields with help are command-line options (vllm_options)
    dtype: str = field(default="float32", metadata=_option(
        "vLLM's dtype (the trainer's by default: a bf16 server drops most of a small update)"))
    max_model_len: int = field(default=8192, metadata=_option("vLLM's context length, in tokens"))
    sleep_mode: bool = False            # the loop's --colocate: vLLM frees the GPU while the trainer runs
    processed_logprobs: bool = False    # logprobs after the temperature (the trainer's, unless it is 1)

    def args(self, model_dir: str | Path, chat_template: str | Path | None = None) -> list[str]:
        """vLLM's command-line arguments for these settings, serving model_dir."""
        template = chat_template or chat_template_for(model_dir)
        return (["--dtype", self.dtype, "--max-model-len", str(self.max_model_len)]
                + (["--chat-template", str(template)] if template else [])
                + (["--enable-sleep-mode"] if self.sleep_mode else [])
                # vLLM's logprobs are raw (before the temperature) by default
                + (["--logprobs-mode", "processed_logprobs"] if self.processed_logprobs else []))


def chat_template_for(model_dir: str | Path) -> Path | None:
    """The tool-aware template where model_dir has the embedded model's tokenizer (None: the
    model's own template)."""
    ours, theirs = default_model_dir() / "tokenizer.json", Path(model_dir) / "tokenizer.json"
    same = ours.is_file() and theirs.is_file() and filecmp.cmp(ours, theirs, shallow=False)
    return TOOLS_TEMPLATE if same else None


OPTION_FIELDS = [f for f in fields(VLLMSettings) if "help" in f.metadata]


def vllm_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """The options of VLLMSettings' fields (--dtype, --max-model-len), with its defaults; the
    command gets them as one argument, vllm: VLLMSettings."""
    @functools.wraps(command)
    def with_settings(*args: Any, **kwargs: Any) -> Any:
        settings = VLLMSettings(**{f.name: kwargs.pop(f.name) for f in OPTION_FIELDS})
        return command(*args, vllm=settings, **kwargs)

    for f in reversed(OPTION_FIELDS):
        with_settings = click.option(f"--{f.name.replace('_', '-')}", default=f.default, show_default=True,
                                     help=f.metadata["help"])(with_settings)
    return with_settings
