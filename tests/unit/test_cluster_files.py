"""The cluster files of cluster_configs/ and the jobs that name them: every `ray up` file passes
Ray's own `prepare_config` + `validate_config`, runs Ray 2.60 on Python 3.11 and installs the
package on every node; the KubeRay manifests use the image the Dockerfile builds; every cluster
file reads without a problem and every job fits the cluster files it names; the reader flags
insecure and inconsistent files; the firewall stays inside the VPC."""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from ray._private.accelerators.tpu import TPUAcceleratorManager
from ray.autoscaler._private.util import prepare_config, validate_config

from ray_diloco.cluster.files import read_cluster_files
from ray_diloco.config import load_config

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "cluster_configs"
PACKAGE_DIR = "/home/ray/ray_diloco"
RAY_PIN = re.search(
    r"ray\[default\]==([\d.]+)",
    " ".join(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]),
).group(1)  # type: ignore[union-attr]


def _docs(path: Path) -> list[Any]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


RAY_UP = sorted(p for p in CONFIGS.rglob("*.yaml") if "available_node_types" in _docs(p)[0])
KUBERAY = sorted(
    p for p in CONFIGS.rglob("*.yaml") if any(d.get("kind") == "RayCluster" for d in _docs(p))
)
CLUSTER_JOBS = sorted(
    p
    for p in (ROOT / "jobs").glob("*.yaml")
    if (yaml.safe_load(p.read_text()) or {}).get("cluster")
)
_rel = lambda p: str(p.relative_to(ROOT))  # noqa: E731


def test_the_repository_has_both_kinds_of_cluster_files_and_jobs_for_them() -> None:
    assert len(RAY_UP) >= 2 and len(KUBERAY) >= 1 and len(CLUSTER_JOBS) >= 2
    named = {f for job in CLUSTER_JOBS for f in load_config(job).cluster.files}
    assert {_rel(p) for p in RAY_UP + KUBERAY} <= named  # no cluster file that no job uses


@pytest.mark.parametrize("path", RAY_UP, ids=_rel)
def test_ray_up_file_passes_rays_own_schema(path: Path) -> None:
    prepared = prepare_config(yaml.safe_load(path.read_text()))
    validate_config(prepared)  # raises on a schema error
    for node_type in prepared["available_node_types"].values():
        accel = node_type["node_config"].get("acceleratorType")
        if accel is not None:
            assert TPUAcceleratorManager.is_valid_tpu_accelerator_type(accel), accel


@pytest.mark.parametrize("path", RAY_UP, ids=_rel)
def test_ray_up_file_installs_the_package_on_python_311_on_every_node(path: Path) -> None:
    prepared = prepare_config(yaml.safe_load(path.read_text()))
    assert prepared["docker"]["image"] == f"rayproject/ray:{RAY_PIN}-py311"
    assert prepared["file_mounts"][PACKAGE_DIR] == "."
    for name, node_type in prepared["available_node_types"].items():
        is_head = name == prepared["head_node_type"]
        commands = node_type.get("worker_setup_commands") or (
            prepared["head_setup_commands"] if is_head else prepared["worker_setup_commands"]
        )
        installs = [c for c in commands if "pip install -e" in c and PACKAGE_DIR in c]
        assert installs, (name, commands)
        if "acceleratorType" in node_type["node_config"]:
            assert any("[tpu]" in c for c in installs), (name, installs)


def test_kuberay_pods_run_the_dockerfile_image_and_the_job_its_console_script() -> None:
    dockerfile = (CONFIGS / "docker" / "Dockerfile").read_text()
    assert f"FROM rayproject/ray:{RAY_PIN}-py311" in dockerfile  # built in test_image.py
    assert (
        "ray-diloco" in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    )
    (cluster,) = [d for p in KUBERAY for d in _docs(p) if d.get("kind") == "RayCluster"]
    spec = cluster["spec"]
    assert spec["rayVersion"] == RAY_PIN
    groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
    images = {c["image"] for g in groups for c in g["template"]["spec"]["containers"]}
    assert images == {"REGISTRY/ray-diloco:TAG"}  # the one image the Dockerfile builds
    (job,) = _docs(CONFIGS / "kuberay" / "rayjob.yaml")
    assert job["spec"]["clusterSelector"] == {"ray.io/cluster": cluster["metadata"]["name"]}
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:2] == ["ray-diloco", "train"]
    job_file = argv[argv.index("--config") + 1]
    assert (ROOT / Path(job_file).relative_to(PACKAGE_DIR)).is_file()  # copied into the image


@pytest.mark.parametrize("path", RAY_UP + KUBERAY, ids=_rel)
def test_cluster_file_reads_without_a_problem(path: Path) -> None:
    spec = read_cluster_files([path])
    assert spec.problems == ()
    assert spec.pools, "every cluster file here provides TPU slices"


