"""What the client tests of `troupe serve` share: start the binary on a free loopback
port with a bearer token and the scripted model, read the address it prints, and stop
it with SIGTERM, checking that it exits 0. Every wait is bounded.

    from serve_harness import check, serving
    with serving(binary, "test-openai-client", TOKEN) as address:
        ...
"""

import contextlib
import os
import subprocess
import threading

# Bounds, in seconds.
START_TIMEOUT_S = 30
STOP_TIMEOUT_S = 15


def check(condition, message):
    if not condition:
        raise AssertionError(message)


def start(binary, name, token):
    """Starts `troupe serve`; returns the process and its address (host:port).

    The server's output is echoed with a `  server: ` prefix for as long as it runs.
    """
    env = dict(os.environ)
    env.pop("OPENAI_API_KEY", None)
    env.pop("TROUPE_TOKEN", None)
    server = subprocess.Popen(
        [binary, "serve", "--bind", "127.0.0.1:0", "--scripted", "--token", token],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    found = {}
    ready = threading.Event()

    def read_output():
        for line in server.stdout:
            if "address" not in found and line.startswith("listening on http://"):
                found["address"] = line.strip()[len("listening on http://"):]
                ready.set()
            print("  server: " + line.rstrip())

    threading.Thread(target=read_output, daemon=True).start()
    if not ready.wait(START_TIMEOUT_S):
        server.kill()
        raise SystemExit(f"{name}: troupe serve printed no address within {START_TIMEOUT_S} s")
    return server, found["address"]


def stop(server, name):
    """SIGTERM, then wait for a clean exit (killed and failed if it takes too long)."""
    server.terminate()
    try:
        code = server.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        server.kill()
        raise SystemExit(f"{name}: troupe serve did not stop within {STOP_TIMEOUT_S} s of SIGTERM")
    if code != 0:
        raise SystemExit(f"{name}: troupe serve exited with {code} after SIGTERM")


@contextlib.contextmanager
def serving(binary, name, token):
    """`troupe serve` for the body of a `with`: yields its address, stops it after."""
    server, address = start(binary, name, token)
    try:
        yield address
    except BaseException:
        server.kill()
        server.wait(STOP_TIMEOUT_S)
        raise
    stop(server, name)
