"""The ``pdserve`` command line: one module per subcommand (``cli/<command>.py``).

``generate``: the offline engine. ``serve``: the OpenAI-compatible service on Ray Serve (``--demo``:
a few requests through it, then exit). ``status`` and ``scale``: a running service. ``bench``:
load-test any OpenAI-compatible server. ``manifests``: render the KubeRay manifests. ``train-tiny``: a
small trained model and draft (for what random weights cannot show); ``train-lora``: trained LoRA
adapters of it. ``profile``: a model's measured
costs; ``plan``: replica counts for a traffic from them. ``docs-reference``: regenerate
docs/reference/ from the parsers and config declarations.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from cli import (
    bench,
    docs_reference,
    generate,
    manifests,
    plan,
    profile,
    scale,
    serve,
    status,
    train_lora,
    train_tiny,
)
from cli.supervise import supervise

COMMANDS = (
    generate,
    serve,
    status,
    scale,
    bench,
    manifests,
    train_tiny,
    train_lora,
    profile,
    plan,
    docs_reference,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="disaggregated prefill/decode LLM serving")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    # docs-reference documents this whole tree (it cannot import this module: that is a cycle)
    sub.choices[docs_reference.COMMAND].set_defaults(root=parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    if args.command == "serve":  # the service runs in a session of its own (cli/supervise.py)
        code = supervise(argv if argv is not None else sys.argv[1:])
        if code is not None:
            return code
    try:
        code = args.func(args)
        sys.stdout.flush()  # inside the try: a reader that left (``| head``) surfaces here
        return code
    except BrokenPipeError:  # the reader of our output left: not an error of ours, and no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit flush writes nowhere
        return 0
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ConnectionError as exc:  # the service or its cluster could not be reached: one line, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
