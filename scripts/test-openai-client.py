#!/usr/bin/env python3
"""The OpenAI-compatible API of `troupe serve`, driven by the official `openai` package.

Starts the troupe binary (the path is the first argument) on 127.0.0.1 with a free port,
a bearer token and the scripted model, then with the `openai` client: lists the models
(the agents), asks the `critic` agent without and with streaming, and checks that an
unknown model and a wrong key fail with the client's typed errors. The server is
stopped with SIGTERM at the end (killed if it does not stop in time). Every wait is
bounded; a missing `openai` package fails the run with what to install.

    python3 scripts/test-openai-client.py target/debug/troupe
"""

import os
import subprocess
import sys
import threading

try:
    import openai
except ImportError:
    print("test-openai-client: the `openai` package is missing: pip install openai", file=sys.stderr)
    sys.exit(1)

TOKEN = "openai-client-test-token-0123456789"
# Bounds, in seconds.
START_TIMEOUT_S = 30
REQUEST_TIMEOUT_S = 30
STOP_TIMEOUT_S = 15
AGENTS = ["analyst", "archivist", "coordinator", "critic", "researcher"]


def start(binary):
    env = dict(os.environ)
    env.pop("OPENAI_API_KEY", None)
    env.pop("TROUPE_TOKEN", None)
    server = subprocess.Popen(
        [binary, "serve", "--bind", "127.0.0.1:0", "--scripted", "--token", TOKEN],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    found = {}

    def read_address():
        for line in server.stdout:
            print("  server: " + line.rstrip())
            if line.startswith("listening on http://"):
                found["address"] = line.strip()[len("listening on http://"):]
                return

    reader = threading.Thread(target=read_address, daemon=True)
    reader.start()
    reader.join(START_TIMEOUT_S)
    if "address" not in found:
        server.kill()
        raise SystemExit(f"test-openai-client: troupe serve printed no address within {START_TIMEOUT_S} s")
    return server, found["address"]


def check(condition, message):
    if not condition:
        raise AssertionError(message)


def run(address):
    client = openai.OpenAI(
        base_url=f"http://{address}/v1", api_key=TOKEN, timeout=REQUEST_TIMEOUT_S, max_retries=0
    )

    models = sorted(model.id for model in client.models.list())
    check(models == AGENTS, f"models.list: {models}")
    print(f"ok models.list: {models}")

    messages = [
        {"role": "system", "content": "ignored: the agent has its own prompt"},
        {"role": "user", "content": "Please review this brief."},
    ]
    completion = client.chat.completions.create(model="critic", messages=messages)
    text = completion.choices[0].message.content
    check(text == "Looks fine.", f"chat.completions: {text!r}")
    check(completion.choices[0].finish_reason == "stop", f"finish_reason {completion.choices[0].finish_reason}")
    check(completion.model == "critic", f"model {completion.model}")
    print(f"ok chat.completions.create: {text!r}")

    stream = client.chat.completions.create(model="critic", messages=messages, stream=True)
    pieces = []
    finish = None
    chunks = 0
    for chunk in stream:
        chunks += 1
        choice = chunk.choices[0]
        if choice.delta.content:
            pieces.append(choice.delta.content)
        if choice.finish_reason:
            finish = choice.finish_reason
    streamed = "".join(pieces)
    check(streamed == "Looks fine.", f"streamed: {streamed!r}")
    check(finish == "stop", f"streamed finish_reason {finish}")
    print(f"ok chat.completions.create(stream=True): {chunks} chunks, {streamed!r}")

    try:
        client.chat.completions.create(model="nobody", messages=messages)
        raise AssertionError("an unknown model was answered")
    except openai.NotFoundError as error:
        check(error.code == "model_not_found", f"unknown model: code {error.code!r}: {error}")
        print("ok unknown model: NotFoundError")

    wrong = openai.OpenAI(base_url=f"http://{address}/v1", api_key="wrong-" + TOKEN, max_retries=0)
    try:
        wrong.models.list()
        raise AssertionError("a wrong key was accepted")
    except openai.AuthenticationError:
        print("ok wrong key: AuthenticationError")


def main():
    if len(sys.argv) != 2:
        raise SystemExit("usage: test-openai-client.py PATH_TO_TROUPE_BINARY")
    print(f"test-openai-client: openai {openai.__version__}")
    server, address = start(sys.argv[1])
    try:
        run(address)
    finally:
        server.terminate()
        try:
            code = server.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            server.kill()
            raise SystemExit(f"test-openai-client: troupe serve did not stop within {STOP_TIMEOUT_S} s of SIGTERM")
    check(code == 0, f"troupe serve exited with {code} after SIGTERM")
    print("test-openai-client: all checks passed")


if __name__ == "__main__":
    main()
