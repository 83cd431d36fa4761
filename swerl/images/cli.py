"""`swerl images pull`, `swerl images status` and `swerl images prefetch`."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

from swerl.chassis.logging import configure_logging


def _images(args: argparse.Namespace) -> list[str]:
    from swerl.images.pull import read_image_list

    images: dict[str, None] = {}
    for path in args.images or ():
        images.update(dict.fromkeys(read_image_list(path)))
    images.update(dict.fromkeys(args.image or ()))
    return list(images)


def _inputs(args: argparse.Namespace) -> tuple[list[str], list[str]] | int:
    from swerl.images.pull import ImageListError, node_addresses

    try:
        images = _images(args)
    except ImageListError as exc:
        print(f"swerl images: {exc}", file=sys.stderr)
        return 2
    if not images:
        print("swerl images: no images given (--images FILE or --image NAME)", file=sys.stderr)
        return 2
    addresses = asyncio.run(node_addresses(args.node or [], args.pool, args.token))
    if not addresses:
        print("swerl images: no exec nodes (--node ADDRESS or --pool ADDRESS)", file=sys.stderr)
        return 2
    return images, addresses


def _pull(args: argparse.Namespace) -> int:
    from swerl.images.pull import ImagePuller, NodeProgress

    configure_logging("console", "warning")
    inputs = _inputs(args)
    if isinstance(inputs, int):
        return inputs
    images, addresses = inputs
    plan: dict[str, list[str]] = {address: images for address in addresses}
    if args.replicas:
        from swerl.images.pull import home_plan, pool_nodes

        if not args.pool or args.node:
            # Home sets are the pool's: only its node list and health say where it would pull.
            print(
                "swerl images: --replicas takes the nodes from --pool (and no --node)",
                file=sys.stderr,
            )
            return 2
        nodes = asyncio.run(pool_nodes(args.pool, args.token))
        plan = home_plan(images, nodes, args.replicas)
        if not plan:
            print("swerl images: the pool has no healthy node to home images on", file=sys.stderr)
            return 1
        skipped = len(nodes) - len(plan)
        print(
            f"ensuring {len(images)} images on their {args.replicas} home nodes of"
            f" {len(plan)} healthy" + (f" ({skipped} not healthy, skipped)" if skipped else ""),
            flush=True,
        )
    else:
        print(f"ensuring {len(images)} images on {len(addresses)} nodes", flush=True)
    printed: dict[str, float] = {}

    def progress(node: NodeProgress, image: str) -> None:
        now = time.monotonic()
        finished = node.done == node.total or node.error
        if finished or now - printed.get(node.address, 0.0) >= args.progress_interval:
            printed[node.address] = now
            print(node.line(), flush=True)

    puller = ImagePuller(
        token=args.token,
        mirror_prefix=args.mirror_prefix,
        concurrency=args.concurrency,
        batch_size=args.batch_size,
        retries=args.retries,
        initial_wait_s=args.retry_wait,
        on_progress=progress,
    )
    report = asyncio.run(puller.pull_plan(plan))
    print(report.render())
    if args.report:
        args.report.write_text(json.dumps(report.to_json(), indent=2) + "\n")
    return 0 if report.ok else 1


def _status(args: argparse.Namespace) -> int:
    from swerl.images.pull import coverage

    configure_logging("console", "warning")
    inputs = _inputs(args)
    if isinstance(inputs, int):
        return inputs
    images, addresses = inputs
    nodes = asyncio.run(coverage(addresses, images, token=args.token))
    for node in nodes:
        print(node.line(len(images)))
        for image in node.missing[: args.show_missing]:
            print(f"  missing {image}")
        if len(node.missing) > args.show_missing > 0:
            print(f"  ... and {len(node.missing) - args.show_missing} more")
    if args.pool:
        for line in asyncio.run(_pool_cache_lines(args.pool, args.token)):
            print(line)
    complete = all(not node.error and not node.missing for node in nodes)
    return 0 if complete else 1


def _gib(size: int) -> str:
    return f"{size / (1 << 30):.1f} GiB"


async def _pool_cache_lines(pool_address: str, token: str | None) -> list[str]:
    """Per node, as the pool sees it: image cache use against its budget, hits, misses, pulls."""
    from swerl.pool.client import PoolClient

    pool = PoolClient(pool_address, token=token)
    try:
        nodes = await pool.list_nodes()
    finally:
        await pool.close()
    lines = ["image cache (pool):"]
    for node in nodes:
        budget = _gib(node.image_budget_bytes) if node.image_budget_bytes else "no budget"
        placed = node.image_hits + node.image_misses
        rate = f"{100.0 * node.image_hits / placed:.1f}%" if placed else "-"
        lines.append(
            f"  {node.node_id}: {_gib(node.image_used_bytes)} of {budget}, hits"
            f" {node.image_hits} misses {node.image_misses} (hit rate {rate}), pulls"
            f" {node.image_pulls} ({node.pulls_in_flight} in flight)"
        )
    return lines


def _prefetch(args: argparse.Namespace) -> int:
    from swerl.images.pull import ImageListError
    from swerl.pool.client import PoolClient
    from swerl.pool.v1 import pool_pb2

    configure_logging("console", "warning")
    try:
        images = _images(args)
    except ImageListError as exc:
        print(f"swerl images: {exc}", file=sys.stderr)
        return 2
    if not images:
        print("swerl images: no images given (--images FILE or --image NAME)", file=sys.stderr)
        return 2

    async def main() -> list[pool_pb2.ImagePrefetch]:
        pool = PoolClient(args.pool, token=args.token)
        try:
            done: list[pool_pb2.ImagePrefetch] = []
            for start in range(0, len(images), args.batch_size):
                done += await pool.prefetch_images(images[start : start + args.batch_size])
            return done
        finally:
            await pool.close()

    done = asyncio.run(main())
    counts: dict[str, int] = {}
    for entry in done:
        name = pool_pb2.PrefetchStatus.Name(entry.status).removeprefix("PREFETCH_STATUS_")
        counts[name] = counts.get(name, 0) + 1
        if entry.status == pool_pb2.PREFETCH_STATUS_FAILED:
            print(f"  {entry.image}: {entry.reason} {entry.message}")
    print(
        f"prefetch of {len(done)} images: "
        + ", ".join(f"{name.lower()} {n}" for name, n in sorted(counts.items()))
    )
    return 1 if counts.get("FAILED") else 0


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--images",
        type=Path,
        action="append",
        help="image list (text, one per line) or dataset JSONL (prepared or raw rows); repeatable",
    )
    parser.add_argument("--image", action="append", help="one image reference; repeatable")
    parser.add_argument("--node", action="append", help="exec node host:port; repeatable")
    parser.add_argument("--pool", help="pool host:port: every node it knows (not drained)")
    parser.add_argument(
        "--token",
        default=os.environ.get("SWERL_TOKEN"),
        help="bearer token of the nodes and the pool (default: $SWERL_TOKEN)",
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    images = subparsers.add_parser("images", help="task images on the exec nodes")
    commands = images.add_subparsers(dest="command", required=True)

    pull = commands.add_parser(
        "pull",
        help="pull a dataset's images onto every exec node (EnsureImages)",
        description="Exit status 0 when every image is on every node, 1 when some are missing.",
    )
    _common(pull)
    pull.add_argument(
        "--mirror-prefix",
        default="",
        help="pull PREFIX/<image> from a registry mirror and re-tag it as <image>",
    )
    pull.add_argument("--concurrency", type=int, default=4, help="pulls at once per node")
    pull.add_argument("--batch-size", type=int, default=64, help="images per EnsureImages call")
    pull.add_argument(
        "--retries", type=int, default=3, help="extra attempts for transient failures"
    )
    pull.add_argument("--retry-wait", type=float, default=1.0, help="first backoff, seconds")
    pull.add_argument(
        "--progress-interval", type=float, default=2.0, help="seconds between progress lines"
    )
    pull.add_argument("--report", type=Path, help="write the final report as JSON")
    pull.add_argument(
        "--replicas",
        type=int,
        default=0,
        help="pull each image only onto its K home nodes, as the pool places it (rendezvous"
        " hashing over the nodes --pool reports healthy; use the pool's --image-replicas);"
        " 0: every node",
    )
    pull.set_defaults(handler=_pull)

    status = commands.add_parser(
        "status",
        help="per-node coverage of a dataset's images (ListImages)",
        description="Exit status 0 when every node has every image, 1 otherwise.",
    )
    _common(status)
    status.add_argument("--show-missing", type=int, default=10, help="missing images listed")
    status.set_defaults(handler=_status)

    prefetch = commands.add_parser(
        "prefetch",
        help="start pulls of images on their home nodes through the pool (PrefetchImages)",
        description="Returns at once; exit status 1 when some image failed recently.",
    )
    prefetch.add_argument("--images", type=Path, action="append", help="image list or dataset")
    prefetch.add_argument("--image", action="append", help="one image reference; repeatable")
    prefetch.add_argument("--pool", default="127.0.0.1:18090", help="pool host:port")
    prefetch.add_argument(
        "--token", default=os.environ.get("SWERL_TOKEN"), help="bearer token of the pool"
    )
    prefetch.add_argument("--batch-size", type=int, default=500, help="images per call")
    prefetch.set_defaults(handler=_prefetch)
