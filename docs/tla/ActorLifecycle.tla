------------------------------ MODULE ActorLifecycle ------------------------------
(***************************************************************************)
(* One virtual actor on a cluster of nodes (Troupe).                       *)
(*                                                                         *)
(* - Placement: a directory (etcd) holds the key of the actor: owner node  *)
(*   and the owner's lease id. A node claims the key with a compare-and-   *)
(*   swap ("create if absent"), which is what makes activation single.     *)
(*   The key dies with the lease: when the owner crashed (its keep-alives  *)
(*   stopped) the server expires the lease and deletes the key.            *)
(* - Lifecycle per node (crates/troupe-core/src/lifecycle.rs):             *)
(*   Inactive -> Activating (key claimed) -> Active (state loaded)         *)
(*   -> Deactivating (idle) -> Inactive (key released).                    *)
(* - Clients send writes; the dispatcher of the owner routes them to the   *)
(*   activation (calls in flight). A turn applies the write and commits    *)
(*   the whole actor state to the shared store, fenced by the lease (the   *)
(*   store write only succeeds while the key still names this node and     *)
(*   lease), and only then acknowledges the client.                         *)
(* - Idle deactivation: the actor task reports idle; the dispatcher        *)
(*   decides, and refuses while calls are in flight (a call may have been  *)
(*   routed after the actor reported idle). The key is released only once  *)
(*   the activation has finished deactivating.                             *)
(* - Nodes crash (memory lost, in-flight calls fail and the client retries)*)
(*   and restart with a new lease.                                         *)
(* - With ZOMBIES, a node that is still running may lose its lease (cut    *)
(*   off from etcd, or paused longer than the TTL): the server deletes the *)
(*   key and another node may claim the actor while the old owner still    *)
(*   runs turns until it notices (a zombie). Every commit carries the      *)
(*   owner's fence (the lease, standing for the claim's revision) and the  *)
(*   store refuses it unless the key still names this node and lease.      *)
(*   Without ZOMBIES a node whose keep-alives fail stops serving before    *)
(*   the server-side TTL runs out (bounded clock drift and pauses), which  *)
(*   is the same as a crash followed by a restart.                         *)
(*                                                                         *)
(* Each BUG_* constant breaks one rule; buggy configs must fail.           *)
(***************************************************************************)
EXTENDS Naturals, FiniteSets, TLC

CONSTANTS
    Nodes,                      \* node ids (model values)
    Writes,                     \* client writes, each acknowledged at most once (model values)
    NoNode,                     \* "key absent" (model value)
    MAX_CRASHES,                \* bound on faults: node crashes and lease losses
    ZOMBIES,                    \* a running node may lose its lease and run on
    PARTITIONS,                 \* (with ZOMBIES) a node may be cut off from etcd, then heal
    BUG_READ_THEN_WRITE,        \* claim = read "absent", later put: not a CAS
    BUG_DEACTIVATE_WITH_CALLS,  \* dispatcher trusts the actor's idle report
    BUG_NO_FENCE,               \* the store accepts a commit without checking the fence
    BUG_ACK_BEFORE_PERSIST,     \* turn acks the client, persists later
    BUG_EARLY_RELEASE           \* key released when deactivation starts, not ends

ASSUME /\ MAX_CRASHES \in Nat
       /\ NoNode \notin Nodes
       /\ \A b \in {ZOMBIES, PARTITIONS, BUG_NO_FENCE, BUG_READ_THEN_WRITE, BUG_DEACTIVATE_WITH_CALLS,
                    BUG_ACK_BEFORE_PERSIST, BUG_EARLY_RELEASE} : b \in BOOLEAN

VARIABLES
    up,         \* node -> BOOLEAN
    lease,      \* node -> its current lease id
    alive,      \* node -> BOOLEAN, its lease is alive on the server (FALSE: a zombie)
    nextLease,  \* next unused lease id
    crashes,    \* crashes so far
    dir,        \* the directory key: [owner |-> node or NoNode, lease |-> id]
    act,        \* node -> lifecycle state of its activation of the actor
    sawFree,    \* node -> BOOLEAN, read "absent" and will put (BUG_READ_THEN_WRITE only)
    mem,        \* node -> SUBSET Writes, state of its activation in memory
    dirty,      \* node -> SUBSET Writes, acked but not persisted (BUG_ACK_BEFORE_PERSIST only)
    inflight,   \* node -> SUBSET Writes, calls routed to its activation, not finished
    idleReq,    \* node -> BOOLEAN, the activation reported idle
    pending,    \* SUBSET Writes, sent (or retried) by clients, not yet routed
    store,      \* SUBSET Writes, the durable actor state
    acked,      \* SUBSET Writes, acknowledged to clients
    cut,        \* node -> BOOLEAN, partitioned from etcd (ZOMBIES only)
    fenced      \* history: some commit was refused by the fence

