"""README's Python blocks, run as written (in order, as one session) from a temporary directory.

Nothing is injected before or between the blocks: the script is the blocks as a reader copies them, followed by
checks. The package is importable the way an installed one is (a folder holding only ``kvcompress``), so the
checkout's ``eval/`` and ``tests/`` are out of reach. The client block needs a running server; the server tests
(tests/test_serve.py, tests/test_install.py) cover it.
"""

from __future__ import annotations

import ast
import builtins
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"

CHECKS = """
# ---- checks (not part of the README)
assert isinstance(answer, str) and answer.strip(), answer
ids, out, cache, context_ids = manual
assert tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()
header = tokenizer.apply_chat_template([{"role": "user", "content": "@@"}], tokenize=False).split("@@")[0]
assert context_text.startswith(header) and question_suffix.strip()  # the template cut as kvpress's pipeline cuts it
n = context_ids.shape[1]
assert cache.get_seq_length() >= n + 1 and cache.get_seq_length(0) < n  # stands for the context, holds fewer rows
static, out, static_answer = compiled
assert type(static).__name__ == "StaticWeightedCache" and 0 < static.remaining() < 64
assert isinstance(static_answer, str) and static_answer.strip(), static_answer
ids, out, answers = padded
assert out.shape[0] == len(answers) == 2 and all(isinstance(a, str) for a in answers)
assert k_s.shape == (2, 4, 1020, 64) and torch.isfinite(attention_out).all()
import kvcompress
print("OK", kvcompress.__file__)
"""


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_blocks_need_nothing_a_reader_would_not_have():
    """Every name the runnable blocks read is bound by the blocks themselves (an import, an assignment, a loop) or
    is a builtin: a reader copying them needs nothing else (checked without running: the slow test runs them)."""
    blocks = [b for b in python_blocks() if "OpenAI(" not in b]
    bound, read = set(dir(builtins)), set()
    for block in blocks:
        for node in ast.walk(ast.parse(block)):
            if isinstance(node, ast.Name):
                (bound if isinstance(node.ctx, ast.Store) else read).add(node.id)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                bound.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    assert read <= bound, sorted(read - bound)
    assert "from kvcompress.models import load_model" in blocks[0]  # not from the checkout's eval/
    by_hand = blocks[1]
    assert "apply_chat_template" in by_hand and "attention_mask=" in by_hand and "tokenizer.decode" in by_hand


@pytest.mark.slow
def test_readme_python_blocks_run_from_a_temporary_directory(tmp_path):
    blocks = [b for b in python_blocks() if "OpenAI(" not in b]
    assert len(blocks) == 5  # pipeline usage, the same by hand, the static cache, padded batches, the tensor API
    # Later blocks reuse names (ids, out, cache); the checks keep each block's own between blocks.
    script = "\n".join(
        [blocks[0], blocks[1], "manual = ids, out, cache, context_ids", blocks[2], "compiled = static, out, answer",
         blocks[3], "padded = ids, out, answers", blocks[4], "attention_out = out", CHECKS]
    )  # fmt: skip
    (tmp_path / "readme.py").write_text(script)
    installed = tmp_path / "site"
    installed.mkdir()
    (installed / "kvcompress").symlink_to(REPO / "kvcompress")
    env = {**os.environ, "PYTHONPATH": str(installed)}
    result = subprocess.run(
        [sys.executable, "readme.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1800
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "OK" in result.stdout
    assert "attention mask" not in result.stderr.lower()  # transformers warns when generate gets no attention_mask
    with pytest.raises(subprocess.CalledProcessError):  # the checkout's eval/ is not importable from there
        subprocess.run([sys.executable, "-c", "import eval.longbench"], cwd=tmp_path, env=env, check=True,
                       capture_output=True)  # fmt: skip
