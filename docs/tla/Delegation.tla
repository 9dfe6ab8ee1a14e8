------------------------------ MODULE Delegation ------------------------------
(***************************************************************************)
(* The delegate protocol of Troupe (issue 12), modelled before the code.   *)
(*                                                                         *)
(* One caller agent C and one callee agent E, on two nodes, each with a    *)
(* durable store and volatile memory. For each delegation d:               *)
(*                                                                         *)
(*   1. C's turn delegates: in one commit it records d as "open" and puts  *)
(*      the task message in C's durable OUTBOX. Accepted = committed.      *)
(*   2. C's sender redelivers the task message while it is in the outbox;  *)
(*      E persists it in its durable INBOX (deduplicated by task id: a     *)
(*      task seen before is not appended again) and only then acks it. C   *)
(*      drops the outbox entry when the ack arrives.                       *)
(*   3. E works on the task in a turn (volatile while it runs) and commits *)
(*      the result (completed or failed) together with the CALLBACK in its *)
(*      own outbox (transactional outbox), in one atomic commit.           *)
(*   4. E redelivers the callback until C acks it; C persists it in its    *)
(*      inbox (deduplicated by id) and then acks.                          *)
(*   5. C processes the callback in a turn: if d is still open it resolves *)
(*      with the callee's result; if C canceled d meanwhile the callback   *)
(*      is consumed and changes nothing.                                   *)
(*   Cancel: C's turn marks d "canceled" (the resolution) and puts a       *)
(*   cancel message in its outbox, redelivered until acked; E, if the task *)
(*   is not done, marks it canceled and abandons a running turn (which     *)
(*   then commits nothing).                                                *)
(*                                                                         *)
(* Faults: either node crashes and restarts at any step (MAX_CRASHES in    *)
(* all), losing its volatile state only: a running turn, and under         *)
(* BUG_ACK_BEFORE_PERSIST the acked-but-unflushed messages. The network    *)
(* delays, reorders, duplicates (a delivery may leave the message in       *)
(* flight) and, with LOSS, loses messages.                                 *)
(*                                                                         *)
(* Each BUG_* constant removes one protection; buggy configs must fail.    *)
(***************************************************************************)
EXTENDS Naturals, FiniteSets, TLC

CONSTANTS
    Dels,                    \* delegation (task) ids, model values
    MAX_CRASHES,             \* bound on crashes of C and E together
    LOSS,                    \* the network may lose messages
    CANCEL,                  \* the caller may cancel a delegation
    BUG_NO_DEDUPE,           \* receivers append a message they have seen before
    BUG_ACK_BEFORE_PERSIST,  \* receivers ack first, persist later (volatile buffer)
    BUG_NO_STATUS_CHECK      \* C resolves on every callback, even if d is no longer open

ASSUME /\ MAX_CRASHES \in Nat
       /\ \A b \in {LOSS, CANCEL, BUG_NO_DEDUPE, BUG_ACK_BEFORE_PERSIST,
                    BUG_NO_STATUS_CHECK} : b \in BOOLEAN

Results == {"completed", "failed"}
Final == Results \cup {"canceled"}

Msgs ==
    [type : {"task", "taskAck", "cbAck", "cancel", "cancelAck"}, d : Dels, r : {"-"}]
    \cup [type : {"cb"}, d : Dels, r : Results]

Msg(t, d) == [type |-> t, d |-> d, r |-> "-"]
Cb(d, r) == [type |-> "cb", d |-> d, r |-> r]

VARIABLES
    \* caller C, durable
    status,     \* d -> "none" | "open" | "completed" | "failed" | "canceled"
    cOut,       \* SUBSET Dels: task messages in C's outbox, not yet acked
    cCancelOut, \* SUBSET Dels: cancel messages in C's outbox, not yet acked
    cInbox,     \* SUBSET (Dels \X Results): callbacks persisted, not yet processed
    cSeen,      \* SUBSET Dels: callbacks ever persisted (the dedupe table)
    \* callee E, durable
    task,       \* d -> "none" | "queued" | "completed" | "failed" | "canceled"
    eSeen,      \* SUBSET Dels: tasks ever persisted or canceled (the dedupe table)
    eOut,       \* SUBSET (Dels \X Results): callbacks in E's outbox, not yet acked
    \* volatile
    eWorking,   \* SUBSET Dels: E's turns running on a task
    cBuf,       \* SUBSET (Dels \X Results): acked callbacks not yet persisted (bug only)
    eBuf,       \* SUBSET Dels: acked tasks not yet persisted (bug only)
    \* environment
    net,        \* SUBSET Msgs in flight
    crashes,
    \* history (ghost) variables, for the properties only
    resolutions,  \* d -> times d was resolved at C
    taskRuns,     \* d -> times E committed a result for d
    cbRuns,       \* d -> times C ran a turn on a callback of d
    taskAcked,    \* SUBSET Dels: C received the ack of the task
    cbAcked       \* SUBSET Dels: E received the ack of the callback

vars == <<status, cOut, cCancelOut, cInbox, cSeen, task, eSeen, eOut, eWorking, cBuf,
          eBuf, net, crashes, resolutions, taskRuns, cbRuns, taskAcked, cbAcked>>

Init ==
    /\ status = [d \in Dels |-> "none"]
    /\ cOut = {} /\ cCancelOut = {} /\ cInbox = {} /\ cSeen = {}
    /\ task = [d \in Dels |-> "none"]
    /\ eSeen = {} /\ eOut = {}
    /\ eWorking = {} /\ cBuf = {} /\ eBuf = {}
    /\ net = {}
    /\ crashes = 0
    /\ resolutions = [d \in Dels |-> 0]
    /\ taskRuns = [d \in Dels |-> 0]
    /\ cbRuns = [d \in Dels |-> 0]
    /\ taskAcked = {} /\ cbAcked = {}

\* A delivery consumes the message or leaves it in flight (a duplicate).
Consume(m) == net' \in {net \ {m}, net}
\* ...and may answer with an ack.
ConsumeAnd(m, reply) == net' \in {(net \ {m}) \cup {reply}, net \cup {reply}}

-----------------------------------------------------------------------------
(* Caller C *)

\* C's turn delegates d: status and outbox entry in one commit.
Delegate(d) ==
    /\ status[d] = "none"
    /\ status' = [status EXCEPT ![d] = "open"]
    /\ cOut' = cOut \cup {d}
    /\ UNCHANGED <<cCancelOut, cInbox, cSeen, task, eSeen, eOut, eWorking, cBuf, eBuf,
                   net, crashes, resolutions, taskRuns, cbRuns, taskAcked, cbAcked>>

\* C's sender (re)sends what its durable outbox holds.
SendTask(d) ==
    /\ d \in cOut /\ Msg("task", d) \notin net
    /\ net' = net \cup {Msg("task", d)}
    /\ UNCHANGED <<status, cOut, cCancelOut, cInbox, cSeen, task, eSeen, eOut, eWorking,
                   cBuf, eBuf, crashes, resolutions, taskRuns, cbRuns, taskAcked, cbAcked>>

SendCancel(d) ==
    /\ d \in cCancelOut /\ Msg("cancel", d) \notin net
    /\ net' = net \cup {Msg("cancel", d)}
    /\ UNCHANGED <<status, cOut, cCancelOut, cInbox, cSeen, task, eSeen, eOut, eWorking,
                   cBuf, eBuf, crashes, resolutions, taskRuns, cbRuns, taskAcked, cbAcked>>

RecvTaskAck(d) ==
    /\ Msg("taskAck", d) \in net
    /\ Consume(Msg("taskAck", d))
    /\ cOut' = cOut \ {d}
    /\ taskAcked' = taskAcked \cup {d}
    /\ UNCHANGED <<status, cCancelOut, cInbox, cSeen, task, eSeen, eOut, eWorking, cBuf,
                   eBuf, crashes, resolutions, taskRuns, cbRuns, cbAcked>>

RecvCancelAck(d) ==
    /\ Msg("cancelAck", d) \in net
    /\ Consume(Msg("cancelAck", d))
    /\ cCancelOut' = cCancelOut \ {d}
    /\ UNCHANGED <<status, cOut, cInbox, cSeen, task, eSeen, eOut, eWorking, cBuf, eBuf,
                   crashes, resolutions, taskRuns, cbRuns, taskAcked, cbAcked>>

\* A callback reaches C's inbox: persist (unless seen before), then ack.
RecvCb(d, r) ==
    /\ Cb(d, r) \in net
    /\ ConsumeAnd(Cb(d, r), Msg("cbAck", d))
    /\ IF d \in cSeen /\ ~BUG_NO_DEDUPE
         THEN UNCHANGED <<cInbox, cSeen, cBuf>>          \* duplicate: ack only
         ELSE IF BUG_ACK_BEFORE_PERSIST
           THEN /\ cBuf' = cBuf \cup {<<d, r>>}
                /\ UNCHANGED <<cInbox, cSeen>>
           ELSE /\ cInbox' = cInbox \cup {<<d, r>>}
                /\ cSeen' = cSeen \cup {d}
                /\ UNCHANGED cBuf
    /\ UNCHANGED <<status, cOut, cCancelOut, task, eSeen, eOut, eWorking, eBuf, crashes,
                   resolutions, taskRuns, cbRuns, taskAcked, cbAcked>>

\* BUG_ACK_BEFORE_PERSIST only: the deferred append.
FlushC(d, r) ==
    /\ <<d, r>> \in cBuf
    /\ cBuf' = cBuf \ {<<d, r>>}
    /\ IF d \in cSeen /\ ~BUG_NO_DEDUPE
         THEN UNCHANGED <<cInbox, cSeen>>
         ELSE /\ cInbox' = cInbox \cup {<<d, r>>}
              /\ cSeen' = cSeen \cup {d}
    /\ UNCHANGED <<status, cOut, cCancelOut, task, eSeen, eOut, eWorking, eBuf, net,
                   crashes, resolutions, taskRuns, cbRuns, taskAcked, cbAcked>>

\* C's turn on a callback: consume it; resolve d if it is still open.
ProcessCb(d, r) ==
    /\ <<d, r>> \in cInbox
    /\ cInbox' = cInbox \ {<<d, r>>}
    /\ cbRuns' = [cbRuns EXCEPT ![d] = @ + 1]
    /\ IF status[d] = "open" \/ BUG_NO_STATUS_CHECK
         THEN /\ status' = [status EXCEPT ![d] = r]
              /\ resolutions' = [resolutions EXCEPT ![d] = @ + 1]
         ELSE UNCHANGED <<status, resolutions>>
    /\ UNCHANGED <<cOut, cCancelOut, cSeen, task, eSeen, eOut, eWorking, cBuf, eBuf, net,
                   crashes, taskRuns, taskAcked, cbAcked>>

\* C's turn cancels an open delegation: the resolution, and a cancel message.
Cancel(d) ==
    /\ CANCEL
    /\ status[d] = "open"
    /\ status' = [status EXCEPT ![d] = "canceled"]
    /\ resolutions' = [resolutions EXCEPT ![d] = @ + 1]
    /\ cCancelOut' = cCancelOut \cup {d}
    /\ UNCHANGED <<cOut, cInbox, cSeen, task, eSeen, eOut, eWorking, cBuf, eBuf, net,
                   crashes, taskRuns, cbRuns, taskAcked, cbAcked>>

-----------------------------------------------------------------------------
(* Callee E *)

\* A task reaches E's inbox: persist (unless seen before), then ack.
RecvTask(d) ==
    /\ Msg("task", d) \in net
    /\ ConsumeAnd(Msg("task", d), Msg("taskAck", d))
    /\ IF d \in eSeen /\ ~BUG_NO_DEDUPE
         THEN UNCHANGED <<task, eSeen, eBuf>>
         ELSE IF BUG_ACK_BEFORE_PERSIST
           THEN /\ eBuf' = eBuf \cup {d}
                /\ UNCHANGED <<task, eSeen>>
           ELSE /\ task' = [task EXCEPT ![d] = "queued"]
                /\ eSeen' = eSeen \cup {d}
                /\ UNCHANGED eBuf
    /\ UNCHANGED <<status, cOut, cCancelOut, cInbox, cSeen, eOut, eWorking, cBuf, crashes,
                   resolutions, taskRuns, cbRuns, taskAcked, cbAcked>>

FlushE(d) ==
    /\ d \in eBuf
    /\ eBuf' = eBuf \ {d}
    /\ IF d \in eSeen /\ ~BUG_NO_DEDUPE
         THEN UNCHANGED <<task, eSeen>>
         ELSE /\ task' = [task EXCEPT ![d] = "queued"]
              /\ eSeen' = eSeen \cup {d}
    /\ UNCHANGED <<status, cOut, cCancelOut, cInbox, cSeen, eOut, eWorking, cBuf, net,
                   crashes, resolutions, taskRuns, cbRuns, taskAcked, cbAcked>>

\* E starts a turn on a queued task (volatile until it commits).
StartWork(d) ==
    /\ task[d] = "queued" /\ d \notin eWorking
    /\ eWorking' = eWorking \cup {d}
    /\ UNCHANGED <<status, cOut, cCancelOut, cInbox, cSeen, task, eSeen, eOut, cBuf, eBuf,
                   net, crashes, resolutions, taskRuns, cbRuns, taskAcked, cbAcked>>

\* The turn commits the result and the callback (outbox) atomically.
FinishWork(d, r) ==
    /\ d \in eWorking /\ task[d] = "queued"
    /\ eWorking' = eWorking \ {d}
    /\ task' = [task EXCEPT ![d] = r]
    /\ eOut' = eOut \cup {<<d, r>>}
    /\ taskRuns' = [taskRuns EXCEPT ![d] = @ + 1]
    /\ UNCHANGED <<status, cOut, cCancelOut, cInbox, cSeen, eSeen, cBuf, eBuf, net,
                   crashes, resolutions, cbRuns, taskAcked, cbAcked>>

SendCb(d, r) ==
    /\ <<d, r>> \in eOut /\ Cb(d, r) \notin net
    /\ net' = net \cup {Cb(d, r)}
    /\ UNCHANGED <<status, cOut, cCancelOut, cInbox, cSeen, task, eSeen, eOut, eWorking,
                   cBuf, eBuf, crashes, resolutions, taskRuns, cbRuns, taskAcked, cbAcked>>

RecvCbAck(d) ==
    /\ Msg("cbAck", d) \in net
    /\ Consume(Msg("cbAck", d))
    /\ eOut' = {x \in eOut : x[1] # d}
    /\ cbAcked' = cbAcked \cup {d}
    /\ UNCHANGED <<status, cOut, cCancelOut, cInbox, cSeen, task, eSeen, eWorking, cBuf,
                   eBuf, crashes, resolutions, taskRuns, cbRuns, taskAcked>>

\* A cancel reaches E: a task not done yet is canceled (a running turn is
\* abandoned and commits nothing); a task never seen is recorded as canceled,
\* so a late task message is deduplicated. Then ack.
RecvCancel(d) ==
    /\ Msg("cancel", d) \in net
    /\ ConsumeAnd(Msg("cancel", d), Msg("cancelAck", d))
    /\ IF task[d] \in {"none", "queued"}
         THEN /\ task' = [task EXCEPT ![d] = "canceled"]
              /\ eSeen' = eSeen \cup {d}
              /\ eWorking' = eWorking \ {d}
         ELSE UNCHANGED <<task, eSeen, eWorking>>
    /\ UNCHANGED <<status, cOut, cCancelOut, cInbox, cSeen, eOut, cBuf, eBuf, crashes,
                   resolutions, taskRuns, cbRuns, taskAcked, cbAcked>>

-----------------------------------------------------------------------------
(* Faults *)

\* A crash and restart: only volatile state is lost.
CrashC ==
    /\ crashes < MAX_CRASHES
    /\ crashes' = crashes + 1
    /\ cBuf' = {}
    /\ UNCHANGED <<status, cOut, cCancelOut, cInbox, cSeen, task, eSeen, eOut, eWorking,
                   eBuf, net, resolutions, taskRuns, cbRuns, taskAcked, cbAcked>>

CrashE ==
    /\ crashes < MAX_CRASHES
    /\ crashes' = crashes + 1
    /\ eWorking' = {}
    /\ eBuf' = {}
    /\ UNCHANGED <<status, cOut, cCancelOut, cInbox, cSeen, task, eSeen, eOut, cBuf,
                   net, resolutions, taskRuns, cbRuns, taskAcked, cbAcked>>

Lose(m) ==
    /\ LOSS /\ m \in net
    /\ net' = net \ {m}
    /\ UNCHANGED <<status, cOut, cCancelOut, cInbox, cSeen, task, eSeen, eOut, eWorking,
                   cBuf, eBuf, crashes, resolutions, taskRuns, cbRuns, taskAcked, cbAcked>>

-----------------------------------------------------------------------------
\* Every delegation made and resolved, every outbox and inbox drained, no
\* turn running: the system may stop (messages may still be in flight:
\* duplicates whose delivery changes nothing but the network).
Quiescent ==
    /\ \A d \in Dels : status[d] \in Final
    /\ cOut = {} /\ cCancelOut = {} /\ cInbox = {} /\ eOut = {}
    /\ eWorking = {} /\ cBuf = {} /\ eBuf = {}
    /\ \A d \in Dels : task[d] # "queued"
Terminated == Quiescent /\ UNCHANGED vars

\* Delivery of one message (each is a separate fairness condition).
Recv(m) ==
    \/ m.type = "task" /\ RecvTask(m.d)
    \/ m.type = "taskAck" /\ RecvTaskAck(m.d)
    \/ m.type = "cb" /\ RecvCb(m.d, m.r)
    \/ m.type = "cbAck" /\ RecvCbAck(m.d)
    \/ m.type = "cancel" /\ RecvCancel(m.d)
    \/ m.type = "cancelAck" /\ RecvCancelAck(m.d)

RuntimeStep ==
    \/ \E d \in Dels :
         \/ SendTask(d) \/ SendCancel(d)
         \/ StartWork(d) \/ FlushE(d)
         \/ \E r \in Results : SendCb(d, r) \/ FlushC(d, r) \/ ProcessCb(d, r)
    \/ \E m \in net : Recv(m)

Next ==
    \/ RuntimeStep
    \/ \E d \in Dels : Delegate(d) \/ Cancel(d) \/ \E r \in Results : FinishWork(d, r)
    \/ CrashC \/ CrashE
    \/ \E m \in net : Lose(m)
    \/ Terminated

(* Each runtime step is weakly fair on its own (one condition over all   *)
(* of them would be met by duplicate deliveries forever); each delivery is *)
(* strongly fair (a message redelivered forever is eventually received,    *)
(* despite losses); the callee's turn eventually finishes (with one of the *)
(* two results). Delegating, canceling, crashes and losses are not fair;   *)
(* crashes are bounded.                                                    *)
Fairness ==
    /\ \A d \in Dels :
         /\ WF_vars(SendTask(d)) /\ WF_vars(SendCancel(d))
         /\ WF_vars(StartWork(d)) /\ WF_vars(FlushE(d))
         /\ \A r \in Results :
              WF_vars(SendCb(d, r)) /\ WF_vars(FlushC(d, r)) /\ WF_vars(ProcessCb(d, r))
    /\ \A m \in Msgs : SF_vars(Recv(m))
    /\ \A d \in Dels : WF_vars(\E r \in Results : FinishWork(d, r))

Spec == Init /\ [][Next]_vars /\ Fairness

-----------------------------------------------------------------------------
(* Safety *)

TypeOK ==
    /\ status \in [Dels -> {"none", "open"} \cup Final]
    /\ cOut \subseteq Dels /\ cCancelOut \subseteq Dels
    /\ cInbox \subseteq Dels \X Results /\ cSeen \subseteq Dels
    /\ task \in [Dels -> {"none", "queued"} \cup Final]
    /\ eSeen \subseteq Dels /\ eOut \subseteq Dels \X Results
    /\ eWorking \subseteq Dels /\ cBuf \subseteq Dels \X Results /\ eBuf \subseteq Dels
    /\ net \subseteq Msgs
    /\ crashes \in 0..MAX_CRASHES
    /\ taskAcked \subseteq Dels /\ cbAcked \subseteq Dels

(* Every accepted delegation resolves AT MOST once at the caller (the       *)
(* "exactly" half is the liveness property EveryDelegationResolves).         *)
ResolvesAtMostOnce == \A d \in Dels : resolutions[d] <= 1

(* No message is processed twice: E commits a result for a task at most    *)
(* once, and C runs at most one turn per callback.                          *)
NoMessageProcessedTwice ==
    \A d \in Dels : taskRuns[d] <= 1 /\ cbRuns[d] <= 1

(* No acknowledged message is lost: once its sender has the ack (and stops  *)
(* redelivering), the message is in the receiver's durable store, or still  *)
(* in a live volatile buffer (BUG_ACK_BEFORE_PERSIST; a crash empties it).  *)
NoAckedMessageLost ==
    /\ \A d \in taskAcked : d \in eSeen \/ d \in eBuf
    /\ \A d \in cbAcked : d \in cSeen \/ \E r \in Results : <<d, r>> \in cBuf

(* The caller sees what the callee did: a delegation resolved completed or  *)
(* failed has exactly that result committed at the callee.                   *)
ResultMatchesCallee ==
    \A d \in Dels : status[d] \in Results => task[d] = status[d]

-----------------------------------------------------------------------------
(* Liveness *)

(* Every accepted delegation is eventually resolved (completed, failed or  *)
(* canceled) at the caller.                                                  *)
EveryDelegationResolves ==
    \A d \in Dels : status[d] = "open" ~> status[d] \in Final

(* Every task the callee acked is eventually done or canceled there. *)
EveryAckedTaskHandled ==
    \A d \in Dels : d \in taskAcked ~> task[d] \in Final

Symmetry == Permutations(Dels)
=============================================================================
