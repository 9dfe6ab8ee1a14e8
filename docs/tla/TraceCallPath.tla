--------------------------- MODULE TraceCallPath ---------------------------
(***************************************************************************)
(* Trace validation: is a DST run's event trace a behaviour of the model?  *)
(*                                                                         *)
(* The technique of etcd-raft's and CCF's trace validation: the trace of  *)
(* one simulated run (NDJSON written under TROUPE_TRACE_OUT, turned into  *)
(* the constant Trace of the generated module TraceData by                *)
(* scripts/trace2tla.py) drives the spec. A variable i is the position in *)
(* the trace; each step consumes the next event, and is enabled only if   *)
(* the model allows that event with those parameters in the current       *)
(* state. The spec is deterministic (one successor at most), so TLC's     *)
(* deadlock check is exact: the trace is accepted iff TLC reaches         *)
(* i = Len(Trace) (where Done stutters), and a rejected trace is reported *)
(* as a deadlock whose state shows i: event i+1 (NDJSON line seq = i) is  *)
(* the first the model refuses.                                           *)
(*                                                                         *)
(* The model: the call path of MultiAgentInvocation/CallPath and the      *)
(* activation lifecycle of ActorLifecycle, at the level of what the trace *)
(* shows: single activation of each actor across nodes; one turn at a    *)
(* time per activation (start, handler end, commit or abandon); a turn    *)
(* commits only if its handler succeeded; admitted calls extend the       *)
(* caller's chain by the caller and its depth by one, never to an actor   *)
(* already in the chain, never past MaxDepth; every turn starts under a   *)
(* context that a client request (depth 0) or an admitted call produced;  *)
(* refusals for a cycle or depth only when admission must refuse; a call  *)
(* ends with DeadlockDetected only while the waits recorded in the trace  *)
(* close a cycle through it. Each action below names the runtime code and *)
(* the trace event it stands for (docs/tla/README.md, "Trace validation").*)
(***************************************************************************)
EXTENDS Naturals, Sequences, FiniteSets, TraceData

VARIABLES
    i,          \* events consumed
    active,     \* live activations: set of <<node, actor>>
    st,         \* per <<node, actor>>: "idle", "running", "ok", "err" (last turn)
    dep,        \* per <<node, actor>>: depth of the running turn's context
    chn,        \* per <<node, actor>>: chain of the running turn's context
    admitted,   \* contexts sent by admitted calls: set of [t, d, ch]
    calls,      \* admitted calls: set of [c, a, t]
    waits,      \* open waits: set of [c, a, t]
    requested   \* per actor: client requests sent and not yet started as a turn

vars == <<i, active, st, dep, chn, admitted, calls, waits, requested>>

Pairs == Nodes \X Actors
Range(s) == {s[j] : j \in 1..Len(s)}

TypeOK ==
    /\ i \in 0..Len(Trace)
    /\ active \subseteq Pairs
    /\ st \in [Pairs -> {"idle", "running", "ok", "err"}]

Init ==
    /\ i = 0
    /\ active = {}
    /\ st = [p \in Pairs |-> "idle"]
    /\ dep = [p \in Pairs |-> 0]
    /\ chn = [p \in Pairs |-> <<>>]
    /\ admitted = {}
    /\ calls = {}
    /\ waits = {}
    /\ requested = [a \in Actors |-> 0]

E == Trace[i + 1]          \* the event this step consumes
Consume == i' = i + 1

\* The node whose activation of a runs a turn (single activation: at most one).
RunningOn(a) == {n \in Nodes : st[<<n, a>>] = "running"}

RECURSIVE Reach(_, _)
Reach(S, edges) ==
    LET next == S \cup {e[2] : e \in {e \in edges : e[1] \in S}}
    IN IF next = S THEN S ELSE Reach(next, edges)

(* A client sent a request (harness SimClient::request_here; RequestSent): *)
(* one more depth-0 turn of the target may start.                         *)
ClientRequest ==
    /\ E.k = "RequestSent"
    /\ requested' = [requested EXCEPT ![E.t] = @ + 1]
    /\ UNCHANGED <<active, st, dep, chn, admitted, calls, waits>>

(* Dispatcher spawns an activation: start_actor, Actor::on_activate       *)
(* (activation.rs; Activated). Single activation across the deployment.   *)
Activate ==
    /\ E.k = "Activated"
    /\ \A m \in Nodes : <<m, E.a>> \notin active
    /\ active' = active \cup {<<E.n, E.a>>}
    /\ st' = [st EXCEPT ![<<E.n, E.a>>] = "idle"]
    /\ UNCHANGED <<dep, chn, admitted, calls, waits, requested>>

(* Idle or closed mailbox: deactivate, Actor::on_deactivate (activation.rs;*)
(* Deactivated). Never while a turn runs.                                 *)
Deactivate ==
    /\ E.k = "Deactivated"
    /\ <<E.n, E.a>> \in active
    /\ st[<<E.n, E.a>>] # "running"
    /\ active' = active \ {<<E.n, E.a>>}
    /\ st' = [st EXCEPT ![<<E.n, E.a>>] = "idle"]
    /\ UNCHANGED <<dep, chn, admitted, calls, waits, requested>>

(* A node dies (SimCluster::kill; NodeKilled): its activations and turns   *)
(* are gone without a hook.                                               *)
Kill ==
    /\ E.k = "NodeKilled"
    /\ active' = {p \in active : p[1] # E.n}
    /\ st' = [p \in Pairs |-> IF p[1] = E.n THEN "idle" ELSE st[p]]
    /\ UNCHANGED <<dep, chn, admitted, calls, waits, requested>>

(* first_poll polls the actor's handler (activation.rs; probe TurnStarted):*)
(* one turn at a time, under a context a client request or an admitted    *)
(* call produced (a depth-0 turn uses up one client request: a request    *)
(* runs at most once); the chain never holds the actor; depth = Len(chain).*)
StartTurn ==
    /\ E.k = "TurnStarted"
    /\ <<E.n, E.a>> \in active
    /\ st[<<E.n, E.a>>] # "running"
    /\ E.d = Len(E.ch)
    /\ E.d <= MaxDepth
    /\ E.a \notin Range(E.ch)
    /\ IF E.d = 0 THEN requested[E.a] > 0
                  ELSE [t |-> E.a, d |-> E.d, ch |-> E.ch] \in admitted
    /\ requested' = IF E.d = 0 THEN [requested EXCEPT ![E.a] = @ - 1]
                                ELSE requested
    /\ st' = [st EXCEPT ![<<E.n, E.a>>] = "running"]
    /\ dep' = [dep EXCEPT ![<<E.n, E.a>>] = E.d]
    /\ chn' = [chn EXCEPT ![<<E.n, E.a>>] = E.ch]
    /\ UNCHANGED <<active, admitted, calls, waits>>

(* The handler returns (probe TurnEnded ok / not ok).                      *)
EndHandler ==
    /\ E.k = "TurnEnded"
    /\ st[<<E.n, E.a>>] = "running"
    /\ st' = [st EXCEPT ![<<E.n, E.a>>] = IF E.ok THEN "ok" ELSE "err"]
    /\ UNCHANGED <<active, dep, chn, admitted, calls, waits, requested>>

(* The commit decision (settle's Raced::Finished(Ok(Ok(_))) arm, then     *)
(* commit; RuntimeEvent::TurnCommitting): only a turn whose handler       *)
(* succeeded commits.                                                     *)
CommitTurn ==
    /\ E.k = "TurnCommitting"
    /\ <<E.n, E.a>> \in active
    /\ st[<<E.n, E.a>>] = "ok"
    /\ st' = [st EXCEPT ![<<E.n, E.a>>] = "idle"]
    /\ UNCHANGED <<active, dep, chn, admitted, calls, waits, requested>>

(* The caller stopped waiting (settle -> abandon;                          *)
(* RuntimeEvent::TurnAbandoned): the handler is dropped (running), had    *)
(* not been polled yet (idle) or had succeeded too late (ok); nothing     *)
(* commits.                                                               *)
AbandonTurn ==
    /\ E.k = "TurnAbandoned"
    /\ <<E.n, E.a>> \in active
    /\ st[<<E.n, E.a>>] \in {"idle", "running", "ok"}
    /\ st' = [st EXCEPT ![<<E.n, E.a>>] = "idle"]
    /\ UNCHANGED <<active, dep, chn, admitted, calls, waits, requested>>

(* Call admission (troupe_core::admit_call through Caller::admit;          *)
(* probe CallAdmitted): the caller runs a turn; the child context is the  *)
(* caller's extended by the caller; no cycle; depth below the limit.      *)
AdmitCall ==
    /\ E.k = "CallAdmitted"
    /\ \E n \in RunningOn(E.a) :
        /\ E.t # E.a
        /\ E.t \notin Range(chn[<<n, E.a>>])
        /\ dep[<<n, E.a>>] < MaxDepth
        /\ E.d = dep[<<n, E.a>>] + 1
        /\ E.ch = Append(chn[<<n, E.a>>], E.a)
    /\ admitted' = admitted \cup {[t |-> E.t, d |-> E.d, ch |-> E.ch]}
    /\ calls' = calls \cup {[c |-> E.c, a |-> E.a, t |-> E.t]}
    /\ UNCHANGED <<active, st, dep, chn, waits, requested>>

(* Admission refuses (probe CallRefused): for a cycle only if the target  *)
(* is the caller or in its chain; for depth only if there is no cycle and *)
(* the caller is at the limit. Other reasons are not modelled.            *)
RefuseCall ==
    /\ E.k = "CallRefused"
    /\ \E n \in RunningOn(E.a) :
        LET cyc == E.t = E.a \/ E.t \in Range(chn[<<n, E.a>>]) IN
        /\ E.r = "Cycle" => cyc
        /\ E.r = "Depth" => ~cyc /\ dep[<<n, E.a>>] >= MaxDepth
        /\ E.r \notin {"Cycle", "Depth"} => ~cyc /\ dep[<<n, E.a>>] < MaxDepth
    /\ UNCHANGED <<active, st, dep, chn, admitted, calls, waits, requested>>

(* The caller's turn waits on an admitted call (probe WaitBegin, before   *)
(* Caller::invoke or TransportClient::invoke).                            *)
BeginWait ==
    /\ E.k = "WaitBegin"
    /\ [c |-> E.c, a |-> E.a, t |-> E.t] \in calls
    /\ RunningOn(E.a) # {}
    /\ waits' = waits \cup {[c |-> E.c, a |-> E.a, t |-> E.t]}
    /\ UNCHANGED <<active, st, dep, chn, admitted, calls, requested>>

(* The wait ends (probe WaitEnd). DeadlockDetected (the dispatcher's      *)
(* wait-for check, dispatcher.rs / wait_for_graph.rs) only while the      *)
(* recorded waits lead from the target back to the caller: the trace's   *)
(* waits open before and close after the dispatcher's edges.              *)
EndWait ==
    /\ E.k = "WaitEnd"
    /\ \E w \in calls : w.c = E.c
    /\ E.o = "deadlock" =>
        \E w \in waits : w.c = E.c /\
            w.a \in Reach({w.t}, {<<x.a, x.t>> : x \in waits})
    /\ waits' = {w \in waits : w.c # E.c}
    /\ UNCHANGED <<active, st, dep, chn, admitted, calls, requested>>

(* Every other event (phases, faults, client acks, node starts, ...).     *)
Skip ==
    /\ E.k \in {"Other", "NodeStarted"}
    /\ UNCHANGED <<active, st, dep, chn, admitted, calls, waits, requested>>

Step ==
    /\ i < Len(Trace)
    /\ Consume
    /\ \/ ClientRequest \/ Activate \/ Deactivate \/ Kill
       \/ StartTurn \/ EndHandler \/ CommitTurn \/ AbandonTurn
       \/ AdmitCall \/ RefuseCall \/ BeginWait \/ EndWait \/ Skip

\* The whole trace consumed: stutter, so that only a refused event deadlocks.
Done == i = Len(Trace) /\ UNCHANGED vars

Next == Step \/ Done

Spec == Init /\ [][Next]_vars

\* For documentation: the trace is a behaviour of the model.
TraceAccepted == <>(i = Len(Trace))
=============================================================================
