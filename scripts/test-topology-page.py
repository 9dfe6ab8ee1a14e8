#!/usr/bin/env python3
"""The topology page of `troupe serve`, in a real browser.

Starts the troupe binary (the path is the first argument) on 127.0.0.1 with a free port,
a bearer token and the scripted model (the demo's five agents), then drives Debian's
Chromium (/usr/bin/chromium, headless, a fresh profile) with Playwright (PyPI
`playwright`; no `playwright install`: the system Chromium is used) and checks what a
person sees:

  1. the page asks for the token; once given, it shows the five agents by name;
  2. a message sent to the coordinator through the page's form gets the coordinator's
     reply, shown on the page;
  3. the event stream (live): the events list shows the call from the coordinator to the
     researcher, and the edge coordinator -> researcher is drawn and labelled "1 call",
     as is researcher -> analyst, and the refused call analyst -> coordinator is drawn
     as refused;
  4. a click on the coordinator opens the side panel: its conversation ends with the
     reply, and the call tree of the request has user -> coordinator at the root, with
     coordinator -> researcher nested under it and researcher -> analyst under that;
  5. messages (live): after the demo's hand-off (a notification to the coordinator, sent
     through the API), the arrows coordinator -> critic (the delegated review) and
     critic -> coordinator (its result) read "1 msg", coordinator -> researcher
     "1 call · 1 msg", and the events list shows the task;
  6. then no agent shows a running turn;
  7. no script error on the page.

A screenshot is saved to target/artifacts/topology.png (or $ARTIFACTS_DIR). The server
is stopped with SIGTERM at the end. Every wait is bounded; a missing `playwright`
package or a missing /usr/bin/chromium fails the run with what to install.

    python3 scripts/test-topology-page.py target/debug/troupe
"""

import json
import os
import sys
import tempfile
import urllib.request

from serve_harness import serving

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")

try:
    from playwright.sync_api import expect, sync_playwright
except ImportError:
    print(
        "test-topology-page: the `playwright` package is missing: pip install playwright "
        "(no `playwright install` needed: the test uses Debian's chromium)",
        file=sys.stderr,
    )
    sys.exit(1)

if not os.access(CHROMIUM, os.X_OK):
    print(f"test-topology-page: {CHROMIUM} is missing: apt-get install chromium", file=sys.stderr)
    sys.exit(1)

TOKEN = "topology-page-test-token-0123456789"
# Bounds, in seconds (Playwright takes milliseconds: * 1000).
PAGE_TIMEOUT_S = 20
# The demo's request takes about 2 s on the scripted model (the archivist times out
# after 1.5 s); generous for a loaded machine.
REPLY_TIMEOUT_S = 60
AGENTS = ["analyst", "archivist", "coordinator", "critic", "researcher"]
QUESTION = "Prepare a short brief on grid-scale battery storage."
HANDOFF = "The report is ready: get it reviewed and tell the researcher."
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]




def notify(address, agent, text):
    request = urllib.request.Request(
        f"http://{address}/v1/agents/{agent}/notify",
        data=json.dumps({"text": text}).encode(),
        headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=REPLY_TIMEOUT_S) as response:
        if response.status != 202:
            raise AssertionError(f"notify {agent}: status {response.status}")


def edge(page, source, target):
    return page.locator(f'#edges .edge[data-from="{source}"][data-to="{target}"]')