vars == <<up, lease, alive, nextLease, crashes, dir, act, sawFree, mem, dirty, inflight,
          idleReq, pending, store, acked, cut, fenced>>

States == {"inactive", "activating", "active", "deactivating"}
NodeCount == Cardinality(Nodes)
MaxLease == NodeCount + MAX_CRASHES
Absent == [owner |-> NoNode, lease |-> 0]

\* The key names node n under its current lease: n may write (fencing).
Owns(n) == dir.owner = n /\ dir.lease = lease[n]

Init ==
    /\ up = [n \in Nodes |-> TRUE]
    \* distinct lease ids 1..NodeCount
    /\ lease = CHOOSE f \in [Nodes -> 1..NodeCount] :
                  \A x, y \in Nodes : x # y => f[x] # f[y]
    /\ alive = [n \in Nodes |-> TRUE]
    /\ nextLease = NodeCount + 1
    /\ crashes = 0
    /\ dir = Absent
    /\ act = [n \in Nodes |-> "inactive"]
    /\ sawFree = [n \in Nodes |-> FALSE]
    /\ mem = [n \in Nodes |-> {}]
    /\ dirty = [n \in Nodes |-> {}]
    /\ inflight = [n \in Nodes |-> {}]
    /\ idleReq = [n \in Nodes |-> FALSE]
    /\ pending = Writes
    /\ store = {}
    /\ acked = {}
    /\ cut = [n \in Nodes |-> FALSE]
    /\ fenced = FALSE

-----------------------------------------------------------------------------
(* Activation, triggered by a request for the actor arriving at node n. *)

\* Correct claim: atomic compare-and-swap "create the key if absent".
ClaimCAS(n) ==
    /\ ~BUG_READ_THEN_WRITE
    /\ up[n] /\ alive[n] /\ ~cut[n] /\ act[n] = "inactive" /\ pending # {}
    /\ dir.owner = NoNode
    /\ dir' = [owner |-> n, lease |-> lease[n]]
    /\ act' = [act EXCEPT ![n] = "activating"]
    /\ UNCHANGED <<up, lease, alive, nextLease, crashes, sawFree, mem, dirty, inflight,
                   idleReq, pending, store, acked, cut, fenced>>

\* Buggy claim, step 1: read the key, see it absent.
ClaimRead(n) ==
    /\ BUG_READ_THEN_WRITE
    /\ up[n] /\ alive[n] /\ act[n] = "inactive" /\ pending # {} /\ ~sawFree[n]
    /\ dir.owner = NoNode
    /\ sawFree' = [sawFree EXCEPT ![n] = TRUE]
    /\ UNCHANGED <<up, lease, alive, nextLease, crashes, dir, act, mem, dirty, inflight,
                   idleReq, pending, store, acked, cut, fenced>>

\* Buggy claim, step 2: put the key unconditionally.
ClaimWrite(n) ==
    /\ BUG_READ_THEN_WRITE
    /\ up[n] /\ alive[n] /\ act[n] = "inactive" /\ sawFree[n]
    /\ dir' = [owner |-> n, lease |-> lease[n]]
    /\ act' = [act EXCEPT ![n] = "activating"]
    /\ sawFree' = [sawFree EXCEPT ![n] = FALSE]
    /\ UNCHANGED <<up, lease, alive, nextLease, crashes, mem, dirty, inflight,
                   idleReq, pending, store, acked, cut, fenced>>

\* Load the persisted state; the activation is now Active.
Load(n) ==
    /\ up[n] /\ act[n] = "activating"
    /\ mem' = [mem EXCEPT ![n] = store]
    /\ act' = [act EXCEPT ![n] = "active"]
    /\ UNCHANGED <<up, lease, alive, nextLease, crashes, dir, sawFree, dirty, inflight,
                   idleReq, pending, store, acked, cut, fenced>>

-----------------------------------------------------------------------------
(* Calls *)

\* The dispatcher routes a client write to the activation named by the key.
Route(n, w) ==
    /\ up[n] /\ act[n] = "active" /\ dir.owner = n
    /\ w \in pending
    /\ pending' = pending \ {w}
    /\ inflight' = [inflight EXCEPT ![n] = @ \cup {w}]
    /\ UNCHANGED <<up, lease, alive, nextLease, crashes, dir, act, sawFree, mem, dirty,
                   idleReq, store, acked, cut, fenced>>

