"""`proxy.tokens.TokenizerFile`: the model's tokenizer.json through the light
`tokenizers` library gives the tokens and text vLLM gives, without Transformers.

Four tokenizer kinds: the shipped byte-level BPE (`models/pycoder/target`), a
Metaspace BPE (SentencePiece style: its decoder strips a leading space), a WordPiece,
and a WordLevel whose tokenizer_config.json asks for Transformers' space clean-up (and
whose vocabulary has tokens it changes, "it 's"). References are
Transformers (encode), `tokenizers`' DecodeStream stepped token by token (how vLLM's
detokenizer makes the text it streams) and, for logprobs token texts, vLLM's own
`convert_ids_list_to_tokens` run in the vLLM install.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tokenizers.decoders import DecodeStream
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from proxy.runtime import check_tokenizer
from proxy.tokens import TokenizerFile

REPO_ROOT = Path(__file__).resolve().parent.parent
CORPUS = [
    "The quick brown fox jumps over the lazy dog. Isn't it? It's fine, we're sure!",
    "def add(a, b):\n    return a + b  # sum, of two numbers.",
    "Héllo wörld ☃, naïve café; don't stop: 1, 2, 3 ... 'quoted' text.",
] * 20
TEXTS = [*CORPUS[:3], "  leading spaces", "x", "a , b . c ! d ? e 's f n't", "<s> mid </s>"]


def _save(tokenizer: Tokenizer, out_dir: Path, **config) -> Path:
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, **config).save_pretrained(str(out_dir))
    return out_dir


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    metaspace = Tokenizer(models.BPE(unk_token="<unk>"))
    metaspace.pre_tokenizer = pre_tokenizers.Metaspace()
    metaspace.decoder = decoders.Metaspace()
    metaspace.train_from_iterator(
        CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"])
    )
    wordpiece = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    wordpiece.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    wordpiece.decoder = decoders.WordPiece()
    wordpiece.train_from_iterator(
        CORPUS, trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[UNK]", "[SEP]"])
    )
    words = ["[UNK]", "the", "fox", ".", ",", "it 's", "do n't", "fine .", "yes , no ?", "a ' b"]
    wordlevel = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    wordlevel.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return {
        "byte_level": REPO_ROOT / "models" / "pycoder" / "target",
        "metaspace": _save(metaspace, root / "metaspace", bos_token="<s>", eos_token="</s>"),
        "wordpiece": _save(wordpiece, root / "wordpiece", sep_token="[SEP]"),
        "wordlevel": _save(
            wordlevel, root / "wordlevel", unk_token="[UNK]", clean_up_tokenization_spaces=True
        ),
    }


def _load(directory: Path) -> TokenizerFile:
    return TokenizerFile.load(directory, server=None)  # type: ignore[arg-type]  # no chat here


def _random_ids(rng: random.Random, vocab_size: int, count: int) -> list[list[int]]:
    return [[rng.randrange(vocab_size) for _ in range(rng.randint(1, 30))] for _ in range(count)]


KINDS = ["byte_level", "metaspace", "wordpiece", "wordlevel"]


@pytest.mark.parametrize("kind", KINDS)
def test_tokens_are_transformers_tokens(tokenizer_dirs, kind):
    local, reference = _load(tokenizer_dirs[kind]), AutoTokenizer.from_pretrained(tokenizer_dirs[kind])
    for text in TEXTS:
        for special in (True, False):
            want = reference(text, add_special_tokens=special)["input_ids"]
            assert asyncio.run(local.encode(text, special)) == want, (text, special)


@pytest.mark.parametrize("kind", KINDS)
def test_text_is_what_a_decode_stream_yields(tokenizer_dirs, kind):
    """vLLM streams text by stepping a DecodeStream (FastIncrementalDetokenizer); once
    no unfinished UTF-8 sequence is pending, what it yielded is the plain decode."""
    local = _load(tokenizer_dirs[kind])
    rng = random.Random(0)
    num_compared = 0
    for ids in _random_ids(rng, local.vocab_size, 300):
        for skip in (True, False):
            want = asyncio.run(local.decode(ids, skip))
            stream = DecodeStream(skip_special_tokens=skip)
            streamed = "".join(stream.step(local.tokenizer, t) or "" for t in ids)
            if not want.endswith("\ufffd"):
                assert streamed == want, (ids, skip)
                num_compared += 1
    assert num_compared > 300


@pytest.mark.vllm
def test_logprob_token_texts_are_vllms(tokenizer_dirs):
    """Every id of each vocabulary: the text vLLM 0.32 reports for it in logprobs (its
    `convert_ids_list_to_tokens`, with Transformers' decode in the vLLM install)."""
    script = (
        "import json, sys\n"
        "from transformers import AutoTokenizer\n"
        "from vllm.tokenizers.detokenizer_utils import convert_ids_list_to_tokens\n"
        "out = {}\n"
        "for name, path in json.loads(sys.argv[1]).items():\n"
        "    tok = AutoTokenizer.from_pretrained(path)\n"
        "    out[name] = convert_ids_list_to_tokens(tok, list(range(len(tok))))\n"
        "print(json.dumps(out))\n"
    )
    paths = {name: str(path) for name, path in tokenizer_dirs.items()}
    result = subprocess.run(
        [str(REPO_ROOT / ".venv-vllm" / "bin" / "python"), "-c", script, json.dumps(paths)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    wanted = json.loads(result.stdout.strip().splitlines()[-1])
    for name, want in wanted.items():
        local = _load(tokenizer_dirs[name])
        got = asyncio.run(local.token_strings(list(range(len(want)))))
        differing = [(i, w, g) for i, (w, g) in enumerate(zip(want, got, strict=True)) if w != g]
        assert differing == [], (name, differing[:10])
    # The two rules beyond a plain decode did apply: leading spaces put back (Metaspace),
    # spaces cleaned up ("it 's" -> "it's").
    metaspace = _load(tokenizer_dirs["metaspace"]).tokenizer
    assert any(
        text != metaspace.decode([i], skip_special_tokens=False)
        for i, text in enumerate(wanted["metaspace"])
    )
    assert "it's" in wanted["wordlevel"] and "don't" in wanted["wordlevel"]


def test_the_start_up_check_tells_a_different_tokenizer(tokenizer_dirs):
    """`check_tokenizer` compares decode and tokens against the server's tokenizer; here
    a TokenizerFile stands in for the server (the real server: the light-install tests)."""
    byte_level, metaspace = _load(tokenizer_dirs["byte_level"]), _load(tokenizer_dirs["metaspace"])
    assert asyncio.run(check_tokenizer(byte_level, _load(tokenizer_dirs["byte_level"]))) == (
        True, True
    )  # fmt: skip
    assert asyncio.run(check_tokenizer(byte_level, metaspace)) == (False, False)
