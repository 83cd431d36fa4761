"""`swerl data ...` subcommands."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from swerl.data.naming import CONVENTIONS


def _prepare(args: argparse.Namespace) -> int:
    from swerl.data.prepare import DataSourceError, prepare

    try:
        report = prepare(
            args.sources,
            args.out,
            split=args.split,
            convention=args.image_convention,
            registry_prefix=args.registry_prefix,
            data_source=args.data_source,
            cache_dir=args.cache_dir,
        )
    except DataSourceError as exc:
        print(f"swerl data prepare: {exc}", file=sys.stderr)
        return 2
    print(report.render())
    if not report.kept and report.first_problem:
        # Nothing usable: say what is wrong with the first row, in one line.
        print(f"swerl data prepare: no row can be graded; {report.first_problem}", file=sys.stderr)
    print(f"wrote {args.out}/data.jsonl, instance_ids.txt, images.txt, skipped.jsonl, report.json")
    return 0 if report.kept else 1


def register(subparsers: argparse._SubParsersAction) -> None:
    data = subparsers.add_parser("data", help="dataset tools")
    commands = data.add_subparsers(dest="command", required=True)
    prepare = commands.add_parser(
        "prepare",
        help="Hugging Face SWE-bench/SWE-Gym datasets -> slime JSONL + image and id lists",
        description=(
            "Reads hub datasets or local parquet/jsonl/json/csv/arrow files (or save_to_disk"
            " directories) and writes OUT/data.jsonl ({text, metadata: {instance, data_source}}),"
            " OUT/instance_ids.txt, OUT/images.txt (for `swerl images pull`), OUT/skipped.jsonl"
            " (rows evaluation could not grade, with reasons) and OUT/report.json."
        ),
    )
    prepare.add_argument("sources", nargs="+", help="hub dataset names or local files")
    prepare.add_argument("--out", type=Path, required=True, help="output directory")
    prepare.add_argument("--split", default="train", help="split of hub/saved datasets")
    prepare.add_argument(
        "--image-convention",
        choices=CONVENTIONS,
        default="auto",
        help="image naming rule for rows without image_name (auto: SWE-Gym when the data source"
        " names it, else SWE-bench)",
    )
    prepare.add_argument(
        "--registry-prefix",
        default="",
        help="replaces docker.io/<namespace> in derived image names"
        " (e.g. mirror.local:5000/swebench)",
    )
    prepare.add_argument(
        "--data-source", help="metadata.data_source (default: the hub name or file stem)"
    )
    prepare.add_argument("--cache-dir", type=Path, help="Hugging Face datasets cache directory")
    prepare.set_defaults(handler=_prepare)
