#!/usr/bin/env python3
"""The A2A protocol v1.0 of `troupe serve`, driven by the official `a2a-sdk` client.

Starts the troupe binary (the path is the first argument) on 127.0.0.1 with a free port,
a bearer token and the scripted model, then with the `a2a-sdk` client (JSON-RPC
transport): resolves an agent card from its well-known path, sends a blocking message
(its task's `status.timestamp` within a minute of now), reads the task back (GetTask,
ListTasks, ListTasks since that timestamp), streams a message, delegates without
blocking to the slow `archivist` agent, cancels a second task still waiting behind it (canceled) and the
running one (not cancelable), subscribes to the running one until it completes,
checks the typed errors: an unknown task, a refused cycle in `metadata.troupe`, an
unknown method and a wrong token, and checks that ListTasks lists each agent's tasks in
the a2a-sdk's own order (its `InMemoryTaskStore` given the same tasks), whole and in
pages of one. The server is stopped with SIGTERM at the end (killed
if it does not stop in time). Every wait is bounded; a missing `a2a-sdk` package fails
the run with what to install.

    python3 scripts/test-a2a-client.py target/debug/troupe
"""

import asyncio
import sys
import time

from serve_harness import check, serving

try:
    import httpx
    from a2a.client import ClientConfig, create_client
    from a2a.client.card_resolver import A2ACardResolver
    from a2a.client.errors import A2AClientError
    from a2a.types import a2a_pb2 as pb
    from a2a.utils.errors import MethodNotFoundError, TaskNotCancelableError, TaskNotFoundError
    from a2a.server.context import ServerCallContext
    from a2a.server.tasks import InMemoryTaskStore
    from a2a.server.tasks.inmemory_task_store import _list_sort_key
    from importlib.metadata import version
except ImportError as error:
    print(
        f"test-a2a-client: the `a2a-sdk` package is missing ({error}): pip install 'a2a-sdk==1.3.0'",
        file=sys.stderr,
    )
    sys.exit(1)

TOKEN = "a2a-client-test-token-0123456789"
# Bounds, in seconds.
START_TIMEOUT_S = 30
REQUEST_TIMEOUT_S = 30






def user_message(text, metadata=None):
    message = pb.Message(message_id=f"m-{abs(hash(text))}", role=pb.ROLE_USER, parts=[pb.Part(text=text)])
    if metadata is not None:
        message.metadata.update(metadata)
    return message


def text_of(parts):
    return "".join(part.text for part in parts)


async def client_for(http, address, agent, streaming=True):
    config = ClientConfig(httpx_client=http, streaming=streaming)
    return await create_client(f"http://{address}/a2a/{agent}", client_config=config)


async def send(client, message, return_immediately=False):
    request = pb.SendMessageRequest(message=message)
    request.configuration.return_immediately = return_immediately
    return [event async for event in client.send_message(request)]


async def list_pages(list_tasks, page_size):
    """Every task `list_tasks` lists, walking its pages of `page_size` from the first."""
    ids, token = [], ""
    while True:
        page = await list_tasks(pb.ListTasksRequest(page_size=page_size, page_token=token))
        ids += [task.id for task in page.tasks]
        check(len(ids) <= page.total_size, f"more tasks than {page.total_size}: {ids}")
        token = page.next_page_token
        if not token:
            return ids


async def check_list_order(client, agent):
    """ListTasks of `agent` lists its tasks in the order the a2a-sdk's own task store
    lists them (by `(has status timestamp, status timestamp, id)`, greatest first,
    `_list_sort_key`): the tasks it lists, put in an `InMemoryTaskStore` and listed by it,
    whole and a page of one at a time (each with its own tokens). The ids, in order."""
    tasks = (await client.list_tasks(pb.ListTasksRequest(page_size=100))).tasks
    store, context = InMemoryTaskStore(), ServerCallContext()
    for task in tasks:
        await store.save(task, context)
    ours = [task.id for task in tasks]
    theirs = [task.id for task in (await store.list(pb.ListTasksRequest(page_size=100), context)).tasks]
    check(ours == theirs, f"ListTasks of {agent}: {ours}, the a2a-sdk lists {theirs}")
    check(ours == [task.id for task in sorted(tasks, key=_list_sort_key, reverse=True)], f"{agent}: {ours}")
    paged = await list_pages(client.list_tasks, 1)
    sdk_paged = await list_pages(lambda request: store.list(request, context), 1)
    check(paged == ours and sdk_paged == ours, f"{agent} in pages of one: {paged}, the a2a-sdk's {sdk_paged}")
    print(f"ok ListTasks of {agent} in the a2a-sdk's order (whole and in pages of one): {ours}")
    return ours


