------------------------------ MODULE CallPath ------------------------------
(***************************************************************************)
(* The call path of one node in finer grain than MultiAgentInvocation:     *)
(*                                                                         *)
(* - SPLIT call/route. The caller's turn starts waiting when it SENDS the  *)
(*   call (Caller::invoke -> Runtime::send_and_wait, runtime.rs); the      *)
(*   dispatcher ROUTES it later (dispatcher.rs `route`): it drops a call   *)
(*   whose caller stopped waiting, checks the wait-for edge (try_add,      *)
(*   refusing with DeadlockDetected), and queues it or answers Busy.       *)
(*   (Since 2026-12-04 the code checks and adds the edge under the graph's *)
(*   lock as the call is sent, handle.rs `add_call_edge`, and puts it into *)
(*   an open mailbox at once: ROUTE taken right after SEND, one of the     *)
(*   orders this model already explores; the check-and-add stays atomic.)  *)
(* - CONCURRENT calls per turn: a turn may have up to K calls in flight    *)
(*   (AGENT_CONCURRENT_CALLS_MAX); one more is refused with TooManyCalls   *)
(*   (a tool result: stuttering). A turn ends only once none is in flight. *)
(* - ABANDONED calls and LATE commits: a caller's wait may time out at any *)
(*   moment (deadlines are not clocks here: a timeout is a nondeterministic*)
(*   step while the call is in flight). The callee's turn then commits only*)
(*   if its caller still waits (activation.rs `settle`: the commit         *)
(*   decision checks the reply channel); a caller may RETRY a timed-out    *)
(*   call (same logical request) while the orphan still runs.             *)
(*   With COMMIT_WINDOW the decision and the store write are two steps, as *)
(*   in the code (`commit(..).await` after the check), so the caller may   *)
(*   time out in between.                                                  *)
(* - IDEMPOTENCY KEYS (IDEMPOTENCY_KEY): every attempt of a logical request *)
(*   carries its key (RuntimeHandle::invoke_keyed). The store write of a    *)
(*   turn records the key with the turn's writes, in the same commit; a     *)
(*   turn whose key is already recorded answers the recorded reply without  *)
(*   running (activation.rs `keyed_turn`, idempotency.rs). The check is the *)
(*   first thing the turn does: turns of one agent are serialized, and the  *)
(*   next turn starts only after the store write (`committing`), so the     *)
(*   retry of an attempt that is committing reads that attempt's record.   *)
(*   (Eviction of old keys, IDEMPOTENCY_KEYS_KEPT_MAX, is not modelled: a   *)
(*   retry is assumed to come within the last keys kept.)                   *)
(*                                                                         *)
(* Each BUG_* constant removes one protection; buggy configs must fail.    *)
(***************************************************************************)
EXTENDS Naturals, Sequences, FiniteSets, TLC

CONSTANTS
    Agents,
    Client,                   \* the external caller (model value)
    K,                        \* AGENT_CONCURRENT_CALLS_MAX
    MAILBOX_CAP,
    MAX_CALLS,                \* bound on calls (roots, agent calls, retries)
    MAX_ROOTS,
    TIMEOUTS,                 \* waits may time out
    RETRY,                    \* a caller may retry a call that timed out
    COMMIT_WINDOW,            \* commit decision and store write are separate steps
    IDEMPOTENCY_KEY,          \* attempts carry their request's key, checked in the turn
    BUG_NO_WAITFOR_CHECK,     \* the dispatcher does not check the wait-for edge
    BUG_COMMIT_AFTER_ABANDON  \* the callee commits even if its caller gave up

ASSUME /\ K \in Nat \ {0} /\ MAILBOX_CAP \in Nat \ {0}
       /\ MAX_CALLS \in Nat \ {0} /\ MAX_ROOTS \in 1..MAX_CALLS
       /\ Client \notin Agents
       /\ \A b \in {TIMEOUTS, RETRY, COMMIT_WINDOW, IDEMPOTENCY_KEY, BUG_NO_WAITFOR_CHECK,
                    BUG_COMMIT_AFTER_ABANDON} : b \in BOOLEAN

CallIds == 1..MAX_CALLS
\* sent: the caller waits, the dispatcher has not routed it yet;
\* routed: edge recorded, in a mailbox or running; the caller waits.
Waiting == {"sent", "routed"}
Statuses == {"none", "sent", "routed", "ok", "refused", "timedout"}

NoCall == [status |-> "none", caller |-> Client, parent |-> 0, target |-> Client,
           req |-> 0, retried |-> FALSE]

VARIABLES
    calls,      \* call id -> record
    nCalls,
    mailbox,    \* agent -> Seq(call id)
    turn,       \* agent -> call id of the running turn, 0 if idle
    committing, \* agent -> TRUE between the commit decision and the store write
    wfg,        \* dispatcher's wait-for graph: set of call ids
    effects,    \* logical request -> number of committed turns (history)
    keys,       \* logical requests whose key (and reply) the store holds
    lateCommits \* store writes for an attempt whose caller had given up (history)

vars == <<calls, nCalls, mailbox, turn, committing, wfg, effects, keys, lateCommits>>

Range(s) == {s[i] : i \in DOMAIN s}

RECURSIVE Reach(_, _, _)
Reach(S, R, k) ==
    IF k = 0 THEN S
    ELSE Reach(S \cup {y \in Agents : \E x \in S : <<x, y>> \in R}, R, k - 1)
Succ(x, R) == {y \in Agents : <<x, y>> \in R}
Path(x, y, R) == y \in Reach(Succ(x, R), R, Cardinality(Agents))
Acyclic(R) == \A a \in Agents : ~Path(a, a, R)

Edges(S) == {<<calls[c].caller, calls[c].target>> : c \in S}
AgentCallsIn(st) == {c \in 1..nCalls : calls[c].status \in st /\ calls[c].caller \in Agents}
InFlight(a) == {c \in 1..nCalls : calls[c].caller = a /\ calls[c].status \in Waiting}

\* Agent a's turn is blocked awaiting a call to b (sent or routed).
BlockedOn == Edges(AgentCallsIn(Waiting))
\* ...restricted to the calls the dispatcher has accepted.
RoutedOn == Edges(AgentCallsIn({"routed"}))

Init ==
    /\ \E targets \in [1..MAX_ROOTS -> Agents] :
         calls = [c \in CallIds |->
                    IF c <= MAX_ROOTS
                      THEN [status |-> "sent", caller |-> Client, parent |-> 0,
                            target |-> targets[c], req |-> c, retried |-> FALSE]
                      ELSE NoCall]
    /\ nCalls = MAX_ROOTS
    /\ mailbox = [a \in Agents |-> << >>]
    /\ turn = [a \in Agents |-> 0]
    /\ committing = [a \in Agents |-> FALSE]
    /\ wfg = {}
    /\ effects = [r \in CallIds |-> 0]
    /\ keys = {}
    /\ lateCommits = 0

NewCall(caller, parent, t, req) ==
    [status |-> "sent", caller |-> caller, parent |-> parent, target |-> t,
     req |-> req, retried |-> FALSE]

(* Agent a's turn sends a call to t: the turn waits from now on. Refused   *)
(* (TooManyCalls, a stuttering tool result) when K calls are in flight.   *)
(* A self-call is refused by admission (CycleDetected).                    *)
Send(a, t) ==
    /\ turn[a] # 0 /\ ~committing[a] /\ t # a
    /\ nCalls < MAX_CALLS
    /\ Cardinality(InFlight(a)) < K
    /\ LET c == nCalls + 1 IN
       /\ calls' = [calls EXCEPT ![c] = NewCall(a, turn[a], t, c)]
       /\ nCalls' = c
    /\ UNCHANGED <<mailbox, turn, committing, wfg, effects, keys, lateCommits>>

(* A caller retries a call that timed out: a new call, same logical request. *)
(* An agent retries from the same turn; the client retries a root request.   *)
Retry(c) ==
    /\ RETRY
    /\ calls[c].status = "timedout" /\ ~calls[c].retried
    /\ nCalls < MAX_CALLS
    /\ LET a == calls[c].caller IN
       IF a = Client THEN TRUE
       ELSE turn[a] = calls[c].parent /\ ~committing[a] /\ Cardinality(InFlight(a)) < K
    /\ LET n == nCalls + 1 IN
       /\ calls' = [calls EXCEPT ![c].retried = TRUE,
                                 ![n] = NewCall(calls[c].caller, calls[c].parent,
                                                calls[c].target, calls[c].req)]
       /\ nCalls' = n
    /\ UNCHANGED <<mailbox, turn, committing, wfg, effects, keys, lateCommits>>

(* The dispatcher takes the call off its queue. *)
Route(c) ==
    /\ c \in 1..nCalls
    /\ calls[c].status = "sent"
    /\ LET a == calls[c].caller
           t == calls[c].target
           hasEdge == a \in Agents
           cycle == ~BUG_NO_WAITFOR_CHECK /\ hasEdge /\ Path(t, a, Edges(wfg))
       IN IF cycle
            THEN /\ calls' = [calls EXCEPT ![c].status = "refused"]   \* DeadlockDetected
                 /\ UNCHANGED <<mailbox, wfg>>
          ELSE IF Len(mailbox[t]) >= MAILBOX_CAP
            THEN /\ calls' = [calls EXCEPT ![c].status = "refused"]   \* Busy
                 /\ UNCHANGED <<mailbox, wfg>>
          ELSE /\ calls' = [calls EXCEPT ![c].status = "routed"]
                 /\ mailbox' = [mailbox EXCEPT ![t] = Append(@, c)]
                 /\ wfg' = IF hasEdge THEN wfg \cup {c} ELSE wfg
    /\ UNCHANGED <<nCalls, turn, committing, effects, keys, lateCommits>>

(* The caller's wait times out (its deadline, or its own turn's cut). A call *)
(* not yet routed is dropped by the dispatcher when it gets to it (route     *)
(* checks the reply channel), modelled by leaving it "timedout".            *)
Timeout(c) ==
    /\ TIMEOUTS
    /\ c \in 1..nCalls
    /\ calls[c].status \in Waiting
    /\ calls' = [calls EXCEPT ![c].status = "timedout"]
    /\ UNCHANGED <<nCalls, mailbox, turn, committing, wfg, effects, keys, lateCommits>>

\* The callee learns (ReleaseCall) that the wait ended.
ForgetEdge(c) ==
    /\ c \in wfg /\ calls[c].status \notin Waiting
    /\ wfg' = wfg \ {c}
    /\ UNCHANGED <<calls, nCalls, mailbox, turn, committing, effects, keys, lateCommits>>

(* An idle agent takes the next message; an abandoned one is never run.   *)
(* With IDEMPOTENCY_KEY, a message whose request's key the store holds is *)
(* answered with the stored reply, unrun (no effect, nothing committed).  *)
StartTurn(a) ==
    /\ turn[a] = 0 /\ mailbox[a] # << >>
    /\ mailbox' = [mailbox EXCEPT ![a] = Tail(@)]
    /\ LET c == Head(mailbox[a]) IN
       IF calls[c].status = "routed" /\ IDEMPOTENCY_KEY /\ calls[c].req \in keys
         THEN /\ calls' = [calls EXCEPT ![c].status = "ok"]
              /\ UNCHANGED turn
         ELSE /\ turn' = IF calls[c].status = "routed"
                          THEN [turn EXCEPT ![a] = c] ELSE turn
              /\ UNCHANGED calls
    /\ UNCHANGED <<nCalls, committing, wfg, effects, keys, lateCommits>>

CallerWaits(c) == calls[c].status = "routed"
Commit(a) ==
    /\ effects' = [effects EXCEPT ![calls[turn[a]].req] = @ + 1]
    /\ keys' = IF IDEMPOTENCY_KEY THEN keys \cup {calls[turn[a]].req} ELSE keys
    /\ IF CallerWaits(turn[a])
         THEN /\ calls' = [calls EXCEPT ![turn[a]].status = "ok"]
              /\ UNCHANGED lateCommits
         ELSE /\ lateCommits' = lateCommits + 1
              /\ UNCHANGED calls
    /\ turn' = [turn EXCEPT ![a] = 0]
    /\ committing' = [committing EXCEPT ![a] = FALSE]

(* The turn's work is done (no call in flight: a turn awaits its calls).    *)
(* The commit decision: commit only if the caller still waits; otherwise     *)
(* the turn is abandoned and commits nothing. Without COMMIT_WINDOW the      *)
(* decision, the store write and the reply are one step.                     *)
FinishTurn(a) ==
    /\ turn[a] # 0 /\ ~committing[a]
    /\ InFlight(a) = {}
    /\ IF CallerWaits(turn[a]) \/ BUG_COMMIT_AFTER_ABANDON
         THEN IF COMMIT_WINDOW
                THEN /\ committing' = [committing EXCEPT ![a] = TRUE]
                     /\ UNCHANGED <<calls, turn, effects, keys, lateCommits>>
                ELSE Commit(a)
         ELSE /\ turn' = [turn EXCEPT ![a] = 0]          \* abandoned: nothing
              /\ UNCHANGED <<calls, committing, effects, keys, lateCommits>>
    /\ UNCHANGED <<nCalls, mailbox, wfg>>

(* COMMIT_WINDOW only: the store write lands (whether or not the caller     *)
(* still waits), then the reply is sent (discarded if the caller gave up).  *)
StoreWrite(a) ==
    /\ committing[a]
    /\ Commit(a)
    /\ UNCHANGED <<nCalls, mailbox, wfg>>

Quiescent ==
    /\ \A c \in 1..nCalls : calls[c].status \notin Waiting
    /\ \A a \in Agents : turn[a] = 0 /\ mailbox[a] = << >>
    /\ wfg = {}
Terminated == Quiescent /\ UNCHANGED vars

RuntimeStep ==
    \/ \E c \in CallIds : Route(c) \/ ForgetEdge(c) \/ Timeout(c)
    \/ \E a \in Agents : StartTurn(a) \/ FinishTurn(a) \/ StoreWrite(a)

Next ==
    \/ RuntimeStep
    \/ \E a, t \in Agents : Send(a, t)
    \/ \E c \in CallIds : Retry(c)
    \/ Terminated

(* Each runtime step of each call or agent is weakly fair on its own.       *)
Fairness ==
    /\ \A c \in CallIds : WF_vars(Route(c)) /\ WF_vars(ForgetEdge(c)) /\ WF_vars(Timeout(c))
    /\ \A a \in Agents : WF_vars(StartTurn(a)) /\ WF_vars(FinishTurn(a)) /\ WF_vars(StoreWrite(a))

Spec == Init /\ [][Next]_vars /\ Fairness

-----------------------------------------------------------------------------
TypeOK ==
    /\ nCalls \in MAX_ROOTS..MAX_CALLS
    /\ \A c \in CallIds : calls[c].status \in Statuses
    /\ \A a \in Agents : Len(mailbox[a]) <= MAILBOX_CAP /\ turn[a] \in 0..nCalls
    /\ committing \in [Agents -> BOOLEAN]
    /\ wfg \subseteq 1..nCalls
    /\ keys \subseteq CallIds

(* What the dispatcher guarantees in the split model: no cycle among the    *)
(* waits it has accepted.                                                   *)
NoRoutedCycle == Acyclic(RoutedOn)

(* The atomic model's property, over every wait (sent or routed). In the    *)
(* split model a cycle exists for a moment: both calls are sent, neither is *)
(* routed yet; the dispatcher refuses the second (CP_gap_transient_cycle).  *)
WaitForGraphAcyclic == Acyclic(BlockedOn)

(* A logical request (a call and its retries) takes effect at most once.    *)
NoDoubleEffect == \A r \in CallIds : effects[r] <= 1

(* An abandoned call commits nothing: no store write lands for an attempt  *)
(* whose caller had stopped waiting (history variable lateCommits; the DST *)
(* invariant NoCommitAfterAbandon).                                         *)
NoCommitAfterAbandon == lateCommits = 0

(* Liveness: every call is eventually answered (ok, refused or timed out).  *)
EveryCallResolves ==
    \A c \in CallIds : calls[c].status \in Waiting ~> calls[c].status \notin Waiting

AgentSymmetry == Permutations(Agents)
=============================================================================
