------------------------------ MODULE MAIDepth ------------------------------
(***************************************************************************)
(* MultiAgentInvocation with a hand-made symmetry reduction for the depth- *)
(* 5 configs (7 agents). TLC's SYMMETRY over 7 agents computes 5,040       *)
(* permutations per state (MAI_depth5 with it: 49,188 states in 16 min);   *)
(* without symmetry the 7! orders of a chain explode (3.8 million states   *)
(* and 2.1 million queued after 17 min, not finished).                      *)
(*                                                                         *)
(* The reduction: an agent no call has touched yet (no call names it as    *)
(* caller or target) is idle with an empty mailbox, exactly like every     *)
(* other untouched agent of its node. So a call (or a root request) may    *)
(* target any touched agent, or the first untouched agent of each node     *)
(* (CHOOSE), not the others: every behaviour of MultiAgentInvocation is    *)
(* one of these up to a renaming of untouched agents, and every invariant  *)
(* checked is symmetric in the agents. Actions, fairness and invariants    *)
(* are those of MultiAgentInvocation; only the choice of targets differs.  *)
(***************************************************************************)
EXTENDS MultiAgentInvocation

Touched == {calls[c].target : c \in 1..nCalls} \cup
           ({calls[c].caller : c \in 1..nCalls} \cap Agents)
Fresh(n, used) == {x \in Agents \ used : NodeOf(x) = n}
Canonical(used) ==
    used \cup {CHOOSE x \in Fresh(n, used) : TRUE : n \in {n2 \in {1, 2} : Fresh(n2, used) # {}}}

\* root requests: each targets an agent an earlier root targets, or a first
\* untouched one
CanonInit ==
    /\ Init
    /\ \A c \in 1..MAX_ROOTS :
         calls[c].target \in Canonical({calls[d].target : d \in 1..(c - 1)})

CanonNext ==
    \/ \E a \in Agents, t \in Canonical(Touched) : AgentCall(a, t)
    \/ \E m \in net : Deliver(m) \/ Lose(m)
    \/ \E a \in Agents : DropExpired(a) \/ StartTurn(a) \/ FinishTurn(a)
    \/ \E c \in CallIds : Timeout(c) \/ ForgetEdge(c)
    \/ Tick
    \/ Terminated


(* A narrower abstraction, as a state CONSTRAINT of the *_chain configs:  *)
(* the admitted calls form one chain from the client's request (call c's  *)
(* parent is call c - 1). Every other step (deliveries, timeouts, busy,    *)
(* ticks, the dispatcher's asynchronous ForgetEdge, the turns unwinding)   *)
(* is explored, but a turn whose call has returned does not call again.   *)
(* An under-approximation: it checks the depth limit along the one chain  *)
(* long enough to reach it.                                                *)
OneChain == \A c \in 2..nCalls : calls[c].parent = c - 1

(* Reachability witness: no turn runs at depth MAX_DEPTH (must FAIL). *)
DepthBelowMax == \A a \in Agents : turn[a] # 0 => calls[turn[a]].depth < MAX_DEPTH

CanonSpec == CanonInit /\ [][CanonNext]_vars /\ Fairness
=============================================================================
