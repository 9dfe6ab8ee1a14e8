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

import sys

from serve_harness import check, serving

try:
    import openai
except ImportError:
    print("test-openai-client: the `openai` package is missing: pip install openai", file=sys.stderr)
    sys.exit(1)

TOKEN = "openai-client-test-token-0123456789"
# Bounds, in seconds.
REQUEST_TIMEOUT_S = 30
AGENTS = ["analyst", "archivist", "coordinator", "critic", "researcher"]






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
    with serving(sys.argv[1], "test-openai-client", TOKEN) as address:
        run(address)
    print("test-openai-client: all checks passed")


if __name__ == "__main__":
    main()
