"""`proxy.model_files`: where the served model's files are on the proxy's host; and
`proxy.generation_defaults`: what vLLM reads from them for unset request fields."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from proxy.generation_defaults import load_generation_defaults
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


# ----- generation defaults (proxy.generation_defaults) --------------------------------


def _model_with(tmp_path: Path, name: str, generation: dict | None, config: dict | None = None) -> Path:
    directory = tmp_path / name
    directory.mkdir()
    if generation is not None:
        (directory / "generation_config.json").write_text(json.dumps(generation))
    (directory / "config.json").write_text(json.dumps(config or {"vocab_size": 10}))
    return directory


def test_auto_reads_the_keys_vllm_reads(tmp_path):
    model = _model_with(tmp_path, "m", {
        "temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
        "max_new_tokens": 256, "max_length": 999, "do_sample": True, "presence_penalty": None,
        "eos_token_id": [1, 2],
    })  # fmt: skip
    defaults = load_generation_defaults("auto", model)
    assert defaults.values == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.05,
                               "repetition_penalty": 1.1, "max_tokens": 256}  # fmt: skip
    assert defaults.known and defaults.max_tokens_cap is None  # auto: a default, not a cap
    assert defaults.get("temperature") == 0.7 and defaults.get("frequency_penalty") == 0.0
    assert "repetition_penalty=1.1" in defaults.describe()
    assert defaults.passthrough_reason({"prompt": "x"}) is None


def test_without_generation_config_json_config_json_is_read(tmp_path):
    model = _model_with(tmp_path, "m", None, {"vocab_size": 10, "temperature": 0.5,
                                              "text_config": {"top_k": 5, "temperature": 2.0}})  # fmt: skip
    assert load_generation_defaults("auto", model).values == {"temperature": 0.5, "top_k": 5}


def test_vllm_mode_reads_nothing_and_a_folder_caps_every_request(tmp_path):
    model = _model_with(tmp_path, "m", {"temperature": 0.7, "max_new_tokens": 64})
    assert load_generation_defaults("vllm", model).values == {}
    folder = _model_with(tmp_path, "folder", {"top_p": 0.5, "max_new_tokens": 32})
    defaults = load_generation_defaults(str(folder), model)
    assert defaults.values == {"top_p": 0.5, "max_tokens": 32} and defaults.max_tokens_cap == 32
    with pytest.raises(FileNotFoundError, match="no such directory"):
        load_generation_defaults(str(tmp_path / "missing"), model)


def test_unknown_without_files_and_output_penalties_pass_through(tmp_path):
    unknown = load_generation_defaults("auto", None)
    assert not unknown.known and unknown.values == {} and "unknown" in unknown.describe()
    assert unknown.get("temperature") == 1.0  # assumed neutral
    model = _model_with(tmp_path, "m", {"presence_penalty": 0.5, "frequency_penalty": 0.0})
    defaults = load_generation_defaults("auto", model)
    assert defaults.passthrough_reason({}) == "default_presence_penalty"
    assert defaults.passthrough_reason({"presence_penalty": None}) == "default_presence_penalty"
    assert defaults.passthrough_reason({"presence_penalty": 0}) is None  # the request's own
    assert "presence_penalty unset pass through" in defaults.describe()
