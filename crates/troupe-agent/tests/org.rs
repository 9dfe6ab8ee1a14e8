//! The organisation end to end: links, permissions, approvals and the config file,
//! enforced at admission for ask, delegate and notify. The model is scripted and
//! really emits `call_agent`, `delegate_to_agent` and `notify_agent`; everything else
//! (runtime, store, inbox, admission) is the real thing.
//!
//! Runs in both builds: `cargo test -p troupe-agent --test org` (tokio, paused time)
//! and under `RUSTFLAGS="--cfg madsim"` (the simulator).

use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use troupe_agent::limits::{AGENT_TASKS_OPEN_MAX, AGENT_TASK_TIMEOUT_MS_MAX, DELIVERY_TASKS_SHUTDOWN_WAIT_MS};
use troupe_agent::{
    AgentCallError, AgentEvent, AgentSpec, AgentSystem, Approval, ApprovalState, BehaviourMode, CallApproval,
    ContactKind, InboxError, Link, LinkDirection, LinkRelationship, Membership, NotPermitted, NotPermittedReason,
    OrgConfig, OrgError, OrgPolicy, Organisation, PermissionRule, RuleMatch, ScriptRule, ScriptedLlm, TaskState,
    ORG_STORE_KEY, ORG_STORE_KIND,
};
use troupe_core::{ActorId, Deadline};
use troupe_runtime::{MemoryStore, SqliteStore, StateStore};

#[path = "support/gate_store.rs"]
mod gate_store;

const SECOND: Duration = Duration::from_secs(1);
/// The most a call may take after its approval was seen (ms): its callee's turn and the
/// replies, microseconds of simulated time.
const REST_OF_CALL_MS_MAX: u64 = 50;

fn start_on(llm: &ScriptedLlm, agents: &[&str], store: Arc<dyn StateStore>) -> AgentSystem {
    let mut builder = AgentSystem::builder().store(store).llm(Arc::new(llm.clone()));
    for agent in agents {
        builder = builder.agent(AgentSpec::new(*agent).role(format!("the {agent}")));
    }
    builder.start().expect("the system starts")
}

fn start(llm: &ScriptedLlm, agents: &[&str]) -> AgentSystem {
    start_on(llm, agents, Arc::new(MemoryStore::new()))
}

/// `a` asks `b` on any user message and reports the tool result; `b` answers "42".
fn ask_script() -> ScriptedLlm {
    ScriptedLlm::new()
        .rule(
            ScriptRule::agent("a")
                .on_user_containing("")
                .call("call_agent", json!({"agent_id": "b", "message": "what is 6 x 7?"})),
        )
        .rule(ScriptRule::agent("a").on_tool_result().reply("result: {tool_result}"))
        .rule(ScriptRule::agent("b").reply("42"))
}

fn not_permitted(from: &str, to: &str, kind: ContactKind, reason: NotPermittedReason) -> NotPermitted {
    NotPermitted {
        from: from.into(),
        to: to.into(),
        kind,
        reason,
    }
}

/// Goal: with no organisation configured, every agent reaches every agent (today's
/// behaviour); once the policy is enforced, a call without a link is refused before
/// anything is sent, and the model reads why; adding a link lets it through again.
/// Method: the same scripted ask under the three states; count `b`'s model calls.
#[tokio::test(start_paused = true)]
async fn open_by_default_enforced_needs_a_link_and_the_model_reads_the_refusal() {
    let llm = ask_script();
    let system = start(&llm, &["a", "b"]);
    assert_eq!(system.ask("a", "go").await.unwrap().text, "result: 42");
    assert_eq!(system.organisation().await.unwrap().policy, OrgPolicy::Open);

    system.set_org_policy(OrgPolicy::Enforced).await.unwrap();
    let reply = system.ask("a", "go").await.unwrap();
    assert_eq!(
        reply.text,
        "result: error: call_agent failed: call not permitted: a may not ask b: \
         no link joins them and the organisation requires one"
    );
    assert_eq!(llm.requests_of("b").len(), 1, "nothing reached b");

    system.add_link(Link::new("a", "b")).await.unwrap();
    assert_eq!(system.ask("a", "go").await.unwrap().text, "result: 42");
    assert_eq!(llm.requests_of("b").len(), 2);
    assert_eq!(
        system.add_link(Link::new("a", "b")).await,
        Err(OrgError::LinkExists {
            from: "a".into(),
            to: "b".into()
        })
    );
    system.shutdown().await;
}

/// Goal: a delegation and a notification without permission are refused at admission,
/// for the model (tool result) and for the Rust caller (typed error), and nothing is
/// kept: no outbox or inbox entry, no turn of the target. Method: an explicit deny rule
/// (open policy) and the enforced policy with no link.
#[tokio::test(start_paused = true)]
async fn refused_delegations_and_notifications_keep_nothing() {
    let llm = ScriptedLlm::new()
        .rule(
            ScriptRule::agent("a")
                .on_user_containing("hand off")
                .call("delegate_to_agent", json!({"agent_id": "b", "message": "do it"}))
                .call("notify_agent", json!({"agent_id": "b", "message": "fyi"})),
        )
        .rule(ScriptRule::agent("a").on_tool_result().reply("{tool_result}"))
        .rule(ScriptRule::agent("b").reply("done"));
    let system = start(&llm, &["a", "b"]);
    system.set_permission("a", PermissionRule::deny("b")).await.unwrap();

    system.ask("a", "hand off").await.unwrap();
    let results = llm.tool_results_seen_by("a");
    assert_eq!(results.len(), 2, "{results:?}");
    assert_eq!(
        results[0],
        "error: delegate_to_agent failed: not permitted: a may not delegate to b: \
         a permission rule denies it (explicit deny)"
    );
    assert_eq!(
        results[1],
        "error: notify_agent failed: not permitted: a may not notify b: a permission rule denies it (explicit deny)"
    );
    let denied = NotPermittedReason::Denied(RuleMatch::ExplicitDeny);
    assert_eq!(
        system.delegate("a", "b", "do it", None).await,
        Err(InboxError::NotPermitted(not_permitted(
            "a",
            "b",
            ContactKind::Delegate,
            denied.clone()
        )))
    );
    assert_eq!(
        system.notify_as("a", "b", "fyi").await,
        Err(InboxError::NotPermitted(not_permitted(
            "a",
            "b",
            ContactKind::Notify,
            denied
        )))
    );
    // The other way round is not denied (rules belong to the sender).
    system.notify_as("b", "a", "fyi").await.unwrap();

    system.remove_permission("a", "b").await.unwrap();
    system.set_org_policy(OrgPolicy::Enforced).await.unwrap();
    assert_eq!(
        system.delegate("a", "b", "do it", None).await,
        Err(InboxError::NotPermitted(not_permitted(
            "a",
            "b",
            ContactKind::Delegate,
            NotPermittedReason::NoLink
        )))
    );
    tokio::time::sleep(10 * SECOND).await;
    assert_eq!(system.pending("a").await.unwrap(), (0, 0));
    assert_eq!(system.pending("b").await.unwrap(), (0, 0));
    assert!(llm.requests_of("b").is_empty(), "b never ran a turn for a refused send");
    system.shutdown().await;
}