async def run(address):
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(headers=headers, timeout=REQUEST_TIMEOUT_S) as http:
        # The card, from the agent's well-known path, without a token.
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as anonymous:
            card = await A2ACardResolver(anonymous, f"http://{address}/a2a/critic").get_agent_card()
        check(card.name == "critic", f"card name {card.name!r}")
        check(card.capabilities.streaming, "card: streaming")
        interface = card.supported_interfaces[0]
        check(interface.url == f"http://{address}/a2a/critic", f"card url {interface.url}")
        check(interface.protocol_binding == "JSONRPC" and interface.protocol_version == "1.0", f"{interface}")
        scheme = card.security_schemes["bearer"].http_auth_security_scheme.scheme
        check(scheme == "Bearer", f"card security scheme {scheme!r}")
        print(f"ok agent card: {card.name!r}, {interface.url}, security {scheme}")

        # SendMessage, blocking.
        blocking = await client_for(http, address, "critic", streaming=False)
        events = await send(blocking, user_message("Please review this brief."))
        check(len(events) == 1 and events[0].HasField("task"), f"SendMessage: {events}")
        task = events[0].task
        check(task.status.state == pb.TASK_STATE_COMPLETED, f"SendMessage state {task.status.state}")
        reply = text_of(task.artifacts[0].parts)
        check(reply == "Looks fine.", f"SendMessage reply {reply!r}")
        check(text_of(task.status.message.parts) == "Looks fine.", f"status message {task.status.message}")
        print(f"ok SendMessage (blocking): {task.id} completed: {reply!r}")
        check(task.status.HasField("timestamp"), f"no status.timestamp: {task.status}")
        off_s = abs(time.time() - task.status.timestamp.ToNanoseconds() / 1e9)
        check(off_s < 60, f"status.timestamp {task.status.timestamp.ToJsonString()} is {off_s:.1f} s from now")
        print(f"ok status.timestamp: {task.status.timestamp.ToJsonString()} ({off_s:.3f} s from now)")

        # GetTask and ListTasks.
        got = await blocking.get_task(pb.GetTaskRequest(id=task.id))
        check(got.id == task.id and got.status.state == pb.TASK_STATE_COMPLETED, f"GetTask: {got}")
        check([m.role for m in got.history] == [pb.ROLE_USER, pb.ROLE_AGENT], f"GetTask history {got.history}")
        listed = await blocking.list_tasks(pb.ListTasksRequest())
        check(task.id in [t.id for t in listed.tasks], f"ListTasks: {listed}")
        print(f"ok GetTask, ListTasks: {len(listed.tasks)} task(s)")
        since = await blocking.list_tasks(pb.ListTasksRequest(status_timestamp_after=task.status.timestamp))
        check(task.id in [t.id for t in since.tasks], f"ListTasks statusTimestampAfter its own time: {since}")
        print(f"ok ListTasks statusTimestampAfter: {len(since.tasks)} task(s)")

        # SendStreamingMessage: the task, then its updates, the reply artifact, the end.
        streaming = await client_for(http, address, "critic")
        events = await send(streaming, user_message("Please review the second brief."))
        kinds = [event.WhichOneof("payload") for event in events]
        check(kinds[0] == "task", f"stream starts with the task: {kinds}")
        artifacts = [event.artifact_update for event in events if event.HasField("artifact_update")]
        check(len(artifacts) == 1 and text_of(artifacts[0].artifact.parts) == "Looks fine.", f"artifacts {artifacts}")
        last = events[-1]
        check(last.HasField("status_update"), f"stream ends with a status update: {kinds}")
        check(last.status_update.status.state == pb.TASK_STATE_COMPLETED, f"final {last.status_update.status}")
        print(f"ok SendStreamingMessage: {kinds}")

        # Delegation without blocking to the slow archivist (a 4 s turn); a second task
        # waits behind it in the agent's lane and can be canceled; the running one cannot.
        archivist = await client_for(http, address, "archivist", streaming=False)
        first = (await send(archivist, user_message("Any reports on batteries?"), return_immediately=True))[0].task
        second = (await send(archivist, user_message("Any reports on solar?"), return_immediately=True))[0].task
        check(first.status.state == pb.TASK_STATE_SUBMITTED, f"first state {first.status.state}")
        check(second.status.state == pb.TASK_STATE_SUBMITTED, f"second state {second.status.state}")
        for _ in range(START_TIMEOUT_S * 100):
            state = (await archivist.get_task(pb.GetTaskRequest(id=first.id))).status.state
            if state == pb.TASK_STATE_WORKING:
                break
            await asyncio.sleep(0.01)
        check(state == pb.TASK_STATE_WORKING, f"the first task did not start: {state}")
        canceled = await archivist.cancel_task(pb.CancelTaskRequest(id=second.id))
        check(canceled.status.state == pb.TASK_STATE_CANCELED, f"CancelTask: {canceled.status}")
        print(f"ok CancelTask of a waiting task: {second.id} canceled")
        try:
            await archivist.cancel_task(pb.CancelTaskRequest(id=first.id))
            raise AssertionError("the running task was canceled")
        except TaskNotCancelableError as error:
            print(f"ok CancelTask of the running task: TaskNotCancelableError ({error.message})")

        # SubscribeToTask: the running task's updates until it completes.
        follower = await client_for(http, address, "archivist")
        subscribed = [event async for event in follower.subscribe(pb.SubscribeToTaskRequest(id=first.id))]
        final = subscribed[-1].status_update.status
        check(final.state == pb.TASK_STATE_COMPLETED, f"SubscribeToTask final {final}")
        check(text_of(final.message.parts) == "Reports: none found.", f"SubscribeToTask reply {final.message}")
        print(f"ok SubscribeToTask: {[event.WhichOneof('payload') for event in subscribed]}")
        again = await archivist.get_task(pb.GetTaskRequest(id=second.id))
        check(again.status.state == pb.TASK_STATE_CANCELED, f"the canceled task stays canceled: {again.status}")

        # Errors.
        try:
            await blocking.get_task(pb.GetTaskRequest(id="critic-task-999999"))
            raise AssertionError("an unknown task was found")
        except TaskNotFoundError:
            print("ok GetTask of an unknown task: TaskNotFoundError")
        cycle = user_message("Review again.", {"troupe": {"chain": ["coordinator", "critic"], "depth": 2}})
        rejected = (await send(blocking, cycle))[0].task
        check(rejected.status.state == pb.TASK_STATE_REJECTED, f"cycle: {rejected.status}")
        check("cycle" in text_of(rejected.status.message.parts), f"cycle reason {rejected.status.message}")
        print(f"ok a cycle in metadata.troupe.chain: rejected ({text_of(rejected.status.message.parts)!r})")
        raw = await http.post(
            f"http://{address}/a2a/critic", json={"jsonrpc": "2.0", "id": 7, "method": "message/send", "params": {}}
        )
        check(raw.json()["error"]["code"] == -32601, f"unknown method: {raw.text}")
        print("ok unknown method: -32601")

        # ListTasks' order is the a2a-sdk's own: the archivist's first task, which
        # completed after the second was canceled, comes first.
        listed = await check_list_order(archivist, "archivist")
        check(listed == [first.id, second.id], f"the task whose state changed last first: {listed}")
        await check_list_order(blocking, "critic")

    async with httpx.AsyncClient(headers={"Authorization": "Bearer wrong-" + TOKEN}) as wrong_http:
        wrong = await client_for(wrong_http, address, "critic", streaming=False)
        try:
            await send(wrong, user_message("hi"))
            raise AssertionError("a wrong token was accepted")
        except A2AClientError as error:
            check("401" in str(error), f"wrong token: {error}")
            print("ok wrong token: HTTP 401")


def main():
    if len(sys.argv) != 2:
        raise SystemExit("usage: test-a2a-client.py PATH_TO_TROUPE_BINARY")
    print(f"test-a2a-client: a2a-sdk {version('a2a-sdk')}")
    with serving(sys.argv[1], "test-a2a-client", TOKEN) as address:
        asyncio.run(asyncio.wait_for(run(address), timeout=REQUEST_TIMEOUT_S * 4))
    print("test-a2a-client: all checks passed")


if __name__ == "__main__":
    main()
