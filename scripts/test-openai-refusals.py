#!/usr/bin/env python3
"""`troupe serve`'s OpenAI-compatible API probed with the official `openai` package as a
demanding user drives it: what the client's typed errors carry, and a client that goes
away mid-stream.

Starts the troupe binary (the path is the first argument) on 127.0.0.1 with a free port,
a bearer token and the scripted model (scripts/serve_harness.py), then checks that:

- every refusal the client can provoke is its typed error with OpenAI's `type`
  (`invalid_request_error`) and `param` naming the field: a message without `role`
  (BadRequestError, param `messages[0].role`), a wrong `n` type, no user
  message (param `messages`), a body over the server's 256 KiB limit (413, param null),
  a wrong key (AuthenticationError); until 2026-12-06 those made before the route's
  code ran (the body's, the token's) had `type` and `param` None;
- a streamed coordinator turn whose client closes the stream after the role chunk
  stops: `troupe_streams_open` is back to 0, the coordinator's turn is abandoned
  (`troupe_runtime_turns_abandoned_total` grows) and nothing of it is in its history,
  and the next request is answered at once.

The server is stopped with SIGTERM at the end (it must exit 0). Every wait is bounded.

    python3 scripts/test-openai-refusals.py target/debug/troupe
"""

import json
import sys
import time
import urllib.request

from serve_harness import check, serving

try:
    import openai
except ImportError:
    print("test-openai-refusals: the `openai` package is missing: pip install openai", file=sys.stderr)
    sys.exit(1)

TOKEN = "openai-refusals-test-token-0123456789"
# Bounds, in seconds.
REQUEST_TIMEOUT_S = 30
# How long the server may take to count a stream's end and its turn's abandonment once
# the client closed it, in seconds.
SETTLE_TIMEOUT_S = 10
# The server's body limit (troupe_server::limits::SERVER_REQUEST_BODY_SIZE_MAX_BYTES).
BODY_LIMIT_BYTES = 256 * 1024
BRIEF = [{"role": "user", "content": "Write a brief on battery prices."}]


def refused(name, call, error_type, status, param, code):
    """`call()` must raise `error_type` with this status, OpenAI `type`, `param`, `code`."""
    try:
        call()
    except error_type as error:
        check(error.status_code == status, f"{name}: status {error.status_code}, not {status}: {error}")
        check(error.type == "invalid_request_error", f"{name}: type {error.type!r}: {error.body}")
        check(error.param == param, f"{name}: param {error.param!r}, not {param!r}: {error.body}")
        check(error.code == code, f"{name}: code {error.code!r}, not {code!r}: {error.body}")
        print(f"ok {name}: {type(error).__name__} {status} type={error.type} param={error.param} code={error.code}")
        return
    raise AssertionError(f"{name}: not refused")


def metrics(address):
    request = urllib.request.Request(
        f"http://{address}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}
    )
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
        text = response.read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and " " in line and "{" not in line:
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def history_total(address, agent):
    request = urllib.request.Request(
        f"http://{address}/v1/agents/{agent}/history", headers={"Authorization": f"Bearer {TOKEN}"}
    )
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
        return json.loads(response.read())["total"]


def refusals(client, address):
    create = client.chat.completions.create
    refused(
        "a message without role",
        lambda: create(model="critic", messages=[{"content": "hi"}]),
        openai.BadRequestError,
        400,
        "messages[0].role",
        "invalid_body",
    )
    refused(
        "n of the wrong type",
        lambda: create(model="critic", messages=BRIEF, n="two"),
        openai.BadRequestError,
        400,
        "n",
        "invalid_body",
    )
    refused(
        "no user message",
        lambda: create(model="critic", messages=[{"role": "assistant", "content": "hi"}]),
        openai.BadRequestError,
        400,
        "messages",
        "no_user_message",
    )
    refused(
        "a body over the limit",
        lambda: create(model="critic", messages=[{"role": "user", "content": "x" * (BODY_LIMIT_BYTES + 1)}]),
        openai.APIStatusError,
        413,
        None,
        "body_too_large",
    )
    wrong = openai.OpenAI(
        base_url=f"http://{address}/v1", api_key="not-the-token", timeout=REQUEST_TIMEOUT_S, max_retries=0
    )
    refused(
        "a wrong key",
        lambda: wrong.chat.completions.create(model="critic", messages=BRIEF),
        openai.AuthenticationError,
        401,
        None,
        "unauthorized",
    )


def a_client_leaving_mid_stream_stops_the_turn(client, address):
    before = metrics(address)
    history_before = history_total(address, "coordinator")
    stream = client.chat.completions.create(model="coordinator", messages=BRIEF, stream=True)
    role = next(iter(stream))
    check(role.choices[0].delta.role == "assistant", f"the first chunk is the role: {role}")
    stream.close()
    left = time.monotonic()
    answered = client.chat.completions.create(model="critic", messages=BRIEF)
    check(answered.choices[0].message.content, f"the next request is answered: {answered}")
    next_at = time.monotonic() - left
    deadline = left + SETTLE_TIMEOUT_S
    while True:
        now = metrics(address)
        abandoned = now["troupe_runtime_turns_abandoned_total"] - before["troupe_runtime_turns_abandoned_total"]
        if now["troupe_streams_open"] == 0 and abandoned >= 1:
            break
        check(
            time.monotonic() < deadline,
            f"{SETTLE_TIMEOUT_S} s after the client left: streams open {now['troupe_streams_open']}, "
            f"turns abandoned {abandoned}",
        )
        time.sleep(0.05)
    # Past the scripted turn's own length (about 2 s): had it gone on, it would be there.
    time.sleep(3)
    history_after = history_total(address, "coordinator")
    check(
        history_after == history_before,
        f"the abandoned turn left {history_after - history_before} messages in the coordinator's history",
    )
    print(
        f"ok a client leaving mid-stream: the next request answered in {next_at:.3f} s, streams open 0, "
        f"{abandoned:.0f} turns abandoned, the coordinator's history unchanged"
    )


def main():
    if len(sys.argv) != 2:
        raise SystemExit("usage: test-openai-refusals.py PATH_TO_TROUPE_BINARY")
    print(f"test-openai-refusals: openai {openai.__version__}")
    with serving(sys.argv[1], "test-openai-refusals", TOKEN) as address:
        client = openai.OpenAI(
            base_url=f"http://{address}/v1", api_key=TOKEN, timeout=REQUEST_TIMEOUT_S, max_retries=0
        )
        refusals(client, address)
        a_client_leaving_mid_stream_stops_the_turn(client, address)
    print("test-openai-refusals: all checks passed")


if __name__ == "__main__":
    main()
