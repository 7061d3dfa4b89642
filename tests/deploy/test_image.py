"""deploy/Dockerfile: the CPU torch pin before the project, a non-root sidecar, its ports and probe.

No Docker daemon is needed: the Dockerfile is read instruction by instruction, and the files it
copies into the build stage are built into a wheel here, as `pip install .` does in the image.
"""

from __future__ import annotations

import fnmatch
import importlib.metadata
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path, PurePosixPath

import pytest

from tests.deploy.helpers import DEPLOY, K8S, REPO, dockerfile_stages, env_pairs, json_form, port_of, yaml_document

DOCKERFILE = DEPLOY / "Dockerfile"
TORCH_INDEX = "--index-url https://download.pytorch.org/whl/cpu"
PROJECT_INSTALL = re.compile(r"pip install (?:[^&;|]*\s)?\.(?:\s|$)")


@pytest.fixture(scope="module")
def stages():
    return dockerfile_stages(DOCKERFILE)


@pytest.fixture(scope="module")
def build_stage(stages):
    (stage,) = [s for s in stages if any(PROJECT_INSTALL.search(run) for run in s.all("RUN"))]
    return stage


@pytest.fixture(scope="module")
def final(stages):
    return stages[-1]


def makefile_torch() -> str:
    match = re.search(r"^TORCH\s*\?=\s*(\S+)", (REPO / "Makefile").read_text(), re.MULTILINE)
    assert match, "the Makefile no longer pins TORCH"
    return match.group(1)


def test_runtime_is_python_311_slim_like_the_stage_that_built_its_venv(build_stage, final):
    assert final.base == "python:3.11-slim-bookworm"  # the apt package names are bookworm's
    assert build_stage.base == final.base  # the venv is copied across: same interpreter path
    (copy,) = [c for c in final.all("COPY") if f"--from={build_stage.name}" in c]
    assert copy.split()[-1] == "/opt/venv"


def test_torch_is_pinned_to_the_cpu_build_before_the_project(build_stage):
    runs = build_stage.all("RUN")
    project = next(i for i, run in enumerate(runs) if PROJECT_INSTALL.search(run))
    torch = [i for i, run in enumerate(runs) if "torch==" in run]
    assert torch and torch[0] < project, "torch must be installed before the project"
    assert "torch==2.13.0" in runs[torch[0]] and TORCH_INDEX in runs[torch[0]]
    assert f"{makefile_torch()} " in runs[torch[0]] + " ", "the Dockerfile and the Makefile pin different torch"


def test_runs_as_the_non_root_user_the_daemonset_expects(final):
    users = final.all("USER")
    assert users, "the final stage sets no USER"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, f"USER {users[-1]}: give a numeric non-root uid (runAsNonRoot checks it)"
    pod = yaml_document(K8S / "daemonset.yaml")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsUser"] == int(uid)
    (chown,) = [c["command"] for c in pod["initContainers"] if c["command"][0] == "chown"]
    assert chown[1] == users[-1]


def test_entrypoint_ports_and_addresses(final):
    assert json_form(final.all("ENTRYPOINT")[-1]) == ["kvstore", "serve"]
    exposed = {int(port) for args in final.all("EXPOSE") for port in args.split()}
    env = env_pairs(final)
    assert exposed == {port_of(env["KVSTORE_ADDRESS"]), port_of(env["KVSTORE_HTTP_ADDRESS"]),
                       port_of(env["KVSTORE_DATA_ADDRESS"])} == {50551, 50552, 50553}
    assert env["KVSTORE_ADDRESS"].startswith("0.0.0.0:") and env["KVSTORE_HTTP_ADDRESS"].startswith("0.0.0.0:")
    assert env["KVSTORE_DISK_PATH"].startswith("/var/lib/kvstore/")


def test_the_image_builds_the_native_data_plane_and_carries_its_runtime(build_stage, final):
    runs = build_stage.all("RUN")
    project = next(i for i, run in enumerate(runs) if PROJECT_INSTALL.search(run))
    dev = [i for i, run in enumerate(runs)
           if all(package in run.split() for package in ("gcc", "g++", "pkg-config", "libgrpc++-dev", "libxxhash-dev"))]
    assert dev and dev[0] < project, "setup.py skips its extensions without gcc, g++, libgrpc++-dev and libxxhash-dev"
    assert any("setup.py" in args.split() for args in build_stage.all("COPY")), "pip install . builds them from setup.py"
    assert any(re.search(r"libgrpc\+\+1\.\d+", run) for run in final.all("RUN")), "no gRPC C++ runtime"


