"""`proxy.model_files`: where the served model's files are on the proxy's host."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from proxy.model_files import find_model_files, hub_snapshot

SHIPPED = Path(__file__).resolve().parent.parent / "models" / "pycoder" / "target"


def _copy(src: Path, dst: Path, names: tuple[str, ...]) -> Path:
    dst.mkdir(parents=True)
    for name in names:
        shutil.copy(src / name, dst / name)
    return dst


def test_a_served_path_here_is_the_model_dir():
    files = find_model_files(str(SHIPPED))
    assert files.model_dir == files.tokenizer_dir == SHIPPED
    assert "served path" in files.found_by["tokenizer_dir"]


def test_the_tokenizer_flag_comes_first_and_must_hold_a_tokenizer(tmp_path):
    tokenizer_only = _copy(SHIPPED, tmp_path / "tok", ("tokenizer.json", "tokenizer_config.json"))
    files = find_model_files(str(SHIPPED), tokenizer_only)
    # The tokenizer from the flag; config.json from the served path (the flag's has none).
    assert (files.tokenizer_dir, files.model_dir) == (tokenizer_only, SHIPPED)
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        find_model_files(str(SHIPPED), tmp_path / "nowhere")


def test_a_hub_id_is_found_in_the_hugging_face_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    repo = tmp_path / "hub" / "models--acme--coder-1b"
    old = _copy(SHIPPED, repo / "snapshots" / "aaa", ("config.json",))
    new = _copy(SHIPPED, repo / "snapshots" / "bbb", ("config.json", "tokenizer.json"))
    assert old.is_dir() and hub_snapshot("acme/coder-1b") is None  # two, and no ref: which?
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("bbb\n")
    files = find_model_files("acme/coder-1b")
    assert files.model_dir == files.tokenizer_dir == new
    assert "HF cache" in files.found_by["model_dir"]
    # Not cached, not a hub id, or a served name that is neither: nothing found.
    for root in ("acme/other", "served-name", None):
        missing = find_model_files(root)
        assert (missing.model_dir, missing.tokenizer_dir) == (None, None)


def test_a_single_cached_snapshot_needs_no_ref(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    only = _copy(SHIPPED, tmp_path / "hub" / "models--acme--tiny" / "snapshots" / "c0", ("config.json",))
    assert hub_snapshot("acme/tiny") == only
    assert find_model_files("acme/tiny").tokenizer_dir is None
