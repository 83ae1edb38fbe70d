"""The image of cluster_configs/docker/Dockerfile builds: its FROM, USER, WORKDIR, COPY and RUN
steps replayed in a scratch directory, with no Docker daemon and no network.

Each path of the image lives under the scratch root with the owner Docker gives it: the base
image's home belongs to the user it builds as (`ray`, uid 1000, in rayproject/ray); a COPY
belongs to its --chown user, else root; a WORKDIR that does not exist yet belongs to root under
Docker's classic builder, and to the current USER under BuildKit (its dispatchWorkdir makes the
directory as `Config.User`); the replay runs both. A RUN step runs as the build user for real:
what the image's user does not own is made read-only, and when the tests run as root the step's
process gives up its capabilities, so the kernel refuses its writes as it would refuse uid 1000's.
`pip install -e` is replayed by what it does in the project directory (setuptools' egg_info,
where the image's error "could not create 'ray_diloco.egg-info': Permission denied" comes from)
and `ray-diloco` by the package the editable install puts on the path.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "cluster_configs" / "docker" / "Dockerfile"
CONSTRAINTS = ROOT / "cluster_configs" / "docker" / "constraints.txt"
# What the replay knows of a base image: the user it builds as and that user's home.
BASE_IMAGES = {"rayproject/ray": ("ray", "/home/ray")}
BUILDERS = ("classic", "buildkit")


class BuildError(Exception):
    """A step of the Dockerfile that fails as it would in `docker build`."""


def _as_image_user() -> None:
    """In the child before exec: drop every capability from the bounding set, so a root process
    is held to the permission bits like any other user (PR_CAPBSET_DROP = 24)."""
    if os.geteuid() != 0:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in range(64):
        if libc.prctl(24, cap, 0, 0, 0) != 0 and ctypes.get_errno() == 22:  # EINVAL: no more
            break


@dataclass
class Replay:
    context: Path  # the build context (the repository root)
    scratch: Path  # the image's `/`
    builder: str
    user: str = "root"
    workdir: PurePosixPath = field(default_factory=lambda: PurePosixPath("/"))
    owners: dict[Path, str] = field(default_factory=dict)

    def host(self, path: str | PurePosixPath) -> Path:
        image_path = PurePosixPath(self.workdir, path)  # an absolute path stays itself
        return self.scratch / str(image_path).lstrip("/")

    def _make_dirs(self, path: Path, owner: str) -> None:
        missing = [p for p in (path, *path.parents) if not p.exists()]
        path.mkdir(parents=True, exist_ok=True)
        self.owners.update({p: owner for p in missing})

    def step(self, instruction: str, args: str) -> None:
        # The daemon writes the COPY and WORKDIR layers; a RUN writes as the image's user.
        self._permissions(self.user if instruction == "RUN" else "root")
        getattr(self, f"_{instruction.lower()}")(args)

    def _permissions(self, user: str) -> None:
        """What `user` does not own is read-only to it (root writes everywhere)."""
        for path, owner in self.owners.items():
            mode = 0o755 if path.is_dir() else 0o644
            path.chmod(mode if user in ("root", owner) else mode & ~0o222)

    def _from(self, args: str) -> None:
        image = args.split()[0].rsplit(":", 1)[0]
        if image not in BASE_IMAGES:
            raise BuildError(f"the replay knows no base image {image!r}; add it to BASE_IMAGES")
        self.user, home = BASE_IMAGES[image]
        self._make_dirs(self.scratch, "root")
        self._make_dirs(self.host(home), self.user)

    def _user(self, args: str) -> None:
        self.user = args.split(":")[0]

    def _workdir(self, args: str) -> None:
        self.workdir = PurePosixPath(self.workdir, args)
        self._make_dirs(self.host(self.workdir), "root" if self.builder == "classic" else self.user)

    def _copy(self, args: str) -> None:
        words = shlex.split(args)
        owner = "root"
        while words[0].startswith("--"):
            flag, _, value = words.pop(0).partition("=")
            if flag == "--chown":
                owner = value.split(":")[0]
        *sources, dest = words
        into_dir = dest.endswith("/") or len(sources) > 1
        target = self.host(dest)
        self._make_dirs(target if into_dir else target.parent, owner)
        for source in sources:
            src = self.context / source
            if not src.exists():
                raise BuildError(f"COPY {source}: not in the build context")
            out = target / src.name if into_dir else target
            if src.is_dir():
                shutil.copytree(src, out, ignore=shutil.ignore_patterns("__pycache__"))
                self.owners.update({p: owner for p in (out, *out.rglob("*"))})
            else:
                shutil.copy2(src, out)
                self.owners[out] = owner

    def _run(self, args: str) -> None:
        for command in args.split("&&"):
            self._command(shlex.split(command))

    def _command(self, argv: list[str]) -> None:
        if ">" in argv:
            argv = argv[: argv.index(">")]
        cwd = self.host(self.workdir)
        if argv[:2] == ["mkdir", "-p"]:
            self._exec(["mkdir", "-p", *(str(self.host(p)) for p in argv[2:])], cwd)
            self.owners.update({self.host(p): self.user for p in argv[2:]})
        elif argv[:2] == ["pip", "install"]:
            self._pip_install(argv[2:], cwd)
        elif argv[:1] == ["ray-diloco"]:
            env = {"PYTHONPATH": str(cwd)}  # where `pip install -e .` points the package
            self._exec([sys.executable, "-m", "ray_diloco.cli", *argv[1:]], cwd, env)
        else:
            raise BuildError(f"the replay cannot run `{shlex.join(argv)}`; teach it in {__file__}")

    def _pip_install(self, args: list[str], cwd: Path) -> None:
        for flag, value in itertools.pairwise(args):
            if flag in ("-c", "--constraint", "-r") and not (cwd / value).is_file():
                raise BuildError(f"pip install {flag} {value}: no such file in {cwd}")
        project = cwd / args[args.index("-e") + 1].split("[")[0]
        extras = args[args.index("-e") + 1].partition("[")[2].rstrip("]")
        declared = tomllib.loads((project / "pyproject.toml").read_text())["project"]
        for extra in filter(None, extras.split(",")):
            if extra not in declared.get("optional-dependencies", {}):
                raise BuildError(f"pip install -e: pyproject.toml has no extra {extra!r}")
        setup = "import setuptools; setuptools.setup()"
        self._exec([sys.executable, "-c", setup, "egg_info"], project)

    def _exec(self, argv: list[str], cwd: Path, env: dict[str, str] | None = None) -> None:
        done = subprocess.run(
            argv,
            cwd=cwd,
            env={**os.environ, **(env or {})},
            preexec_fn=_as_image_user,
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise BuildError(f"`{shlex.join(argv)}` failed: {done.stdout}{done.stderr}")


def steps(text: str) -> list[tuple[str, str]]:
    """The Dockerfile's instructions, continuation lines joined and comments dropped."""
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
    joined = "\n".join(lines).replace("\\\n", " ")
    return [
        (ln.split(None, 1)[0].upper(), ln.split(None, 1)[1])
        for ln in joined.splitlines()
        if ln.strip()
    ]


