"""Hub repo ids against a hand-built Hugging Face cache (never the network).

Every test runs with HF_HUB_OFFLINE=1 and HF_HOME / HF_HUB_CACHE in tmp_path, both in the
environment and in `huggingface_hub.constants` (read once at import). The cache layout is the
real one: models--org--name/{refs/<name>, snapshots/<commit>/<file> -> ../../blobs/<hash>}.
"""
from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from tessellm.errors import ModelLoadError
from tessellm.models import hub
from tessellm.models.hub import looks_like_repo_id, resolve_hub_model

STORIES = Path("/work/shared/models/stories260K-hf")
STORIES_FILES = ("config.json", "generation_config.json", "model.safetensors",
                 "tokenizer.json", "tokenizer.model", "tokenizer_config.json")
COMMIT = "a" * 40
OTHER_COMMIT = "b" * 40
pytestmark = pytest.mark.skipif(not STORIES.is_dir(), reason="stories260K-hf not available")


@pytest.fixture
def hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    from huggingface_hub import constants

    home = tmp_path / "hf"
    cache = home / "hub"
    cache.mkdir(parents=True)
    for name, value in (("HF_HOME", str(home)), ("HF_HUB_CACHE", str(cache)),
                        ("HF_HUB_OFFLINE", "1")):
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setattr(constants, "HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def cache_repo(cache: Path, repo_id: str, files: dict[str, Path | bytes],
               commit: str = COMMIT, refs: tuple[str, ...] = ("main",)) -> Path:
    """Put `files` (name -> source file or contents) in the cache as snapshot `commit`, each
    a symlink to its blob, and point refs/<name> at it. Returns the snapshot directory."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    for name, src in files.items():
        data = src.read_bytes() if isinstance(src, Path) else src
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        if not blob.exists():
            blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(Path("../" * (name.count("/") + 2)) / "blobs" / blob.name)
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


def stories_files() -> dict[str, Path | bytes]:
    return {name: STORIES / name for name in STORIES_FILES}


def test_repo_id_resolves_offline_to_a_snapshot_that_loads_like_the_directory(hf_cache):
    from tessellm import LLM, SamplingParams

    snapshot = cache_repo(hf_cache, "tiny/stories", stories_files())
    path = resolve_hub_model("tiny/stories")
    assert path == snapshot and (path / "config.json").is_file()
    params = SamplingParams(max_tokens=8, temperature=0)
    via_hub = LLM(str(path), device="cpu", dtype="float32", load_progress=False)
    direct = LLM(str(STORIES), device="cpu", dtype="float32", load_progress=False)
    a = via_hub.generate(["Once upon a time"], params)[0]
    b = direct.generate(["Once upon a time"], params)[0]
    assert a.token_ids == b.token_ids and a.text == b.text


def test_revision_by_tag_or_branch_name_and_by_commit(hf_cache):
    main = cache_repo(hf_cache, "tiny/stories", stories_files())
    tagged = cache_repo(hf_cache, "tiny/stories", stories_files(), commit=OTHER_COMMIT,
                        refs=("v1.0", "dev"))
    assert resolve_hub_model("tiny/stories") == main
    assert resolve_hub_model("tiny/stories", revision="v1.0") == tagged
    assert resolve_hub_model("tiny/stories", revision="dev") == tagged
    assert resolve_hub_model("tiny/stories", revision=OTHER_COMMIT) == tagged


def test_unknown_revision_offline_names_repo_and_revision(hf_cache):
    cache_repo(hf_cache, "tiny/stories", stories_files())
    with pytest.raises(ModelLoadError, match=r"'tiny/stories' \(revision 'nope'\).*not in the "
                       r"local Hugging Face cache.*HF_HUB_OFFLINE"):
        resolve_hub_model("tiny/stories", revision="nope")


def test_missing_repo_offline_is_a_clear_error(hf_cache):
    with pytest.raises(ModelLoadError, match=r"'nobody/nothing' \(revision 'main'\) is not in "
                       r"the local Hugging Face cache .*HF_HUB_OFFLINE is set"):
        resolve_hub_model("nobody/nothing")


def test_gguf_file_of_a_cached_repo(hf_cache):
    snapshot = cache_repo(hf_cache, "tiny/stories-GGUF",
                          {"stories-Q8_0.gguf": b"GGUF q8", "stories-F32.gguf": b"GGUF f32",
                           "README.md": b"# tiny"})
    path = resolve_hub_model("tiny/stories-GGUF", gguf_file="stories-Q8_0.gguf")
    assert path == snapshot / "stories-Q8_0.gguf" and path.read_bytes() == b"GGUF q8"


def test_gguf_repo_without_gguf_file_lists_the_files(hf_cache):
    cache_repo(hf_cache, "tiny/stories-GGUF",
               {"stories-Q8_0.gguf": b"GGUF q8", "stories-F32.gguf": b"GGUF f32"})
    with pytest.raises(ModelLoadError, match=r"no safetensors.*pass gguf_file= one of: "
                       r"stories-F32\.gguf, stories-Q8_0\.gguf"):
        resolve_hub_model("tiny/stories-GGUF")


def test_gguf_file_not_cached_lists_the_cached_ones(hf_cache):
    cache_repo(hf_cache, "tiny/stories-GGUF", {"stories-Q8_0.gguf": b"GGUF q8"})
    with pytest.raises(ModelLoadError, match=r"'stories-Q4_0\.gguf' is not in the cached "
                       r"snapshot.*cached \.gguf files: stories-Q8_0\.gguf"):
        resolve_hub_model("tiny/stories-GGUF", gguf_file="stories-Q4_0.gguf")
    with pytest.raises(ModelLoadError, match="not in the local Hugging Face cache"):
        resolve_hub_model("tiny/absent-GGUF", gguf_file="x.gguf")
    with pytest.raises(ModelLoadError, match="must name a .gguf file"):
        resolve_hub_model("tiny/stories-GGUF", gguf_file="config.json")


def test_incomplete_cached_snapshot_names_the_missing_shard(hf_cache):
    files = stories_files()
    del files["model.safetensors"]
    files["model.safetensors.index.json"] = (
        b'{"weight_map": {"a": "model-00001-of-00002.safetensors", '
        b'"b": "model-00002-of-00002.safetensors"}}')
    files["model-00001-of-00002.safetensors"] = STORIES / "model.safetensors"
    cache_repo(hf_cache, "tiny/sharded", files)
    with pytest.raises(ModelLoadError, match=r"incomplete \(missing: "
                       r"model-00002-of-00002\.safetensors\).*without HF_HUB_OFFLINE"):
        resolve_hub_model("tiny/sharded")


def test_invalid_repo_id_is_refused_before_any_lookup(hf_cache):
    for bad in ("no-slash", "a/b/c", "a--b/c", "-a/b"):
        with pytest.raises(ModelLoadError, match="not a Hugging Face repo id"):
            resolve_hub_model(bad)


def test_looks_like_repo_id_on_paths_and_ids(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert looks_like_repo_id("meta-llama/Llama-3.2-1B")
    assert looks_like_repo_id("Qwen/Qwen2.5-0.5B-Instruct")
    assert looks_like_repo_id("TheBloke/Llama-2-7B-GGUF")
    (tmp_path / "models" / "local").mkdir(parents=True)
    assert not looks_like_repo_id("models/local")           # an existing directory wins
    assert not looks_like_repo_id(str(STORIES))             # absolute path: several slashes
    assert not looks_like_repo_id("stories260K-hf")         # no slash
    assert not looks_like_repo_id("./models")
    assert not looks_like_repo_id("~/models")
    assert not looks_like_repo_id("a/b/c")
    assert not looks_like_repo_id("org/model.gguf")          # a file name, not a repo
    assert not looks_like_repo_id("a--b/c") and not looks_like_repo_id("a/b..c")
    assert not looks_like_repo_id("org/" + "x" * 100)


# ---- the online path, with huggingface_hub's calls replaced (still no network) --------------

def test_online_fetches_only_the_loader_files(hf_cache, monkeypatch):
    """With the index present, only its shards are fetched: not the repo's second copy of the
    weights (consolidated.safetensors), its pickles or its README."""
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    listing = ["README.md", "config.json", "consolidated.safetensors",
               "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
               "model.safetensors.index.json", "pytorch_model.bin", "tokenizer.json",
               "original/consolidated.00.pth"]
    index = (b'{"weight_map": {"a": "model-00001-of-00002.safetensors", '
             b'"b": "model-00002-of-00002.safetensors"}}')
    calls: list[tuple[str, str | None, list[str], bool]] = []

    def list_repo_files(repo_id, *, revision=None, **kwargs):
        return listing

    def snapshot_download(repo_id, *, revision=None, allow_patterns=None,
                          local_files_only=False, **kwargs):
        assert "cache_dir" not in kwargs and "token" not in kwargs
        calls.append((repo_id, revision, list(allow_patterns), local_files_only))
        files: dict[str, Path | bytes] = {"config.json": STORIES / "config.json",
                                          "model.safetensors.index.json": index}
        if len(calls) == 2:
            files = {f: b"w" for f in allow_patterns if f.endswith(".safetensors")}
        repo = hf_cache / "models--org--big" / "snapshots" / COMMIT
        return str(cache_repo(hf_cache, repo_id, {f: d for f, d in files.items()
                                                  if not (repo / f).exists()}))

    monkeypatch.setattr(huggingface_hub, "list_repo_files", list_repo_files)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    path = resolve_hub_model("org/big", revision="v2")
    assert path == hf_cache / "models--org--big" / "snapshots" / COMMIT
    assert [c[1] for c in calls] == ["v2", "v2"] and not any(c[3] for c in calls)
    fetched = set(calls[1][2])
    assert {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
            "config.json", "tokenizer.json"} <= fetched
    assert not fetched & {"consolidated.safetensors", "pytorch_model.bin", "README.md"}


def test_online_gguf_only_repo_lists_its_files_without_downloading(hf_cache, monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(huggingface_hub, "list_repo_files",
                        lambda repo_id, **kw: ["README.md", "m-Q4_0.gguf", "m-Q8_0.gguf"])

    def no_download(*args, **kwargs):
        raise AssertionError("nothing may be downloaded")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_download)
    with pytest.raises(ModelLoadError, match="one of: m-Q4_0.gguf, m-Q8_0.gguf"):
        resolve_hub_model("org/m-GGUF")


def test_hub_errors_become_model_load_errors(hf_cache, monkeypatch):
    import httpx2
    import huggingface_hub
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    response = httpx2.Response(404, request=httpx2.Request("GET", "https://example.invalid"))
    cases = [(RepositoryNotFoundError("404", response=response),
              "no model repository 'org/none' on the Hugging Face Hub"),
             (RevisionNotFoundError("404", response=response),
              "revision 'v9' of 'org/none' does not exist"),
             (httpx2.ConnectError("down"), "cannot reach the Hugging Face Hub")]
    for error, message in cases:
        def list_repo_files(repo_id, *, revision=None, error=error, **kwargs):
            raise error

        monkeypatch.setattr(huggingface_hub, "list_repo_files", list_repo_files)
        with pytest.raises(ModelLoadError, match=message):
            resolve_hub_model("org/none", revision="v9")


def test_offline_set_after_import_still_keeps_it_offline(hf_cache, monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # env still "1"
    monkeypatch.setattr(huggingface_hub, "list_repo_files",
                        lambda *a, **kw: pytest.fail("the Hub was asked while offline"))
    assert hub.hub_offline()
    snapshot = cache_repo(hf_cache, "tiny/stories", stories_files())
    assert resolve_hub_model("tiny/stories") == snapshot


def test_llm_takes_repo_ids_directly(hf_cache):
    """LLM("org/name") and a GGUF repo with gguf_file, through tessellm.models.source."""
    from tessellm import LLM, SamplingParams

    cache_repo(hf_cache, "tiny/stories", stories_files())
    gguf = STORIES.parent / "stories260K" / "stories260K.gguf"
    cache_repo(hf_cache, "tiny/stories-GGUF", {"stories260K.gguf": gguf})
    params = SamplingParams(max_tokens=8, temperature=0)
    direct = LLM(str(STORIES), device="cpu", dtype="float32", load_progress=False)
    expected = direct.generate(["Once upon a time"], params)[0].token_ids
    for model, extra in (("tiny/stories", {}),
                         ("tiny/stories-GGUF", {"gguf_file": "stories260K.gguf"})):
        llm = LLM(model, device="cpu", dtype="float32", load_progress=False, **extra)
        assert llm.engine.parts.source.name == model  # the id the server reports
        assert llm.generate(["Once upon a time"], params)[0].token_ids == expected


def test_a_split_gguf_of_a_cached_repo_fetches_every_part(hf_cache):
    parts = {f"m/model-Q4_K_M-{i:05d}-of-00003.gguf": f"GGUF part {i}".encode()
             for i in (1, 2, 3)}
    snapshot = cache_repo(hf_cache, "tiny/split-GGUF", parts)
    path = resolve_hub_model("tiny/split-GGUF", gguf_file="m/model-Q4_K_M-00002-of-00003.gguf")
    assert path == snapshot / "m/model-Q4_K_M-00001-of-00003.gguf"
    del parts["m/model-Q4_K_M-00003-of-00003.gguf"]
    cache_repo(hf_cache, "tiny/split-missing", parts)
    with pytest.raises(ModelLoadError, match=r"'m/model-Q4_K_M-00003-of-00003\.gguf' is not in "
                       r"the cached snapshot"):
        resolve_hub_model("tiny/split-missing", gguf_file="m/model-Q4_K_M-00001-of-00003.gguf")
