"""`python -m kakeya_runtime.server.testing_serve`: a real server on the tiny random llama, for tests of clients in
other languages (the TypeScript SDK's). Nothing here is on the serving path.

Like `kakeya serve`, the last stdout line is the address. It runs until stdin closes (the parent test process
exited or closed it) or SIGTERM, so a crashed test run leaves no server behind.
"""

from __future__ import annotations

import argparse
import sys

from kakeya_runtime.server.testing import SlowModel, running_server, tiny_served


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kakeya_runtime.server.testing_serve",
                                     description="Serve the tiny random llama on 127.0.0.1, any free port.")
    parser.add_argument("--api-key", action="append", default=[], help="Accepted bearer key (repeatable).")
    parser.add_argument("--step-delay", type=float, default=0.0, metavar="SECONDS",
                        help="Every forward takes at least this long (makes cancellation observable).")
    args = parser.parse_args(argv)
    served = tiny_served("llama")
    if args.step_delay > 0:
        served.model = SlowModel(served.model, args.step_delay)  # type: ignore[assignment]
    with running_server(served, api_keys=tuple(args.api_key), metrics_port=None) as thread:
        print(thread.address, flush=True)
        sys.stdin.read()


if __name__ == "__main__":
    main()