@pytest.mark.parametrize("tls", [False, True])
def test_healthcheck_asks_the_grpc_health_service_of_the_bound_port(final, tls):
    (healthcheck,) = final.all("HEALTHCHECK")
    command = healthcheck.split(" CMD ", 1)[1]
    assert command.startswith("grpc_health_probe ")
    assert [c for c in final.all("COPY") if c.split()[-1].endswith("/grpc_health_probe")], "no grpc_health_probe"
    env = {**env_pairs(final), "KVSTORE_ADDRESS": "0.0.0.0:6000"}
    if tls:
        env["KVSTORE_TLS_CERT"] = "/run/secrets/cert"
    # Docker runs the shell form with /bin/sh -c; echo shows the arguments the probe would get.
    args = subprocess.run(["/bin/sh", "-c", "echo " + command.removeprefix("grpc_health_probe ")], env=env,
                          capture_output=True, text=True, check=True).stdout.split()
    assert "-addr=127.0.0.1:6000" in args and "-service=kvstore.v1.KVStore" in args
    assert ("-tls" in args) is tls  # TLS exactly when the sidecar has a certificate


def test_the_kubernetes_probes_use_the_binary_the_image_installs(final):
    installed = {c.split()[-1].rsplit("/", 1)[1] for c in final.all("COPY")}
    container = yaml_document(K8S / "daemonset.yaml")["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["exec"]["command"][0] in installed


def context_copies(stage) -> list[tuple[str, str]]:
    """(repository path, destination relative to WORKDIR) of the stage's COPY from the build context."""
    copies = []
    for args in stage.all("COPY"):
        if "--from=" in args:
            continue
        *sources, dest = [w for w in args.split() if not w.startswith("--")]
        assert not dest.startswith("/"), f"COPY {args}: the test expects destinations relative to WORKDIR"
        for source in sources:
            into_dir = dest.endswith("/") or len(sources) > 1
            copies.append((source, str(PurePosixPath(dest) / PurePosixPath(source).name) if into_dir else dest))
    return copies


def dockerignore_patterns() -> list[str]:
    lines = (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def test_copied_sources_exist_and_are_not_dockerignored(build_stage):
    patterns = dockerignore_patterns()
    assert {".venv", ".git", "deploy/compose/secrets"} <= set(patterns)
    for source, _ in context_copies(build_stage):
        assert (REPO / source).exists(), source
        assert not any(fnmatch.fnmatch(source, p) for p in patterns), f"{source} is excluded from the context"


def offline_build_unavailable() -> str | None:
    """Why this interpreter cannot build the wheel without the network, or None if it can."""
    wanted = re.search(r'"setuptools>=(\d+)', (REPO / "pyproject.toml").read_text())
    try:
        have = int(importlib.metadata.version("setuptools").split(".")[0])
    except importlib.metadata.PackageNotFoundError:
        return "setuptools is not installed here (the image's pip fetches it)"
    if wanted and have < int(wanted.group(1)):
        return f"setuptools {have} here, the project builds with >={wanted.group(1)} (the image's pip fetches it)"
    return None


def test_the_copied_files_build_a_wheel_with_the_kvstore_command(build_stage, tmp_path):
    """What `pip install .` sees in the image: only the copied files (no network, no build isolation)."""
    if reason := offline_build_unavailable():
        pytest.skip(reason)
    source = tmp_path / "src"  # the build stage's WORKDIR
    for path, dest in context_copies(build_stage):
        origin, target = REPO / path, source / dest
        if origin.is_dir():
            shutil.copytree(origin, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(origin, target)
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                             "-q", "-w", str(tmp_path / "wheels"), str(source)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    (wheel,) = (tmp_path / "wheels").glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        entry_points = archive.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11")
    include = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = [p.parent.name for p in REPO.glob("*/__init__.py")
                if any(fnmatch.fnmatch(p.parent.name, pattern) for pattern in include)]
    assert "kvstore" in packages
    for package in packages:  # every package pyproject ships, as the repository has it
        assert f"{package}/__init__.py" in names, f"the image's wheel lacks {package}"
    assert "kvstore/service/metrics.py" in names and "kvstore/service/v1/kvstore_pb2.py" in names
    assert re.search(r"^kvstore = kvstore\.cli:main$", entry_points, re.MULTILINE)
    # setup.py's extensions, built with the build stage's packages, which `make test` installs here
    # too (SYSTEM_PACKAGES). Until session 28 the Dockerfile did not copy setup.py: the image had none of them.
    missing = native_build_tools_missing()
    assert missing is None, f"{missing}: run `make test`, which installs them, or apt-get install them"
    for module in ("kvstore/_chain", "kvstore/policies/_sampling", "kvstore/service/_dataplane"):
        assert any(n.startswith(module + ".") and n.endswith(".so") for n in names), f"the image's wheel lacks {module}"


def native_build_tools_missing() -> str | None:
    """What this machine lacks of the tools the image's build stage installs, or None."""
    needed = {"gcc": shutil.which("gcc"), "g++": shutil.which("g++"), "pkg-config": shutil.which("pkg-config"),
              "xxhash.h": Path("/usr/include/xxhash.h").exists()}
    if needed["pkg-config"]:
        needed["grpc++"] = subprocess.run(["pkg-config", "--exists", "grpc++"]).returncode == 0
    absent = [name for name, present in needed.items() if not present]
    return ", ".join(absent) + " not installed" if absent else None
