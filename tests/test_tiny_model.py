"""The bundled tiny model: deterministic, small, cached once, and a working chat model in transformers."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from gym_resilience import models
from gym_resilience.cache import CACHE_ENV_VAR, cache_dir
from gym_resilience.errors import UnsupportedConfigError
from gym_resilience.models import TINY_MODEL_RECIPE, build_tiny_model

MESSAGES = [
    {"role": "system", "content": "You are an agent."},
    {"role": "user", "content": "Move left, then reward 12."},
]
RENDERED = (
    "<|im_start|>system\nYou are an agent.<|im_end|>\n"
    "<|im_start|>user\nMove left, then reward 12.<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def files_of(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


# -- the cache folder ----------------------------------------------------------------------------------


def test_cache_dir_is_the_env_var_when_set_and_is_created(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path / "somewhere" / "cache"))
    assert cache_dir() == tmp_path / "somewhere" / "cache"
    assert cache_dir().is_dir()


def test_cache_dir_defaults_to_the_user_cache(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv(CACHE_ENV_VAR, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_dir() == tmp_path / ".cache" / "gym_resilience"
    assert cache_dir().is_dir()


# -- building ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_same_recipe_builds_byte_identical_files_and_the_default_build_is_reused(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path / "cache"))
    default = build_tiny_model()
    assert default == tmp_path / "cache" / "models" / TINY_MODEL_RECIPE
    (tmp_path / "elsewhere").mkdir()  # an empty folder is filled
    explicit = build_tiny_model(tmp_path / "elsewhere")
    assert explicit == tmp_path / "elsewhere"
    ours, theirs = files_of(default), files_of(explicit)
    assert {"model.safetensors", "tokenizer.json", "config.json", "chat_template.jinja"} <= set(ours)
    assert ours == theirs

    weights_mtime = (default / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_model() == default
    assert (default / "model.safetensors").stat().st_mtime_ns == weights_mtime
    assert [p.name for p in (tmp_path / "cache" / "models").iterdir()] == [TINY_MODEL_RECIPE]


@pytest.mark.slow
def test_concurrent_builders_both_get_one_complete_model_and_leave_no_staging_folder(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path))
    # Both builders finish writing before either renames, so they really race for the final name.
    both_written = threading.Barrier(2, timeout=60)
    write = models._write

    def write_then_wait(folder: Path) -> None:
        write(folder)
        both_written.wait()

    monkeypatch.setattr(models, "_write", write_then_wait)
    results: list[Path] = []
    errors: list[BaseException] = []

    def build() -> None:
        try:
            results.append(build_tiny_model())
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert results == [tmp_path / "models" / TINY_MODEL_RECIPE] * 2
    assert [p.name for p in (tmp_path / "models").iterdir()] == [TINY_MODEL_RECIPE]
    assert (results[0] / "model.safetensors").is_file()


def test_a_folder_holding_something_else_is_refused_and_left_alone(tmp_path: Path, tiny_model: Path) -> None:
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="is not a tiny-chat-v2 model"):
        build_tiny_model(foreign)
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]


@pytest.mark.slow
def test_a_link_to_an_empty_folder_gets_the_model_built_into_that_folder(tmp_path: Path) -> None:
    folder = tmp_path / "disk" / "models"
    folder.mkdir(parents=True)
    link = tmp_path / "model"
    link.symlink_to(folder)
    built = build_tiny_model(link)
    assert built == folder.resolve()
    assert (folder / "model.safetensors").is_file() and link.is_symlink()
    assert build_tiny_model(link) == built  # and found there the next time


def test_the_tiny_model_is_small(tiny_model: Path) -> None:
    total = sum(path.stat().st_size for path in tiny_model.iterdir())
    assert total < 1 << 20


# -- the model and tokenizer in transformers -------------------------------------------------------


def test_the_tiny_model_loads_in_transformers_and_runs_a_forward_pass(tiny_model: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert model.dtype == torch.float32
    assert 100_000 < sum(p.numel() for p in model.parameters()) < 200_000
    ids = tokenizer.encode("Move left, then step 3.")
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), len(tokenizer))
    assert bool(torch.isfinite(logits).all())


def test_the_tokenizer_has_pad_and_eos_and_a_chatml_template(tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    assert len(tokenizer) == 1024
    assert tokenizer.pad_token_id == tokenizer.convert_tokens_to_ids("<pad>") == 0
    assert tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.bos_token_id == tokenizer.convert_tokens_to_ids("<s>")
    assert tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == RENDERED


def test_apply_chat_template_gives_a_plain_id_list_only_with_return_dict_false(tiny_model: Path) -> None:
    # transformers 5 returns a BatchEncoding for tokenize=True unless return_dict=False: the runner
    # needs the plain list[int].
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    ids = tokenizer.apply_chat_template(
        MESSAGES, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
    encoding = tokenizer.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)
    assert encoding["input_ids"] == ids
    assert tokenizer.decode(ids) == RENDERED
    assert ids[-3:] == [tokenizer.convert_tokens_to_ids("<|im_start|>"), *tokenizer.encode("assistant\n")]
    assert ids.count(tokenizer.eos_token_id) == 2


@pytest.mark.parametrize("text", ["Move left, then step 3.", '{"reward": -12}', "naïve café ✓\n\tend"])
def test_text_round_trips_through_encode_and_decode(tiny_model: Path, text: str) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert all(0 <= i < len(tokenizer) for i in ids)


def test_a_relative_cache_dir_is_taken_from_where_it_was_first_read(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(CACHE_ENV_VAR, f"relative-cache-{tmp_path.name}")
    monkeypatch.chdir(tmp_path)
    first = cache_dir()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert cache_dir() == first == tmp_path / f"relative-cache-{tmp_path.name}"


@pytest.mark.parametrize("value", ["{tmp}/a-file", "~no-such-user-of-this-machine/cache"])
def test_a_cache_dir_that_cannot_be_made_is_an_error_naming_the_variable(
    tmp_path: Path, monkeypatch, value: str
) -> None:
    (tmp_path / "a-file").write_text("in the way")
    monkeypatch.setenv(CACHE_ENV_VAR, value.format(tmp=tmp_path))
    with pytest.raises(UnsupportedConfigError, match=rf"^{CACHE_ENV_VAR}: cannot use \${CACHE_ENV_VAR}="):
        cache_dir()
