"""The embedded model's one-time conversion when two processes (e.g. two test workers) run it at once."""

from pathlib import Path
from types import SimpleNamespace

import pytest

import kvcompress.models as models


def _fake_conversion(monkeypatch, tmp_path: Path, while_saving) -> Path:
    """Patch the GGUF reads so that a conversion writes two small files, calling ``while_saving(target)`` between
    them (where another process could finish its own conversion); returns the target directory."""
    target = tmp_path / "cache" / models.embedded_cache_name()

    class Saved(SimpleNamespace):
        def save_pretrained(self, path):
            Path(path).mkdir(parents=True, exist_ok=True)
            (Path(path) / self.file).write_text("this process")
            if self.file == "tokenizer.json":
                while_saving(target)

    monkeypatch.setenv("KVCOMPRESS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(models, "embedded_gguf_dir", lambda: tmp_path)
    for name, file in (("AutoTokenizer", "tokenizer.json"), ("AutoModelForCausalLM", "config.json")):
        monkeypatch.setattr(models, name, SimpleNamespace(from_pretrained=lambda *a, file=file, **k: Saved(file=file)))
    return target


def _finish_first(target: Path) -> None:
    target.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json"):
        (target / name).write_text("the other process")


def test_a_conversion_finishing_second_keeps_the_first_and_leaves_no_staging(monkeypatch, tmp_path):
    target = _fake_conversion(monkeypatch, tmp_path, _finish_first)
    assert models.embedded_model_dir() == target
    assert (target / "config.json").read_text() == "the other process"
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]


def test_a_lone_conversion_moves_its_staging_into_place(monkeypatch, tmp_path):
    target = _fake_conversion(monkeypatch, tmp_path, lambda target: None)
    assert models.embedded_model_dir() == target
    assert (target / "config.json").read_text() == "this process"
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]


def test_a_target_holding_no_model_is_one_clear_error(monkeypatch, tmp_path):
    def leave_junk(target: Path) -> None:
        target.mkdir(parents=True)
        (target / "notes.txt").write_text("not a model")

    _fake_conversion(monkeypatch, tmp_path, leave_junk)
    with pytest.raises(RuntimeError, match="holds no converted model; remove it"):
        models.embedded_model_dir()
