"""The registry data, user aliases and model-name resolution."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ruvllm_cli.errors import CacheError, ModelNotFoundError, UsageError
from ruvllm_cli.quantization import Quantization
from ruvllm_cli.registry.registry import (ModelRef, add_user_alias, aliases_path, builtin_entries, is_repo_id,
                                          load_registry, remove_user_alias, resolve_model)

BUILTIN_ALIASES = ["qwen", "mistral", "phi", "llama", "qwen-coder", "qwen-large",
                   "qwen-0.5b", "qwen-1.5b", "llama-1b", "smollm"]


@pytest.fixture
def config_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty config dir; the working dir is a fresh tmp dir so no stray path shadows a name."""
    directory = tmp_path / "config"
    monkeypatch.setenv("RUVLLM_CONFIG_DIR", str(directory))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return directory


# --- built-in data -------------------------------------------------------------------------------

def test_builtin_aliases_in_order() -> None:
    assert list(builtin_entries()) == BUILTIN_ALIASES


@pytest.mark.parametrize("alias", BUILTIN_ALIASES)
def test_builtin_entry_is_complete_and_exact(alias: str) -> None:
    entry = builtin_entries()[alias]
    assert is_repo_id(entry.repo_id)
    assert entry.name and entry.architecture and entry.use_case and entry.notes
    assert entry.architecture.endswith("ForCausalLM")
    assert entry.params is not None and entry.params_b == pytest.approx(entry.params / 1e9, abs=5e-4)
    assert entry.context_length in {8192, 32768, 131072}
    assert entry.kv_shape is entry
    assert entry.recommended_quantization in set(Quantization)
    assert 0.0 <= entry.sampling.temperature <= 1.0 and 0.0 < entry.sampling.top_p <= 1.0
    assert entry.sampling.top_k >= 0 and entry.sampling.repetition_penalty >= 1.0
    assert not entry.user
    if entry.gguf_files:
        assert entry.gguf_repo and is_repo_id(entry.gguf_repo)
    assert set(entry.gguf_files) <= {Quantization.Q4_K_M, Quantization.Q8_0, Quantization.F16}
    for quant, filename in entry.gguf_files.items():
        # Exact single-file names only: the original tool asked the hub for a wildcard.
        assert re.fullmatch(r"[A-Za-z0-9._-]+\.gguf", filename), filename
        assert "-of-" not in filename
        markers = {"q4k": ("q4_k_m",), "q8": ("q8_0",), "f16": ("f16", "fp16")}[quant.value]
        assert any(marker in filename.lower() for marker in markers), filename


def test_gated_models_say_so() -> None:
    for alias in ("llama", "llama-1b"):
        assert "Gated" in builtin_entries()[alias].notes
        assert "HF_TOKEN" in builtin_entries()[alias].notes


# --- resolution ----------------------------------------------------------------------------------

