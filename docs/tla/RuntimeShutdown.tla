------------------------------ MODULE RuntimeShutdown ------------------------------
(***************************************************************************)
(* Shutdown and abort of one runtime, seen from one activation (Troupe:    *)
(* crates/troupe-runtime/src/runtime.rs, dispatcher.rs, activation.rs;     *)
(* docs/architecture.md, "Bounded shutdown").                              *)
(*                                                                         *)
(* - Callers send requests. While the runtime runs, a request goes into   *)
(*   the activation's mailbox; once the shutdown has begun (or the runtime *)
(*   is aborted) the dispatcher refuses it with Shutdown at once.          *)
(* - The activation's task takes one request at a time and runs its turn; *)
(*   a turn ends with its commit and then the answer (Ok), or, when the    *)
(*   runtime was aborted meanwhile, with nothing committed and Shutdown    *)
(*   (`store_commit` checks the abort flag first; the commit is one step   *)
(*   here: a commit already inside the store when the abort comes lands). *)
(* - A graceful shutdown closes the mailbox: queued requests still run,    *)
(*   then the task sees the end of its mailbox, runs on_deactivate and     *)
(*   saves (`deactivate`). The grace period may run out first: then, as   *)
(*   when the Runtime is dropped, the runtime is aborted: the abort flag   *)
(*   is set, the mailbox closed and the task aborted.                      *)
(* - tokio's abort drops a task only when it is not being polled: a task   *)
(*   in a poll on another worker runs on until it next returns Pending.    *)
(*   Taking a queued message and running a turn that never awaits happen   *)
(*   inside one poll, so the task's own checks of the abort flag are what  *)
(*   keeps it from running queued work after the abort (`begin`) and from  *)
(*   running on_deactivate (`deactivate`): the fix of 2026-12-06 (77ea4f1).*)
(*   A dropped task answers its turn's caller and every queued request     *)
(*   Shutdown (their reply channels close) and runs no on_deactivate.      *)
(*                                                                         *)
(* Each BUG_* constant removes one of those checks; buggy configs must     *)
(* fail (RS_bug_*.cfg).                                                    *)
(***************************************************************************)
EXTENDS Naturals, FiniteSets, TLC

CONSTANTS
    Reqs,                        \* the callers' requests (model values)
    NoReq,                       \* "no turn in progress" (model value)
    BUG_BEGIN_IGNORES_ABORT,     \* `begin` runs a queued request after the abort (before 77ea4f1)
    BUG_DEACTIVATE_AFTER_ABORT,  \* `deactivate` runs on_deactivate after the abort (before 77ea4f1)
    BUG_COMMIT_AFTER_ABORT       \* `store_commit` commits after the abort

ASSUME /\ NoReq \notin Reqs
       /\ \A b \in {BUG_BEGIN_IGNORES_ABORT, BUG_DEACTIVATE_AFTER_ABORT,
                    BUG_COMMIT_AFTER_ABORT} : b \in BOOLEAN

VARIABLES
    phase,       \* "running", "draining" (shutdown begun: the grace period), "aborted"
    open,        \* the activation's mailbox is open
    mailbox,     \* SUBSET Reqs: accepted into the mailbox, not taken yet
    task,        \* "waiting" (for its next message), "turn" (a turn in progress), "ended"
    cur,         \* the request of the turn in progress, or NoReq
    polling,     \* the task is in a poll on a worker (runs until it returns Pending)
    cancel,      \* the task was aborted: it is dropped when it is not in a poll
    sent,        \* SUBSET Reqs: sent by their callers
    ans,         \* Reqs -> "none", "ok" or "shutdown": what each caller was answered
    committed,   \* SUBSET Reqs: whose turn's effects are in the store
    deactivated, \* on_deactivate ran and the state was saved
    startedAfterAbort,     \* history: a turn started once the runtime was aborted
    committedAfterAbort,   \* history: a turn committed once the runtime was aborted
    deactivatedAfterAbort  \* history: on_deactivate ran once the runtime was aborted

vars == <<phase, open, mailbox, task, cur, polling, cancel, sent, ans, committed,
          deactivated, startedAfterAbort, committedAfterAbort, deactivatedAfterAbort>>

Init ==
    /\ phase = "running"
    /\ open = TRUE
    /\ mailbox = {}
    /\ task = "waiting"
    /\ cur = NoReq
    /\ polling = FALSE
    /\ cancel = FALSE
    /\ sent = {}
    /\ ans = [r \in Reqs |-> "none"]
    /\ committed = {}
    /\ deactivated = FALSE
    /\ startedAfterAbort = FALSE
    /\ committedAfterAbort = FALSE
    /\ deactivatedAfterAbort = FALSE

Aborted == phase = "aborted"

-----------------------------------------------------------------------------
(* Callers *)

\* A request to the actor: into its open mailbox while the runtime runs; refused with
\* Shutdown at once once the shutdown has begun.
Send(r) ==
    /\ r \notin sent
    /\ sent' = sent \cup {r}
    /\ IF phase = "running" /\ open
         THEN /\ mailbox' = mailbox \cup {r}
              /\ UNCHANGED ans
         ELSE /\ ans' = [ans EXCEPT ![r] = "shutdown"]
              /\ UNCHANGED mailbox
    /\ UNCHANGED <<phase, open, task, cur, polling, cancel, committed, deactivated,
                   startedAfterAbort, committedAfterAbort, deactivatedAfterAbort>>

-----------------------------------------------------------------------------
(* The runtime: the shutdown notice and the abort *)

\* `Runtime::shutdown`: the dispatcher closes the mailbox; queued work keeps the grace.
BeginShutdown ==
    /\ phase = "running"
    /\ phase' = "draining"
    /\ open' = FALSE
    /\ UNCHANGED <<mailbox, task, cur, polling, cancel, sent, ans, committed, deactivated,
                   startedAfterAbort, committedAfterAbort, deactivatedAfterAbort>>

\* The grace period is over (from "draining"), or the Runtime was dropped (from
\* "running"): the abort flag is set, the mailbox closed, the task aborted.
Abort ==
    /\ phase \in {"running", "draining"}
    /\ phase' = "aborted"
    /\ open' = FALSE
    /\ cancel' = (task # "ended")
    /\ UNCHANGED <<mailbox, task, cur, polling, sent, ans, committed, deactivated,
                   startedAfterAbort, committedAfterAbort, deactivatedAfterAbort>>

-----------------------------------------------------------------------------
(* The activation's task *)

\* The scheduler polls the task: what it waits for is ready (a message, the mailbox's
\* end, or the turn's I/O).
Wake ==
    /\ ~polling /\ ~cancel /\ task # "ended"
    /\ task = "turn" \/ mailbox # {} \/ ~open
    /\ polling' = TRUE
    /\ UNCHANGED <<phase, open, mailbox, task, cur, cancel, sent, ans, committed, deactivated,
                   startedAfterAbort, committedAfterAbort, deactivatedAfterAbort>>

\* The task returns Pending: its turn awaits I/O, or its mailbox is empty and open.
Yield ==
    /\ polling
    /\ task = "turn" \/ (task = "waiting" /\ mailbox = {} /\ open)
    /\ polling' = FALSE
    /\ UNCHANGED <<phase, open, mailbox, task, cur, cancel, sent, ans, committed, deactivated,
                   startedAfterAbort, committedAfterAbort, deactivatedAfterAbort>>

\* The aborted task, not in a poll, is dropped: its turn's caller and every queued
\* request are answered Shutdown (their reply channels close); no on_deactivate.
Dropped ==
    /\ cancel /\ ~polling /\ task # "ended"
    /\ ans' = [r \in Reqs |-> IF r \in mailbox \/ r = cur THEN "shutdown" ELSE ans[r]]
    /\ mailbox' = {}
    /\ task' = "ended"
    /\ cur' = NoReq
    /\ UNCHANGED <<phase, open, polling, cancel, sent, committed, deactivated,
                   startedAfterAbort, committedAfterAbort, deactivatedAfterAbort>>

\* `begin`: the task takes a queued request. Once the runtime is aborted it answers it
\* Shutdown, unrun.
Begin(r) ==
    /\ polling /\ task = "waiting" /\ r \in mailbox
    /\ mailbox' = mailbox \ {r}
    /\ IF Aborted /\ ~BUG_BEGIN_IGNORES_ABORT
         THEN /\ ans' = [ans EXCEPT ![r] = "shutdown"]
              /\ UNCHANGED <<task, cur, startedAfterAbort>>
         ELSE /\ task' = "turn"
              /\ cur' = r
              /\ startedAfterAbort' = (startedAfterAbort \/ Aborted)
              /\ UNCHANGED ans
    /\ UNCHANGED <<phase, open, polling, cancel, sent, committed, deactivated,
                   committedAfterAbort, deactivatedAfterAbort>>

\* The turn ends: `store_commit` commits, then the caller is answered Ok; once the runtime
\* is aborted nothing is committed and the caller gets Shutdown.
Commit ==
    /\ polling /\ task = "turn"
    /\ IF Aborted /\ ~BUG_COMMIT_AFTER_ABORT
         THEN /\ ans' = [ans EXCEPT ![cur] = "shutdown"]
              /\ UNCHANGED <<committed, committedAfterAbort>>
         ELSE /\ committed' = committed \cup {cur}
              /\ ans' = [ans EXCEPT ![cur] = "ok"]
              /\ committedAfterAbort' = (committedAfterAbort \/ Aborted)
    /\ task' = "waiting"
    /\ cur' = NoReq
    /\ UNCHANGED <<phase, open, mailbox, polling, cancel, sent, deactivated,
                   startedAfterAbort, deactivatedAfterAbort>>

\* `deactivate`: the mailbox is closed and empty. After a graceful shutdown the task runs
\* on_deactivate and saves; once the runtime is aborted it ends at once.
Deactivate ==
    /\ polling /\ task = "waiting" /\ mailbox = {} /\ ~open
    /\ task' = "ended"
    /\ polling' = FALSE
    /\ IF Aborted /\ ~BUG_DEACTIVATE_AFTER_ABORT
         THEN UNCHANGED <<deactivated, deactivatedAfterAbort>>
         ELSE /\ deactivated' = TRUE
              /\ deactivatedAfterAbort' = (deactivatedAfterAbort \/ Aborted)
    /\ UNCHANGED <<phase, open, mailbox, cur, cancel, sent, ans, committed,
                   startedAfterAbort, committedAfterAbort>>

-----------------------------------------------------------------------------
TaskStep == Wake \/ Yield \/ Dropped \/ (\E r \in Reqs : Begin(r)) \/ Commit \/ Deactivate

\* Every request sent and the activation gone: only stuttering is left.
Terminated == sent = Reqs /\ task = "ended" /\ UNCHANGED vars

Next ==
    \/ \E r \in Reqs : Send(r)
    \/ BeginShutdown \/ Abort
    \/ TaskStep
    \/ Terminated

(* The task is polled when what it waits for is ready, and a dropped task is dropped *)
(* (weak fairness); a task that keeps being polled makes progress (strong fairness  *)
(* on its steps, since its turn may await and be woken any number of times). The    *)
(* shutdown and the abort are not fair: they come when the embedder decides.         *)
Fairness ==
    /\ WF_vars(Wake) /\ WF_vars(Dropped)
    /\ SF_vars(\E r \in Reqs : Begin(r)) /\ SF_vars(Commit) /\ SF_vars(Deactivate)

Spec == Init /\ [][Next]_vars /\ Fairness

-----------------------------------------------------------------------------
(* Safety *)

TypeOK ==
    /\ phase \in {"running", "draining", "aborted"}
    /\ open \in BOOLEAN
    /\ mailbox \subseteq Reqs
    /\ task \in {"waiting", "turn", "ended"}
    /\ cur \in Reqs \cup {NoReq}
    /\ polling \in BOOLEAN
    /\ cancel \in BOOLEAN
    /\ sent \subseteq Reqs
    /\ ans \in [Reqs -> {"none", "ok", "shutdown"}]
    /\ committed \subseteq Reqs
    /\ deactivated \in BOOLEAN
    /\ startedAfterAbort \in BOOLEAN
    /\ committedAfterAbort \in BOOLEAN
    /\ deactivatedAfterAbort \in BOOLEAN

(* Once the runtime is aborted, no queued request starts a turn: everything still *)
(* queued is answered Shutdown, unrun.                                             *)
NoTurnStartsAfterAbort == ~startedAfterAbort

(* Once the runtime is aborted, no turn commits.                                  *)
NoCommitAfterAbort == ~committedAfterAbort

(* Once the runtime is aborted, on_deactivate does not run.                       *)
NoOnDeactivateAfterAbort == ~deactivatedAfterAbort

(* Ok means committed; a request answered Shutdown without a turn left no effect;  *)
(* a request is in the mailbox, in the turn, or answered, never two of them.       *)
AnswersTellTheTruth ==
    /\ \A r \in Reqs : ans[r] = "ok" => r \in committed
    /\ \A r \in committed : ans[r] = "ok"
    /\ \A r \in mailbox : ans[r] = "none" /\ r # cur
    /\ cur # NoReq => ans[cur] = "none"

(* A graceful shutdown's on_deactivate runs after the last queued turn.            *)
DeactivatedLast == deactivated => mailbox = {} /\ task = "ended"

(* Liveness: every request sent is answered, and once the shutdown has begun the   *)
(* activation ends (by its deactivation or by the abort).                          *)
EveryRequestAnswered == \A r \in Reqs : [](r \in sent => <>(ans[r] # "none"))
ShutdownEnds == [](phase # "running" => <>(task = "ended"))

(* Reachability witness, not a property: RS_graceful_deactivates must FAIL on it,   *)
(* showing that a graceful shutdown reaches on_deactivate in the safe model.        *)
NeverDeactivated == ~deactivated

Symmetry == Permutations(Reqs)
=============================================================================
