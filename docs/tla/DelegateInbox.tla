------------------------------ MODULE DelegateInbox ------------------------------
(***************************************************************************)
(* The delegate protocol of Troupe's agent inbox (crates/troupe-agent/src/ *)
(* inbox.rs), for one delegator A and one delegatee B.                     *)
(*                                                                         *)
(* - A delegates task t: one atomic commit writes its task record          *)
(*   (submitted) and an outbox entry.                                      *)
(* - A relay sends the outbox entry to B, again and again until acked      *)
(*   (duplicates); the network may lose, reorder and duplicate messages    *)
(*   (a message stays in `net` after delivery until it is lost).           *)
(* - B appends a task: seen before? ack again, nothing new (dedupe);       *)
(*   else inbox entry + seen mark committed, then the ack. (bSeen is what  *)
(*   B took; since 2026-12-01 B knows it by the pair's order, not a mark   *)
(*   per task: PairOrder.tla's TakenOrSkipped shows the two agree.)        *)
(* - B processes an inbox entry: in one commit deletes it, records the     *)
(*   work and puts the result in its outbox; a relay sends the result.     *)
(* - A appends a result: its task record already final? ack, nothing new   *)
(*   (dedupe by task); else record final + inbox entry, then the ack.      *)
(* - A processes the result: deletes the entry in the commit that uses it. *)
(* - A's delivery task, acked, reports Delivered to A; A's turn takes the  *)
(*   entry off its outbox and answers whether it found it; only then is    *)
(*   the MessageSent event told (inbox_turns.rs: deliver, DELIVERED_FOUND,  *)
(*   since 2026-12-06). BUG_SENT_PER_ACK tells it at every ack instead,    *)
(*   as before: an ack duplicated by the network (or two delivery tasks of *)
(*   one entry) tells it twice. The event is told after the commit, so a   *)
(*   crash between the two loses it: it is told at most once, not surely.  *)
(* - A crash loses only volatile state (appends acked but not persisted,   *)
(*   which exist only with BUG_ACK_BEFORE_PERSIST); wake-ups are rebuilt   *)
(*   from the store by resume, so every step enabled by persistent state   *)
(*   stays enabled.                                                        *)
(*                                                                         *)
(* Each BUG_* constant breaks one rule; buggy configs must fail.           *)
(***************************************************************************)
EXTENDS Naturals, FiniteSets, TLC

CONSTANTS
    Tasks,                  \* task ids (model values)
    MAX_LOSSES,             \* bound on lost messages (liveness needs it finite)
    MAX_CRASHES,            \* bound on crashes
    BUG_NO_DEDUPE,          \* appends skip the seen mark / the task-record check
    BUG_ACK_BEFORE_PERSIST, \* the append acks first and persists in a later step
    BUG_SENT_PER_ACK        \* MessageSent told at every ack, not by the report that found the entry

ASSUME /\ MAX_LOSSES \in Nat /\ MAX_CRASHES \in Nat
       /\ BUG_NO_DEDUPE \in BOOLEAN /\ BUG_ACK_BEFORE_PERSIST \in BOOLEAN
       /\ BUG_SENT_PER_ACK \in BOOLEAN

VARIABLES
    aTask,      \* t -> "none" | "submitted" | "final"   (A's task record)
    aOutbox,    \* SUBSET Tasks: task entries not yet acknowledged by B
    aInbox,     \* t -> Nat: result entries at A not yet processed
    aDone,      \* t -> Nat: times A's processing of t's result committed
    bSeen,      \* SUBSET Tasks: B's dedupe marks
    bInbox,     \* t -> Nat: task entries at B not yet processed
    bWorked,    \* t -> Nat: times B's work on t committed
    bOutbox,    \* SUBSET Tasks: results not yet acknowledged by A
    aSent,      \* t -> Nat: times A told MessageSent for t's task entry
    volatile,   \* set of [at, t]: appends acked but not persisted (bug only)
    net,        \* messages in flight
    losses, crashes

vars == <<aTask, aOutbox, aInbox, aDone, bSeen, bInbox, bWorked, bOutbox, aSent, volatile,
          net, losses, crashes>>

Msg == [type : {"task", "taskAck", "result", "resultAck"}, t : Tasks]

Init ==
    /\ aTask = [t \in Tasks |-> "none"]
    /\ aOutbox = {}
    /\ aInbox = [t \in Tasks |-> 0]
    /\ aDone = [t \in Tasks |-> 0]
    /\ bSeen = {}
    /\ bInbox = [t \in Tasks |-> 0]
    /\ bWorked = [t \in Tasks |-> 0]
    /\ bOutbox = {}
    /\ aSent = [t \in Tasks |-> 0]
    /\ volatile = {}
    /\ net = {}
    /\ losses = 0
    /\ crashes = 0

Delegate(t) ==
    /\ aTask[t] = "none"
    /\ aTask' = [aTask EXCEPT ![t] = "submitted"]
    /\ aOutbox' = aOutbox \cup {t}
    /\ UNCHANGED <<aSent, aInbox, aDone, bSeen, bInbox, bWorked, bOutbox, volatile, net, losses, crashes>>

RelayTask(t) ==
    /\ t \in aOutbox
    /\ net' = net \cup {[type |-> "task", t |-> t]}
    /\ UNCHANGED <<aSent, aTask, aOutbox, aInbox, aDone, bSeen, bInbox, bWorked, bOutbox, volatile, losses, crashes>>

\* B's append of a task (the Enqueue turn).
AppendTask(t) ==
    /\ [type |-> "task", t |-> t] \in net
    /\ net' = net \cup {[type |-> "taskAck", t |-> t]}
    /\ IF t \in bSeen /\ ~BUG_NO_DEDUPE
       THEN UNCHANGED <<bSeen, bInbox, volatile>>
       ELSE IF BUG_ACK_BEFORE_PERSIST
            THEN /\ volatile' = volatile \cup {[at |-> "B", t |-> t]}
                 /\ UNCHANGED <<bSeen, bInbox>>
            ELSE /\ bSeen' = bSeen \cup {t}
                 /\ bInbox' = [bInbox EXCEPT ![t] = @ + 1]
                 /\ UNCHANGED volatile
    /\ UNCHANGED <<aSent, aTask, aOutbox, aInbox, aDone, bWorked, bOutbox, losses, crashes>>

\* An ack reaches A's delivery task, which reports Delivered: A's turn takes the entry
\* off its outbox if it is still there, and the event is told if it was (with the bug:
\* at every ack, found or not; the ack stays in `net`, so it may be received again).
TaskAcked(t) ==
    /\ [type |-> "taskAck", t |-> t] \in net
    /\ t \in aOutbox \/ (BUG_SENT_PER_ACK /\ aSent[t] < 2)
    /\ aOutbox' = aOutbox \ {t}
    /\ aSent' = [aSent EXCEPT ![t] = @ + 1]
    /\ UNCHANGED <<aTask, aInbox, aDone, bSeen, bInbox, bWorked, bOutbox, volatile, net, losses, crashes>>

\* B's Process turn: entry deleted, work recorded, result queued, in one commit.
Work(t) ==
    /\ bInbox[t] > 0
    /\ bInbox' = [bInbox EXCEPT ![t] = @ - 1]
    /\ bWorked' = [bWorked EXCEPT ![t] = @ + 1]
    /\ bOutbox' = bOutbox \cup {t}
    /\ UNCHANGED <<aSent, aTask, aOutbox, aInbox, aDone, bSeen, volatile, net, losses, crashes>>

RelayResult(t) ==
    /\ t \in bOutbox
    /\ net' = net \cup {[type |-> "result", t |-> t]}
    /\ UNCHANGED <<aSent, aTask, aOutbox, aInbox, aDone, bSeen, bInbox, bWorked, bOutbox, volatile, losses, crashes>>

\* A's append of a result: dedupe by the task record.
AppendResult(t) ==
    /\ [type |-> "result", t |-> t] \in net
    /\ net' = net \cup {[type |-> "resultAck", t |-> t]}
    /\ IF aTask[t] = "final" /\ ~BUG_NO_DEDUPE
       THEN UNCHANGED <<aTask, aInbox, volatile>>
       ELSE IF BUG_ACK_BEFORE_PERSIST
            THEN /\ volatile' = volatile \cup {[at |-> "A", t |-> t]}
                 /\ UNCHANGED <<aTask, aInbox>>
            ELSE /\ aTask' = [aTask EXCEPT ![t] = "final"]
                 /\ aInbox' = [aInbox EXCEPT ![t] = @ + 1]
                 /\ UNCHANGED volatile
    /\ UNCHANGED <<aSent, aOutbox, aDone, bSeen, bInbox, bWorked, bOutbox, losses, crashes>>

ResultAcked(t) ==
    /\ [type |-> "resultAck", t |-> t] \in net
    /\ t \in bOutbox
    /\ bOutbox' = bOutbox \ {t}
    /\ UNCHANGED <<aSent, aTask, aOutbox, aInbox, aDone, bSeen, bInbox, bWorked, volatile, net, losses, crashes>>

\* A's Process turn on the result.
Resolve(t) ==
    /\ aInbox[t] > 0
    /\ aInbox' = [aInbox EXCEPT ![t] = @ - 1]
    /\ aDone' = [aDone EXCEPT ![t] = @ + 1]
    /\ UNCHANGED <<aSent, aTask, aOutbox, bSeen, bInbox, bWorked, bOutbox, volatile, net, losses, crashes>>

\* With BUG_ACK_BEFORE_PERSIST only: the late write of an acked append.
Persist(v) ==
    /\ v \in volatile
    /\ volatile' = volatile \ {v}
    /\ IF v.at = "B"
       THEN /\ bSeen' = bSeen \cup {v.t}
            /\ bInbox' = [bInbox EXCEPT ![v.t] = @ + 1]
            /\ UNCHANGED <<aTask, aInbox>>
       ELSE /\ aTask' = [aTask EXCEPT ![v.t] = "final"]
            /\ aInbox' = [aInbox EXCEPT ![v.t] = @ + 1]
            /\ UNCHANGED <<bSeen, bInbox>>
    /\ UNCHANGED <<aSent, aOutbox, aDone, bWorked, bOutbox, net, losses, crashes>>

Lose(m) ==
    /\ m \in net
    /\ losses < MAX_LOSSES
    /\ net' = net \ {m}
    /\ losses' = losses + 1
    /\ UNCHANGED <<aSent, aTask, aOutbox, aInbox, aDone, bSeen, bInbox, bWorked, bOutbox, volatile, crashes>>

\* A process crash: memory is lost (acked-but-unpersisted appends, messages of the
\* dead process are modelled by Lose); the store stays.
Crash ==
    /\ crashes < MAX_CRASHES
    /\ crashes' = crashes + 1
    /\ volatile' = {}
    /\ UNCHANGED <<aSent, aTask, aOutbox, aInbox, aDone, bSeen, bInbox, bWorked, bOutbox, net, losses>>

\* Every task delegated and resolved, nothing left to send: the run may stop here.
Finished ==
    /\ \A t \in Tasks : aTask[t] = "final" /\ aInbox[t] = 0
    /\ aOutbox = {} /\ bOutbox = {}
    /\ UNCHANGED vars

Next ==
    \/ Finished
    \/ \E t \in Tasks : \/ Delegate(t) \/ RelayTask(t) \/ AppendTask(t) \/ TaskAcked(t)
                        \/ Work(t) \/ RelayResult(t) \/ AppendResult(t) \/ ResultAcked(t)
                        \/ Resolve(t)
    \/ \E v \in volatile : Persist(v)
    \/ \E m \in net : Lose(m)
    \/ Crash

\* Relays, appends, work and processing are retried or re-scheduled (resume) for as
\* long as the store says so: weak fairness on each.
Fairness ==
    /\ \A t \in Tasks : /\ WF_vars(RelayTask(t)) /\ WF_vars(AppendTask(t)) /\ WF_vars(TaskAcked(t))
                        /\ WF_vars(Work(t)) /\ WF_vars(RelayResult(t)) /\ WF_vars(AppendResult(t))
                        /\ WF_vars(ResultAcked(t)) /\ WF_vars(Resolve(t))
    /\ \A v \in [at : {"A", "B"}, t : Tasks] : WF_vars(Persist(v))

Spec == Init /\ [][Next]_vars /\ Fairness


TypeOK ==
    /\ aTask \in [Tasks -> {"none", "submitted", "final"}]
    /\ aOutbox \subseteq Tasks /\ bOutbox \subseteq Tasks /\ bSeen \subseteq Tasks
    /\ aSent \in [Tasks -> 0..2]
    /\ net \subseteq Msg

\* No message is processed twice: B works each task at most once, A processes each
\* result at most once (and never holds two of them).
ExactlyOnceWork == \A t \in Tasks : bWorked[t] <= 1
ExactlyOnceResolve == \A t \in Tasks : aDone[t] + aInbox[t] <= 1

\* No acknowledged message is lost: a task A no longer relays (B acked it) is persisted
\* at B; a result B no longer relays (A acked it) is recorded at A.
NoAckedMessageLost ==
    /\ \A t \in Tasks : (aTask[t] = "submitted" /\ t \notin aOutbox) => t \in bSeen
    /\ \A t \in Tasks : (bWorked[t] > 0 /\ t \notin bOutbox) => aTask[t] = "final"

\* MessageSent is told at most once per task entry, and only for an entry B took
\* (persisted): a listener counting sent messages sees each once.
SentToldAtMostOnce == \A t \in Tasks : aSent[t] <= 1
SentOnlyWhenTaken == \A t \in Tasks : aSent[t] > 0 => t \in bSeen

\* Every accepted delegation resolves (liveness).
EveryDelegationResolves == \A t \in Tasks : (aTask[t] = "submitted") ~> (aDone[t] = 1)

Symmetry == Permutations(Tasks)
=============================================================================
