"""Mutation score of the method's core: mutmut changes one operator, constant or call at a time
in `algorithm/merge.py`, `outer.py`, `rounds.py`, `sync_core.py` and `version_history.py`
(`[tool.mutmut]` in pyproject.toml), runs the unit tests that reach the changed function, and a
mutant the tests still pass "survived". The score is the share of mutants a test or the type
checker caught.

Every survivor has a verdict in `benchmarks/mutation_verdicts.json` (why it is equivalent, or
which gap it shows), found by its function and the change it makes: mutmut numbers a
function's mutants in order, so an edit to the function renames them, and a verdict found by
name would judge whatever mutant took that number. A survivor without one is listed as "not
looked at". Needs the `mutation`
extra (`pip install -e '.[dev,mutation]'`); mutmut works in `mutants/` (ignored by git) and
keeps its verdicts there, so a run stopped half-way resumes where it was.

    python benchmarks/mutation.py [--jobs 2] [--report]   # --report: no run, only the JSON
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from collections import Counter
from pathlib import Path
from typing import Any

from common import parser, write_results

ROOT = Path(__file__).resolve().parent.parent
VERDICTS = Path(__file__).resolve().parent / "mutation_verdicts.json"
# mutmut's words for a mutant the suite detected: a failing test, a test that ran past its
# timeout (a mutant that loops), or mypy rejecting the mutated code before any test ran
CAUGHT = {"killed", "timeout", "caught by type check"}
GOAL = 0.9


def mutmut(*args: str) -> str:
    """Run mutmut (the one installed beside this Python) in the repository root."""
    done = subprocess.run(
        [sys.executable, "-m", "mutmut", *args], cwd=ROOT, capture_output=True, text=True
    )
    if done.returncode:
        sys.exit(f"error: mutmut {' '.join(args)} failed:\n{done.stdout}{done.stderr}")
    return done.stdout


def statuses() -> dict[str, str]:
    """Every mutant's verdict, by mutmut's name for it (`module.x_function__mutmut_N`)."""
    found = re.findall(r"^\s+(\S+): (.+)$", mutmut("results", "--all", "true"), re.M)
    return dict(found)


def changed_lines(name: str) -> list[str]:
    """The mutant's diff, only the lines it removes and adds."""
    diff = mutmut("show", name).splitlines()
    return [
        line
        for line in diff
        if line[:1] in "+-" and not line.startswith(("+++", "---")) and line[1:].strip()
    ]


def function_of(name: str) -> str:
    """The mutated function, as mutmut names it (`module.x_function`)."""
    return name.rsplit("__mutmut_", 1)[0]


def load_verdicts() -> dict[tuple[str, tuple[str, ...]], str]:
    """(function, the change's lines) -> verdict. The file lists each as the mutant's name
    when judged (for a reader), its change and the verdict."""
    listed = json.loads(VERDICTS.read_text()) if VERDICTS.exists() else []
    return {(function_of(v["mutant"]), tuple(v["change"])): v["verdict"] for v in listed}


def file_of(name: str) -> str:
    return name.split(".x")[0].rsplit(".", 1)[-1] + ".py"


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=2, help="mutants tested at once")
    p.add_argument("--report", action="store_true", help="write the JSON from mutmut's results")
    args = p.parse_args()
    if not args.report:
        # Every mutant's tests run in a fresh process, whose first model build compiles for
        # seconds; JAX's persistent cache, shared by all of them, turns that into a load.
        cache = ROOT / "mutants" / "jax-cache"
        env = {
            "JAX_COMPILATION_CACHE_DIR": str(cache),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
        }
        # mutmut prints a progress line per mutant; its verdicts are read back below
        subprocess.run(
            [sys.executable, "-m", "mutmut", "run", "--max-children", str(args.jobs)],
            cwd=ROOT,
            check=True,
            env={**os.environ, **env},
        )
    found = statuses()
    if not found:
        sys.exit("error: mutmut has no results; run without --report first")
    # a run stopped before its end leaves mutants no test has judged yet: counted apart
    checked = {n: s for n, s in found.items() if s != "not checked"}
    verdicts = load_verdicts()
    rows: list[dict[str, Any]] = []
    for module in sorted({file_of(n) for n in found}):
        mine = Counter(s for n, s in found.items() if file_of(n) == module)
        judged = sum(mine.values()) - mine["not checked"]
        rows.append(
            {
                "file": module,
                "mutants": sum(mine.values()),
                "not_checked": mine["not checked"],
                "killed": mine["killed"],
                "timeout": mine["timeout"],
                "type_check": mine["caught by type check"],
                "survived": mine["survived"],
                "no_tests": mine["no tests"],
                "score": sum(mine[s] for s in CAUGHT) / judged if judged else None,
            }
        )
    caught = sum(s in CAUGHT for s in checked.values())
    survivors = []
    for name, status in sorted(checked.items()):
        if status in CAUGHT:
            continue
        change = changed_lines(name)
        verdict = verdicts.get((function_of(name), tuple(change)), "not looked at")
        survivors.append({"mutant": name, "status": status, "change": change, "verdict": verdict})
    equivalent = sum(s["verdict"].startswith("equivalent") for s in survivors)
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]
    meta = {
        "files": config["only_mutate"],
        "tests": config["pytest_add_cli_args_test_selection"],
        "mutants": len(found),
        "checked": len(checked),
        "caught": caught,
        "score": caught / len(checked),
        "equivalent": equivalent,
        "score_without_equivalent": caught / (len(checked) - equivalent),
        "goal": GOAL,
        "not_looked_at": sum(s["verdict"] == "not looked at" for s in survivors),
        "survivors": survivors,
    }
    write_results(args.out, "mutation", rows, list(rows[0]), meta)
    print(
        f"score {meta['score']:.1%} ({caught} of {len(checked)} checked mutants caught, "
        f"{len(found) - len(checked)} not checked), {meta['score_without_equivalent']:.1%} "
        f"without the {equivalent} equivalent; {meta['not_looked_at']} survivors not looked at"
    )


if __name__ == "__main__":
    main()