\* One turn: apply the write, commit the whole state (fenced by the lease),
\* then acknowledge. If the fence fails the turn rolls back and the client
\* retries. Turns also run while the activation deactivates: closing the
\* mailbox (dropping its sender) still lets the actor task receive every
\* message routed before (crates/troupe-runtime/src/activation.rs).
Turn(n, w) ==
    /\ up[n] /\ act[n] \in {"active", "deactivating"}
    /\ w \in inflight[n]
    /\ inflight' = [inflight EXCEPT ![n] = @ \ {w}]
    /\ IF BUG_ACK_BEFORE_PERSIST
         THEN /\ mem' = [mem EXCEPT ![n] = @ \cup {w}]
              /\ dirty' = [dirty EXCEPT ![n] = @ \cup {w}]
              /\ acked' = acked \cup {w}
              /\ UNCHANGED <<store, pending, fenced>>
         ELSE IF Owns(n) \/ BUG_NO_FENCE
           THEN /\ mem' = [mem EXCEPT ![n] = @ \cup {w}]
                /\ store' = mem[n] \cup {w}
                /\ acked' = acked \cup {w}
                /\ UNCHANGED <<dirty, pending, fenced>>
           ELSE /\ pending' = pending \cup {w}
                /\ fenced' = TRUE                  \* the store refused the commit
                /\ UNCHANGED <<mem, dirty, store, acked, cut>>
    /\ UNCHANGED <<up, lease, alive, nextLease, crashes, dir, act, sawFree, idleReq, cut>>

\* BUG_ACK_BEFORE_PERSIST only: the deferred commit of acked writes.
Persist(n) ==
    /\ up[n] /\ dirty[n] # {}
    /\ store' = IF Owns(n) THEN mem[n] ELSE store
    /\ dirty' = [dirty EXCEPT ![n] = {}]
    /\ UNCHANGED <<up, lease, alive, nextLease, crashes, dir, act, sawFree, mem, inflight,
                   idleReq, pending, acked, cut, fenced>>

-----------------------------------------------------------------------------
(* Idle deactivation *)

\* The actor task saw no work for ACTOR_IDLE_TIMEOUT and asks to deactivate.
ReportIdle(n) ==
    /\ up[n] /\ act[n] = "active" /\ ~idleReq[n]
    /\ inflight[n] = {} /\ dirty[n] = {}
    /\ idleReq' = [idleReq EXCEPT ![n] = TRUE]
    /\ UNCHANGED <<up, lease, alive, nextLease, crashes, dir, act, sawFree, mem, dirty,
                   inflight, pending, store, acked, cut, fenced>>

\* The dispatcher decides. Calls may have been routed since the report.
DecideDeactivate(n) ==
    /\ up[n] /\ act[n] = "active" /\ idleReq[n]
    /\ idleReq' = [idleReq EXCEPT ![n] = FALSE]
    /\ IF inflight[n] = {} \/ BUG_DEACTIVATE_WITH_CALLS
         THEN /\ act' = [act EXCEPT ![n] = "deactivating"]
              /\ dir' = IF BUG_EARLY_RELEASE /\ Owns(n) THEN Absent ELSE dir
         ELSE UNCHANGED <<act, dir, cut, fenced>>          \* refused: stays Active
    /\ UNCHANGED <<up, lease, alive, nextLease, crashes, sawFree, mem, dirty, inflight,
                   pending, store, acked, cut, fenced>>

\* Deactivation ends: flush (nothing left to flush when turns commit before
\* acking), drop the memory, release the key (CAS delete if still ours).
FinishDeactivate(n) ==
    /\ up[n] /\ act[n] = "deactivating"
    /\ inflight[n] = {}            \* the task sees the end of its mailbox last
    /\ store' = IF dirty[n] # {} /\ Owns(n) THEN mem[n] ELSE store
    /\ dirty' = [dirty EXCEPT ![n] = {}]
    /\ dir' = IF Owns(n) THEN Absent ELSE dir
    /\ act' = [act EXCEPT ![n] = "inactive"]
    /\ mem' = [mem EXCEPT ![n] = {}]
    /\ UNCHANGED <<up, lease, alive, nextLease, crashes, sawFree, inflight, idleReq,
                   pending, acked, cut, fenced>>

-----------------------------------------------------------------------------
(* Faults *)

