------------------------------ MODULE CrossNodeProbes ------------------------------
(***************************************************************************)
(* Cross-node deadlock detection by probes (issue 16), as designed before  *)
(* the code (to be implemented in crates/troupe-cluster by the cross-node  *)
(* work). Edge chasing in the style of Chandy-Misra-Haas, with call ids.   *)
(*                                                                         *)
(* - Actors are non-reentrant: one turn at a time. A turn serves a client  *)
(*   request (a "root" turn) or a call. Inside a turn the actor may call   *)
(*   another actor and then BLOCKS until the call ends (reply, timeout,    *)
(*   or DeadlockDetected).                                                 *)
(* - A wait edge is (waiter, call id, target): waiting[w] = c and          *)
(*   calls[c].target = t. Each node knows only the edges of its own        *)
(*   actors (it reads waiting[x] only for x hosted on it).                 *)
(* - Local cycles are refused by the node's own wait-for graph before the  *)
(*   edge is recorded (as MultiAgentInvocation.tla / CallPath.tla model).  *)
(* - When a new edge W -> T (call c) is recorded, the node follows the     *)
(*   waits from T while they stay on the node; if they leave it, it sends  *)
(*   a probe [init W, icid c, path, to X] to the host of the next actor X. *)
(* - A node receiving a probe for X: if X is the initiator and still waits *)
(*   on icid: cycle, call icid fails at once with DeadlockDetected; if X   *)
(*   waits on Y: append (X, call) to the path and continue with Y (local   *)
(*   hops followed locally, remote ones by a new message); if X waits on   *)
(*   nothing: drop. A path longer than MAX_PATH is dropped.                *)
(* - Calls also end by timeout (TIMEOUTS, at any moment: deadlines are not *)
(*   clocks here, which over-approximates them). Probes between nodes may  *)
(*   be delayed, reordered and (LOSS) lost.                                *)
(*                                                                         *)
(* BUG_NO_PROBES: no probe is ever sent. BUG_NO_CALL_ID_CHECK: at the      *)
(* initiator, "still waits on the same call id" becomes "waits on some     *)
(* call", and that call is refused.                                        *)
(***************************************************************************)
EXTENDS Naturals, Sequences, FiniteSets, TLC

CONSTANTS
    Actors,               \* actor ids (model values)
    Remote,               \* actors hosted on node 2; the others on node 1
    MAX_CALLS,            \* bound on calls made (ids 1..MAX_CALLS)
    MAX_ROOTS,            \* bound on client requests (root turns)
    MAX_PATH,             \* bound on the edges a probe carries
    TIMEOUTS,             \* TRUE: a waiting call may time out at any moment
    LOSS,                 \* TRUE: the network may lose probes
    BUG_NO_PROBES,        \* no probe is sent: cross-node cycles wait for timeouts
    BUG_NO_CALL_ID_CHECK  \* the initiator refuses whatever call it waits on now

ASSUME /\ MAX_CALLS \in Nat \ {0} /\ MAX_ROOTS \in Nat \ {0}
       /\ MAX_PATH \in Nat \ {0}
       /\ Remote \subseteq Actors
       /\ \A b \in {TIMEOUTS, LOSS, BUG_NO_PROBES, BUG_NO_CALL_ID_CHECK} : b \in BOOLEAN

VARIABLES
    turn,      \* actor -> 0 idle, ROOT serving a client request, c > 0 serving call c
    waiting,   \* actor -> call id its turn is blocked on, 0 if none (the wait edge)
    calls,     \* call id -> call record
    nCalls,    \* call ids 1..nCalls are used
    nRoots,    \* client requests started
    net,       \* probes in flight (a set: delay and reordering)
    refusals   \* history: one record per DeadlockDetected refusal

vars == <<turn, waiting, calls, nCalls, nRoots, net, refusals>>

ROOT == MAX_CALLS + 1          \* turn value of a root turn (not a call id)
CallIds == 1..MAX_CALLS
NodeOf(a) == IF a \in Remote THEN 2 ELSE 1

(* coexist: the calls pending when this call was created (history, used  *)
(* only by RefusedCycleExistedAtOnce).                                     *)
NoCall == [status |-> "none", caller |-> CHOOSE a \in Actors : TRUE,
           target |-> CHOOSE a \in Actors : TRUE, served |-> FALSE, coexist |-> {}]

Pending == {c \in CallIds : calls[c].status = "pending"}

(* A probe: initiator, its call id, the edges passed so far (a sequence of *)
(* <<actor, call id>>, the first one the initiator's), and the actor whose *)
(* host it is addressed to.                                                 *)
Probe(w, c, p, x) == [init |-> w, icid |-> c, path |-> p, to |-> x]

(* What the host of x does with a probe at x, following local hops         *)
(* locally: [kind "refuse", call, path], [kind "send", probe], or          *)
(* [kind "drop"]. Reads waiting[] only for actors hosted with x.           *)
RECURSIVE Follow(_, _, _, _)
Follow(w, c, p, x) ==
    IF x = w
      THEN IF BUG_NO_CALL_ID_CHECK
             THEN IF waiting[w] # 0 THEN [kind |-> "refuse", call |-> waiting[w], path |-> p]
                                    ELSE [kind |-> "drop"]
             ELSE IF waiting[w] = c THEN [kind |-> "refuse", call |-> c, path |-> p]
                                    ELSE [kind |-> "drop"]
    ELSE IF waiting[x] = 0 \/ Len(p) >= MAX_PATH THEN [kind |-> "drop"]
    ELSE LET d == waiting[x]
             y == calls[d].target
             p2 == Append(p, <<x, d>>)
         IN IF NodeOf(y) = NodeOf(x) THEN Follow(w, c, p2, y)
            ELSE [kind |-> "send", probe |-> Probe(w, c, p2, y)]

(* The local wait-for graph: would the edge a -> t close a cycle among the *)
(* actors of a's node? (t = a, or t waits on ... on a, all on a's node.)    *)
RECURSIVE LocalReaches(_, _, _)
LocalReaches(x, a, k) ==
    IF x = a THEN TRUE
    ELSE IF k = 0 \/ NodeOf(x) # NodeOf(a) \/ waiting[x] = 0 THEN FALSE
    ELSE LocalReaches(calls[waiting[x]].target, a, k - 1)
LocalCycle(a, t) == LocalReaches(t, a, Cardinality(Actors))

(* The end of one call: the caller's wait ends. *)
EndCall(c, st) ==
    /\ calls' = [calls EXCEPT ![c].status = st]
    /\ waiting' = [waiting EXCEPT ![calls[c].caller] = 0]

(* Apply an outcome of Follow: refuse, send or drop. *)
Apply(o) ==
    IF o.kind = "refuse"
      THEN /\ EndCall(o.call, "deadlock")
           /\ refusals' = refusals \cup
                {[call |-> o.call, path |-> o.path,
                  \* history for RefusedCycleExistsAtRefusal
                  allPending |-> \A i \in DOMAIN o.path : calls[o.path[i][2]].status = "pending"]}
           /\ UNCHANGED nCalls
    ELSE UNCHANGED <<refusals>>

-----------------------------------------------------------------------------
Init ==
    /\ turn = [a \in Actors |-> 0]
    /\ waiting = [a \in Actors |-> 0]
    /\ calls = [c \in CallIds |-> NoCall]
    /\ nCalls = 0
    /\ nRoots = 0
    /\ net = {}
    /\ refusals = {}

(* An idle actor starts serving a client request. *)
StartRoot(a) ==
    /\ turn[a] = 0
    /\ nRoots < MAX_ROOTS
    /\ nRoots' = nRoots + 1
    /\ turn' = [turn EXCEPT ![a] = ROOT]
    /\ UNCHANGED <<waiting, calls, nCalls, net, refusals>>

(* Actor a, in a turn, calls t and blocks. The local wait-for graph refuses  *)
(* an edge that closes a local cycle (a tool error: a stuttering step). The  *)
(* new edge sends a probe if the waits from t leave the node.               *)
Call(a, t) ==
    /\ turn[a] # 0
    /\ waiting[a] = 0
    /\ nCalls < MAX_CALLS
    /\ ~LocalCycle(a, t)
    /\ LET c == nCalls + 1
           p == << <<a, c>> >>
           o == IF NodeOf(t) # NodeOf(a)
                  THEN [kind |-> "send", probe |-> Probe(a, c, p, t)]
                  ELSE Follow(a, c, p, t)
       IN /\ calls' = [calls EXCEPT ![c] = [status |-> "pending", caller |-> a,
                          target |-> t, served |-> FALSE, coexist |-> Pending]]
          /\ nCalls' = c
          /\ waiting' = [waiting EXCEPT ![a] = c]
          /\ net' = IF o.kind = "send" /\ ~BUG_NO_PROBES THEN net \cup {o.probe} ELSE net
    /\ UNCHANGED <<turn, nRoots, refusals>>

(* An idle actor serves a pending call addressed to it. *)
Serve(t, c) ==
    /\ turn[t] = 0
    /\ calls[c].status = "pending" /\ calls[c].target = t /\ ~calls[c].served
    /\ turn' = [turn EXCEPT ![t] = c]
    /\ calls' = [calls EXCEPT ![c].served = TRUE]
    /\ UNCHANGED <<waiting, nCalls, nRoots, net, refusals>>

(* A turn that waits on nothing ends; its reply ends the call (a call that *)
(* already ended, by timeout or refusal, ignores it).                       *)
Finish(a) ==
    /\ turn[a] # 0
    /\ waiting[a] = 0
    /\ turn' = [turn EXCEPT ![a] = 0]
    /\ LET c == turn[a] IN
       IF c # ROOT /\ calls[c].status = "pending"
         THEN EndCall(c, "ok")
         ELSE UNCHANGED <<calls, waiting>>
    /\ UNCHANGED <<nCalls, nRoots, net, refusals>>

(* The caller's deadline passes (any moment: an over-approximation). *)
Timeout(c) ==
    /\ TIMEOUTS
    /\ calls[c].status = "pending"
    /\ EndCall(c, "timedout")
    /\ UNCHANGED <<turn, nCalls, nRoots, net, refusals>>

(* The host of m.to handles a probe. *)
DeliverProbe(m) ==
    /\ m \in net
    /\ LET o == Follow(m.init, m.icid, m.path, m.to) IN
       /\ net' = (net \ {m}) \cup (IF o.kind = "send" THEN {o.probe} ELSE {})
       /\ Apply(o)
       /\ IF o.kind = "refuse" THEN TRUE ELSE UNCHANGED <<calls, waiting>>
    /\ UNCHANGED <<turn, nCalls, nRoots>>

LoseProbe(m) ==
    /\ LOSS
    /\ m \in net
    /\ net' = net \ {m}
    /\ UNCHANGED <<turn, waiting, calls, nCalls, nRoots, refusals>>

Quiescent == \A a \in Actors : turn[a] = 0
Terminated == Quiescent /\ net = {} /\ UNCHANGED vars

Next ==
    \/ \E a \in Actors : StartRoot(a) \/ Finish(a)
    \/ \E a, t \in Actors : Call(a, t)
    \/ \E t \in Actors, c \in CallIds : Serve(t, c)
    \/ \E c \in CallIds : Timeout(c)
    \/ \E m \in net : DeliverProbe(m) \/ LoseProbe(m)
    \/ Terminated

(* Fairness: the runtime's steps (serving a call, ending a turn that waits *)
(* on nothing, handling a probe) are weakly fair, each on its own. Client  *)
(* requests, the actors' decisions to call, timeouts and losses are not:   *)
(* liveness must hold without waiting for a timeout.                       *)
Fairness ==
    /\ \A a \in Actors : WF_vars(Finish(a))
    /\ \A t \in Actors, c \in CallIds : WF_vars(Serve(t, c))
    /\ WF_vars(\E m \in net : DeliverProbe(m))

Spec == Init /\ [][Next]_vars /\ Fairness

-----------------------------------------------------------------------------
(* Safety *)

TypeOK ==
    /\ turn \in [Actors -> {0, ROOT} \cup CallIds]
    /\ waiting \in [Actors -> {0} \cup CallIds]
    /\ nCalls \in 0..MAX_CALLS /\ nRoots \in 0..MAX_ROOTS
    /\ \A c \in CallIds : calls[c].status \in {"none", "pending", "ok", "timedout", "deadlock"}
    /\ \A m \in net : Len(m.path) \in 1..MAX_PATH

(* The wait edges, with their call ids. *)
Edges == {<<a, waiting[a], calls[waiting[a]].target>> : a \in {x \in Actors : waiting[x] # 0}}

(* The path of a refusal names a cycle: edge i is a call from its actor to *)
(* the next actor of the path, and the last one is a call to the initiator. *)
NamesACycle(p) ==
    \A i \in DOMAIN p :
        /\ calls[p[i][2]].caller = p[i][1]
        /\ calls[p[i][2]].target = IF i = Len(p) THEN p[1][1] ELSE p[i + 1][1]

(* The property that holds (weak, precise): a refusal refuses the          *)
(* initiator's own wait, the call id of the first edge of the path; the    *)
(* path is a cycle of calls; and each of its edges was a wait present when *)
(* the probe passed it (by construction: Follow reads the host's current   *)
(* waiting[]), the initiator's up to the refusal (the refused call was     *)
(* pending: EndCall of a pending call). Call ids are never reused, so an   *)
(* edge that ended and restarted is a different edge.                       *)
RefusalCycleWasObserved ==
    \A r \in refusals : r.call = r.path[1][2] /\ NamesACycle(r.path)

(* Stronger: the refused cycle existed at one instant. Call ids grow with  *)
(* time and each call is pending on one interval, so the edges of the path *)
(* coexisted iff all were pending when the newest of them was created.     *)
RefusedCycleExistedAtOnce ==
    \A r \in refusals :
        LET ids == {r.path[i][2] : i \in DOMAIN r.path}
            newest == CHOOSE c \in ids : \A d \in ids : d <= c
        IN NamesACycle(r.path) /\ ids \ {newest} \subseteq calls[newest].coexist

(* Strongest: the refused cycle still exists when the refusal is made. *)
RefusedCycleExistsAtRefusal == \A r \in refusals : r.allPending

-----------------------------------------------------------------------------
(* Liveness *)

(* c is a wait on a cycle of waits: from its target, the waits lead back   *)
(* to its caller.                                                           *)
RECURSIVE WaitsReach(_, _, _)
WaitsReach(x, a, k) ==
    IF x = a THEN TRUE
    ELSE IF k = 0 \/ waiting[x] = 0 THEN FALSE
    ELSE WaitsReach(calls[waiting[x]].target, a, k - 1)
InCycle(c) ==
    /\ calls[c].status = "pending"
    /\ WaitsReach(calls[c].target, calls[c].caller, Cardinality(Actors))

(* No wait stays on a cycle forever: the cycle is refused (or otherwise    *)
(* broken), with timeouts not fair, so without waiting for a timeout.       *)
NoCycleWaitsForever == \A c \in CallIds : InCycle(c) ~> ~InCycle(c)

(* Every call ends (liveness without cycles: with timeouts unfair, a call   *)
(* on a cycle must be refused).                                              *)
EveryCallEnds ==
    \A c \in CallIds : calls[c].status = "pending" ~> calls[c].status # "pending"

(* VIEW for the safety configs (a reduction TLC applies when it compares   *)
(* states; the behaviours and the checked invariants are unchanged). A     *)
(* probe whose initiator's call has ended can never refuse anything again  *)
(* in the safe protocol (call ids are not reused): it is left out, and so  *)
(* is the record of an ended call no live probe refers to. Refusals are    *)
(* kept as the verdicts of the three refusal properties (a verdict never   *)
(* changes: the fields it reads are fixed when a call is created). Not     *)
(* used with BUG_NO_CALL_ID_CHECK (there an old probe matters) nor for     *)
(* liveness.                                                                *)
LiveProbes == {m \in net : calls[m.icid].status = "pending"}
Referenced == UNION {{m.path[i][2] : i \in DOMAIN m.path} : m \in LiveProbes}
CallView(c) ==
    IF calls[c].status = "none" THEN "none"   \* NoCall's CHOOSE is not symmetric
    ELSE IF calls[c].status = "pending" \/ c \in Referenced THEN calls[c]
    ELSE "ended"
SafetyView ==
    <<turn, waiting, [c \in CallIds |-> CallView(c)], nCalls, nRoots, LiveProbes,
      RefusalCycleWasObserved, RefusedCycleExistedAtOnce, RefusedCycleExistsAtRefusal>>

ActorSymmetry == Permutations(Actors \ Remote) \cup Permutations(Remote)

=============================================================================
