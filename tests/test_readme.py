"""README's usage example, run as written against the installed package from a directory outside the checkout."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"

# What the README leaves to the reader: a long context with a fact, the token ids of the second block.
SETUP = """
import pydoc_data.topics as topics
context = "Remember this: the secret passcode is 4812. " + " ".join(list(topics.topics.values())[:6])[:3000]
"""
BETWEEN = """
context_ids = tokenizer(context, return_tensors="pt").input_ids[:, :700]
question_ids = tokenizer(" What is the secret passcode?", return_tensors="pt").input_ids
"""
CHECKS = """
assert isinstance(answer, str) and answer.strip(), answer
n, total = context_ids.shape[1], cache.get_seq_length()  # total: the tokens the cache stands for
assert out.shape[1] > n + question_ids.shape[1] and total >= n + question_ids.shape[1]
assert cache.get_seq_length(0) == int(n * 0.25) + total - n, cache.get_seq_length(0)  # rows held: context compressed
import kvcompress
print("OK", kvcompress.__file__)
"""


@pytest.mark.slow
def test_readme_usage_runs_from_a_temporary_directory(tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    usage, reuse = blocks[0], blocks[1]
    assert "from kvcompress.models import load_model" in usage  # not from the checkout's eval/
    script = tmp_path / "usage.py"
    script.write_text(SETUP + usage + BETWEEN + reuse + CHECKS)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "OK" in result.stdout
    assert not (tmp_path / "eval").exists()
    with pytest.raises(subprocess.CalledProcessError):  # the checkout's eval/ is not importable from there
        subprocess.run([sys.executable, "-c", "import eval.longbench"], cwd=tmp_path, env=env, check=True,
                       capture_output=True)  # fmt: skip
