//! Simulated cluster nodes that join again after a lost lease, each publishing its
//! current agent client in a slot: waiting for a node's client, and placing an agent on
//! a node (madsim only).

use std::sync::Mutex;
use std::time::Duration;

use troupe_agent::AgentClient;

use crate::agents::Seen;

/// Each node's current agent client (`None` while it is not joined).
pub(crate) type Slots = Mutex<Vec<Option<AgentClient>>>;

/// Node `index`'s agent client, once the node has joined.
pub(crate) async fn joined_client(slots: &Slots, index: usize) -> AgentClient {
    loop {
        if let Some(client) = slots.lock().expect("slots")[index].clone() {
            return client;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Places `agent` on `node` (node `index`, named `name`) by asking it `ping` through
/// that node's `client` within `timeout`: its first turn runs there, which `seen` shows.
pub(crate) async fn place_on(
    node: &madsim::runtime::NodeHandle,
    client: AgentClient,
    seen: &Seen,
    (index, name): (usize, &str),
    agent: &str,
    timeout: Duration,
) {
    let agent_name = agent.to_string();
    let reply = node
        .spawn(async move { client.ask_with_timeout(&agent_name, "ping", timeout).await })
        .await
        .expect("the ask's task");
    assert_eq!(reply.expect("a ping").text, "pong", "{agent} answers a ping");
    let last = seen.turns_of(agent).pop().expect("a turn");
    assert_eq!(last.0, index, "{agent} placed on {name}");
}
