------------------------------- MODULE PairOrder -------------------------------
(***************************************************************************)
(* Per-pair ordered delivery of agent inbox entries (the design of         *)
(* docs/architecture.md, "Order between two agents"), for one sender A and *)
(* one receiver B, entries numbered 0 .. N-1 in A's send order.            *)
(*                                                                         *)
(* - A sends e: one commit adds the outbox entry and e to Pending (A's     *)
(*   durable set of pending pair seqs to B) and bumps A's pair counter.    *)
(* - Delivery attempts for a pending entry: any number, concurrent. Each   *)
(*   reads the watermark w = Min(Pending) from A's committed state when it *)
(*   is sent and sends (e, w). The network delays, reorders, loses         *)
(*   (MAX_LOSSES) and duplicates (MAX_DUPS deliveries that leave the       *)
(*   message in flight; attempts themselves are repeated without bound,    *)
(*   at most MAX_IN_FLIGHT of one entry in flight at once).                *)
(* - B (durable: Expected, Skipped, Inbox) on (e, w):                    *)
(*   e = Expected \/ (e = w /\ e > Expected) -> append e, add the numbers *)
(*   jumped over (Expected .. e-1) to Skipped and Expected := e + 1 in one *)
(*   commit, then reply Accepted; else e < Expected -> Stale if e is in    *)
(*   Skipped, else Duplicate (the order dedupes: every number below        *)
(*   Expected was taken or skipped, so B keeps no mark per entry; until    *)
(*   2026-12-01 B kept the set of taken entries and checked it first);     *)
(*   else OutOfOrder (A simply attempts again).                            *)
(* - A on Accepted/Duplicate/Stale for e: removes e from Pending. A may    *)
(*   give up any pending e at any moment (its deadline): removes it from   *)
(*   Pending while attempts for it may still be in flight.                 *)
(* - Pruning (in the code since 2026-12-05: AGENT_PAIR_SKIPPED_KEPT_MS,    *)
(*   AGENT_PAIR_SKIPPED_RANGES_MAX). Skipped holds ranges, one per gap.    *)
(*   With PRUNE, B may drop a range (PruneSkipped) once no attempt of its  *)
(*   numbers can still come. The code drops it 330 s after it was          *)
(*   recorded, on the argument that by then each of its numbers is past    *)
(*   its deadline (at most 300 s after its send, which came before the     *)
(*   skip), so no delivery task attempts it again, and every attempt made  *)
(*   was answered or abandoned (30 s acknowledgement wait). Time is        *)
(*   abstracted by that consequence: a range may go once each of its       *)
(*   numbers was given up and has no attempt in flight, and from then on   *)
(*   no attempt of them starts (aExpired). BUG_PRUNE_EARLY drops the       *)
(*   guard: any range at any moment, while A may go on attempting its      *)
(*   numbers. SKIPPED_RANGES_MAX > 0 is the code's count bound: when a gap *)
(*   is added only the newest that many ranges are kept, whatever their    *)
(*   age.                                                                  *)
(* - Crashes lose memory only. B: a crash between its commit and its reply *)
(*   (ReceiveThenCrash; B keeps nothing else in memory). A: its delivery   *)
(*   tasks die and resume restarts one per entry still pending, so an      *)
(*   attempt stays enabled by the durable Pending: a crash of A changes    *)
(*   no state here (every A step is one commit).                           *)
(*                                                                         *)
(* Each BUG_* constant breaks one rule in one plausible way (four of B's   *)
(* acceptance rule, one of A's retries); buggy configs must fail.          *)
(* LATE_ATTEMPTS is not a bug: with it a task that has not noticed its     *)
(* entry left Pending may still send attempts for it (with the watermark   *)
(* read then, or the next seq if Pending is empty).                        *)
(***************************************************************************)
EXTENDS Naturals, Sequences, FiniteSets, TLC

CONSTANTS
    N,                      \* entries A sends to B: pair seqs 0 .. N-1
    MAX_LOSSES,             \* bound on lost messages (liveness needs it finite)
    MAX_DUPS,               \* bound on duplicated deliveries
    MAX_IN_FLIGHT,          \* bound on attempts of one entry in flight at once
    MAX_CRASHES_B,          \* bound on crashes of B
    LATE_ATTEMPTS,          \* attempts may be sent for an entry no longer pending
    BUG_NO_ORDER_CHECK,     \* B accepts any e not in Seen
    BUG_NO_WATERMARK,       \* B accepts only e = Expected
    BUG_WATERMARK_ANY,      \* B accepts e = Expected \/ (e >= w /\ e > Expected)
    BUG_WATERMARK_BELOW_EXPECTED, \* B accepts e = Expected \/ e = w (no e > Expected)
    BUG_RETRY_OLD_WATERMARK,\* A's retries resend the watermark of e's first attempt
    BUG_DEDUPE_WITHOUT_SKIPS,\* B answers Duplicate to any e < Expected (no Skipped)
    PRUNE,                  \* B drops a skipped range once no attempt of it can come
    BUG_PRUNE_EARLY,        \* with PRUNE: B drops any skipped range at any moment
    SKIPPED_RANGES_MAX      \* 0: no bound; else B keeps the newest this many ranges

ASSUME /\ N \in Nat /\ MAX_LOSSES \in Nat /\ MAX_DUPS \in Nat /\ MAX_CRASHES_B \in Nat
       /\ MAX_IN_FLIGHT \in Nat \ {0}
       /\ LATE_ATTEMPTS \in BOOLEAN
       /\ BUG_NO_ORDER_CHECK \in BOOLEAN /\ BUG_NO_WATERMARK \in BOOLEAN
       /\ BUG_WATERMARK_ANY \in BOOLEAN /\ BUG_WATERMARK_BELOW_EXPECTED \in BOOLEAN
       /\ BUG_RETRY_OLD_WATERMARK \in BOOLEAN /\ BUG_DEDUPE_WITHOUT_SKIPS \in BOOLEAN
       /\ PRUNE \in BOOLEAN /\ BUG_PRUNE_EARLY \in BOOLEAN /\ SKIPPED_RANGES_MAX \in Nat
       /\ BUG_PRUNE_EARLY => PRUNE

Entries == 0 .. (N - 1)

VARIABLES
    aNext,      \* A's durable pair counter: the seq of the next entry it sends
    aPending,   \* A's durable Pending: entries sent and neither answered nor given up
    aGaveUp,    \* history: entries A gave up at their deadline (GiveUp)
    aExpired,   \* entries past their deadline at every delivery task of them: no
                \* attempt of them starts again. Set by PruneSkipped under the time
                \* guard (TIMED), which implies it; else empty
    aFirstW,    \* e -> watermark of e's first attempt (NoW: none yet); set only
                \* under BUG_RETRY_OLD_WATERMARK, else constant
    bExpected,  \* B's durable next expected pair seq from A
    bSkipped,   \* B's durable skipped ranges (pair_skip/): a set of <<lo, hi>>, the
                \* numbers lo .. hi-1 jumped over by one entry taken past a gap
    bJumped,    \* history: every pair seq B ever jumped over (kept or pruned since)
    bSeen,      \* history: the pair seqs B accepted (no longer stored by B)
    bInbox,     \* B's durable inbox: the accepted entries in append order
    net,        \* messages in flight (a set: a delivery consumes its message)
    losses, dups, crashesB

vars == <<aNext, aPending, aGaveUp, aExpired, aFirstW, bExpected, bSkipped, bJumped,
          bSeen, bInbox, net, losses, dups, crashesB>>
aVars == <<aNext, aPending, aGaveUp, aExpired, aFirstW>>
bVars == <<bExpected, bSkipped, bJumped, bSeen, bInbox>>

EntryMsg == [type : {"entry"}, e : Entries, w : 0 .. N]
ReplyMsg == [type : {"Accepted", "Duplicate", "Stale"}, e : Entries]
Msg == EntryMsg \cup ReplyMsg

Min(S) == CHOOSE x \in S : \A y \in S : x <= y

\* The numbers of a range, and the numbers B still keeps as skipped.
RangeNums(r) == {d \in Entries : r[1] <= d /\ d < r[2]}
SkippedNums == UNION {RangeNums(r) : r \in bSkipped}

\* Pruning under the time guard (PruneSkipped).
TIMED == PRUNE /\ ~BUG_PRUNE_EARLY

\* The watermark an attempt reads from A's committed state: the lowest pending pair
\* seq; with nothing pending (only a late attempt), the next seq to be sent (no entry
\* below it is pending either).
Watermark == IF aPending = {} THEN aNext ELSE Min(aPending)

NoW == N + 1

Init ==
    /\ aNext = 0
    /\ aPending = {}
    /\ aGaveUp = {}
    /\ aExpired = {}
    /\ aFirstW = [e \in Entries |-> NoW]
    /\ bExpected = 0
    /\ bSkipped = {}
    /\ bJumped = {}
    /\ bSeen = {}
    /\ bInbox = << >>
    /\ net = {}
    /\ losses = 0
    /\ dups = 0
    /\ crashesB = 0

\* A sends entry aNext: outbox entry, Pending and the counter in one commit.
Send ==
    /\ aNext < N
    /\ aNext' = aNext + 1
    /\ aPending' = aPending \cup {aNext}
    /\ UNCHANGED <<aGaveUp, aExpired, aFirstW, bVars, net, losses, dups, crashesB>>

\* One delivery attempt for e: reads the watermark and sends (e, w). With
\* LATE_ATTEMPTS, also for a sent entry no longer pending (a task that has not yet
\* noticed the answer or the give-up). Every attempt reads the watermark again;
\* under BUG_RETRY_OLD_WATERMARK a retry resends the first attempt's watermark.
AttemptW(e) ==
    IF BUG_RETRY_OLD_WATERMARK /\ aFirstW[e] # NoW THEN aFirstW[e] ELSE Watermark

Attempt(e) ==
    /\ e \in aPending \/ (LATE_ATTEMPTS /\ e < aNext)
    /\ e \notin aExpired
    /\ Cardinality({m \in net : m.type = "entry" /\ m.e = e}) < MAX_IN_FLIGHT
    /\ net' = net \cup {[type |-> "entry", e |-> e, w |-> AttemptW(e)]}
    /\ aFirstW' = IF BUG_RETRY_OLD_WATERMARK /\ aFirstW[e] = NoW
                  THEN [aFirstW EXCEPT ![e] = Watermark] ELSE aFirstW
    /\ UNCHANGED <<aNext, aPending, aGaveUp, aExpired, bVars, losses, dups, crashesB>>

\* The deadline of e passed: A gives it up (attempts may still be in flight).
GiveUp(e) ==
    /\ e \in aPending
    /\ aPending' = aPending \ {e}
    /\ aGaveUp' = aGaveUp \cup {e}
    /\ UNCHANGED <<aNext, aExpired, aFirstW, bVars, net, losses, dups, crashesB>>

\* B's acceptance rule (each bug replaces it by one plausible mistake).
Accepts(e, w) ==
    IF BUG_NO_ORDER_CHECK THEN TRUE
    ELSE IF BUG_NO_WATERMARK THEN e = bExpected
    ELSE IF BUG_WATERMARK_ANY THEN e = bExpected \/ (e >= w /\ e > bExpected)
    ELSE IF BUG_WATERMARK_BELOW_EXPECTED THEN e = bExpected \/ e = w
    ELSE e = bExpected \/ (e = w /\ e > bExpected)

\* The newest SKIPPED_RANGES_MAX ranges of S (all of them with no bound). Gaps come
\* in order, so the newest are the highest.
KeepNewest(S) ==
    IF SKIPPED_RANGES_MAX = 0 \/ Cardinality(S) <= SKIPPED_RANGES_MAX THEN S
    ELSE {r \in S : Cardinality({q \in S : q[1] > r[1]}) < SKIPPED_RANGES_MAX}

\* B's commit of an accepted entry (with the range it jumps over, if any: one range
\* per gap; a gap starts above the entry taken last, so it never touches an earlier
\* range and the code's merge of adjacent ranges never applies). The count bound
\* applies when a range is added, as in the code.
AcceptCommit(e) ==
    /\ bInbox' = Append(bInbox, e)
    /\ bSkipped' = IF e > bExpected THEN KeepNewest(bSkipped \cup {<<bExpected, e>>})
                   ELSE bSkipped
    /\ bJumped' = bJumped \cup {d \in Entries : bExpected <= d /\ d < e}
    /\ bSeen' = bSeen \cup {e}
    /\ bExpected' = e + 1

\* B's answer to an entry below Expected: it was skipped, or else taken before.
Skipped(e) == e \in SkippedNums /\ ~BUG_DEDUPE_WITHOUT_SKIPS

\* B drops skipped range r (the code: when a gap is added, the ranges recorded
\* AGENT_PAIR_SKIPPED_KEPT_MS or longer before; here at any moment, which covers it).
\* The time guard (TIMED), abstracted by what 330 s after the skip implies for each
\* number d of r: A gave d up; no attempt of d is in flight (each was answered, lost,
\* or abandoned after its 30 s wait); and d is past its deadline at every delivery
\* task of it (at most 300 s after its send, before the skip), so none attempts it
\* again: aExpired, which Attempt respects. The code's tasks stop at their deadline,
\* before the prune; a run where a task stops before the prune is one where it makes
\* no more attempts, which the model has too. BUG_PRUNE_EARLY: no guard, and A may
\* go on attempting.
PruneSkipped(r) ==
    /\ PRUNE
    /\ r \in bSkipped
    /\ BUG_PRUNE_EARLY \/
           \A d \in RangeNums(r) :
               /\ d \in aGaveUp
               /\ ~\E m \in net : m.type = "entry" /\ m.e = d
    /\ bSkipped' = bSkipped \ {r}
    /\ aExpired' = IF TIMED THEN aExpired \cup RangeNums(r) ELSE aExpired
    /\ UNCHANGED <<aNext, aPending, aGaveUp, aFirstW, bExpected, bJumped, bSeen, bInbox,
                   net, losses, dups, crashesB>>

\* B's answer to (e, w) and its commit (the reply leaves after the commit).
\* OutOfOrder replies are not modelled: A attempts again in any case.
Handle(m, rest) ==
    IF Accepts(m.e, m.w)
    THEN /\ AcceptCommit(m.e)
         /\ net' = rest \cup {[type |-> "Accepted", e |-> m.e]}
    ELSE IF m.e < bExpected
    THEN /\ net' = rest \cup {[type |-> IF Skipped(m.e) THEN "Stale" ELSE "Duplicate",
                                 e |-> m.e]}
         /\ UNCHANGED bVars
    ELSE /\ net' = rest      \* OutOfOrder
         /\ UNCHANGED bVars

\* B's Enqueue of a delivered (e, w).
Receive(m) ==
    /\ m \in net
    /\ m.type = "entry"
    /\ Handle(m, net \ {m})
    /\ UNCHANGED <<aVars, losses, dups, crashesB>>

\* The network delivers a copy of (e, w) and keeps another in flight.
ReceiveCopy(m) ==
    /\ dups < MAX_DUPS
    /\ m \in net
    /\ m.type = "entry"
    /\ Handle(m, net)
    /\ dups' = dups + 1
    /\ UNCHANGED <<aVars, losses, crashesB>>

\* B crashes after committing an accepted entry, before its reply left (a crash
\* at any other moment loses nothing: B keeps no other memory here).
ReceiveThenCrash(m) ==
    /\ crashesB < MAX_CRASHES_B
    /\ m \in net
    /\ m.type = "entry"
    /\ Accepts(m.e, m.w)
    /\ AcceptCommit(m.e)
    /\ net' = net \ {m}
    /\ crashesB' = crashesB + 1
    /\ UNCHANGED <<aVars, losses, dups>>

\* A handles a reply for e: Accepted/Duplicate (delivered) or Stale (skipped by B:
\* given up) remove e from Pending and its outbox entry in one commit; a reply for
\* an entry no longer pending changes nothing.
HandleReply(m) ==
    /\ m \in net
    /\ m.type \in {"Accepted", "Duplicate", "Stale"}
    /\ net' = net \ {m}
    /\ aPending' = aPending \ {m.e}
    /\ UNCHANGED <<aNext, aGaveUp, aExpired, aFirstW, bVars, losses, dups, crashesB>>

Lose(m) ==
    /\ m \in net
    /\ losses < MAX_LOSSES
    /\ net' = net \ {m}
    /\ losses' = losses + 1
    /\ UNCHANGED <<aVars, bVars, dups, crashesB>>

\* Everything sent and settled, nothing in flight: the run may stop here.
Finished ==
    /\ aNext = N /\ aPending = {} /\ net = {}
    /\ UNCHANGED vars

Next ==
    \/ Finished
    \/ Send
    \/ \E e \in Entries : Attempt(e) \/ GiveUp(e)
    \/ \E r \in bSkipped : PruneSkipped(r)
    \/ \E m \in net : Receive(m) \/ ReceiveCopy(m) \/ ReceiveThenCrash(m) \/ HandleReply(m)
                      \/ Lose(m)

\* Attempts are repeated (resume after a crash restarts them), the network delivers
\* what it does not lose, B answers, A handles answers: weakly fair. Sending,
\* giving up, pruning, losses, duplicates and crashes are not.
Fairness ==
    /\ \A e \in Entries : WF_vars(e \in aPending /\ Attempt(e))
    /\ \A m \in EntryMsg : WF_vars(Receive(m))
    /\ \A m \in ReplyMsg : WF_vars(HandleReply(m))

Spec == Init /\ [][Next]_vars /\ Fairness

-----------------------------------------------------------------------------

TypeOK ==
    /\ aNext \in 0 .. N
    /\ aPending \subseteq Entries /\ aGaveUp \subseteq Entries /\ aExpired \subseteq aGaveUp
    /\ aFirstW \in [Entries -> 0 .. NoW]
    /\ bExpected \in 0 .. N
    /\ bSkipped \subseteq (0 .. N) \X (0 .. N) /\ bJumped \subseteq Entries
    /\ bSeen \subseteq Entries
    /\ bInbox \in Seq(Entries)
    /\ net \subseteq Msg
    /\ losses \in 0 .. MAX_LOSSES /\ dups \in 0 .. MAX_DUPS /\ crashesB \in 0 .. MAX_CRASHES_B

\* Why B needs no mark per entry: every number below Expected was taken (appended)
\* or skipped, never both; and B keeps as skipped only numbers it skipped (without
\* pruning it keeps all of them: SkippedNums = bJumped).
TakenOrSkipped ==
    /\ \A d \in Entries : d < bExpected <=> (d \in bSeen \/ d \in bJumped)
    /\ bSeen \cap bJumped = {}
    /\ SkippedNums \subseteq bJumped

\* A number B skipped is never taken afterwards (however late an attempt of it comes,
\* and whether its range is still kept or was pruned). Part of TakenOrSkipped, named.
SkippedNeverTaken == bSeen \cap bJumped = {}

\* B answers Duplicate only about an entry it appended: A takes Duplicate as
\* delivered, so a Duplicate for an entry never appended would lose it silently.
DuplicateOnlyForTaken ==
    \A m \in net : m.type = "Duplicate" => m.e \in bSeen

\* What is left of it when ranges may be pruned early (BUG_PRUNE_EARLY, or the
\* count bound): a Duplicate for an entry never appended concerns only a number B
\* skipped, whose range it no longer keeps, and that A had given up. A no longer
\* holds it pending (a given-up entry never is again), so taking it as delivered
\* changes nothing at A: in the code the outbox entry is gone, only the delivery's
\* MessageSent event is wrong.
DuplicateOnlyForTakenOrPruned ==
    \A m \in net : m.type = "Duplicate" =>
        \/ m.e \in bSeen
        \/ m.e \in bJumped /\ m.e \notin SkippedNums /\ m.e \in aGaveUp /\ m.e \notin aPending

\* Entries from A are appended at B in the order A sent them.
InOrderPerPair ==
    \A i, j \in 1 .. Len(bInbox) : i < j => bInbox[i] < bInbox[j]

\* No entry is appended twice.
NoDuplicateAppend ==
    \A i, j \in 1 .. Len(bInbox) : i # j => bInbox[i] # bInbox[j]

\* An entry B skipped (never appended, and below the next number B expects, so it
\* will never be appended) is one A had given up at its deadline: B never skips an
\* entry A still delivers. (Checked in every state, so "had given up" holds at the
\* moment of the skip: aGaveUp is a history and B's Expected only grows.)
NoPendingEntrySkipped ==
    \A d \in Entries : (d < bExpected /\ d \notin bSeen) => d \in aGaveUp

\* B answers Stale only about an entry A had already given up at its deadline: a
\* Stale reply never arrives for an entry A still holds pending.
StaleOnlyForGivenUp ==
    \A m \in net : m.type = "Stale" => m.e \in aGaveUp

\* Reachability witness (expected to FAIL with PRUNE): B drops a skipped range under
\* the time guard, so the safe pruning configs are not vacuous.
NothingPruned == SkippedNums = bJumped

\* Reachability witness (expected to FAIL): B may append an entry A has given up
\* (an attempt sent before the give-up arrives later). A give-up means "outcome
\* unknown", not "not delivered".
NoAcceptAfterGiveUp == bSeen \cap aGaveUp = {}

\* Every sent entry eventually leaves Pending (answered, or given up).
EveryPendingEntryEnds == \A e \in Entries : (e \in aPending) ~> (e \notin aPending)

\* Stronger: every sent entry is eventually appended at B or given up at its deadline.
EveryEntryDeliveredOrGivenUp ==
    \A e \in Entries : (e < aNext) ~> (e \in bSeen \/ e \in aGaveUp)
=============================================================================