Crash(n) ==
    /\ up[n] /\ crashes < MAX_CRASHES
    /\ crashes' = crashes + 1
    /\ up' = [up EXCEPT ![n] = FALSE]
    /\ act' = [act EXCEPT ![n] = "inactive"]
    /\ mem' = [mem EXCEPT ![n] = {}]
    /\ dirty' = [dirty EXCEPT ![n] = {}]
    /\ pending' = pending \cup inflight[n]
    /\ inflight' = [inflight EXCEPT ![n] = {}]
    /\ idleReq' = [idleReq EXCEPT ![n] = FALSE]
    /\ sawFree' = [sawFree EXCEPT ![n] = FALSE]
    /\ cut' = [cut EXCEPT ![n] = FALSE]
    /\ UNCHANGED <<lease, alive, nextLease, dir, store, acked, fenced>>

\* A restarted node gets a fresh lease.
Restart(n) ==
    /\ ~up[n]
    /\ up' = [up EXCEPT ![n] = TRUE]
    /\ lease' = [lease EXCEPT ![n] = nextLease]
    /\ alive' = [alive EXCEPT ![n] = TRUE]
    /\ nextLease' = nextLease + 1
    /\ UNCHANGED <<crashes, dir, act, sawFree, mem, dirty, inflight, idleReq,
                   pending, store, acked, cut, fenced>>

\* A running node loses its lease (ZOMBIES only): cut off from etcd, or paused
\* past the TTL. The server deletes the key if it names that lease; the node
\* does not know yet and keeps its activation (a zombie).
LoseLease(n) ==
    /\ ZOMBIES /\ up[n] /\ alive[n] /\ crashes < MAX_CRASHES
    /\ crashes' = crashes + 1
    /\ alive' = [alive EXCEPT ![n] = FALSE]
    /\ dir' = IF Owns(n) THEN Absent ELSE dir
    /\ UNCHANGED <<up, lease, nextLease, act, sawFree, mem, dirty, inflight,
                   idleReq, pending, store, acked, cut, fenced>>

\* The zombie notices (its keep-alive fails): it drops the activation without
\* saving (calls in flight fail, the clients retry) and takes a new lease.
NoticeLeaseLost(n) ==
    /\ up[n] /\ ~alive[n] /\ ~cut[n]
    /\ alive' = [alive EXCEPT ![n] = TRUE]
    /\ lease' = [lease EXCEPT ![n] = nextLease]
    /\ nextLease' = nextLease + 1
    /\ act' = [act EXCEPT ![n] = "inactive"]
    /\ mem' = [mem EXCEPT ![n] = {}]
    /\ dirty' = [dirty EXCEPT ![n] = {}]
    /\ pending' = pending \cup inflight[n]
    /\ inflight' = [inflight EXCEPT ![n] = {}]
    /\ idleReq' = [idleReq EXCEPT ![n] = FALSE]
    /\ sawFree' = [sawFree EXCEPT ![n] = FALSE]
    /\ UNCHANGED <<up, crashes, dir, store, acked, cut, fenced>>

\* ZOMBIES only: the node is cut off from etcd (not from its clients or the
\* store). Its keep-alives fail; it cannot claim; its lease is still alive on
\* the server until the TTL runs out (ExpireCut).
Partition(n) ==
    /\ ZOMBIES /\ PARTITIONS /\ up[n] /\ alive[n] /\ ~cut[n] /\ crashes < MAX_CRASHES
    /\ crashes' = crashes + 1
    /\ cut' = [cut EXCEPT ![n] = TRUE]
    /\ UNCHANGED <<up, lease, alive, nextLease, dir, act, sawFree, mem, dirty, inflight,
                   idleReq, pending, store, acked, fenced>>

\* The TTL of a cut-off node's lease runs out on the server: the key goes with
\* it, and the node, which has not noticed, is now a zombie.
ExpireCut(n) ==
    /\ cut[n] /\ alive[n]
    /\ alive' = [alive EXCEPT ![n] = FALSE]
    /\ dir' = IF Owns(n) THEN Absent ELSE dir
    /\ UNCHANGED <<up, lease, nextLease, crashes, act, sawFree, mem, dirty, inflight,
                   idleReq, pending, store, acked, cut, fenced>>

\* The partition heals (before or after the TTL ran out; in the second case
\* the node then notices, NoticeLeaseLost).
Heal(n) ==
    /\ cut[n]
    /\ cut' = [cut EXCEPT ![n] = FALSE]
    /\ UNCHANGED <<up, lease, alive, nextLease, crashes, dir, act, sawFree, mem, dirty,
                   inflight, idleReq, pending, store, acked, fenced>>

