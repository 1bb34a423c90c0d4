"""A small real server for the gate tests (its records: tests/support/records.py): records when it starts and when it listens, takes a while in between.

Usage: slow_server.py NAME PORT DELAY_SECONDS LOG_FILE tcp|http
Each record is one line ``start|ready NAME MONOTONIC`` appended with a single write
(O_APPEND), so concurrent servers never interleave within a line.
"""

from __future__ import annotations

import http.server
import os
import socket
import sys
import time


def record(log: str, event: str, name: str) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{event} {name} {time.monotonic():.6f}\n".encode())
    finally:
        os.close(fd)


class Quiet(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


def main() -> None:
    name, port, delay, log, kind = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4], sys.argv[5]
    record(log, "start", name)
    time.sleep(delay)  # "initialising": the gate must count this as starting
    # Recorded just before listening: no probe can succeed before this line is written.
    record(log, "ready", name)
    if kind == "http":
        http.server.HTTPServer(("127.0.0.1", port), Quiet).serve_forever()
    listener = socket.create_server(("127.0.0.1", port))
    while True:
        conn, _ = listener.accept()
        conn.close()


if __name__ == "__main__":
    main()
