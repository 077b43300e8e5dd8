"""Export a database's rollouts as SFT data (`polar-mitm export sft`) and run one optimizer
step of TRL's SFTTrainer on the file as it is, printing the loss: the check that the export
is what TRL trains on.

    .venv/bin/python scripts/sft_trl_step.py --db rollouts.duckdb [--db node2.duckdb] \\
        [--min-reward 1] [--format messages|tokens] [--suffix parquet|jsonl] [--model DIR] [--out DIR]

--model: a Hugging Face model directory (its tokenizer's chat template renders the messages);
without it, a tiny random Llama (2 layers, hidden size 32) with the default model's tokenizer
and the chat template vLLM serves it with (polar_mitm/templates/smollm2_tools.jinja), so the
step runs on CPU in seconds. Needs `trl` and `datasets` (the sft extra)."""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path


def tiny_model(out: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A tiny random Llama with the tokenizer of `tokenizer_dir`, whose chat template is the
    one vLLM renders the default model's prompts with."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from polar_mitm.stack import launch

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.chat_template = (launch.TEMPLATES / "smollm2_tools.jinja").read_text()
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
                      tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def load(data_file: Path):
    """The exported file, loaded by `datasets` as it is."""
    import datasets

    cache = str(data_file.parent / f".{data_file.name}.cache")
    if data_file.suffix == ".parquet":
        return datasets.Dataset.from_parquet(str(data_file), cache_dir=cache)
    return datasets.load_dataset("json", data_files=str(data_file), split="train", cache_dir=cache)


def one_step(data_file: Path, out_dir: Path, *, model_dir: Path | None = None,
             tokenizer_dir: Path | None = None, max_length: int = 8192, batch_size: int | None = None) -> float:
    """One SFTTrainer step on the exported file (a batch of its first rows: all of them by
    default); returns the training loss."""
    import datasets
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    datasets.disable_progress_bars()
    out_dir.mkdir(parents=True, exist_ok=True)
    if model_dir is None:
        if tokenizer_dir is None:
            from polar_mitm.models import ensure_default_model
            tokenizer_dir = ensure_default_model()
        model_dir = tiny_model(out_dir / "model", Path(tokenizer_dir))
    ds = load(Path(data_file))   # as it is: TRL leaves the rows' other columns (session_id, ...) alone
    tokens = "input_ids" in ds.column_names
    args = SFTConfig(output_dir=str(out_dir / "run"), max_steps=1, per_device_train_batch_size=batch_size or len(ds),
                     learning_rate=1e-4, logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
                     use_cpu=True, bf16=False, fp16=False, max_length=max_length, dataloader_num_workers=0,
                     # the exported completion_mask: loss on the sampled tokens only
                     completion_only_loss=True if tokens else None)
    if batch_size:
        ds = ds.select(range(min(batch_size, len(ds))))
    trainer = SFTTrainer(model=str(model_dir), args=args, train_dataset=ds,
                         processing_class=AutoTokenizer.from_pretrained(model_dir))
    return float(trainer.train().training_loss)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--db", action="append", required=True, help="DuckDB file (repeatable)")
    p.add_argument("--min-reward", type=float, default=1.0)
    p.add_argument("--format", choices=["messages", "tokens"], default="messages")
    p.add_argument("--suffix", choices=["parquet", "jsonl"], default="parquet")
    p.add_argument("--model", type=Path, default=None, help="model directory (default: a tiny random Llama)")
    p.add_argument("--out", type=Path, default=None, help="keep the export and the run here")
    a = p.parse_args(argv)

    from polar_mitm.store.sft import export_sft

    out = a.out or Path(tempfile.mkdtemp(prefix="sft-trl-"))
    try:
        data = out / f"sft.{a.suffix}"
        stats = export_sft(a.db, data, min_reward=a.min_reward, fmt=a.format)
        print(f"exported {stats.rows} rows ({a.format}) from {stats.sessions} sessions to {data}; "
              f"skipped sessions: {dict(stats.skipped_sessions) or 'none'}")
        if not stats.rows:
            print("nothing to train on", file=sys.stderr)
            return 1
        t0 = time.monotonic()
        loss = one_step(data, out, model_dir=a.model)
        print(f"one TRL SFTTrainer step: loss {loss:.4f} ({time.monotonic() - t0:.1f} s)")
        return 0 if math.isfinite(loss) else 1
    finally:
        if a.out is None:
            shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
