"""The bundled tiny model: a random-weight chat LM built locally, so everything runs with no model hub.

``build_tiny_model()`` trains a byte-level BPE tokenizer on text generated from a fixed seed, wraps it
with a ChatML chat template, and saves a two-layer Llama with random weights from a fixed seed. It is
about 150k parameters, under 1 MB on disk, and loads in transformers and vLLM. Its output is nonsense:
it exists to exercise real generation (token counts, logprobs, finish reasons, batching, cancellation),
not to be good at anything.

The same recipe gives byte-identical files, so a change to the recipe must bump ``TINY_MODEL_RECIPE``:
the default path is keyed by it, and a cached build of an older recipe is simply left behind.
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import json
import os
import random
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gym_resilience.cache import cache_dir
from gym_resilience.engines.vllm_common import check_torch_extensions

__all__ = [
    "TINY_MODEL_RECIPE",
    "build_tiny_model",
]

TINY_MODEL_RECIPE = "tiny-chat-v2"

# A file written last inside the build folder: a folder holding it is a complete tiny model.
_MARKER = "gym_resilience_recipe.json"

_SEED = 0
_VOCAB_SIZE = 1024
_MAX_POSITIONS = 4096

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<s>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
# Ids 0..3, in this order: the trainer places special tokens first.
_SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_WORD_TEXT = """
the a an of to in on at for with from by and or but not no yes is are was were be been have has had
do does did can could will would should may might must this that these those it its he she they we
you i me my your our their his her them us what which who when where why how all any each every some
many much more most few less one two three four five six seven eight nine ten first last next new
old good bad big small long short high low left right up down forward back move step go stop turn
take put get give make see look find keep hold push pull open close run walk jump wait try win lose
play start end reset done action observation reward state agent environment episode goal hole ice
frozen lake cart pole angle velocity position grid cell row column north south east west red green
blue box key door wall floor room path map water fire answer question number value score point total
sum count think plan because so then if else while until after before again always never now here
there today time day world game level
"""
_WORDS = tuple(_WORD_TEXT.split())
_ROLES = ("system", "user", "assistant", "tool")
_PUNCTUATION = (".", ".", ".", "!", "?", ",", ";", ":")


def _corpus(rng: random.Random, n_lines: int = 4000) -> Iterator[str]:
    """Yield deterministic training text: sentences, numbers, simple JSON and chat-shaped lines."""
    for _ in range(n_lines):
        kind = rng.random()
        if kind < 0.55:
            words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 14))]
            sentence = " ".join(words)
            yield sentence[0].upper() + sentence[1:] + rng.choice(_PUNCTUATION)
        elif kind < 0.7:
            numbers = [str(rng.randint(0, 10 ** rng.randint(1, 4))) for _ in range(rng.randint(1, 6))]
            yield rng.choice(("", "step ", "reward ", "action ")) + " ".join(numbers)
        elif kind < 0.85:
            key, other = rng.choice(_WORDS), rng.choice(_WORDS)
            yield json.dumps({key: rng.randint(-50, 50), other: rng.choice(_WORDS)})
        else:
            content = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(2, 10)))
            yield f"{rng.choice(_ROLES)}\n{content}\n"


def _import(name: str) -> Any:
    # Untyped on purpose: mypy runs with and without these heavy packages installed, and their own
    # annotations (where present) are incomplete enough to need ignores that would then go unused.
    return importlib.import_module(name)


def _build_tokenizer() -> Any:
    tokenizers = _import("tokenizers")
    decoders, models, pre_tokenizers = tokenizers.decoders, tokenizers.models, tokenizers.pre_tokenizers
    transformers = _import("transformers")

    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = tokenizers.processors.ByteLevel(trim_offsets=False)
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=_VOCAB_SIZE,
        special_tokens=list(_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_corpus(random.Random(_SEED)), trainer=trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS_TOKEN,
        eos_token=IM_END_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START_TOKEN],
        chat_template=CHAT_TEMPLATE,
        model_max_length=_MAX_POSITIONS,
        clean_up_tokenization_spaces=False,
    )


def _build_model(tokenizer: Any) -> Any:
    torch = _import("torch")
    transformers = _import("transformers")

    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        # Head dim 32 is the smallest the vLLM CPU attention backend supports.
        num_key_value_heads=2,
        max_position_embeddings=_MAX_POSITIONS,
        tie_word_embeddings=True,
        # The default 0.02 gives near-uniform logits (argmax ties in bf16, greedy stuck on one token);
        # 0.3 gives a peaked, varied greedy continuation that stays stable across batch shapes.
        initializer_range=0.3,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    # fork_rng: seeding must not disturb the caller's global torch RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SEED)
        model = transformers.LlamaForCausalLM(config)
    # float32 on disk, so vLLM runs it in float32: in bf16 the same prompt's logprobs moved by up to 0.05
    # with the batch it shared, enough to flip greedy argmax ties; in float32 they move by about 1e-6.
    model = model.to(torch.float32)
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return model


def _is_complete(path: Path) -> bool:
    marker = path / _MARKER
    if not marker.is_file():
        return False
    try:
        return bool(json.loads(marker.read_text(encoding="utf-8")).get("recipe") == TINY_MODEL_RECIPE)
    except (OSError, ValueError):
        return False


def _write(folder: Path) -> None:
    tokenizer = _build_tokenizer()
    model = _build_model(tokenizer)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / _MARKER).write_text(json.dumps({"recipe": TINY_MODEL_RECIPE}) + "\n", encoding="utf-8")


def build_tiny_model(path: str | Path | None = None) -> Path:
    """Build the bundled tiny chat model (tokenizer and weights) and return its folder.

    Args:
        path: where to put it. ``None`` means the shared cache, ``cache_dir()/models/<recipe>``,
            built once and reused. A folder that already holds this recipe's model is reused as is;
            an empty folder is filled; a non-empty folder holding anything else is refused.

    The model is written to a temporary sibling folder and renamed into place, so a crash leaves no
    half-built model and two concurrent builders both end up with the same complete one.

    Raises:
        FileExistsError: ``path`` is a non-empty folder (or a file) that is not this tiny model.
        BrokenDependencyError: a torch extension is installed but fails to import (see its fix).

    Example:
        >>> from transformers import AutoTokenizer  # doctest: +SKIP
        >>> tokenizer = AutoTokenizer.from_pretrained(build_tiny_model())  # doctest: +SKIP
    """
    target = Path(path) if path is not None else cache_dir() / "models" / TINY_MODEL_RECIPE
    # Resolved: a link to a folder is built into that folder (a rename onto the link would fail).
    target = target.expanduser().resolve()
    if _is_complete(target):
        return target
    check_torch_extensions()  # transformers imports them: a broken one fails with its fix, not deep inside
    _refuse_foreign(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.building-", dir=target.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the cached model is meant to be shared
    try:
        _write(staging)
        try:
            # Atomic on one filesystem; it also replaces an empty folder at the target.
            os.rename(staging, target)
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY) or not _is_complete(target):
                raise
            # Another builder got there first with the same recipe: theirs is as good as ours.
    finally:
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(staging)
    return target


def _refuse_foreign(target: Path) -> None:
    if target.is_dir() and not any(target.iterdir()):
        return
    if target.exists():
        raise FileExistsError(
            f"{target} exists and is not a {TINY_MODEL_RECIPE} model; pass an empty or new folder"
        )
