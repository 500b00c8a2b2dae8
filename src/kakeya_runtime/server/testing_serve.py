"""`python -m kakeya_runtime.server.testing_serve`: a real server on the tiny random llama, for tests of clients in
other languages (the TypeScript SDK's). Nothing here is on the serving path.

Like `kakeya serve`, the last stdout line is the address. It runs until stdin closes (the parent test process
exited or closed it) or SIGTERM, so a crashed test run leaves no server behind.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kakeya_runtime.server.testing import SlowModel, running_server, self_signed_cert, tiny_served


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kakeya_runtime.server.testing_serve",
                                     description="Serve the tiny random llama on 127.0.0.1, any free port.")
    parser.add_argument("--api-key", action="append", default=[], help="Accepted bearer key (repeatable).")
    parser.add_argument("--step-delay", type=float, default=0.0, metavar="SECONDS",
                        help="Every forward takes at least this long (makes cancellation observable).")
    parser.add_argument("--max-sessions", type=int, default=64, help="Sessions the server holds at most.")
    parser.add_argument("--tls-dir", metavar="DIR",
                        help="Serve TLS only, with a fresh self-signed certificate written to DIR/server.crt.")
    args = parser.parse_args(argv)
    served = tiny_served("llama")
    if args.step_delay > 0:
        served.model = SlowModel(served.model, args.step_delay)  # type: ignore[assignment]
    tls = {}
    if args.tls_dir:
        cert, key = self_signed_cert(Path(args.tls_dir))
        tls = {"tls_cert": str(cert), "tls_key": str(key)}
    with running_server(served, api_keys=tuple(args.api_key), metrics_port=None, max_sessions=args.max_sessions,
                        **tls) as thread:
        print(thread.address, flush=True)
        sys.stdin.read()


if __name__ == "__main__":
    main()
