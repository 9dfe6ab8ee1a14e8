#!/usr/bin/env python3
"""The OpenAI-compatible API of `troupe serve`, driven by the official `openai` package.

Starts the troupe binary (the path is the first argument) on 127.0.0.1 with a free port,
a bearer token and the scripted model, then with the `openai` client: lists the models
(the agents), asks the `critic` agent without and with streaming (and streamed with
`stream_options={"include_usage": True}`: the last chunk carries the turn's token usage,
as the scripted model counts it, one token per word), and checks that `stream_options`
without streaming, an unknown model and a wrong key fail with the client's typed errors. The server is
stopped with SIGTERM at the end (killed if it does not stop in time). Every wait is
bounded; a missing `openai` package fails the run with what to install.

    python3 scripts/test-openai-client.py target/debug/troupe
"""

import sys
import time

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






def words(text):
    """Tokens as the scripted model counts them: whitespace-separated words."""
    return len(text.split())


def stream_text(chunks):
    """The text and the finish reason of a streamed answer's chunks (each one choice)."""
    pieces = []
    finish = None
    for chunk in chunks:
        check(len(chunk.choices) == 1, f"a chunk with one choice: {chunk}")
        choice = chunk.choices[0]
        if choice.delta.content:
            pieces.append(choice.delta.content)
        if choice.finish_reason:
            finish = choice.finish_reason
    return "".join(pieces), finish


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
    # `created`: Unix seconds of the completion, from the server's runtime clock.
    now = time.time()
    check(now - 60 <= completion.created <= now + 1, f"created {completion.created}, now {now}")
    print(f"ok chat.completions.create: {text!r}")

    usage = completion.usage
    check(usage.completion_tokens == words(text), f"usage: {usage}")
    check(usage.total_tokens == usage.prompt_tokens + usage.completion_tokens, f"usage: {usage}")
    check(usage.prompt_tokens > words(messages[-1]["content"]), f"usage: {usage}")
    print(f"ok chat.completions.create usage: {usage}")

    chunks = list(client.chat.completions.create(model="critic", messages=messages, stream=True))
    streamed, finish = stream_text(chunks)
    check(streamed == "Looks fine.", f"streamed: {streamed!r}")
    check(finish == "stop", f"streamed finish_reason {finish}")
    check(all(chunk.usage is None for chunk in chunks), f"usage not asked for: {chunks}")
    print(f"ok chat.completions.create(stream=True): {len(chunks)} chunks, {streamed!r}")

    # The agent keeps its conversation: each turn's prompt holds the turns before it.
    # Two turns since the plain one: this one's prompt is that one's, plus both earlier
    # exchanges' words (the question and "Looks fine." twice), plus nothing else.
    exchange = words(messages[-1]["content"]) + words(text)
    chunks = list(
        client.chat.completions.create(
            model="critic", messages=messages, stream=True, stream_options={"include_usage": True}
        )
    )
    last = chunks[-1]
    check(last.choices == [], f"the usage chunk is last, with no choices: {last}")
    streamed, finish = stream_text(chunks[:-1])
    check(streamed == "Looks fine.", f"streamed with usage: {streamed!r}")
    check(finish == "stop", f"streamed with usage: finish_reason {finish}")
    check(all(chunk.usage is None for chunk in chunks[:-1]), f"usage before the last chunk: {chunks}")
    streamed_usage = last.usage
    check(streamed_usage is not None, f"no usage chunk: {chunks}")
    check(streamed_usage.completion_tokens == words("Looks fine."), f"streamed usage: {streamed_usage}")
    check(
        streamed_usage.prompt_tokens == usage.prompt_tokens + 2 * exchange,
        f"streamed usage: {streamed_usage}, plain turn's: {usage}",
    )
    check(
        streamed_usage.total_tokens == streamed_usage.prompt_tokens + streamed_usage.completion_tokens,
        f"streamed usage: {streamed_usage}",
    )
    print(f"ok chat.completions.create(stream=True, include_usage): {len(chunks)} chunks, {streamed_usage}")

    # As OpenAI's API: stream_options on a request that is not streamed is a 400.
    try:
        client.chat.completions.create(model="critic", messages=messages, stream_options={"include_usage": True})
        raise AssertionError("stream_options without stream was answered")
    except openai.BadRequestError as error:
        check(error.code == "invalid_request_error", f"stream_options without stream: code {error.code!r}: {error}")
        check("stream_options" in str(error), f"stream_options without stream: {error}")
        print("ok stream_options without stream: BadRequestError")

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
