"""vLLM's start settings from one source (stack/vllm.py): the options of `polar-mitm up`,
`polar-mitm rollout` and `polar-train loop` are generated from VLLMSettings, and the chat
template follows the tokenizer (the embedded model's and its checkpoints': the tool-aware one)."""

from __future__ import annotations

import shutil
from dataclasses import fields

import click
from click.testing import CliRunner

from polar_mitm.cli.main import main as polar_mitm
from polar_mitm.cli.train import main as polar_train
from polar_mitm.models import default_model_dir
from polar_mitm.stack.vllm import TOOLS_TEMPLATE, VLLMSettings, chat_template_for, vllm_options


def test_the_tool_template_serves_the_default_model_and_its_checkpoints_only(tmp_path, monkeypatch):
    monkeypatch.setenv("POLAR_MITM_CACHE", str(tmp_path / "cache"))
    default = default_model_dir()
    default.mkdir(parents=True)
    (default / "tokenizer.json").write_text('{"model": "smollm2"}')
    checkpoint, other = tmp_path / "v3", tmp_path / "other"
    checkpoint.mkdir()
    other.mkdir()
    shutil.copy(default / "tokenizer.json", checkpoint)     # as polar-train saves a checkpoint
    (other / "tokenizer.json").write_text('{"model": "another"}')
    assert chat_template_for(default) == chat_template_for(checkpoint) == TOOLS_TEMPLATE
    assert chat_template_for(other) is None and chat_template_for(tmp_path / "missing") is None
    settings = VLLMSettings(sleep_mode=True, processed_logprobs=True)
    assert settings.args(checkpoint) == [
        "--dtype", settings.dtype, "--max-model-len", str(settings.max_model_len), "--chat-template",
        str(TOOLS_TEMPLATE), "--enable-sleep-mode", "--logprobs-mode", "processed_logprobs"]
    assert "--chat-template" not in VLLMSettings().args(other)


def test_up_rollout_and_loop_take_the_same_generated_options():
    defaults = VLLMSettings()
    for command in (polar_mitm.commands["up"], polar_mitm.commands["rollout"], polar_train.commands["loop"]):
        params = {p.name: p for p in command.params}
        for f in fields(VLLMSettings):
            if "help" in f.metadata:
                assert params[f.name].default == getattr(defaults, f.name), (command.name, f.name)
                assert params[f.name].help == f.metadata["help"]

    got: list[VLLMSettings] = []

    @click.command()
    @vllm_options
    def command(vllm: VLLMSettings) -> None:
        got.append(vllm)

    r = CliRunner().invoke(command, ["--dtype", "bfloat16", "--max-model-len", "4096"])
    assert r.exit_code == 0, r.output
    assert got == [VLLMSettings(dtype="bfloat16", max_model_len=4096)]