def _model_dir(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    return path


def test_resolve_local_model_directory(config_dir: Path, tmp_path: Path) -> None:
    model = _model_dir(tmp_path / "my-model")
    ref = resolve_model(str(model))
    assert ref == ModelRef(kind="local", repo_id=None, local_path=model.resolve())
    assert ref.display_name == str(model.resolve())


def test_resolve_relative_directory_beats_an_alias(config_dir: Path) -> None:
    _model_dir(Path("qwen"))
    ref = resolve_model("qwen")
    assert ref.kind == "local" and ref.local_path == Path("qwen").resolve()


def test_resolve_gguf_file(config_dir: Path, tmp_path: Path) -> None:
    gguf = tmp_path / "model.Q4_K_M.gguf"
    gguf.write_bytes(b"GGUF")
    ref = resolve_model(str(gguf))
    assert ref.kind == "local" and ref.local_path == gguf and ref.is_gguf and ref.repo_id is None


@pytest.mark.parametrize("name", ["./plain-dir", "plain-dir"])
def test_directory_without_config_is_not_a_model(config_dir: Path, name: str) -> None:
    Path("plain-dir").mkdir()
    with pytest.raises(ModelNotFoundError, match=r"^'.*plain-dir' is not a model directory \(it has no config.json\)$"):
        resolve_model(name)


def test_missing_explicit_path(config_dir: Path) -> None:
    with pytest.raises(ModelNotFoundError, match=r"^no such file or directory: './nothing'$"):
        resolve_model("./nothing")
    with pytest.raises(ModelNotFoundError, match=r"^no such file or directory: 'gone.gguf'$"):
        resolve_model("gone.gguf")


def test_other_file_is_not_a_model(config_dir: Path) -> None:
    Path("notes.txt").write_text("hi")
    with pytest.raises(ModelNotFoundError, match="expected a directory with config.json or a .gguf file"):
        resolve_model("./notes.txt")


@pytest.mark.parametrize("name,alias,repo,revision", [
    ("qwen", "qwen", "Qwen/Qwen2.5-7B-Instruct", None),
    ("QWEN", "qwen", "Qwen/Qwen2.5-7B-Instruct", None),
    ("Qwen-0.5B", "qwen-0.5b", "Qwen/Qwen2.5-0.5B-Instruct", None),
    ("qwen@abc123", "qwen", "Qwen/Qwen2.5-7B-Instruct", "abc123"),
    ("smollm@refs/pr/1", "smollm", "HuggingFaceTB/SmolLM2-360M-Instruct", "refs/pr/1"),
    ("  llama-1b  ", "llama-1b", "meta-llama/Llama-3.2-1B-Instruct", None),
])
def test_resolve_alias(config_dir: Path, name: str, alias: str, repo: str, revision: str | None) -> None:
    ref = resolve_model(name)
    assert (ref.kind, ref.repo_id, ref.revision) == ("registry", repo, revision)
    assert ref.entry is not None and ref.entry.alias == alias
    assert ref.display_name == (f"{alias}@{revision}" if revision else alias)


@pytest.mark.parametrize("name,repo,revision", [
    ("some-org/some-model", "some-org/some-model", None),
    ("some-org/some.model_v2@v1.0", "some-org/some.model_v2", "v1.0"),
    ("org/name@" + "a" * 40, "org/name", "a" * 40),
])
def test_resolve_hub_id(config_dir: Path, name: str, repo: str, revision: str | None) -> None:
    ref = resolve_model(name)
    assert ref == ModelRef(kind="hub", repo_id=repo, revision=revision)
    assert ref.display_name == name


def test_hub_id_of_a_registry_model_carries_its_entry(config_dir: Path) -> None:
    ref = resolve_model("qwen/qwen2.5-0.5b-instruct")
    assert ref.kind == "hub" and ref.entry is not None and ref.entry.alias == "qwen-0.5b"


def test_typo_suggests_the_nearest_alias(config_dir: Path) -> None:
    with pytest.raises(ModelNotFoundError) as caught:
        resolve_model("qwne")
    assert caught.value.message == "unknown model 'qwne'"
    assert caught.value.hint.startswith("did you mean 'qwen'? Aliases: ")
    for alias in BUILTIN_ALIASES:
        assert alias in caught.value.hint


def test_a_name_far_from_every_alias_gets_no_guess_but_a_way_to_name_it(config_dir: Path) -> None:
    """Issue 23, item 7: `chat mytiny` suggested 'mistral'."""
    with pytest.raises(ModelNotFoundError) as caught:
        resolve_model("mytiny")
    assert caught.value.exit_code == 1
    assert caught.value.hint == (
        f"aliases: {', '.join(sorted(BUILTIN_ALIASES))}; or give a Hugging Face id (org/name) or a local path; "
        "to name your own model: ruvllm alias set mytiny ORG/NAME (or a local directory)")


@pytest.mark.parametrize("name,message", [
    ("a/b/c", "invalid Hugging Face model id 'a/b/c'"),
    ("org/", "invalid Hugging Face model id 'org/'"),
    ("org//name", "invalid Hugging Face model id 'org//name'"),
    ("org/bad name", "invalid Hugging Face model id 'org/bad name'"),
    ("org/a--b", "invalid Hugging Face model id 'org/a--b'"),
    ("qwen@", "invalid model reference 'qwen@'"),
    ("@main", "invalid model reference '@main'"),
    ("org/name@bad rev", "invalid model reference 'org/name@bad rev'"),
    ("", "empty model name"),
])
def test_malformed_names_are_usage_errors(config_dir: Path, name: str, message: str) -> None:
    with pytest.raises(UsageError) as caught:
        resolve_model(name)
    assert caught.value.message == message
    assert caught.value.exit_code == 2


# --- user aliases --------------------------------------------------------------------------------

def test_add_and_resolve_user_alias(config_dir: Path) -> None:
    entry = add_user_alias("mine", "someone/their-model", name="Their model")
    assert (entry.alias, entry.repo_id, entry.name, entry.user) == ("mine", "someone/their-model", "Their model", True)
    registry = load_registry()
    assert registry["mine"].user and list(registry)[:len(BUILTIN_ALIASES)] == BUILTIN_ALIASES
    ref = resolve_model("MINE@dev")
    assert (ref.kind, ref.repo_id, ref.revision, ref.entry.alias) == ("registry", "someone/their-model", "dev", "mine")
    stored = json.loads(aliases_path().read_text())
    assert stored == {"version": 1, "aliases": {"mine": {"repo_id": "someone/their-model", "name": "Their model"}}}
    # no temp file left; the lock file stays (deleting it would race a writer that opened it)
    assert sorted(p.name for p in config_dir.iterdir()) == [".aliases.json.lock", "aliases.json"]


def make_model_dir(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    return path


def test_user_alias_of_a_local_directory(config_dir: Path) -> None:
    """Issue 23, item 7: MODEL is a directory everywhere, so an alias may name one."""
    model = make_model_dir(Path("models/tiny")).resolve()
    entry = add_user_alias("mytiny", "./models/tiny")
    assert (entry.alias, entry.path, entry.repo_id, entry.name, entry.target) == (
        "mytiny", model, "", "tiny", str(model))
    stored = json.loads(aliases_path().read_text())
    assert stored["aliases"] == {"mytiny": {"path": str(model)}}  # absolute: works from any directory
    ref = resolve_model("mytiny")
    assert (ref.kind, ref.local_path, ref.repo_id, ref.entry.alias) == ("local", model, None, "mytiny")
    gguf = Path("tiny.gguf")
    gguf.write_bytes(b"GGUF")
    assert add_user_alias("g", "tiny.gguf").path == gguf.resolve()
    assert load_registry()["mytiny"].to_dict()["path"] == str(model)


def test_user_alias_of_a_local_model_that_went_away(config_dir: Path) -> None:
    make_model_dir(Path("tiny"))
    add_user_alias("mytiny", "./tiny")
    with pytest.raises(UsageError, match="'mytiny' is a local model .*: it has no revisions"):
        resolve_model("mytiny@main")
    Path("tiny").rename("moved")
    with pytest.raises(ModelNotFoundError) as caught:
        resolve_model("mytiny")
    assert caught.value.message == f"alias 'mytiny' points at {Path('tiny').resolve()}, which is not a model now"
    assert caught.value.hint == "point it elsewhere (ruvllm alias set mytiny PATH) or remove it (ruvllm alias rm mytiny)"


@pytest.mark.parametrize("target, message", [
    ("./missing", "no such file or directory: './missing'"),
    ("not-a-model", "'not-a-model' is not a model directory (it has no config.json)"),
])
def test_user_alias_of_a_path_that_is_no_model(config_dir: Path, target: str, message: str) -> None:
    Path("not-a-model").mkdir()
    with pytest.raises(ModelNotFoundError) as caught:
        add_user_alias("x", target)
    assert caught.value.message == message
    assert not aliases_path().exists()


def test_user_alias_defaults_name_to_the_repo_name(config_dir: Path) -> None:
    assert add_user_alias("x", "org/Great-Model").name == "Great-Model"


def test_an_alias_of_an_alias_is_refused_with_what_that_alias_names(config_dir: Path) -> None:
    """It said "invalid Hugging Face model id 'mine'"; the hint now gives the command to run."""
    add_user_alias("mine", "someone/their-model")
    for target, names in (("mine", "someone/their-model"), ("qwen", builtin_entries()["qwen"].repo_id)):
        with pytest.raises(UsageError) as refused:
            add_user_alias("other", target)
        assert refused.value.message.startswith(f"'{target}' is an alias itself")
        assert refused.value.hint == f"ruvllm alias set other {names}"
    assert "other" not in load_registry()


def test_user_alias_shadows_builtin_until_removed(config_dir: Path) -> None:
    add_user_alias("qwen", "me/my-qwen", recommended_quantization=Quantization.Q8_0)
    ref = resolve_model("qwen")
    assert ref.repo_id == "me/my-qwen" and ref.entry.user
    assert ref.entry.recommended_quantization is Quantization.Q8_0
    removed = remove_user_alias("qwen")
    assert removed.repo_id == "me/my-qwen"
    assert resolve_model("qwen").repo_id == "Qwen/Qwen2.5-7B-Instruct"


def test_user_alias_of_a_builtin_repo_inherits_its_facts(config_dir: Path) -> None:
    add_user_alias("tiny", "Qwen/Qwen2.5-0.5B-Instruct", name="Tiny")
    entry = load_registry()["tiny"]
    assert (entry.name, entry.params, entry.user) == ("Tiny", 494_032_768, True)
    assert entry.gguf_repo == "Qwen/Qwen2.5-0.5B-Instruct-GGUF"


def test_add_replaces_and_remove_keeps_others(config_dir: Path) -> None:
    add_user_alias("a", "org/one")
    add_user_alias("b", "org/two")
    add_user_alias("a", "org/three")
    assert load_registry()["a"].repo_id == "org/three"
    remove_user_alias("a")
    registry = load_registry()
    assert "a" not in registry and registry["b"].repo_id == "org/two"


def test_concurrent_alias_writes_keep_every_alias(config_dir: Path) -> None:
    """Eight `alias set` at once had kept two to four: each wrote back the file it had read."""
    from concurrent.futures import ThreadPoolExecutor

    names = [f"a{i}" for i in range(8)]
    with ThreadPoolExecutor(len(names)) as pool:
        list(pool.map(lambda name: add_user_alias(name, f"org/{name}"), names))
    assert sorted(name for name, entry in load_registry().items() if entry.user) == names
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(remove_user_alias, names[:4]))
    assert sorted(name for name, entry in load_registry().items() if entry.user) == names[4:]


@pytest.mark.parametrize("alias", ["Bad", "-x", "a b", "a/b", "", "ü"])
def test_invalid_alias_names(config_dir: Path, alias: str) -> None:
    with pytest.raises(UsageError, match="invalid alias name"):
        add_user_alias(alias, "org/name")
    assert not aliases_path().exists()


def test_an_alias_ending_in_gguf_is_refused(config_dir: Path) -> None:
    """`alias set my.gguf org/x` was stored, and then every use of `my.gguf` looked for a file."""
    with pytest.raises(UsageError) as refused:
        add_user_alias("my.gguf", "org/x")
    assert (refused.value.message, refused.value.hint) == (
        "invalid alias name 'my.gguf': a name ending in .gguf is read as a GGUF file's path",
        "choose a name without the .gguf ending, e.g. my")
    assert not aliases_path().exists()
    assert add_user_alias("my-gguf", "org/x").alias == "my-gguf"   # the word elsewhere is fine


def test_invalid_repo_and_fields(config_dir: Path) -> None:
    with pytest.raises(UsageError, match="invalid Hugging Face model id 'nope'"):
        add_user_alias("x", "nope")
    with pytest.raises(UsageError, match="unknown alias field"):
        add_user_alias("x", "org/name", colour="red")


def test_remove_unknown_and_builtin(config_dir: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="no user alias 'ghost'"):
        remove_user_alias("ghost")
    with pytest.raises(UsageError, match="'llama' is a built-in alias and cannot be removed"):
        remove_user_alias("llama")


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"aliases": {"x": "org/name"}}', '{"aliases": 3}'])
def test_corrupt_user_file_is_a_clear_error(config_dir: Path, content: str) -> None:
    config_dir.mkdir()
    path = config_dir / "aliases.json"
    path.write_text(content)
    with pytest.raises(CacheError) as caught:
        load_registry()
    assert str(path) in caught.value.message
    assert "delete it" in caught.value.hint
    with pytest.raises(CacheError):
        resolve_model("qwen")


