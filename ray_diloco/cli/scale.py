"""`ray-diloco scale RUN_DIR`: the parser; runtime/scale.py asks the running job's supervisor."""

from __future__ import annotations

from ray_diloco.cli.help import SPEC_FORMAT, parser


def scale_main(argv: list[str]) -> int:
    p = parser("scale")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the running job's run_dir (config.json)")
    p.add_argument(
        "--add", action="append", default=[], metavar="SPEC", help=f"learner to add; {SPEC_FORMAT}"
    )
    p.add_argument(
        "--remove", action="append", default=[], metavar="NAME", help="learner to remove"
    )
    p.add_argument("--list", action="store_true", help="print the learners and their states")
    p.add_argument("--address", default=None, help="Ray address (default: RAY_ADDRESS/auto)")
    args = p.parse_args(argv)
    from ray_diloco.runtime.scale import scale

    return scale(args.run_dir, args.add, args.remove, args.list, args.address)