/// Goal: a one-way link `boss → worker` lets the worker answer the boss's ask and
/// return its delegated task's result, but not start contact. Method: the boss
/// delegates (the result comes back completed), the boss's ask is answered, the
/// worker's ask and notification to the boss are refused with `OneWayLink`.
#[tokio::test(start_paused = true)]
async fn a_one_way_link_lets_the_target_reply_but_not_start_contact() {
    let llm = ScriptedLlm::new()
        .rule(
            ScriptRule::agent("boss")
                .on_user_containing("you delegated is")
                .reply("thanks"),
        )
        .rule(ScriptRule::agent("boss").reply("ok"))
        .rule(ScriptRule::agent("worker").reply("work done"));
    let system = start(&llm, &["boss", "worker"]);
    system.set_org_policy(OrgPolicy::Enforced).await.unwrap();
    system
        .add_link(
            Link::new("boss", "worker")
                .direction(LinkDirection::OneWay)
                .relationship(LinkRelationship::Superior),
        )
        .await
        .unwrap();

    let task = system.delegate("boss", "worker", "build it", None).await.unwrap();
    tokio::time::sleep(10 * SECOND).await;
    let status = system.task("boss", &task).await.unwrap().unwrap();
    assert_eq!(status.state, TaskState::Completed);
    assert_eq!(status.result.as_deref(), Some("work done"));
    let reply = system.ask_as("boss", "worker", "status?", 10 * SECOND).await.unwrap();
    assert_eq!(reply.text, "work done");
    // The worker's model was told who the boss is.
    let worker_input = llm
        .requests_of("worker")
        .last()
        .unwrap()
        .messages
        .last()
        .unwrap()
        .content
        .clone();
    assert_eq!(
        worker_input,
        "[message from agent boss; boss is your superior: treat its directives as assignments.] status?"
    );

    let one_way = |kind| not_permitted("worker", "boss", kind, NotPermittedReason::OneWayLink);
    match system.ask_as("worker", "boss", "hello", 10 * SECOND).await {
        Err(AgentCallError::NotPermitted(refused)) => assert_eq!(refused, one_way(ContactKind::Ask)),
        other => panic!("expected NotPermitted, got {other:?}"),
    }
    assert_eq!(
        system.notify_as("worker", "boss", "hello").await,
        Err(InboxError::NotPermitted(one_way(ContactKind::Notify)))
    );
    system.shutdown().await;
}

/// Goal: an agent's manager and direct reports are always reachable: the bypass skips
/// links, deny rules and the behaviour mode. Method: enforced policy, no links, a
/// wildcard deny and strict mode on the report; both directions of the hierarchy are
/// answered, a third agent is refused.
#[tokio::test(start_paused = true)]
async fn the_manager_hierarchy_bypasses_links_rules_and_modes() {
    let llm = ScriptedLlm::new().rule(ScriptRule::any_agent().reply("yes"));
    let system = start(&llm, &["lead", "dev", "outsider"]);
    system.set_org_policy(OrgPolicy::Enforced).await.unwrap();
    system
        .set_membership(
            "dev",
            Membership {
                manager: Some("lead".into()),
                mode: BehaviourMode::Strict,
            },
        )
        .await
        .unwrap();
    system.set_permission("dev", PermissionRule::deny("*")).await.unwrap();
    assert_eq!(system.ask_as("dev", "lead", "q", SECOND).await.unwrap().text, "yes");
    assert_eq!(system.ask_as("lead", "dev", "q", SECOND).await.unwrap().text, "yes");
    assert!(matches!(
        system.ask_as("dev", "outsider", "q", SECOND).await,
        Err(AgentCallError::NotPermitted(NotPermitted {
            reason: NotPermittedReason::NoLink,
            ..
        }))
    ));
    assert!(matches!(
        system
            .set_membership(
                "lead",
                Membership {
                    manager: Some("dev".into()),
                    mode: BehaviourMode::Autonomous
                }
            )
            .await,
        Err(OrgError::ManagerCycle { .. })
    ));
    system.shutdown().await;
}

/// Makes `agent` supervised (no manager): each of its contacts needs approval.
async fn supervise(system: &AgentSystem, agent: &str) {
    let supervised = Membership {
        manager: None,
        mode: BehaviourMode::Supervised,
    };
    system.set_membership(agent, supervised).await.unwrap();
}