def test_user_entry_missing_repo_is_a_clear_error(config_dir: Path) -> None:
    config_dir.mkdir()
    (config_dir / "aliases.json").write_text('{"aliases": {"x": {"name": "no repo"}}}')
    with pytest.raises(CacheError, match="invalid model entry in .*aliases.json"):
        load_registry()


@pytest.mark.parametrize("fields, complaint", [
    ({"params_b": "big"}, "x's params_b is 'big', not a number"),
    ({"context_length": 4096.5}, "x's context_length is 4096.5, not a whole number"),
    ({"num_layers": True}, "x's num_layers is True, not a whole number"),
    ({"sampling": {"temperature": "hot"}}, "x's sampling.temperature is 'hot', not a number"),
])
def test_a_number_field_that_is_no_number_is_a_clear_error(config_dir: Path, fields: dict, complaint: str) -> None:
    """`"params_b": "big"` had failed `ruvllm list` with a TypeError."""
    config_dir.mkdir()
    path = config_dir / "aliases.json"
    path.write_text(json.dumps({"aliases": {"x": {"repo_id": "org/x", **fields}}}))
    with pytest.raises(CacheError) as caught:
        load_registry()
    assert (caught.value.message, caught.value.hint) == (f"invalid model entry in {path}: {complaint}",
                                                         "fix or delete that entry")


def test_number_fields_take_ints_and_floats(config_dir: Path) -> None:
    config_dir.mkdir()
    (config_dir / "aliases.json").write_text(json.dumps({"aliases": {"x": {
        "repo_id": "org/x", "params_b": 7, "context_length": 32768, "sampling": {"temperature": 1, "top_p": 0.9}}}}))
    entry = load_registry()["x"]
    assert (entry.params, entry.context_length, entry.sampling.temperature) == (7_000_000_000, 32768, 1)


def test_explicit_config_dir_argument(tmp_path: Path) -> None:
    add_user_alias("elsewhere", "org/model", config_dir=tmp_path)
    assert load_registry(tmp_path)["elsewhere"].repo_id == "org/model"
    assert resolve_model("elsewhere", config_dir=tmp_path).repo_id == "org/model"
    remove_user_alias("elsewhere", config_dir=tmp_path)
    assert "elsewhere" not in load_registry(tmp_path)