@pytest.mark.parametrize("job", CLUSTER_JOBS, ids=_rel)
def test_job_fits_the_cluster_files_it_names(job: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ray_diloco.algorithm.setup import fragment_plan
    from ray_diloco.cluster.plan import make_plan

    monkeypatch.chdir(ROOT)
    cfg = load_config(job)
    plan = make_plan(cfg, read_cluster_files(cfg.cluster.files), fragment_plan(cfg).sizes)
    assert plan.problems == []
    assert all(site.pool is not None for site in plan.sites)
    assert plan.head is not None and plan.head.region == cfg.synchronizer.region


def _edited(tmp_path: Path, source: Path, edit: Any) -> Path:
    docs = _docs(source)
    edit(docs)
    path = tmp_path / source.name
    path.write_text(yaml.safe_dump_all(docs))
    return path


def _cluster(docs: list[Any]) -> dict[str, Any]:
    return next(d for d in docs if d.get("kind") == "RayCluster")["spec"]


def _set(tree: dict[str, Any], key: str, value: Any) -> None:
    tree[key] = value


KUBERAY_EDITS = {
    "token authentication is off": lambda d: _cluster(d).pop("authOptions"),
    "open beyond the cluster": lambda d: _set(
        _cluster(d)["headGroupSpec"], "serviceType", "LoadBalancer"
    ),
    "tpu-v5p topology 2x2x2 has no 1-host shape": lambda d: _set(
        _cluster(d)["workerGroupSpecs"][0], "numOfHosts", 1
    ),
    "no RAY_NODE_REGION": lambda d: _set(
        _cluster(d)["workerGroupSpecs"][0]["template"]["spec"]["containers"][0], "env", []
    ),
    "no containerPort 8081": lambda d: _set(
        _cluster(d)["workerGroupSpecs"][0]["template"]["spec"]["containers"][0], "ports", []
    ),
    "needs JAX_PLATFORMS=tpu,cpu, ENABLE_PJRT_COMPATIBILITY=true": lambda d: _set(
        _cluster(d)["workerGroupSpecs"][1]["template"]["spec"]["containers"][0],
        "env",
        [{"name": "RAY_NODE_REGION", "value": "us-east5"}],
    ),
    "is ct6e-standard-4t": lambda d: _set(
        _cluster(d)["workerGroupSpecs"][1]["template"]["spec"]["nodeSelector"],
        "node.kubernetes.io/instance-type",
        "ct6e-standard-8t",
    ),
}


@pytest.mark.parametrize("needle", sorted(KUBERAY_EDITS))
def test_reader_flags_a_bad_kuberay_manifest(tmp_path: Path, needle: str) -> None:
    path = _edited(tmp_path, CONFIGS / "kuberay" / "raycluster.yaml", KUBERAY_EDITS[needle])
    problems = read_cluster_files([path]).problems
    assert len(problems) == 1 and needle in problems[0], problems


def _head_start(docs: list[Any], old: str, new: str) -> None:
    docs[0]["head_start_ray_commands"] = [
        c.replace(old, new) for c in docs[0]["head_start_ray_commands"]
    ]


RAY_UP_EDITS = {
    "the dashboard listens on 0.0.0.0": lambda d: _head_start(d, "=127.0.0.1", "=0.0.0.0"),
    "token authentication is off": lambda d: _head_start(d, "RAY_AUTH_MODE=token ", ""),
    "make them agree": lambda d: _head_start(d, "REGION=us-east5", "REGION=us-central1"),
    "'v5p-24' is not a known slice": lambda d: _set(
        d[0]["available_node_types"]["v5p_2x2x2"]["node_config"], "acceleratorType", "v5p-24"
    ),
}


@pytest.mark.parametrize("needle", sorted(RAY_UP_EDITS))
def test_reader_flags_a_bad_ray_up_file(tmp_path: Path, needle: str) -> None:
    path = _edited(tmp_path, CONFIGS / "gcp" / "us-east5.yaml", RAY_UP_EDITS[needle])
    problems = read_cluster_files([path]).problems
    assert len(problems) == 1 and needle in problems[0], problems


def test_firewall_rules_admit_only_the_vpc_subnets_and_admin_ssh() -> None:
    script = (CONFIGS / "gcp" / "network.sh").read_text().replace("\\\n", " ")
    rules = [ln for ln in script.splitlines() if "firewall-rules create" in ln]
    assert len(rules) == 2
    for rule in rules:
        sources = re.search(r"--source-ranges=\"?([^\" ]+)", rule).group(1).split(",")  # type: ignore[union-attr]
        allow = re.search(r"--allow=(\S+)", rule).group(1)  # type: ignore[union-attr]
        assert "0.0.0.0/0" not in sources
        subnets = {"$US_CIDR", "$EU_CIDR"}
        assert set(sources) == subnets or (
            allow == "tcp:22" and set(sources) - subnets == {"$ADMIN_CIDR"}
        )