\* The server expires a lease whose keep-alives stopped; the key goes with it.
ExpireLease ==
    /\ dir.owner # NoNode
    /\ ~up[dir.owner] \/ lease[dir.owner] # dir.lease
    /\ dir' = Absent
    /\ UNCHANGED <<up, lease, alive, nextLease, crashes, act, sawFree, mem, dirty, inflight,
                   idleReq, pending, store, acked, cut, fenced>>

-----------------------------------------------------------------------------
Done ==
    /\ pending = {}
    /\ \A n \in Nodes : inflight[n] = {} /\ dirty[n] = {}

\* All client writes handled: stuttering is allowed (and only then).
Terminated == Done /\ UNCHANGED vars

RuntimeStep ==
    \/ \E n \in Nodes :
         \/ ClaimCAS(n) \/ ClaimRead(n) \/ ClaimWrite(n) \/ Load(n)
         \/ \E w \in Writes : Route(n, w) \/ Turn(n, w)
         \/ Persist(n) \/ DecideDeactivate(n) \/ FinishDeactivate(n)
         \/ Restart(n) \/ NoticeLeaseLost(n) \/ ExpireCut(n) \/ Heal(n)
    \/ ExpireLease

Next ==
    \/ RuntimeStep
    \/ \E n \in Nodes : ReportIdle(n) \/ Crash(n) \/ LoseLease(n) \/ Partition(n)
    \/ Terminated

(* The runtime keeps running (weak fairness over its steps); a write that   *)
(* keeps finding an active owner is eventually routed (strong fairness,     *)
(* so that endless activate/idle/deactivate cycles cannot starve it).       *)
(* Idle reports and crashes are not fair.                                   *)
Fairness ==
    /\ WF_vars(RuntimeStep)
    /\ \A n \in Nodes : SF_vars(\E w \in Writes : Route(n, w))

Spec == Init /\ [][Next]_vars /\ Fairness

-----------------------------------------------------------------------------
(* Safety *)

TypeOK ==
    /\ up \in [Nodes -> BOOLEAN]
    /\ lease \in [Nodes -> 1..MaxLease]
    /\ alive \in [Nodes -> BOOLEAN]
    /\ nextLease \in 1..(MaxLease + 1)
    /\ crashes \in 0..MAX_CRASHES
    /\ dir \in [owner : Nodes \cup {NoNode}, lease : 0..MaxLease]
    /\ act \in [Nodes -> States]
    /\ sawFree \in [Nodes -> BOOLEAN]
    /\ mem \in [Nodes -> SUBSET Writes]
    /\ dirty \in [Nodes -> SUBSET Writes]
    /\ inflight \in [Nodes -> SUBSET Writes]
    /\ idleReq \in [Nodes -> BOOLEAN]
    /\ pending \subseteq Writes
    /\ store \subseteq Writes
    /\ acked \subseteq Writes
    /\ cut \in [Nodes -> BOOLEAN]
    /\ fenced \in BOOLEAN

(* At most one node whose lease is alive holds an activation of the actor, *)
(* in any non-inactive state (activating, active or deactivating). Without *)
(* ZOMBIES every lease of a running node is alive, so this is "at most one  *)
(* activation"; with ZOMBIES a zombie may still run (see                    *)
(* AL_zombie_runs_twice.cfg) and the fence is what keeps the state safe.    *)
SingleActivation ==
    Cardinality({n \in Nodes : act[n] # "inactive" /\ alive[n]}) <= 1

(* The stronger statement, which needs bounded clocks and pauses (no        *)
(* zombies): at most one activation at all.                                 *)
NoTwoActivations ==
    Cardinality({n \in Nodes : act[n] # "inactive"}) <= 1

(* Every acknowledged write is durable (or, under the ack-before-persist    *)
(* bug, still waiting to be flushed by a live activation), and the state of *)
(* the activation that owns the key contains every acknowledged write.      *)
NoAckedStateLost ==
    /\ \A w \in acked :
          w \in store \/ \E n \in Nodes : up[n] /\ w \in dirty[n]
    /\ \A n \in Nodes : (act[n] = "active" /\ Owns(n)) => acked \subseteq mem[n]

(* Liveness: every client write is eventually acknowledged. *)
EveryWriteAcked == \A w \in Writes : <>(w \in acked)

(* Reachability witness, not a property: a config that lists it must FAIL, *)
(* showing that the fence really refuses a commit there (AL_zombie_fence_fires; *)
(* AL_safe lists it and passes: without zombies the fence never refuses).  *)
FenceNeverRefuses == ~fenced

Symmetry == Permutations(Nodes) \cup Permutations(Writes)
=============================================================================
