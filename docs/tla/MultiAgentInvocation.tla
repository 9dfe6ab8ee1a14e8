------------------------------ MODULE MultiAgentInvocation ------------------------------
(***************************************************************************)
(* Agent-to-agent calls in Troupe (call_agent) on one or two nodes, each  *)
(* node with its own dispatcher and wait-for graph (Remote: node 2).        *)
(*                                                                         *)
(* - Agents are non-reentrant actors: one turn at a time, fed from a       *)
(*   bounded mailbox. A full mailbox answers Busy.                         *)
(* - A turn may call another agent and then BLOCKS until the reply, a      *)
(*   timeout, or a rejection. The blocking wait is modelled explicitly     *)
(*   (waiting[a]), because that is where a deadlock lives.                 *)
(* - Every call carries call_depth, call_chain and an absolute deadline.   *)
(*   Admission (pure, crates/troupe-core/src/admission.rs) rejects a call  *)
(*   whose target is in the chain (or is the caller) and a call made from  *)
(*   a context whose depth is >= MAX_DEPTH. The child deadline is the      *)
(*   requested timeout clipped to the caller's deadline.                   *)
(* - The dispatcher keeps a wait-for graph (wfg) and refuses an edge that  *)
(*   would close a cycle (DeadlockDetected). Its view is updated           *)
(*   asynchronously: an edge is added when the call is admitted and only   *)
(*   forgotten some time after the caller stopped waiting.                 *)
(* - Requests and replies travel through a network that may delay,         *)
(*   reorder and (if LOSS) lose them. Timeouts fire at the deadline.       *)
(* - The workload is bounded (MAX_CALLS call attempts, MAX_ROOTS client    *)
(*   requests) so the state space is finite and every behaviour can end;  *)
(*   Terminated is a stuttering step allowed only once all work is done,   *)
(*   so TLC's deadlock check stays meaningful.                             *)
(*                                                                         *)
(* Each BUG_* constant removes one protection; the buggy configs set one   *)
(* of them and TLC must produce a counterexample.                          *)
(***************************************************************************)
EXTENDS Naturals, Sequences, FiniteSets, TLC

CONSTANTS
    Agents,                \* agent ids (model values)
    Remote,                \* agents hosted on a second node ({} = one node)
    Client,                \* the external caller of root requests (model value)
    MAX_DEPTH,             \* AGENT_CALL_DEPTH_MAX
    MAILBOX_CAP,           \* capacity of each agent's mailbox
    MAX_CALLS,             \* bound on admitted calls (root requests + agent calls)
    MAX_ROOTS,             \* bound on requests from the client
    ROOT_TIMEOUT,          \* ticks the client waits for a root request
    CHILD_TIMEOUT,         \* ticks an agent requests for a child call, before clipping
    LOSS,                  \* TRUE: the network may lose requests and replies
    BUG_NO_CHAIN_CHECK,    \* admission forgets "target in call_chain / target = self"
    BUG_NO_DEPTH_CHECK,    \* admission forgets "call_depth >= MAX_DEPTH"
    BUG_NO_WAITFOR_CHECK,  \* dispatcher does not consult the wait-for graph
    BUG_NO_DEADLINE_CLIP,  \* child deadline = now + timeout, not clipped to parent's
    BUG_NO_TIMEOUT,        \* no deadlines: waits never time out, work never expires
    BUG_CALL_AFTER_DEADLINE \* admission lets a turn past its own deadline call out

ASSUME /\ MAX_DEPTH \in Nat /\ MAILBOX_CAP \in Nat \ {0}
       /\ MAX_CALLS \in Nat \ {0} /\ MAX_ROOTS \in 1..MAX_CALLS
       /\ ROOT_TIMEOUT \in Nat \ {0} /\ CHILD_TIMEOUT \in Nat \ {0}
       /\ Client \notin Agents
       /\ Remote \subseteq Agents
       /\ \A b \in {LOSS, BUG_NO_CHAIN_CHECK, BUG_NO_DEPTH_CHECK, BUG_NO_WAITFOR_CHECK,
                    BUG_NO_DEADLINE_CLIP, BUG_NO_TIMEOUT,
                    BUG_CALL_AFTER_DEADLINE} :
              b \in BOOLEAN

VARIABLES
    now,       \* global clock (ticks)
    calls,     \* call id -> call record
    nCalls,    \* call ids 1..nCalls are used
    mailbox,   \* agent -> Seq(call id): delivered requests not yet started
    turn,      \* agent -> call id of the running turn, 0 if idle
    waiting,   \* agent -> call id the running turn is blocked on, 0 if not blocked
    net,       \* set of messages in flight (unordered: delay and reordering)
    wfg        \* dispatcher's wait-for graph: set of call ids, edge caller -> target

vars == <<now, calls, nCalls, mailbox, turn, waiting, net, wfg>>

CallIds == 1..MAX_CALLS
Callers == Agents \cup {Client}
Statuses == {"none", "pending", "ok", "busy", "timedout"}
Resolved == {"ok", "busy", "timedout"}       \* final states of an admitted call

NoCall == [status |-> "none", caller |-> Client, parent |-> 0, target |-> Client,
           depth |-> 0, chain |-> << >>, deadline |-> 0]

Range(s) == {s[i] : i \in DOMAIN s}
Min(x, y) == IF x <= y THEN x ELSE y
Admitted(c) == calls[c].status # "none"

ReqMsg(c) == [kind |-> "req", call |-> c, result |-> "-"]
RepMsg(c, r) == [kind |-> "rep", call |-> c, result |-> r]

(* Reachability over a relation R on Agents: the agents reachable from S. *)
RECURSIVE Reach(_, _, _)
Reach(S, R, k) ==
    IF k = 0 THEN S
    ELSE Reach(S \cup {y \in Agents : \E x \in S : <<x, y>> \in R}, R, k - 1)
Succ(x, R) == {y \in Agents : <<x, y>> \in R}
\* there is a path of length >= 1 from x to y
Path(x, y, R) == y \in Reach(Succ(x, R), R, Cardinality(Agents))
Acyclic(R) == \A a \in Agents : ~Path(a, a, R)

(* Two nodes at most: node 2 hosts the agents in Remote, node 1 the others.  *)
(* Each node's runtime records the edges of the calls its agents make (in    *)
(* the code, under the graph's lock as the call is sent: wait_for_graph.rs;  *)
(* the transport does not share them), and checks a new edge against those   *)
(* only.                                                                     *)
NodeOf(a) == IF a \in Remote THEN 2 ELSE 1
EdgesOf(S) == {<<calls[c].caller, calls[c].target>> : c \in S}
(* The union of the dispatchers' views (the graph of one node when Remote = {}). *)
DispatcherEdges == EdgesOf(wfg)
(* The view of the dispatcher of node n. *)
NodeEdges(n) == EdgesOf({c \in wfg : NodeOf(calls[c].caller) = n})

(* The real blocked-on relation: agent a's turn is blocked awaiting the reply *)
(* to a call to agent b. This is derived from the agents' state, not from    *)
(* the dispatcher's bookkeeping.                                              *)
BlockedOn == {<<a, calls[waiting[a]].target>> : a \in {x \in Agents : waiting[x] # 0}}

-----------------------------------------------------------------------------
(* The client's MAX_ROOTS requests are all sent at time 0 to any agents;   *)
(* the network delays (and may lose) them, so they still arrive at any time. *)
RootCall(t) == [status |-> "pending", caller |-> Client, parent |-> 0,
                target |-> t, depth |-> 0, chain |-> << >>,
                deadline |-> ROOT_TIMEOUT]

Init ==
    /\ now = 0
    /\ \E targets \in [1..MAX_ROOTS -> Agents] :
         calls = [c \in CallIds |-> IF c <= MAX_ROOTS THEN RootCall(targets[c]) ELSE NoCall]
    /\ nCalls = MAX_ROOTS
    /\ mailbox = [a \in Agents |-> << >>]
    /\ turn = [a \in Agents |-> 0]
    /\ waiting = [a \in Agents |-> 0]
    /\ net = {ReqMsg(c) : c \in 1..MAX_ROOTS}
    /\ wfg = {}

(* Agent a, inside its turn, calls agent t (call_agent). Admission first     *)
(* (cycle, depth, the caller's own deadline already passed), then the         *)
(* dispatcher's wait-for check; if both pass, the                             *)
(* call is admitted and the turn BLOCKS until reply, Busy or timeout.         *)
(* A refused call returns an error to the turn as a tool result and changes   *)
(* nothing else, so it is a stuttering step and is not written out.           *)
Cycle(a, t) == ~BUG_NO_CHAIN_CHECK /\ (t = a \/ t \in Range(calls[turn[a]].chain))
TooDeep(a) == ~BUG_NO_DEPTH_CHECK /\ calls[turn[a]].depth >= MAX_DEPTH
\* DeadlineExpired: the turn runs on (an LLM step is not preempted at once) but
\* may not start a call once its own deadline has passed.
Expired(a) == ~BUG_NO_TIMEOUT /\ ~BUG_CALL_AFTER_DEADLINE /\ now >= calls[turn[a]].deadline
\* dispatcher: would the edge a -> t close a cycle in its wait-for graph?
\* Only the edges routed by a's own node are known to its dispatcher.
ClosesCycle(a, t) == ~BUG_NO_WAITFOR_CHECK /\ (t = a \/ Path(t, a, NodeEdges(NodeOf(a))))

AgentCall(a, t) ==
    /\ turn[a] # 0
    /\ waiting[a] = 0
    /\ nCalls < MAX_CALLS
    /\ ~Cycle(a, t)
    /\ ~TooDeep(a)
    /\ ~Expired(a)
    /\ ~ClosesCycle(a, t)
    /\ LET p == turn[a]
           ctx == calls[p]
           c == nCalls + 1
           dl == IF BUG_NO_DEADLINE_CLIP THEN now + CHILD_TIMEOUT
                 ELSE Min(now + CHILD_TIMEOUT, ctx.deadline)
       IN /\ calls' = [calls EXCEPT ![c] =
                         [status |-> "pending", caller |-> a, parent |-> p, target |-> t,
                          depth |-> ctx.depth + 1, chain |-> Append(ctx.chain, a),
                          deadline |-> dl]]
          /\ nCalls' = c
          /\ waiting' = [waiting EXCEPT ![a] = c]
          /\ wfg' = wfg \cup {c}
          /\ net' = net \cup {ReqMsg(c)}
    /\ UNCHANGED <<now, mailbox, turn>>

(* The dispatcher receives a request: into the mailbox, or Busy if full. *)
DeliverReq(m) ==
    /\ m.kind = "req"
    /\ LET t == calls[m.call].target IN
       IF Len(mailbox[t]) < MAILBOX_CAP
         THEN /\ mailbox' = [mailbox EXCEPT ![t] = Append(@, m.call)]
              /\ net' = net \ {m}
         ELSE /\ net' = (net \ {m}) \cup {RepMsg(m.call, "busy")}
              /\ UNCHANGED mailbox
    /\ UNCHANGED <<now, calls, nCalls, turn, waiting, wfg>>

(* A reply reaches the caller. A reply to a call that already timed out is  *)
(* discarded.                                                                *)
DeliverRep(m) ==
    /\ m.kind = "rep"
    /\ net' = net \ {m}
    /\ LET c == m.call IN
       IF calls[c].status = "pending"
         THEN /\ calls' = [calls EXCEPT ![c].status = m.result]
              /\ IF calls[c].caller \in Agents
                   THEN waiting' = [waiting EXCEPT ![calls[c].caller] = 0]
                   ELSE UNCHANGED waiting
         ELSE UNCHANGED <<calls, waiting>>
    /\ UNCHANGED <<now, nCalls, mailbox, turn, wfg>>

Deliver(m) == DeliverReq(m) \/ DeliverRep(m)

Lose(m) ==
    /\ LOSS
    /\ net' = net \ {m}
    /\ UNCHANGED <<now, calls, nCalls, mailbox, turn, waiting, wfg>>

(* An idle agent takes the next message; expired work is dropped unrun. *)
DropExpired(a) ==
    /\ ~BUG_NO_TIMEOUT
    /\ turn[a] = 0
    /\ mailbox[a] # << >>
    /\ now >= calls[Head(mailbox[a])].deadline
    /\ mailbox' = [mailbox EXCEPT ![a] = Tail(@)]
    /\ UNCHANGED <<now, calls, nCalls, turn, waiting, net, wfg>>

StartTurn(a) ==
    /\ turn[a] = 0
    /\ mailbox[a] # << >>
    /\ BUG_NO_TIMEOUT \/ now < calls[Head(mailbox[a])].deadline
    /\ turn' = [turn EXCEPT ![a] = Head(mailbox[a])]
    /\ mailbox' = [mailbox EXCEPT ![a] = Tail(@)]
    /\ UNCHANGED <<now, calls, nCalls, waiting, net, wfg>>

(* The turn ends (state committed) and the reply is sent. A reply to a call *)
(* that is no longer pending would be discarded on arrival, so it is not     *)
(* sent at all (a reduction that changes no observable behaviour).          *)
FinishTurn(a) ==
    /\ turn[a] # 0
    /\ waiting[a] = 0
    /\ net' = IF calls[turn[a]].status = "pending"
                THEN net \cup {RepMsg(turn[a], "ok")} ELSE net
    /\ turn' = [turn EXCEPT ![a] = 0]
    /\ UNCHANGED <<now, calls, nCalls, mailbox, waiting, wfg>>

(* The caller's wait reaches the deadline. *)
Timeout(c) ==
    /\ ~BUG_NO_TIMEOUT
    /\ calls[c].status = "pending"
    /\ now >= calls[c].deadline
    /\ calls' = [calls EXCEPT ![c].status = "timedout"]
    /\ IF calls[c].caller \in Agents
         THEN waiting' = [waiting EXCEPT ![calls[c].caller] = 0]
         ELSE UNCHANGED waiting
    \* a reply still in flight is now stale: drop it (same reduction as above)
    /\ net' = {m \in net : ~(m.kind = "rep" /\ m.call = c)}
    /\ UNCHANGED <<now, nCalls, mailbox, turn, wfg>>

(* The dispatcher learns (asynchronously) that a wait has ended. *)
ForgetEdge(c) ==
    /\ c \in wfg
    /\ calls[c].status # "pending"
    /\ wfg' = wfg \ {c}
    /\ UNCHANGED <<now, calls, nCalls, mailbox, turn, waiting, net>>

(* Time passes while some admitted call still waits for a future deadline. *)
Tick ==
    /\ ~BUG_NO_TIMEOUT
    /\ \E c \in CallIds : calls[c].status = "pending" /\ calls[c].deadline > now
    /\ now' = now + 1
    /\ UNCHANGED <<calls, nCalls, mailbox, turn, waiting, net, wfg>>

Quiescent ==
    /\ \A c \in CallIds : calls[c].status # "pending"
    /\ \A a \in Agents : turn[a] = 0 /\ mailbox[a] = << >>
    /\ net = {}
    /\ wfg = {}

(* All work finished: stutter. Only allowed when quiescent. *)
Terminated == Quiescent /\ UNCHANGED vars

Next ==
    \/ \E a, t \in Agents : AgentCall(a, t)
    \/ \E m \in net : Deliver(m) \/ Lose(m)
    \/ \E a \in Agents : DropExpired(a) \/ StartTurn(a) \/ FinishTurn(a)
    \/ \E c \in CallIds : Timeout(c) \/ ForgetEdge(c)
    \/ Tick
    \/ Terminated

(* Fairness: the runtime keeps running; the agents' decisions to call, the *)
(* network's losses and the client are not fair. One weak-fairness          *)
(* condition over all runtime steps suffices: every non-stuttering step     *)
(* consumes a bounded resource (calls, messages, ticks), so a behaviour     *)
(* ends in a state where no runtime step is enabled; WF forbids stopping    *)
(* anywhere else. Turns end (in the real system an LLM step is bounded by   *)
(* its own timeout).                                                         *)
RuntimeStep ==
    \/ \E m \in net : Deliver(m)
    \/ \E a \in Agents : DropExpired(a) \/ StartTurn(a) \/ FinishTurn(a)
    \/ \E c \in CallIds : Timeout(c) \/ ForgetEdge(c)
    \/ Tick

Fairness == WF_vars(RuntimeStep)

Spec == Init /\ [][Next]_vars /\ Fairness

-----------------------------------------------------------------------------
(* Safety *)

MaxTime == ROOT_TIMEOUT + MAX_CALLS * CHILD_TIMEOUT

TypeOK ==
    /\ now \in 0..MaxTime
    /\ nCalls \in 0..MAX_CALLS
    /\ \A c \in CallIds :
         /\ calls[c].status \in Statuses
         /\ (c > nCalls) <=> (calls[c].status = "none")
         /\ calls[c].status # "none" =>
              /\ calls[c].caller \in Callers
              /\ calls[c].target \in Agents
              /\ calls[c].parent \in 0..nCalls
              /\ calls[c].depth \in Nat
              /\ calls[c].chain \in Seq(Agents)
              /\ calls[c].deadline \in 0..MaxTime
    /\ \A a \in Agents :
         \* a bounded channel: its capacity is part of its type (no bug switch:
         \* the runtime's bound is structural, a tokio bounded mpsc)
         /\ mailbox[a] \in Seq(1..nCalls) /\ Len(mailbox[a]) <= MAILBOX_CAP
         /\ turn[a] \in 0..nCalls
         /\ waiting[a] \in 0..nCalls
    /\ \A m \in net : m.kind \in {"req", "rep"} /\ m.call \in 1..nCalls
                      /\ m.result \in {"-", "ok", "busy"}
    /\ wfg \subseteq 1..nCalls

(* The depth limit is a policy (AGENT_CALL_DEPTH_MAX), so its property is   *)
(* the limit itself, but stated on what RUNS, not on what admission decided: *)
(* no turn ever executes work nested deeper than MAX_DEPTH calls below the   *)
(* client's request.                                                          *)
NoTurnTooDeep ==
    \A a \in Agents : turn[a] # 0 => calls[turn[a]].depth <= MAX_DEPTH

(* The agents along an admitted call (chain, then target) are all distinct: *)
(* no agent is re-entered through its own call chain.                        *)
NoCycleInCallChain ==
    \A c \in CallIds : Admitted(c) =>
        LET full == Append(calls[c].chain, calls[c].target) IN
        \A i, j \in DOMAIN full : i # j => full[i] # full[j]

(* Deadlock freedom: the real blocked-on relation between agents (a turn     *)
(* waiting for a reply) never contains a cycle.                              *)
WaitForGraphAcyclic == Acyclic(BlockedOn)

(* The client's deadline bounds all work done on its behalf: no call of a    *)
(* request's tree is still pending once the time is past the deadline of    *)
(* the client request at its root. (The model's clock only advances while   *)
(* some call waits for a later deadline, and every client request has the    *)
(* same deadline, so a timeout that has not fired yet cannot make this fail  *)
(* spuriously.)                                                              *)
RECURSIVE RootOf(_)
RootOf(c) == IF calls[c].caller = Client THEN c ELSE RootOf(calls[c].parent)
NoCallOutlivesItsRequest ==
    \A c \in CallIds :
        calls[c].status = "pending" => now <= calls[RootOf(c)].deadline

(* Helper invariants (consistency of the model, and why the wait-for check  *)
(* works: the dispatcher's view always covers the real blocking).            *)
WaitingConsistent ==
    /\ \A a \in Agents : waiting[a] # 0 =>
          /\ turn[a] # 0
          /\ calls[waiting[a]].status = "pending"
          /\ calls[waiting[a]].caller = a
    /\ \A c \in CallIds : (calls[c].status = "pending" /\ calls[c].caller \in Agents)
          => waiting[calls[c].caller] = c
DispatcherViewCoversBlocking == BlockedOn \subseteq DispatcherEdges

-----------------------------------------------------------------------------
(* Liveness *)

(* Every admitted call eventually completes, fails (Busy) or times out. *)
EveryCallResolves ==
    \A c \in CallIds : calls[c].status = "pending" ~> calls[c].status \in Resolved

(* No agent stays blocked forever, and every turn ends. *)
NoAgentBlockedForever ==
    \A a \in Agents : waiting[a] # 0 ~> waiting[a] = 0
EveryTurnEnds ==
    \A a \in Agents : turn[a] # 0 ~> turn[a] = 0

(* For SYMMETRY in safety-only configs (agents on the same node are        *)
(* interchangeable).                                                        *)
AgentSymmetry == Permutations(Agents \ Remote) \cup Permutations(Remote)

=============================================================================
