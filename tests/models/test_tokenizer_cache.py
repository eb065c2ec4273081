"""GGUF tokenizers built once, then read from the tokenizer cache (tessellm.models.
tokenizer_cache), and the engine core's light tokenizer (tessellm.models.core_tokenizer).

- A built tokenizer equals transformers' own GGUF tokenizer (AutoTokenizer with gguf_file):
  class, vocabulary, special tokens, chat template and the encodings of llama.cpp's tokenizer
  test texts; so does the copy read back from the cache, without building again.
- The engine core's tokenizer from the cache entry has the full tokenizer's EOS id, Rust
  tokenizer (what llguidance compiles grammars against) and decoding.
- An edited file gets a new entry; an unreadable entry is rebuilt; two builders at once both
  succeed and leave one entry.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest

from gguf_fixtures import STORIES_GGUF
from hf_fixtures import SHARED
from tessellm.models import gguf_tokenizer
from tessellm.models.core_tokenizer import load_core_tokenizer
from tessellm.models.gguf_tokenizer import load_gguf_tokenizer
from tessellm.models.source import default_model_file
from tessellm.models.tokenizer_cache import cache_entry, is_complete

VOCABS = SHARED / "tokenizers" / "gguf-vocab"
FILES = {"smollm2": default_model_file(), "stories260K": STORIES_GGUF,
         "gpt2": VOCABS / "ggml-vocab-gpt-2.gguf", "llama-spm": VOCABS / "ggml-vocab-llama-spm.gguf",
         "phi3": VOCABS / "ggml-vocab-phi-3.gguf"}
CHAT = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"}]


def _texts(path: Path) -> list[str]:
    inp = path.with_name(path.name + ".inp")
    texts = inp.read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n") if inp.exists() else []
    return [t for t in texts if t][:40] + ["Once upon a time 你好 🙂 <|im_end|> </s>"]


@pytest.fixture(scope="module")
def reference() -> Any:
    from transformers import AutoTokenizer
    made: dict[str, Any] = {}

    def get(name: str) -> Any:
        if name not in made:
            if name == "stories260K":   # transformers cannot read its "none" special ids
                made[name] = load_gguf_tokenizer(FILES[name])
            else:
                p = FILES[name]
                made[name] = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name,
                                                           local_files_only=True)
        return made[name]
    return get


def assert_same(got: Any, want: Any, path: Path) -> None:
    assert type(got).__name__ == type(want).__name__
    assert got.get_vocab() == want.get_vocab()
    for attr in ("bos_token_id", "eos_token_id", "unk_token_id", "pad_token_id"):
        assert getattr(got, attr) == getattr(want, attr), attr
    assert got.chat_template == want.chat_template
    for text in _texts(path):
        ids = want.encode(text)
        assert got.encode(text) == ids, text
        assert got.decode(ids) == want.decode(ids)
    if want.chat_template:
        assert (got.apply_chat_template(CHAT, tokenize=False)
                == want.apply_chat_template(CHAT, tokenize=False))


@pytest.mark.parametrize("name", sorted(FILES))
def test_built_and_cached_tokenizers_equal_transformers(name: str, reference: Any,
                                                        tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    path = FILES[name]
    built = load_gguf_tokenizer(path, cache_dir=tmp_path)
    assert is_complete(cache_entry(path, tmp_path))
    assert_same(built, reference(name), path)

    def no_build(*args: Any) -> Any:
        raise AssertionError("built again although the cache holds it")
    monkeypatch.setattr(gguf_tokenizer, "_build", no_build)
    assert_same(load_gguf_tokenizer(path, cache_dir=tmp_path), reference(name), path)


@pytest.mark.parametrize("name", ["smollm2", "stories260K", "gpt2", "llama-spm"])
def test_core_tokenizer_reads_what_the_core_needs(name: str, reference: Any,
                                                  tmp_path: Path) -> None:
    path = FILES[name]
    full = load_gguf_tokenizer(path, cache_dir=tmp_path)
    core = load_core_tokenizer(cache_entry(path, tmp_path))
    assert core is not None
    assert core.eos_token_id == full.eos_token_id == reference(name).eos_token_id
    assert core.backend_tokenizer.to_str() == full.backend_tokenizer.to_str()
    assert len(core) == len(full)
    ids = full.encode(_texts(path)[-1])
    assert core.decode(ids) == full.decode(ids)


def test_no_core_tokenizer_without_an_eos_token(tmp_path: Path) -> None:
    entry = cache_entry(STORIES_GGUF, tmp_path)
    load_gguf_tokenizer(STORIES_GGUF, cache_dir=tmp_path)
    config = entry / "tokenizer_config.json"
    config.write_text(config.read_text().replace('"eos_token"', '"former_eos_token"'))
    assert load_core_tokenizer(entry) is None
    assert load_core_tokenizer(tmp_path / "absent") is None


def test_an_edited_file_gets_a_new_entry(tmp_path: Path) -> None:
    copy = tmp_path / "model.gguf"
    copy.write_bytes(STORIES_GGUF.read_bytes())
    first = cache_entry(copy, tmp_path / "cache")
    os.utime(copy, ns=(0, copy.stat().st_mtime_ns + 10**9))
    assert cache_entry(copy, tmp_path / "cache") != first


def test_an_unreadable_entry_is_rebuilt(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    load_gguf_tokenizer(STORIES_GGUF, cache_dir=tmp_path)
    entry = cache_entry(STORIES_GGUF, tmp_path)
    (entry / "tokenizer.json").write_text("{ not json")
    tok = load_gguf_tokenizer(STORIES_GGUF, cache_dir=tmp_path)
    assert tok("Once upon a time").input_ids == [1, 403, 407, 261, 378]
    assert "building it again" in caplog.text
    assert is_complete(entry)
    assert load_gguf_tokenizer(STORIES_GGUF, cache_dir=tmp_path).get_vocab() == tok.get_vocab()


def test_two_builders_at_once_leave_one_entry(tmp_path: Path) -> None:
    results: list[Any] = []
    threads = [threading.Thread(target=lambda: results.append(
        load_gguf_tokenizer(STORIES_GGUF, cache_dir=tmp_path))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 2 and results[0].get_vocab() == results[1].get_vocab()
    entries = [p for p in (tmp_path / "tokenizers").iterdir()]
    assert entries == [cache_entry(STORIES_GGUF, tmp_path)]


def test_an_unwritable_cache_costs_only_the_rebuild(tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    tok = load_gguf_tokenizer(STORIES_GGUF, cache_dir=blocked)
    assert len(tok) == 512
    assert "not written" in caplog.text