/// The approvals listed for a person, once there are `count`: a delegation's or a
/// notification's approval is listed once the turn that sent it has committed and its
/// delivery waits for it, a moment after the ask that sent it returned.
async fn listed_approvals(system: &AgentSystem, count: usize) -> Vec<Approval> {
    for _ in 0..1_000 {
        let pending = system.pending_approvals().await.unwrap();
        if pending.len() >= count {
            return pending;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    panic!("{count} approvals were not listed within 1 s")
}

/// Waits for the next `ApprovalRequested` event and returns its id.
async fn next_approval(events: &mut tokio::sync::broadcast::Receiver<AgentEvent>) -> u64 {
    loop {
        if let AgentEvent::ApprovalRequested { id, .. } = events.recv().await.unwrap() {
            return id;
        }
    }
}

/// Goal: a contact that needs approval waits for it: approved, the call proceeds; denied,
/// the model reads a clear refusal; neither, the call is refused at its deadline and the
/// record stays pending. The record is durable (another system on the same store sees
/// it). Method: `a` is supervised; three asks, resolved through the API.
#[tokio::test(start_paused = true)]
async fn a_call_needing_approval_waits_and_proceeds_or_is_refused() {
    let llm = ask_script();
    let store: Arc<dyn StateStore> = Arc::new(SqliteStore::open_in_memory().unwrap());
    let system = start_on(&llm, &["a", "b"], Arc::clone(&store));
    supervise(&system, "a").await;

    let mut events = system.subscribe();
    let client = system.client();
    let asked = tokio::spawn(async move { client.ask("a", "go").await });
    let id = next_approval(&mut events).await;
    let pending = system.pending_approvals().await.unwrap();
    assert_eq!(pending.len(), 1);
    assert_eq!((pending[0].from.as_str(), pending[0].to.as_str()), ("a", "b"));
    assert_eq!(pending[0].message, "what is 6 x 7?");
    assert!(llm.requests_of("b").is_empty(), "nothing reached b before approval");
    let approved = system.approve(id).await.unwrap();
    assert_eq!(approved.state, ApprovalState::Approved);
    assert_eq!(asked.await.unwrap().unwrap().text, "result: 42");
    assert_eq!(system.approve(id).await, Err(OrgError::NotPending { id }));

    let client = system.client();
    let asked = tokio::spawn(async move { client.ask("a", "go").await });
    let id = next_approval(&mut events).await;
    system.deny(id).await.unwrap();
    assert_eq!(
        asked.await.unwrap().unwrap().text,
        format!("result: error: call_agent failed: call not permitted: a may not ask b: approval {id} was denied")
    );

    // Nobody answers: refused at the call's deadline (call_agent's 30 s default).
    let reply = system.ask("a", "go").await.unwrap();
    // Still stored as pending, but past its deadline.
    let id = system.organisation().await.unwrap().pending_approvals()[0].id;
    assert_eq!(
        reply.text,
        format!(
            "result: error: call_agent failed: call not permitted: a may not ask b: \
             approval {id} was still pending at the deadline"
        )
    );
    // Nothing waits for it: it reads expired, is not listed, and approving it is
    // refused (and stores it as expired).
    assert!(system.pending_approvals().await.unwrap().is_empty());
    assert_eq!(
        system.approval(id).await.unwrap().unwrap().state,
        ApprovalState::Expired
    );
    assert_eq!(system.approve(id).await, Err(OrgError::Expired { id }));
    assert_eq!(system.deny(id).await, Err(OrgError::NotPending { id }));
    assert_eq!(llm.requests_of("b").len(), 1, "only the approved call reached b");
    system.shutdown().await;

    // The expired record and the membership are in the store.
    let again = start_on(&llm, &["a", "b"], store);
    let org = again.organisation().await.unwrap();
    assert_eq!(org.approval(id).unwrap().state, ApprovalState::Expired);
    assert!(org.pending_approvals().is_empty());
    assert_eq!(org.membership("a").mode, BehaviourMode::Supervised);
    again.shutdown().await;
}

/// Goal: a call waiting in its turn for approval whose caller gives up takes its
/// approval off the list: the approval is marked expired (reported as
/// `ApprovalResolved`), so a person no longer sees it and approving it is refused
/// instead of accepted for a call that will never be made; the next call is asked for
/// afresh. Before 2026-12-02 it stayed listed, approvable, until the call's deadline (30 s
/// here). Method: `a` is supervised; the ask's task is aborted while its call waits.
async fn a_call_whose_caller_gave_up_takes_its_approval_off_the_list() {
    let llm = ask_script();
    let system = start(&llm, &["a", "b"]);
    supervise(&system, "a").await;
    let mut events = system.subscribe();
    let client = system.client();
    let asked = tokio::spawn(async move { client.ask("a", "go").await });
    let id = next_approval(&mut events).await;
    assert_eq!(listed_approvals(&system, 1).await[0].id, id);
    asked.abort();
    let _ = asked.await;
    taken_off_the_list(&system, &mut events, &llm, id).await;

    // The next call is asked for afresh, and goes through once approved.
    let client = system.client();
    let asked = tokio::spawn(async move { client.ask("a", "go").await });
    let next = next_approval(&mut events).await;
    assert_ne!(next, id);
    system.approve(next).await.unwrap();
    assert_eq!(asked.await.unwrap().unwrap().text, "result: 42");
    assert_eq!(llm.requests_of("b").len(), 1);
    system.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn a_call_whose_caller_gave_up_takes_its_approval_off_the_list_paused() {
    a_call_whose_caller_gave_up_takes_its_approval_off_the_list().await;
}

#[cfg(not(madsim))]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_call_whose_caller_gave_up_takes_its_approval_off_the_list_on_the_multi_thread_runtime() {
    a_call_whose_caller_gave_up_takes_its_approval_off_the_list().await;
}

/// Goal: a system dropped while a call waits in its turn for approval writes nothing
/// more, as a crashed process would not: the approval is still pending for the next
/// process on the store (where it expires at the call's deadline), not marked expired
/// by the dying one's cancelled turn.
#[tokio::test(start_paused = true)]
async fn a_dropped_system_leaves_its_waiting_call_s_approval_as_a_crash_would() {
    let llm = ask_script();
    let data = MemoryStore::new();
    let system = start_on(&llm, &["a", "b"], Arc::new(data.clone()));
    supervise(&system, "a").await;
    let mut events = system.subscribe();
    let client = system.client();
    let asked = tokio::spawn(async move { client.ask("a", "go").await });
    let id = next_approval(&mut events).await;
    drop(system);
    let _ = asked.await;
    tokio::time::sleep(SECOND).await;
    let again = start_on(&llm, &["a", "b"], Arc::new(data));
    assert_eq!(
        again.approval(id).await.unwrap().unwrap().state,
        ApprovalState::Pending,
        "the dropped process marked nothing"
    );
    again.shutdown().await;
}

/// Waits (up to 1 s, in 1 ms steps) until `done` holds; whether it did is the caller's
/// to check.
async fn within_a_second(done: impl Fn() -> bool) -> bool {
    for _ in 0..1_000 {
        if done() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    done()
}

/// Checks that approval `id`, whose waiter gave up, is taken off the list within 1 s
/// (polled every 1 ms): stored expired, reported as `ApprovalResolved`, approving it
/// refused as not pending, and nothing reached `b`.
async fn taken_off_the_list(
    system: &AgentSystem,
    events: &mut tokio::sync::broadcast::Receiver<AgentEvent>,
    llm: &ScriptedLlm,
    id: u64,
) {
    let mut listed = true;
    for _ in 0..1_000 {
        listed = !system.pending_approvals().await.unwrap().is_empty();
        if !listed {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert!(
        !listed,
        "the approval is off the list within 1 s of its waiter giving up"
    );
    assert_eq!(
        system.approval(id).await.unwrap().unwrap().state,
        ApprovalState::Expired
    );
    assert_eq!(system.approve(id).await, Err(OrgError::NotPending { id }));
    let resolved = loop {
        if let AgentEvent::ApprovalResolved { approval, .. } = events.recv().await.unwrap() {
            break approval;
        }
    };
    assert_eq!((resolved.id, resolved.state), (id, ApprovalState::Expired));
    assert!(llm.requests_of("b").is_empty(), "nothing reached b");
}

/// Goal: an `ask_as` whose caller stops waiting for its approval (its future dropped,
/// as when the HTTP request that asked is gone) takes the approval off the list, as a
/// call waiting in its turn does. Before 2026-12-02 it stayed listed, approvable, until
/// the ask's deadline (30 s here), and approving it sent nothing.
async fn an_ask_as_whose_caller_gave_up_takes_its_approval_off_the_list() {
    let llm = ask_script();
    let system = start(&llm, &["a", "b"]);
    supervise(&system, "a").await;
    let mut events = system.subscribe();
    let client = system.client();
    let asked = tokio::spawn(async move { client.ask_as("a", "b", "status?", 30 * SECOND).await });
    let id = next_approval(&mut events).await;
    assert_eq!(listed_approvals(&system, 1).await[0].id, id);
    asked.abort();
    let _ = asked.await;
    taken_off_the_list(&system, &mut events, &llm, id).await;
    system.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn an_ask_as_whose_caller_gave_up_takes_its_approval_off_the_list_paused() {
    an_ask_as_whose_caller_gave_up_takes_its_approval_off_the_list().await;
}

#[cfg(not(madsim))]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_ask_as_whose_caller_gave_up_takes_its_approval_off_the_list_on_the_multi_thread_runtime() {
    an_ask_as_whose_caller_gave_up_takes_its_approval_off_the_list().await;
}

/// `a` supervised, on a store whose organisation's commits are held (in flight: one
/// lands once released, whether or not anyone waits for it) and then its claims too, and
/// `a`'s ask of `b` given up while the approval's commit is held. Returns the system,
/// the store, its data and the events, subscribed before the ask, once the abandoned
/// waiter's task is held at its claim of the record (or, if nothing claims it, after
/// 1 s). The task holds the organisation's lock meanwhile: the system cannot read it.
async fn give_up_while_the_approval_is_written(
    llm: &ScriptedLlm,
) -> (
    AgentSystem,
    Arc<gate_store::GateStore>,
    MemoryStore,
    tokio::sync::broadcast::Receiver<AgentEvent>,
) {
    let data = MemoryStore::new();
    let store = gate_store::GateStore::new(Arc::new(data.clone()), false);
    let system = start_on(llm, &["a", "b"], store.clone());
    supervise(&system, "a").await;
    let org = || ActorId::new(ORG_STORE_KIND, ORG_STORE_KEY).unwrap();
    let held = org();
    store.commits.hold(move |actor| *actor == held);
    let events = system.subscribe();
    let client = system.client();
    let asked = tokio::spawn(async move { client.ask("a", "go").await });
    assert!(
        within_a_second(|| store.commits.held() == 1).await,
        "the approval's write is held"
    );
    let held = org();
    store.claims.hold(move |actor| *actor == held);
    asked.abort();
    let _ = asked.await;
    // Before 2026-12-02 nothing claims it: this wait runs out.
    within_a_second(|| store.claims.held() == 1).await;
    (system, store, data, events)
}

/// Goal: a call whose caller gave up while the approval it waits for was being written
/// leaves no approval listed, however the write in flight ends. Before 2026-12-02 the
/// waiter was armed only once the write had returned, so a write still in flight (as
/// SQLite's thread or a PostgreSQL server finishes one whose caller left) landed as a
/// pending approval listed until the call's deadline, with nothing waiting for it.
/// Method: the ask is aborted while the approval's commit is held. Here the abandoned
/// waiter's task claims the record before the commit is let go: the commit is fenced
/// and never lands. The next call is asked for afresh and goes through once approved.
async fn a_call_given_up_while_its_approval_is_written_leaves_it_unwritten() {
    let llm = ask_script();
    let (system, store, _, mut events) = give_up_while_the_approval_is_written(&llm).await;
    store.claims.release();
    within_a_second(|| store.claims.done() == 1).await;
    store.commits.release();
    assert!(
        within_a_second(|| store.commits.done() == 1).await,
        "the write in flight ended"
    );
    assert_eq!(
        system.pending_approvals().await.unwrap(),
        Vec::<Approval>::new(),
        "nothing listed: the write in flight was fenced"
    );

    // The next call is asked for afresh, and goes through once approved.
    let client = system.client();
    let asked = tokio::spawn(async move { client.ask("a", "go").await });
    let next = next_approval(&mut events).await;
    assert_eq!(listed_approvals(&system, 1).await[0].id, next);
    system.approve(next).await.unwrap();
    assert_eq!(asked.await.unwrap().unwrap().text, "result: 42");
    assert_eq!(llm.requests_of("b").len(), 1);
    system.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn a_call_given_up_while_its_approval_is_written_leaves_it_unwritten_paused() {
    a_call_given_up_while_its_approval_is_written_leaves_it_unwritten().await;
}

#[cfg(not(madsim))]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_call_given_up_while_its_approval_is_written_leaves_it_unwritten_on_the_multi_thread_runtime() {
    a_call_given_up_while_its_approval_is_written_leaves_it_unwritten().await;
}

/// Goal: as above, but the write in flight lands before the abandoned waiter's task
/// claims the record: the approval it wrote is found there and marked expired (reported
/// as `ApprovalResolved`), so it is off the list and approving it is refused.
async fn a_call_given_up_while_its_approval_is_written_takes_it_off_the_list_once_written() {
    let llm = ask_script();
    let (system, store, data, mut events) = give_up_while_the_approval_is_written(&llm).await;
    store.commits.release();
    assert!(within_a_second(|| store.commits.done() == 1).await, "the write landed");
    // Read from the data: the system waits for the organisation's lock.
    let org = ActorId::new(ORG_STORE_KIND, ORG_STORE_KEY).unwrap();
    let stored = data.load(&org).await.unwrap().expect("the organisation is stored");
    let stored: Organisation = serde_json::from_slice(&stored).unwrap();
    let listed = stored.pending_approvals_at(Deadline::from_micros(0));
    assert_eq!(
        listed.len(),
        1,
        "the write in flight landed: listed until the waiter's task marks it"
    );
    let id = listed[0].id;
    store.claims.release();
    taken_off_the_list(&system, &mut events, &llm, id).await;
    system.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn a_call_given_up_while_its_approval_is_written_takes_it_off_the_list_once_written_paused() {
    a_call_given_up_while_its_approval_is_written_takes_it_off_the_list_once_written().await;
}

#[cfg(not(madsim))]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_call_given_up_while_its_approval_is_written_takes_it_off_the_list_once_written_on_the_multi_thread_runtime()
{
    a_call_given_up_while_its_approval_is_written_takes_it_off_the_list_once_written().await;
}

/// `a` (which sends calls needing approval as tasks) and `b` on `store`.
fn start_sending_calls_as_tasks(llm: &ScriptedLlm, store: Arc<dyn StateStore>) -> AgentSystem {
    AgentSystem::builder()
        .store(store)
        .llm(Arc::new(llm.clone()))
        .agent(AgentSpec::new("a").call_approval(CallApproval::Delegate))
        .agent(AgentSpec::new("b"))
        .start()
        .expect("the system starts")
}

/// The requests of `a`'s model that carried a task's result (`[task ... you delegated
/// is ...]`), by their last message.
fn results_read_by_a(llm: &ScriptedLlm) -> Vec<String> {
    llm.requests_of("a")
        .iter()
        .filter_map(|request| request.messages.last())
        .filter(|message| message.content.contains("you delegated is"))
        .map(|message| message.content.clone())
        .collect()
}

/// Goal: an agent whose calls needing approval are sent as tasks
/// (`CallApproval::Delegate`) does not wait for the approval in its turn: its model reads
/// at once that the question was sent as task N pending approval M (a `delegate`
/// approval); the task waits in the outbox, durably (across a shutdown and a restart on
/// the same store); approved, `b` answers it and the answer comes back to `a` as the
/// task's result, read by its model in a turn of its own; denied, the denial comes back
/// and `b` never sees the question. An agent with the default (`WaitInTurn`) still
/// waits in its turn (`a_call_needing_approval_waits_and_proceeds_or_is_refused`).
#[tokio::test(start_paused = true)]
async fn a_call_needing_approval_can_be_sent_as_a_task_that_waits_durably() {
    let llm = ScriptedLlm::new()
        .rule(
            ScriptRule::agent("a")
                .on_user_containing("you delegated is")
                .reply("a read the result"),
        )
        .rule(
            ScriptRule::agent("a")
                .on_user_containing("")
                .call("call_agent", json!({"agent_id": "b", "message": "what is 6 x 7?"})),
        )
        .rule(ScriptRule::agent("a").on_tool_result().reply("result: {tool_result}"))
        .rule(ScriptRule::agent("b").reply("42"));
    let store: Arc<dyn StateStore> = Arc::new(SqliteStore::open_in_memory().unwrap());
    let system = start_sending_calls_as_tasks(&llm, Arc::clone(&store));
    supervise(&system, "a").await;
    let mut events = system.subscribe();

    // The turn does not wait: it ends with the model's reading of the tool result. The
    // approval is listed once that turn committed and the task's delivery waits for it.
    let reply = system.ask("a", "go").await.unwrap();
    let listed = next_approval(&mut events).await;
    let pending = system.pending_approvals().await.unwrap();
    assert_eq!(pending.len(), 1, "{pending:?}");
    assert_eq!(pending[0].id, listed);
    assert_eq!(
        (pending[0].from.as_str(), pending[0].to.as_str(), pending[0].kind),
        ("a", "b", ContactKind::Delegate)
    );
    assert_eq!(pending[0].message, "what is 6 x 7?");
    let id = pending[0].id;
    assert_eq!(
        reply.text,
        format!(
            "result: the call to b needs approval {id}: your question was sent as task a.0 instead, which is \
             sent once approved; b's answer (or the denial) will come back to you as the task's result"
        )
    );
    assert_eq!(
        system.pending("a").await.unwrap(),
        (0, 1),
        "the task waits in a's outbox"
    );

    // Across a restart, then approved: b answers once, a reads the answer once.
    system.shutdown().await;
    let system = start_sending_calls_as_tasks(&llm, Arc::clone(&store));
    tokio::time::sleep(10 * SECOND).await;
    assert!(llm.requests_of("b").is_empty(), "nothing reached b before the approval");
    system.approve(id).await.unwrap();
    tokio::time::sleep(10 * SECOND).await;
    assert_eq!(llm.requests_of("b").len(), 1);
    let task = system.task("a", "a.0").await.unwrap().unwrap();
    assert_eq!((task.state, task.result.as_deref()), (TaskState::Completed, Some("42")));
    assert_eq!(results_read_by_a(&llm).len(), 1, "{:?}", results_read_by_a(&llm));
    assert!(results_read_by_a(&llm)[0].contains("[task a.0 you delegated is completed]"));
    assert!(results_read_by_a(&llm)[0].contains("42"));

    // Denied: the denial comes back as the result; b never sees the question.
    let mut events = system.subscribe();
    system.ask("a", "go again").await.unwrap();
    next_approval(&mut events).await;
    let pending = system.pending_approvals().await.unwrap();
    assert_eq!(pending.len(), 1, "{pending:?}");
    system.deny(pending[0].id).await.unwrap();
    tokio::time::sleep(10 * SECOND).await;
    assert_eq!(llm.requests_of("b").len(), 1, "the denied question never reached b");
    let task = system.task("a", "a.1").await.unwrap().unwrap();
    assert_eq!(task.state, TaskState::Rejected);
    assert_eq!(
        task.result.as_deref(),
        Some(
            format!(
                "not permitted: a may not delegate to b: approval {} was denied",
                pending[0].id
            )
            .as_str()
        )
    );
    assert_eq!(results_read_by_a(&llm).len(), 2);
    assert_eq!(system.pending("a").await.unwrap(), (0, 0));
    system.shutdown().await;
}

/// `a` delegates to `b` and notifies `b` on "hand off", then reports its tool results;
/// it echoes every task result it gets back; `b` answers "done".
fn hand_off_script() -> ScriptedLlm {
    ScriptedLlm::new()
        .rule(
            ScriptRule::agent("a")
                .on_user_containing("hand off")
                .call("delegate_to_agent", json!({"agent_id": "b", "message": "do it"}))
                .call("notify_agent", json!({"agent_id": "b", "message": "fyi"})),
        )
        .rule(ScriptRule::agent("a").on_tool_result().reply("{tool_result}"))
        .rule(ScriptRule::agent("a").on_user_containing("you delegated").reply("seen"))
        .rule(ScriptRule::agent("b").reply("done"))
}

/// Goal: a delegation and a notification that need approval do not hold the sending
/// turn: the turn ends at once, its model reads "pending approval N"; the messages wait
/// in the outbox (durably: across a restart on the same store) and are delivered once
/// approved; a denied delegation comes back to the delegator as a `rejected` task whose
/// result names the denial, and a denied notification is never delivered. Method: `a`
/// is supervised; its scripted model delegates and notifies; the approvals are resolved
/// through the API, the second pair after the system was shut down and started again.
#[tokio::test(start_paused = true)]
async fn a_send_needing_approval_waits_in_the_outbox_across_a_restart() {
    let llm = hand_off_script();
    let store: Arc<dyn StateStore> = Arc::new(SqliteStore::open_in_memory().unwrap());
    let supervised = Membership {
        manager: None,
        mode: BehaviourMode::Supervised,
    };
    let system = start_on(&llm, &["a", "b"], Arc::clone(&store));
    system.set_membership("a", supervised.clone()).await.unwrap();

    // Approved: the turn does not wait; b works only after the approval.
    let reply = system.ask("a", "hand off").await.unwrap();
    let pending = listed_approvals(&system, 2).await;
    assert_eq!(pending.len(), 2, "{pending:?}");
    let (task_approval, notify_approval) = (pending[0].id, pending[1].id);
    assert_eq!(pending[0].kind, ContactKind::Delegate);
    assert_eq!(pending[1].kind, ContactKind::Notify);
    let results = llm.tool_results_seen_by("a");
    assert_eq!(
        results[0],
        format!(
            "task a.0 is pending approval {task_approval}: it is sent once approved; if it is denied \
             (or not approved in time) the denial comes back as the task's result"
        )
    );
    assert_eq!(
        results[1],
        format!("notification a.1 is pending approval {notify_approval}: it is sent only once approved")
    );
    assert!(reply.text.contains("pending approval"), "{}", reply.text);
    tokio::time::sleep(10 * SECOND).await;
    assert!(llm.requests_of("b").is_empty(), "nothing reached b before approval");
    assert_eq!(system.pending("a").await.unwrap(), (0, 2), "both wait in a's outbox");
    system.approve(task_approval).await.unwrap();
    system.approve(notify_approval).await.unwrap();
    tokio::time::sleep(10 * SECOND).await;
    assert_eq!(llm.requests_of("b").len(), 2, "the task and the notification reached b");
    let task = system.task("a", "a.0").await.unwrap().unwrap();
    assert_eq!(
        (task.state, task.result.as_deref()),
        (TaskState::Completed, Some("done"))
    );

    // Pending across a restart, then denied: b never sees them; the task is rejected.
    system.ask("a", "hand off").await.unwrap();
    let pending = listed_approvals(&system, 2).await;
    assert_eq!(pending.len(), 2, "{pending:?}");
    let task_id = "a.2";
    assert_eq!(system.pending("a").await.unwrap(), (0, 2));
    system.shutdown().await;
    let system = start_on(&llm, &["a", "b"], Arc::clone(&store));
    tokio::time::sleep(SECOND).await;
    assert_eq!(
        system.pending("a").await.unwrap(),
        (0, 2),
        "still queued after the restart"
    );
    system.deny(pending[0].id).await.unwrap();
    system.deny(pending[1].id).await.unwrap();
    tokio::time::sleep(10 * SECOND).await;
    assert_eq!(llm.requests_of("b").len(), 2, "nothing denied reached b");
    let task = system.task("a", task_id).await.unwrap().unwrap();
    assert_eq!(task.state, TaskState::Rejected);
    assert_eq!(
        task.result.as_deref(),
        Some(
            format!(
                "not permitted: a may not delegate to b: approval {} was denied",
                pending[0].id
            )
            .as_str()
        )
    );
    let rejected = llm
        .requests_of("a")
        .iter()
        .filter(|request| {
            let needle = format!("[task {task_id} you delegated is rejected]");
            request.messages.last().is_some_and(|m| m.content.contains(&needle))
        })
        .count();
    assert_eq!(rejected, 1, "a's model read the denial once");
    assert_eq!(system.pending("a").await.unwrap(), (0, 0));
    system.shutdown().await;
}

/// Goal: a shutdown ends the tasks delivering sends that wait for an approval where
/// they wait, instead of waiting its whole bound for them
/// (`DELIVERY_TASKS_SHUTDOWN_WAIT_MS`) and leaving them running until their sends'
/// deadlines, minutes later (before: the shutdown took 1,000 ms and warned "delivery
/// tasks still ran"); what they were to deliver stays in the outbox, and the next start
/// delivers it once approved. Method: `a` is supervised, delegates and notifies (two
/// outbox entries pending approval); the shutdown's length is read on the runtime's
/// clock (simulated time when `paused`); a new system on the same store is approved both.
async fn a_shutdown_ends_the_deliveries_waiting_for_an_approval_at_once(paused: bool) {
    let llm = hand_off_script();
    let store: Arc<dyn StateStore> = Arc::new(SqliteStore::open_in_memory().unwrap());
    let system = start_on(&llm, &["a", "b"], Arc::clone(&store));
    supervise(&system, "a").await;
    system.ask("a", "hand off").await.unwrap();
    let pending = listed_approvals(&system, 2).await;
    assert_eq!(system.pending("a").await.unwrap(), (0, 2), "both wait in a's outbox");

    let started = tokio::time::Instant::now();
    system.shutdown().await;
    let took = started.elapsed();
    assert!(
        took < Duration::from_millis(DELIVERY_TASKS_SHUTDOWN_WAIT_MS),
        "the shutdown waited {took:?} for the deliveries waiting for an approval (paused: {paused}); \
         they should have ended at once"
    );

    let system = start_on(&llm, &["a", "b"], Arc::clone(&store));
    assert_eq!(
        system.pending("a").await.unwrap(),
        (0, 2),
        "still queued after the restart"
    );
    system.approve(pending[0].id).await.unwrap();
    system.approve(pending[1].id).await.unwrap();
    let waited_from = tokio::time::Instant::now();
    while llm.requests_of("b").len() < 2 && waited_from.elapsed() < 10 * SECOND {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        llm.requests_of("b").len(),
        2,
        "the task and the notification reached b once approved"
    );
    system.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn a_shutdown_ends_the_deliveries_waiting_for_an_approval_at_once_paused() {
    a_shutdown_ends_the_deliveries_waiting_for_an_approval_at_once(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shutdown_ends_the_deliveries_waiting_for_an_approval_at_once_on_the_multi_thread_runtime() {
    a_shutdown_ends_the_deliveries_waiting_for_an_approval_at_once(false).await;
}

/// Goal: a send that needs approval can be approved until its own deadline (the
/// task's or the notification's, which the outbox waits until), not only until the
/// deadline of the turn or request that sent it: the approval keeps the send's deadline.
/// Method: `a` is supervised; (1) its turn, asked with a 5 s timeout, delegates and
/// notifies (120 s each by default): both approved 60 s later are delivered; (2) a
/// delegation through the API with the longest deadline (300 s), which outlives the API
/// request's 120 s: approved at 200 s, it is delivered and completes.
#[tokio::test(start_paused = true)]
async fn a_send_needing_approval_can_be_approved_until_its_own_deadline() {
    let llm = hand_off_script();
    let system = start(&llm, &["a", "b"]);
    supervise(&system, "a").await;

    let reply = system.ask_with_timeout("a", "hand off", 5 * SECOND).await.unwrap();
    assert!(reply.text.contains("pending approval"), "{}", reply.text);
    let pending = listed_approvals(&system, 2).await;
    assert_eq!(pending.len(), 2, "{pending:?}");
    tokio::time::sleep(60 * SECOND).await;
    for approval in &pending {
        let approved = system.approve(approval.id).await.unwrap();
        assert_eq!(approved.state, ApprovalState::Approved);
    }
    tokio::time::sleep(10 * SECOND).await;
    assert_eq!(llm.requests_of("b").len(), 2, "the task and the notification reached b");
    let task = system.task("a", "a.0").await.unwrap().unwrap();
    assert_eq!(
        (task.state, task.result.as_deref()),
        (TaskState::Completed, Some("done"))
    );

    let task_id = system
        .delegate("a", "b", "the long job", Some(AGENT_TASK_TIMEOUT_MS_MAX))
        .await
        .unwrap();
    let pending = listed_approvals(&system, 1).await;
    assert_eq!(pending.len(), 1, "{pending:?}");
    tokio::time::sleep(200 * SECOND).await;
    assert_eq!(
        system.pending_approvals().await.unwrap(),
        pending,
        "still pending past the request's deadline"
    );
    system.approve(pending[0].id).await.unwrap();
    tokio::time::sleep(10 * SECOND).await;
    let task = system.task("a", &task_id).await.unwrap().unwrap();
    assert_eq!(
        (task.state, task.result.as_deref()),
        (TaskState::Completed, Some("done"))
    );
    system.shutdown().await;
}

/// Goal: an approval recorded for a send that then fails a later check (here: the
/// sender already has `AGENT_TASKS_OPEN_MAX` delegations open) is withdrawn at once, not
/// left unlisted, where no person can see or deny it, holding room of the 1,000 pending
/// until its deadline. Method: `a` is supervised (its every contact needs approval); it
/// delegates `AGENT_TASKS_OPEN_MAX` jobs to `b` through the API (each waits for
/// approval), then one more.
#[tokio::test(start_paused = true)]
async fn an_approval_for_a_send_that_was_not_queued_is_withdrawn() {
    let llm = hand_off_script();
    let system = start(&llm, &["a", "b"]);
    supervise(&system, "a").await;
    for job in 0..AGENT_TASKS_OPEN_MAX {
        system.delegate("a", "b", &format!("job {job}"), None).await.unwrap();
    }
    let one_more = system.delegate("a", "b", "one job too many", None).await;
    assert!(matches!(one_more, Err(InboxError::OutboxFull { .. })), "{one_more:?}");
    let max = usize::try_from(AGENT_TASKS_OPEN_MAX).unwrap();
    let listed = listed_approvals(&system, max).await;
    assert_eq!(listed.len(), max);
    let org = system.organisation().await.unwrap();
    let recorded = org.pending_approvals();
    assert_eq!(recorded.len(), max, "the refused one's approval was withdrawn");
    assert!(recorded.iter().all(|approval| approval.message != "one job too many"));
    system.shutdown().await;
}

/// Goal: links, rules and the policy survive a restart and are enforced after it.
#[tokio::test(start_paused = true)]
async fn the_organisation_is_kept_in_the_store_across_a_restart() {
    let llm = ask_script();
    let store: Arc<dyn StateStore> = Arc::new(SqliteStore::open_in_memory().unwrap());
    let system = start_on(&llm, &["a", "b", "c"], Arc::clone(&store));
    system.set_org_policy(OrgPolicy::Enforced).await.unwrap();
    system.add_link(Link::new("a", "c")).await.unwrap();
    system.add_link(Link::new("b", "c")).await.unwrap();
    system
        .update_link(Link::new("b", "c").direction(LinkDirection::OneWay))
        .await
        .unwrap();
    system.remove_link("a", "c").await.unwrap();
    system.set_permission("c", PermissionRule::deny("a")).await.unwrap();
    system.shutdown().await;

    let system = start_on(&llm, &["a", "b", "c"], store);
    assert_eq!(
        system.links().await.unwrap(),
        vec![Link::new("b", "c").direction(LinkDirection::OneWay)]
    );
    assert_eq!(
        system.organisation().await.unwrap().rules("c"),
        vec![PermissionRule::deny("a")]
    );
    let reply = system.ask("a", "go").await.unwrap();
    assert!(
        reply.text.contains("call not permitted: a may not ask b"),
        "{}",
        reply.text
    );
    system.shutdown().await;
}

/// Goal: the model sees its place in the organisation and, in the contact tools'
/// descriptions, only the agents it may contact. Method: read the system prompt and the
/// tool specs of the worker's model request.
#[tokio::test(start_paused = true)]
async fn the_prompt_shows_the_organisation_and_the_tools_list_only_reachable_agents() {
    let llm = ScriptedLlm::new().rule(ScriptRule::any_agent().reply("ok"));
    let system = start(&llm, &["boss", "worker", "peer", "stranger"]);
    system.set_org_policy(OrgPolicy::Enforced).await.unwrap();
    system
        .set_membership(
            "worker",
            Membership {
                manager: Some("boss".into()),
                mode: BehaviourMode::Autonomous,
            },
        )
        .await
        .unwrap();
    system.add_link(Link::new("worker", "peer")).await.unwrap();
    system.ask("worker", "hi").await.unwrap();
    let request = &llm.requests_of("worker")[0];
    let prompt = &request.messages[0].content;
    assert!(
        prompt.contains(
            "## Organisation\nYou are part of a multi-agent organisation.\nReports to:\n- boss: your superior"
        ),
        "{prompt}"
    );
    assert!(prompt.contains("Peers:\n- peer: equal peer"), "{prompt}");
    assert!(
        prompt.contains("Agents you may contact with call_agent, delegate_to_agent and notify_agent:\n- boss: the boss\n- peer: the peer"),
        "{prompt}"
    );
    assert!(!prompt.contains("stranger"), "{prompt}");
    for tool in request.tools.iter() {
        assert!(
            tool.description.ends_with(" Agents you may contact: boss, peer."),
            "{}: {}",
            tool.name,
            tool.description
        );
    }
    system.shutdown().await;
}

/// Goal: a config file's organisation is synced into a running system: config wins
/// for what it declares; links and rules created at runtime are kept.
#[tokio::test(start_paused = true)]
async fn a_config_is_synced_and_runtime_items_are_kept() {
    let text = r#"
policy = "enforced"
[[agents]]
id = "lead"
[[agents]]
id = "dev"
manager = "lead"
[[agents]]
id = "qa"
[[links]]
from = "dev"
to = "qa"
direction = "one_way"
[[permissions]]
agent = "qa"
target = "dev"
effect = "deny"
"#;
    let config = OrgConfig::from_toml(text, "org.toml").unwrap();
    let llm = ScriptedLlm::new().rule(ScriptRule::any_agent().reply("ok"));
    let system = AgentSystem::builder().llm(Arc::new(llm)).start().unwrap();
    system.directory().upsert(AgentSpec::new("temp")).unwrap();
    system.add_link(Link::new("temp", "qa")).await.unwrap();
    system.add_link(Link::new("dev", "qa")).await.unwrap(); // two-way: config will override
    system.apply_config(&config).await.unwrap();
    let org = system.organisation().await.unwrap();
    assert_eq!(org.policy, OrgPolicy::Enforced);
    assert_eq!(org.link("dev", "qa").unwrap().direction, LinkDirection::OneWay);
    assert!(org.link("temp", "qa").is_some(), "a runtime link is kept");
    assert!(system.directory().contains("temp") && system.directory().contains("qa"));
    assert_eq!(system.ask_as("dev", "qa", "test it", SECOND).await.unwrap().text, "ok");
    assert!(system.ask_as("qa", "dev", "bug", SECOND).await.is_err());
    assert_eq!(system.ask_as("dev", "lead", "done", SECOND).await.unwrap().text, "ok");
    system.shutdown().await;
}

/// Goal: a change committed by another process on the same store reaches this process's
/// admission within `ORG_CACHE_MAX_AGE_MS`, without `reload_org`: a deny rule, then the
/// rule's removal, and an approval resolved over there for a call waiting here. Until
/// that age, this process decides on what it read (one store read per age at most).
/// Method: two systems on one SQLite store (two processes on one file): `serving`
/// answers asks, `admin` only changes the organisation. Time is paused (or simulated):
/// the waits are exact.
#[tokio::test(start_paused = true)]
async fn another_process_s_change_reaches_admission_within_the_cache_age() {
    let age = Duration::from_millis(troupe_agent::ORG_CACHE_MAX_AGE_MS);
    let llm = ask_script();
    let store: Arc<dyn StateStore> = Arc::new(SqliteStore::open_in_memory().unwrap());
    let serving = start_on(&llm, &["a", "b"], Arc::clone(&store));
    let admin = start_on(&llm, &["a", "b"], Arc::clone(&store));
    assert_eq!(serving.ask("a", "go").await.unwrap().text, "result: 42");
    let denied = "result: error: call_agent failed: call not permitted: a may not ask b";

    admin.set_permission("a", PermissionRule::deny("b")).await.unwrap();
    // Read less than an age ago: still the organisation read then.
    assert_eq!(serving.ask("a", "go").await.unwrap().text, "result: 42");
    tokio::time::sleep(age).await;
    let reply = serving.ask("a", "go").await.unwrap();
    assert!(
        reply.text.starts_with(denied),
        "the deny reached the serving process: {}",
        reply.text
    );
    assert_eq!(
        serving.organisation().await.unwrap().rules("a"),
        vec![PermissionRule::deny("b")]
    );

    admin.remove_permission("a", "b").await.unwrap();
    tokio::time::sleep(age).await;
    assert_eq!(
        serving.ask("a", "go").await.unwrap().text,
        "result: 42",
        "the removal too"
    );

    // An approval resolved by the other process reaches a call waiting here.
    supervise(&admin, "a").await;
    tokio::time::sleep(age).await;
    let mut events = serving.subscribe();
    let client = serving.client();
    let asked = tokio::spawn(async move { client.ask("a", "go").await });
    let id = next_approval(&mut events).await;
    // The admin process reads the pending approval from the store once its copy is old.
    tokio::time::sleep(age).await;
    let pending = admin.pending_approvals().await.unwrap();
    assert_eq!(pending.iter().map(|approval| approval.id).collect::<Vec<_>>(), vec![id]);
    let approved_at = tokio::time::Instant::now();
    admin.approve(id).await.unwrap();
    let reply = asked.await.unwrap().unwrap();
    assert_eq!(reply.text, "result: 42");
    // Seen within the age; then the rest of the call (b's turn, the replies) takes a few
    // microseconds of simulated time (none when paused).
    let rest = Duration::from_millis(REST_OF_CALL_MS_MAX);
    let waited = approved_at.elapsed();
    assert!(
        waited <= age + rest,
        "the waiting call answered {waited:?} after the approval was given, more than {age:?} + {rest:?}"
    );
    assert_eq!(llm.requests_of("b").len(), 4, "b answered the four permitted asks only");
    admin.shutdown().await;
    serving.shutdown().await;
}

/// Goal: a process whose store stops answering the organisation's re-read goes on
/// deciding on the copy it holds while that copy is younger than
/// `ORG_CACHE_STALE_MAX_MS`, then refuses every contact (`the organisation could not be
/// read`) rather than decide on an older one; once the store answers again, it decides
/// on the newest organisation (a deny added meanwhile by another process). Method: the
/// serving system's store refuses `load` (the organisation's read) on a switch; the
/// admin system writes to the same data directly. Time is paused (or simulated).
#[tokio::test(start_paused = true)]
async fn a_failing_re_read_keeps_the_organisation_until_it_is_too_old_then_refuses() {
    let age = Duration::from_millis(troupe_agent::ORG_CACHE_MAX_AGE_MS);
    let stale_max = Duration::from_millis(troupe_agent::ORG_CACHE_STALE_MAX_MS);
    let llm = ask_script();
    let data: Arc<dyn StateStore> = Arc::new(SqliteStore::open_in_memory().unwrap());
    let gate = gate_store::GateStore::new(Arc::clone(&data), false);
    let serving = start_on(&llm, &["a", "b"], Arc::clone(&gate) as Arc<dyn StateStore>);
    let admin = start_on(&llm, &["a", "b"], data);
    assert_eq!(serving.ask("a", "go").await.unwrap().text, "result: 42");
    let read_at = tokio::time::Instant::now();

    gate.refuse_loads.store(true, std::sync::atomic::Ordering::SeqCst);
    admin.set_permission("a", PermissionRule::deny("b")).await.unwrap();
    tokio::time::sleep(age).await;
    assert_eq!(
        serving.ask("a", "go").await.unwrap().text,
        "result: 42",
        "the copy read {:?} ago is kept",
        read_at.elapsed()
    );
    tokio::time::sleep(stale_max.saturating_sub(read_at.elapsed())).await;
    let reply = serving.ask("a", "go").await.unwrap();
    assert!(
        reply.text.starts_with(
            "result: error: call_agent failed: call not permitted: a may not ask b: the organisation could not be read"
        ),
        "a copy {:?} old is not decided on: {}",
        read_at.elapsed(),
        reply.text
    );

    gate.refuse_loads.store(false, std::sync::atomic::Ordering::SeqCst);
    let reply = serving.ask("a", "go").await.unwrap();
    assert!(
        reply
            .text
            .starts_with("result: error: call_agent failed: call not permitted: a may not ask b"),
        "{}",
        reply.text
    );
    assert!(
        !reply.text.contains("could not be read"),
        "the store answers again: {}",
        reply.text
    );
    assert_eq!(
        llm.requests_of("b").len(),
        2,
        "b answered only while the copy was young enough"
    );
    admin.shutdown().await;
    serving.shutdown().await;
}

/// Goal: a call waiting for an approval while the store refuses the organisation's
/// re-read tries again once per `ORG_CACHE_MAX_AGE_MS`, not in a loop (it retried every
/// millisecond once its copy was old and the kept copy stayed old). Method: `a` is
/// supervised, so its ask waits for an approval; the store then refuses `load` for 10
/// simulated seconds; the refused reads are counted.
#[tokio::test(start_paused = true)]
async fn a_waiting_call_reads_a_failing_store_once_per_cache_age() {
    /// How long the store refuses, in seconds.
    const REFUSING_S: u64 = 10;
    let llm = ask_script();
    let data: Arc<dyn StateStore> = Arc::new(SqliteStore::open_in_memory().unwrap());
    let gate = gate_store::GateStore::new(data, false);
    let system = start_on(&llm, &["a", "b"], Arc::clone(&gate) as Arc<dyn StateStore>);
    supervise(&system, "a").await;
    let mut events = system.subscribe();
    let client = system.client();
    let asked = tokio::spawn(async move { client.ask("a", "go").await });
    let id = next_approval(&mut events).await;
    gate.refuse_loads.store(true, std::sync::atomic::Ordering::SeqCst);
    tokio::time::sleep(Duration::from_secs(REFUSING_S)).await;
    let refused = gate.refused_loads.load(std::sync::atomic::Ordering::SeqCst);
    let most = REFUSING_S * 1_000 / troupe_agent::ORG_CACHE_MAX_AGE_MS + 1;
    assert!(
        (1..=most).contains(&refused),
        "{refused} reads of the organisation in {REFUSING_S} s of a failing store (at most {most})"
    );
    gate.refuse_loads.store(false, std::sync::atomic::Ordering::SeqCst);
    system.approve(id).await.unwrap();
    assert_eq!(asked.await.unwrap().unwrap().text, "result: 42");
    system.shutdown().await;
}
