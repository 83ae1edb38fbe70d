"""Bad input never gives a traceback: every command answers a malformed YAML file,
a `--set` into a list without an index, an impossible output directory, a config file that is
a directory or a number it cannot read with one `error:` line naming the file or field and the
fix, exit code 2, and nothing written. Run in-process: each case fails before Ray or JAX
starts, which is the point."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from ray_diloco import cli
from ray_diloco.config import RunConfig


@pytest.fixture
def place(tmp_path: Path) -> Path:
    """A directory with a malformed YAML file, a directory named like a config, a plain file
    (no directory can be made under it) and the config.json of a (not running) run."""
    (tmp_path / "bad.yaml").write_text("name: x\n  bad: [\n")
    (tmp_path / "conf.yaml").mkdir()
    (tmp_path / "file").write_text("")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text(json.dumps(RunConfig().model_dump(mode="json")))
    return tmp_path


IMPOSSIBLE = "file/out"  # under a plain file


def _closed_port() -> int:
    """A local port nothing listens on (one the OS just handed out, closed again)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# Stands for a local address nothing listens on (Ray would retry it for ever, runtime/connect.py),
# picked when the case runs: the case's id must be the same in every pytest-xdist worker.
NO_CLUSTER = "NO_CLUSTER"
CASES = {
    # command -> [(arguments, what the error line must name)]
    "train": [
        (["--config", "bad.yaml"], "bad.yaml: not valid YAML (line 2, column 6"),
        (["--set", "learners.x=1"], "--set learners.x: learners is a list of 4 items"),
        (["--set", f"run_dir={IMPOSSIBLE}"], "run_dir=file/out: "),
        (["--config", "conf.yaml"], "config file conf.yaml is a directory"),
        (["--set", "token_budget=1e-3"], "invalid configuration"),
        (["--address", NO_CLUSTER], f"no Ray cluster at {NO_CLUSTER}"),
    ],
    "simulate": [
        (["--config", "bad.yaml"], "bad.yaml: not valid YAML"),
        (["--set", "learners.x=1"], "--set learners.x: "),
        (["--set", "run_dir=/proc/no/such/dir"], "run_dir=/proc/no/such/dir: cannot write in"),
        (["--config", "conf.yaml"], "is a directory"),
        (["--set", "learners.0.batch_size=1.5e-1"], "learners.0.batch_size"),
    ],
    "simulate-goodput": [
        (["--config", "bad.yaml"], "bad.yaml: not valid YAML"),
        (["--set", "learners.x=1"], "--set learners.x: "),
        (["--out", IMPOSSIBLE], "--out=file/out: "),
        (["--config", "conf.yaml"], "is a directory"),
        (["--set", "goodput_sim.chips=1.5e-2"], "goodput_sim.chips"),
    ],
    "simulate-bandwidth": [
        (["--config", "bad.yaml"], "bad.yaml: not valid YAML"),
        (["--set", "learners.x=1"], "--set learners.x: "),
        (["--out", IMPOSSIBLE], "--out=file/out: "),
        (["--config", "conf.yaml"], "is a directory"),
        (["--set", "bandwidth_sim.datacenters=2.5"], "bandwidth_sim.datacenters"),
    ],
    "prepare-data": [
        (["--input", "bad.yaml", "--out", IMPOSSIBLE], "--out=file/out: "),
        (["--input", "bad.yaml", "--out", "o", "--vocab-size", "1e2"], "--vocab-size 100"),
    ],
    "scale": [
        (["conf.yaml"], "conf.yaml/config.json not found"),
        (["run", "--add", "name=[x"], "--add name: not valid YAML"),
        (["run", "--add", "batch_size=1e3"], "the learner needs a name"),
        (["run", "--list", "--address", NO_CLUSTER], f"no Ray cluster at {NO_CLUSTER}"),
    ],
}


@pytest.mark.parametrize(
    ("command", "args", "names"),
    [(command, args, names) for command, cases in CASES.items() for args, names in cases],
)
def test_bad_input_is_one_error_line_exit_2_and_nothing_written(
    place: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    command: str,
    args: list[str],
    names: str,
) -> None:
    monkeypatch.chdir(place)
    address = f"127.0.0.1:{_closed_port()}"
    args, names = (
        [address if a == NO_CLUSTER else a for a in args],
        names.replace(NO_CLUSTER, address),
    )
    before = sorted(p.relative_to(place) for p in place.rglob("*"))
    assert cli.main([command, *args]) == 2
    out, err = capsys.readouterr()
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith("error:"), err
    assert names in err, err  # on the error line, or (a list of fields) just below it
    assert "Traceback" not in out + err
    assert sorted(p.relative_to(place) for p in place.rglob("*")) == before  # nothing written


def test_a_number_written_1e6_is_read_as_a_number(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["simulate-bandwidth", "--datacenters", "4", "--links", "5"]) == 0
    assert cli.main(["simulate-goodput", "--chips", "1e6", "--days", "0.01"]) == 0
    assert "1,000,000" in capsys.readouterr().out


def test_a_cluster_that_refuses_the_token_is_named_with_the_fix() -> None:
    """Ray 2.60's chain when token auth is on and this process has no token (measured
    against `ray start --head`): a ConnectionError raised while handling a RuntimeError whose
    text carries the GCS client's InvalidAuthToken."""
    from ray_diloco.runtime.connect import _why

    address = "10.0.0.2:6379"
    try:
        try:
            raise RuntimeError("Failed to connect to GCS. ... InvalidAuthToken: token missing")
        except RuntimeError:
            raise ConnectionError(f"Failed to connect to Ray cluster at {address}")  # noqa: B904 - as Ray does
    except ConnectionError as err:
        why = _why(address, err)
    assert why.startswith(f"Ray at {address} refused this process's token")
    assert "RAY_AUTH_MODE=token" in why
    other = _why(address, ConnectionError(f"Failed to connect to Ray cluster at {address}"))
    assert other.startswith(f"no Ray cluster at {address} (Failed to connect")


def test_what_address_is_tried_before_ray_and_what_is_left_to_it() -> None:
    from ray_diloco.runtime.connect import gcs_host_port

    assert gcs_host_port("10.0.0.2:6379") == ("10.0.0.2", 6379)
    assert gcs_host_port("[::1]:6379") == ("::1", 6379)  # an IPv6 head, brackets off
    assert gcs_host_port("head.example:6379") == ("head.example", 6379)
    for left_to_ray in ("auto", "local", "ray://10.0.0.2:10001", "10.0.0.2"):
        assert gcs_host_port(left_to_ray) is None
