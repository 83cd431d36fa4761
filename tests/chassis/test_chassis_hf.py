"""Tokenizers from local directories: loaded once per directory however many threads ask at
once (the agent loads them on worker threads), in a fresh interpreter where transformers is
not imported yet."""

from __future__ import annotations

import subprocess
import sys

# Eight threads ask for the bundled tokenizer at the same instant, in a fresh interpreter: none
# fails and all get the one tokenizer object.
ASK_AT_ONCE = """
import threading
from swerl.chassis.hf import bundled_qwen3_tokenizer_dir, load_tokenizer
path = bundled_qwen3_tokenizer_dir()
barrier = threading.Barrier(8)
got, errors = [], []
def ask():
    barrier.wait()
    try:
        got.append(load_tokenizer(path))
    except Exception as exc:
        errors.append(repr(exc))
threads = [threading.Thread(target=ask) for _ in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(len(got), len({id(t) for t in got}), errors)
"""


def test_a_tokenizer_asked_for_by_many_threads_at_once_is_loaded_once():
    done = subprocess.run(
        [sys.executable, "-c", ASK_AT_ONCE], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[-2] == "8 1 []"
