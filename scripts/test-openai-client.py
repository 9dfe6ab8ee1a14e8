#!/usr/bin/env python3
"""The OpenAI-compatible API of `troupe serve`, driven by the official `openai` package.

Starts the troupe binary (the path is the first argument) on 127.0.0.1 with a free port,
a bearer token and the scripted model, then with the `openai` client: lists the models
(the agents, each `created` within a day of now), asks the `critic` agent without and with streaming (and streamed with
`stream_options={"include_usage": True}`: the last chunk carries the turn's token usage,
as the scripted model counts it, one token per word), streams a long turn of the
`coordinator` (its role chunk arrives while the turn runs, a second or more before its
content), then gives the coordinator one model step so that its turn fails after its
tool calls, after the headers: the stream's error event is raised as `openai.APIError`.
It retrieves every model (`models.retrieve`, each as listed) and checks that retrieving
an unknown model, `stream_options` without streaming, `n=3`, an unknown model and a wrong
key fail with the client's typed errors. The server is stopped with SIGTERM at the end (killed if
it does not stop in time). Every wait is bounded; a missing `openai` package fails the
run with what to install.

    python3 scripts/test-openai-client.py target/debug/troupe
"""

import json
import sys
import time
import urllib.request

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
# What the scripted coordinator takes a brief for: its turn calls the researcher (who
# calls the analyst) and the archivist (4 s to answer, called with a 1.5 s timeout).
BRIEF = [{"role": "user", "content": "Write a brief on battery prices."}]
# How much later than the role chunk the coordinator's content must arrive, in seconds:
# its turn waits 1.5 s for the archivist alone, after the headers went out (0.2 s at most).
STREAMED_GAP_MIN_S = 1.0


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

    listed = list(client.models.list())
    models = sorted(model.id for model in listed)
    check(models == AGENTS, f"models.list: {models}")
    # `created`: Unix seconds of the agent's definition; these agents come from the
    # config, defined when the server started (0 until 2026-12-06).
    now = time.time()
    for model in listed:
        check(now - 86_400 <= model.created <= now + 1, f"{model.id} created {model.created}, now {now}")
    print(f"ok models.list: {models}")

    # Retrieve model: each agent as its entry of the list; an unknown one is a 404 in
    # OpenAI's error shape (until 2026-12-06 the route did not exist).
    for model in listed:
        retrieved = client.models.retrieve(model.id)
        check(retrieved == model, f"models.retrieve({model.id!r}): {retrieved}, listed {model}")
    try:
        client.models.retrieve("nobody")
        raise AssertionError("an unknown model was retrieved")
    except openai.NotFoundError as error:
        check(error.code == "model_not_found", f"retrieve an unknown model: code {error.code!r}: {error}")
        check(error.type == "invalid_request_error", f"retrieve an unknown model: type {error.type!r}: {error}")
        check(error.param == "model", f"retrieve an unknown model: param {error.param!r}: {error}")
        print("ok models.retrieve: every agent; an unknown one NotFoundError model_not_found")

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

    stream_streams_while_the_turn_runs(client)
    an_error_after_the_headers_raises_api_error(client, address)

    # As OpenAI's API: stream_options on a request that is not streamed is a 400.
    try:
        client.chat.completions.create(model="critic", messages=messages, stream_options={"include_usage": True})
        raise AssertionError("stream_options without stream was answered")
    except openai.BadRequestError as error:
        check(error.code == "invalid_request_error", f"stream_options without stream: code {error.code!r}: {error}")
        check("stream_options" in str(error), f"stream_options without stream: {error}")
        print("ok stream_options without stream: BadRequestError")

    # n other than 1: refused, not answered with one choice (until 2026-12-06 ignored).
    try:
        client.chat.completions.create(model="critic", messages=messages, n=3)
        raise AssertionError("n=3 was answered")
    except openai.BadRequestError as error:
        check(error.param == "n", f"n=3: param {error.param!r}: {error}")
        check(error.type == "invalid_request_error", f"n=3: type {error.type!r}: {error}")
        print("ok n=3: BadRequestError naming n")
    completion = client.chat.completions.create(model="critic", messages=messages, n=1)
    check(len(completion.choices) == 1, f"n=1: {completion}")

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


def stream_streams_while_the_turn_runs(client):
    """A streamed answer's role chunk comes while the turn runs, its content at the end."""
    started = time.monotonic()
    stream = client.chat.completions.create(model="coordinator", messages=BRIEF, stream=True)
    chunks = iter(stream)
    role = next(chunks)
    role_at = time.monotonic() - started
    check(role.choices[0].delta.role == "assistant", f"the first chunk is the role: {role}")
    rest = list(chunks)
    ended_at = time.monotonic() - started
    streamed, finish = stream_text(rest)
    check(streamed.startswith("Brief. "), f"the coordinator's brief: {streamed!r}")
    check(finish == "stop", f"finish_reason {finish}")
    check(
        ended_at - role_at >= STREAMED_GAP_MIN_S,
        f"the role chunk at {role_at:.2f} s, the content at {ended_at:.2f} s: not streamed while the turn ran",
    )
    print(f"ok stream=True streams: the role chunk at {role_at:.2f} s, the answer at {ended_at:.2f} s")


def an_error_after_the_headers_raises_api_error(client, address):
    """A turn that fails after the headers: the stream's error event is `openai.APIError`."""
    # One model step: the coordinator's turn calls its tools, then has no step left to
    # answer, and fails (500 `agent_failed` had it failed before the headers).
    body = json.dumps({"role": "the coordinator, short of steps", "model": "scripted", "max_steps": 1}).encode()
    request = urllib.request.Request(
        f"http://{address}/v1/agents/coordinator",
        data=body,
        method="PUT",
        headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
        check(response.status == 200, f"PUT coordinator: {response.status}")
    stream = client.chat.completions.create(model="coordinator", messages=BRIEF, stream=True)
    chunks = iter(stream)
    role = next(chunks)
    check(role.choices[0].delta.role == "assistant", f"the first chunk is the role: {role}")
    try:
        rest = list(chunks)
        raise AssertionError(f"a failed turn's stream ended without an error: {rest}")
    except openai.APIError as error:
        check(not isinstance(error, openai.APIStatusError), f"an HTTP status error, not an in-stream one: {error!r}")
        check(error.code == "agent_failed", f"in-stream error: code {error.code!r}: {error}")
        check("model steps" in error.message, f"in-stream error: {error.message!r}")
        print(f"ok an error after the headers: APIError {error.code}: {error.message}")


def main():
    if len(sys.argv) != 2:
        raise SystemExit("usage: test-openai-client.py PATH_TO_TROUPE_BINARY")
    print(f"test-openai-client: openai {openai.__version__}")
    with serving(sys.argv[1], "test-openai-client", TOKEN) as address:
        run(address)
    print("test-openai-client: all checks passed")


if __name__ == "__main__":
    main()