def run(address, screenshot, profile):
    errors = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch_persistent_context(
            profile,
            executable_path=CHROMIUM,
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": 1280, "height": 900},
        )
        try:
            page = browser.new_page()
            page.set_default_timeout(PAGE_TIMEOUT_S * 1000)
            page.on("pageerror", lambda error: errors.append(str(error)))
            print(f"test-topology-page: chromium {browser.browser.version if browser.browser else ''}".rstrip())

            page.goto(f"http://{address}/")
            # 1. The token, then the five agents by name.
            expect(page.get_by_label("This server needs its bearer token")).to_be_visible()
            page.get_by_label("This server needs its bearer token").fill(TOKEN)
            page.get_by_role("button", name="Open").click()
            names = page.locator("#nodes .node .node-name")
            expect(names).to_have_count(len(AGENTS))
            expect(names).to_have_text(AGENTS)  # laid out in id order
            for name in AGENTS:
                expect(page.locator("#nodes").get_by_text(name, exact=True)).to_be_visible()
            expect(page.locator("#status")).to_have_text("live")
            print(f"ok the page shows the agents: {', '.join(AGENTS)}")

            # 2. A message through the form; the reply on the page.
            page.get_by_label("Send a message to").select_option("coordinator")
            page.locator("#send-text").fill(QUESTION)
            page.get_by_role("button", name="Send").click()
            result = page.locator("#send-result")
            expect(result).to_contain_text("coordinator: Brief.", timeout=REPLY_TIMEOUT_S * 1000)
            reply = result.inner_text()
            print(f"ok the form got the reply: {reply[:90]!r}...")

            # 3. Live: the events list and the edges.
            expect(page.locator("#events")).to_contain_text("coordinator → researcher")
            expect(page.locator("#events")).to_contain_text("researcher → analyst")
            to_researcher = edge(page, "coordinator", "researcher")
            expect(to_researcher).to_be_visible()
            expect(to_researcher.locator("text")).to_have_text("1 call")
            expect(edge(page, "researcher", "analyst").locator("text")).to_have_text("1 call")
            expect(edge(page, "coordinator", "archivist").locator("text")).to_have_text("1 call")
            back = edge(page, "analyst", "coordinator")
            expect(back).to_have_class("edge refused")
            print("ok edges: coordinator → researcher 1 call, researcher → analyst 1 call, analyst → coordinator refused")

            # 4. The side panel of the coordinator.
            page.locator('#nodes .node[data-agent="coordinator"]').click()
            expect(page.locator("#panel-title")).to_have_text("coordinator")
            conversation = page.locator("#conversation li")
            expect(conversation.first).to_be_visible()
            expect(conversation.last).to_contain_text("Brief.")
            expect(page.locator("#conversation")).to_contain_text(QUESTION)
            root = page.locator("#call-tree > ul.tree > li.tree-node")
            expect(root).to_have_count(1)
            expect(root.locator(":scope > .tree-call")).to_have_text("user → coordinator")
            expect(root.locator(":scope > .outcome")).to_contain_text("ok")
            child = root.locator(":scope > ul > li.tree-node").filter(
                has=page.locator(":scope > .tree-call", has_text="coordinator → researcher")
            )
            expect(child).to_have_count(1)
            grandchild = child.locator(":scope > ul > li.tree-node > .tree-call")
            expect(grandchild.first).to_have_text("researcher → analyst")
            archivist = root.locator(":scope > ul > li.tree-node").filter(
                has=page.locator(":scope > .tree-call", has_text="coordinator → archivist")
            )
            expect(archivist.locator(":scope > .outcome")).to_contain_text("timeout")
            cycle = child.locator("li.tree-node").filter(
                has=page.locator(":scope > .tree-call", has_text="analyst → coordinator")
            )
            expect(cycle.locator(":scope > .outcome")).to_contain_text("refused")
            print("ok panel: the conversation ends with the reply; call tree user → coordinator → researcher → analyst (→ coordinator refused), archivist timeout")

            # Messages: the demo's hand-off, a notification to the coordinator through the
            # API; in its turn it delegates a review to the critic (a task message) and
            # notifies the researcher; the critic's result comes back as a message.
            notify(address, "coordinator", HANDOFF)
            expect(edge(page, "coordinator", "critic").locator("text")).to_have_text("1 msg", timeout=REPLY_TIMEOUT_S * 1000)
            expect(to_researcher.locator("text")).to_have_text("1 call · 1 msg", timeout=REPLY_TIMEOUT_S * 1000)
            expect(edge(page, "critic", "coordinator").locator("text")).to_have_text("1 msg", timeout=REPLY_TIMEOUT_S * 1000)
            expect(page.locator("#events")).to_contain_text("task: coordinator → critic")
            print("ok messages: coordinator → critic 1 msg (task), coordinator → researcher 1 call · 1 msg, critic → coordinator 1 msg")

            # Once the request is done, no agent shows a running turn (the archivist's
            # turn ends at its 1.5 s deadline, with its call).
            expect(page.locator("#nodes .node.busy")).to_have_count(0)
            print("ok no agent shows a running turn once the request is done")

            page.screenshot(path=screenshot, full_page=True)
            print(f"ok screenshot: {screenshot}")
        finally:
            browser.close()
    if errors:
        raise AssertionError(f"script errors on the page: {errors}")
    print("ok no script error on the page")


def main():
    if len(sys.argv) != 2:
        raise SystemExit("usage: test-topology-page.py PATH_TO_TROUPE_BINARY")
    target = os.environ.get("CARGO_TARGET_DIR", "target")
    artifacts = os.environ.get("ARTIFACTS_DIR", os.path.join(target, "artifacts"))
    os.makedirs(artifacts, exist_ok=True)
    screenshot = os.path.join(artifacts, "topology.png")
    with serving(sys.argv[1], "test-topology-page", TOKEN) as address:
        with tempfile.TemporaryDirectory(prefix="troupe-topology-chromium-") as profile:
            run(address, screenshot, profile)
    print("test-topology-page: all checks passed")


if __name__ == "__main__":
    main()