def replay(text: str, scratch: Path, builder: str) -> Replay:
    image = Replay(ROOT, scratch / "image", builder)
    for instruction, args in steps(text):
        image.step(instruction, args)
    return image


@pytest.mark.parametrize("builder", BUILDERS)
def test_the_image_builds_as_its_non_root_user(tmp_path: Path, builder: str) -> None:
    image = replay(DOCKERFILE.read_text(), tmp_path, builder)
    assert image.user == "ray"
    assert (image.host(image.workdir) / "ray_diloco.egg-info" / "PKG-INFO").is_file()


def _permission_bits_hold(scratch: Path) -> bool:
    """Whether a replayed step is refused a read-only directory here: not where the tests run
    as root in a container that may not drop capabilities (no CAP_SETPCAP)."""
    locked = scratch / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    touch = [sys.executable, "-c", f"open({str(locked / 'x')!r}, 'w')"]
    return subprocess.run(touch, preexec_fn=_as_image_user, capture_output=True).returncode != 0


def test_the_replay_fails_a_workdir_the_image_user_cannot_write(tmp_path: Path) -> None:
    """The step that makes the directory as `ray` is what lets pip write there: without it the
    classic builder's root-owned WORKDIR fails as the real build does."""
    if not _permission_bits_hold(tmp_path):
        pytest.skip("root here keeps its capabilities: the replay cannot refuse it a write")
    text = "\n".join(ln for ln in DOCKERFILE.read_text().splitlines() if "mkdir" not in ln)
    with pytest.raises(BuildError, match=r"could not create 'ray_diloco\.egg-info'"):
        replay(text, tmp_path, "classic")


def test_the_image_installs_with_the_constraints_and_they_pin_every_dependency() -> None:
    run = [args for instruction, args in steps(DOCKERFILE.read_text()) if instruction == "RUN"]
    installs = [shlex.split(c) for r in run for c in r.split("&&") if "pip install" in c]
    assert installs and all("-c" in argv for argv in installs)
    pins = {
        Requirement(ln).name.lower(): Requirement(ln)
        for ln in CONSTRAINTS.read_text().splitlines()
        if ln and not ln.startswith("#")
    }
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for text in project["dependencies"] + project["optional-dependencies"]["tpu"]:
        wanted = Requirement(text)
        if wanted.name.lower() == "jax" and wanted.extras:
            continue  # jax[tpu] is jax, pinned with the core; libtpu is pinned by jax[tpu]
        (version,) = (str(s.version) for s in pins[wanted.name.lower()].specifier)
        assert wanted.specifier.contains(version, prereleases=True), (wanted, version)
