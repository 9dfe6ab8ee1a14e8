------------------------------ MODULE ToldKept ------------------------------
(***************************************************************************)
(* Told messages kept after a fence (Troupe, crates/troupe-runtime,        *)
(* commits 1c1cda0 and 7efdca2).                                           *)
(*                                                                         *)
(* Two runtimes, A and B, share one store and one actor. A runtime starts  *)
(* an activation of the actor when a message for it finds none there; the  *)
(* activation claims the actor in the store (a new fence), and every       *)
(* commit of a turn is made under its fence: the store refuses it once the *)
(* other runtime has claimed the actor since. A refused activation is      *)
(* stale: it closes its mailbox and runs nothing more. The told messages   *)
(* still in its mailbox were accepted (their senders were answered Ok):    *)
(* it gives each back to its dispatcher (Control::KeepTold), which keeps   *)
(* them, at most a mailbox's worth, for this runtime's next activation of  *)
(* the actor but does NOT start one for them. When a new message starts    *)
(* it, the kept messages run first, in the order they were accepted, then  *)
(* the new one; if none comes, each is dropped as expired at its deadline. *)
(*                                                                         *)
(* Only told messages are modelled (a request that meets the fence fails   *)
(* to its caller, who sees it: FenceFound stands for it, at most           *)
(* REQUESTS_FENCED_MAX times; with the keep rule each activation is found  *)
(* stale at most once and there are at most |Tells| activations, so a      *)
(* bound of |Tells| cuts nothing; START_AT_ONCE needs it: there every      *)
(* request that meets the fence can start another claim). One actor, no    *)
(* crashes (a crashed activation's unrun messages start the next one at    *)
(* once, a separate rule), no shutdown (kept messages are then counted     *)
(* lost), no idle deactivation holding messages (the fenced close is the   *)
(* path that holds them here).                                             *)
(*                                                                         *)
(* START_AT_ONCE is the variant that was tried and reverted (6f09540,      *)
(* 16a0ec0): the kept messages start the next activation themselves.       *)
(* Each BUG_* constant removes one guard; buggy configs must fail.         *)
(***************************************************************************)
EXTENDS Naturals, Sequences, FiniteSets, TLC

CONSTANTS
    TellsA,              \* told messages clients send to runtime A (model values)
    TellsB,              \* told messages clients send to runtime B (model values)
    CAPACITY,            \* the actor kind's mailbox capacity, in messages
    REQUESTS_FENCED_MAX, \* bound on requests that meet the fence (FenceFound)
    START_AT_ONCE,       \* the reverted variant: kept messages start an activation
    BUG_KEEP_UNBOUNDED,  \* keep every message given back (no mailbox's-worth bound)
    BUG_KEPT_AFTER_NEW,  \* the next activation runs the new message before the kept ones
    BUG_FENCED_COMMITS,  \* a stale activation commits its queued tells (no fence on them)
    BUG_KEPT_NOT_TAKEN,  \* the next activation copies the kept messages, leaves them kept
    BUG_KEPT_NO_DEADLINE \* kept messages wait for a new message with no deadline

ASSUME /\ CAPACITY \in Nat \ {0}
       /\ REQUESTS_FENCED_MAX \in Nat
       /\ TellsA \cap TellsB = {}
       /\ \A b \in {START_AT_ONCE, BUG_KEEP_UNBOUNDED, BUG_KEPT_AFTER_NEW,
                    BUG_FENCED_COMMITS, BUG_KEPT_NOT_TAKEN, BUG_KEPT_NO_DEADLINE} :
                  b \in BOOLEAN

\* dispatcher.rs CARRIED_OVER_MAX_MAILBOXES: a next activation opens with at most this
\* many mailboxes' worth (the stale one's kept messages, then those held meanwhile).
CARRIED_OVER_MAX_MAILBOXES == 2

Runtimes == {"A", "B"}
Tells == TellsA \cup TellsB
Target(t) == IF t \in TellsA THEN "A" ELSE "B"

VARIABLES
    claim,      \* the store: the epoch of the latest claim of the actor (0: never claimed)
    gen,        \* runtime -> epoch its activation claimed (0: no activation)
    act,        \* runtime -> "none", "open" or "closed" (found stale, mailbox closed)
    mbox,       \* runtime -> Seq of tells in its activation's mailbox, oldest first
    held,       \* runtime -> Seq of tells held while its closed activation ends (Waiting::held)
    wkept,      \* runtime -> Seq of tells its closed activation gave back (Waiting::kept)
    kept,       \* runtime -> Seq of tells kept with no activation (Dispatcher::kept)
    unsent,     \* tells not sent yet
    order,      \* tell -> its acceptance number (0: not accepted)
    accepts,    \* tells accepted so far (the last acceptance number)
    needed,     \* accepted tells that found their runtime with no open activation
    commits,    \* history: Seq of [tell, rt, gen, epoch], epoch = the claim at commit
    failed,     \* tells whose own turn met the fence (the turn fails, rolled back)
    expired,    \* kept tells dropped at their deadline (expired_dropped)
    lost,       \* tells refused past the bound (told_lost)
    refused,    \* tells refused Busy when sent (never accepted, the sender told)
    wasKept,    \* history: tells ever kept after a fence
    requestsFenced  \* requests that met the fence so far (FenceFound)

vars == <<claim, gen, act, mbox, held, wkept, kept, unsent, order, accepts, needed,
          commits, failed, expired, lost, refused, wasKept, requestsFenced>>

Init ==
    /\ claim = 0
    /\ gen = [r \in Runtimes |-> 0]
    /\ act = [r \in Runtimes |-> "none"]
    /\ mbox = [r \in Runtimes |-> <<>>]
    /\ held = [r \in Runtimes |-> <<>>]
    /\ wkept = [r \in Runtimes |-> <<>>]
    /\ kept = [r \in Runtimes |-> <<>>]
    /\ unsent = Tells
    /\ order = [t \in Tells |-> 0]
    /\ accepts = 0
    /\ needed = 0
    /\ commits = <<>>
    /\ failed = {}
    /\ expired = {}
    /\ lost = {}
    /\ refused = {}
    /\ wasKept = {}
    /\ requestsFenced = 0

Range(s) == {s[i] : i \in 1..Len(s)}
\* s without its element at index i
RemoveAt(s, i) == SubSeq(s, 1, i - 1) \o SubSeq(s, i + 1, Len(s))
\* What a next activation opens with: the kept messages, then the new ones.
OpenWith(keptTells, newTells) ==
    IF BUG_KEPT_AFTER_NEW THEN newTells \o keptTells ELSE keptTells \o newTells
Commit(t, r) == Append(commits, [tell |-> t, rt |-> r, gen |-> gen[r], epoch |-> claim])

-----------------------------------------------------------------------------
(* Clients *)

\* A client tells runtime Target(t). The dispatcher (dispatcher.rs route, 347):
\* - no activation: start one (its task claims the actor: activation.rs 553), which
\*   opens with the kept messages first, then this one (dispatcher.rs 382-404,
\*   after_kept 862);
\* - an open activation: into its mailbox, or refused Busy if full (deliver, 438);
\* - a closed one: held for the next activation, or Busy past a mailbox's worth
\*   (deliver, 453-457).
Send(t) ==
    LET r == Target(t) IN
    /\ t \in unsent
    /\ unsent' = unsent \ {t}
    /\ \/ /\ act[r] = "none"
          /\ claim' = claim + 1
          /\ gen' = [gen EXCEPT ![r] = claim + 1]
          /\ act' = [act EXCEPT ![r] = "open"]
          /\ mbox' = [mbox EXCEPT ![r] = OpenWith(kept[r], <<t>>)]
          /\ kept' = IF BUG_KEPT_NOT_TAKEN THEN kept ELSE [kept EXCEPT ![r] = <<>>]
          /\ order' = [order EXCEPT ![t] = accepts + 1]
          /\ accepts' = accepts + 1
          /\ needed' = needed + 1
          /\ UNCHANGED <<held, refused>>
       \/ /\ act[r] = "open" /\ Len(mbox[r]) < CAPACITY
          /\ mbox' = [mbox EXCEPT ![r] = Append(@, t)]
          /\ order' = [order EXCEPT ![t] = accepts + 1]
          /\ accepts' = accepts + 1
          /\ UNCHANGED <<claim, gen, act, held, kept, needed, refused>>
       \/ /\ act[r] = "closed" /\ Len(held[r]) < CAPACITY
          /\ held' = [held EXCEPT ![r] = Append(@, t)]
          /\ order' = [order EXCEPT ![t] = accepts + 1]
          /\ accepts' = accepts + 1
          /\ needed' = needed + 1
          /\ UNCHANGED <<claim, gen, act, mbox, kept, refused>>
       \/ /\ \/ act[r] = "open" /\ Len(mbox[r]) >= CAPACITY
             \/ act[r] = "closed" /\ Len(held[r]) >= CAPACITY
          /\ refused' = refused \cup {t}
          /\ UNCHANGED <<claim, gen, act, mbox, held, kept, order, accepts, needed>>
    /\ UNCHANGED <<wkept, commits, failed, expired, lost, wasKept, requestsFenced>>

-----------------------------------------------------------------------------
(* Runtime *)

\* A turn of the oldest tell in an open activation's mailbox, committed under its
\* fence (activation.rs store_commit, 1492). Refused (another claim since): the turn
\* fails (fail, 1305), the activation is stale and closes its mailbox
\* (store_commit_failed 1585, StoreCommit::run 1337, close_fenced 1359).
Run(r) ==
    /\ act[r] = "open" /\ mbox[r] # <<>>
    /\ LET t == Head(mbox[r]) IN
       /\ mbox' = [mbox EXCEPT ![r] = Tail(@)]
       /\ IF gen[r] = claim
            THEN /\ commits' = Commit(t, r)
                 /\ UNCHANGED <<act, failed>>
            ELSE /\ failed' = failed \cup {t}
                 /\ act' = [act EXCEPT ![r] = "closed"]
                 /\ UNCHANGED commits
    /\ UNCHANGED <<claim, gen, held, wkept, kept, unsent, order, accepts, needed,
                   expired, lost, refused, wasKept, requestsFenced>>

\* The activation meets the refusal without a tell's turn: a request's turn whose
\* commit or check_fence is refused (activation.rs close_if_fence_refused, 1204/1383),
\* the request failing to its caller. The tells queued stay in the closed mailbox.
FenceFound(r) ==
    /\ act[r] = "open" /\ gen[r] # claim
    /\ requestsFenced < REQUESTS_FENCED_MAX
    /\ requestsFenced' = requestsFenced + 1
    /\ act' = [act EXCEPT ![r] = "closed"]
    /\ UNCHANGED <<claim, gen, mbox, held, wkept, kept, unsent, order, accepts, needed,
                   commits, failed, expired, lost, refused, wasKept>>

\* The closed activation takes its next message: a stale one runs nothing
\* (activation.rs begin, 778-789), a tell goes back to the dispatcher (stale_message,
\* 1420-1431: Control::KeepTold), which keeps it while under a mailbox's worth and
\* refuses the rest, told_lost (dispatcher.rs on_control KeepTold, 521-540).
Drain(r) ==
    /\ act[r] = "closed" /\ mbox[r] # <<>>
    /\ LET t == Head(mbox[r]) IN
       /\ mbox' = [mbox EXCEPT ![r] = Tail(@)]
       /\ IF BUG_FENCED_COMMITS
            THEN /\ commits' = Commit(t, r)
                 /\ UNCHANGED <<wkept, lost, wasKept>>
            ELSE IF Len(wkept[r]) < CAPACITY \/ BUG_KEEP_UNBOUNDED
              THEN /\ wkept' = [wkept EXCEPT ![r] = Append(@, t)]
                   /\ wasKept' = wasKept \cup {t}
                   /\ UNCHANGED <<commits, lost>>
              ELSE /\ lost' = lost \cup {t}
                   /\ UNCHANGED <<commits, wkept, wasKept>>
    /\ UNCHANGED <<claim, gen, act, held, kept, unsent, order, accepts, needed,
                   failed, expired, refused, requestsFenced>>

\* The closed activation's task ends (Control::Deactivated: dispatcher.rs finish, 591).
\* - Messages held meanwhile: they start the next activation (a new claim), the kept
\*   ones first (after_kept, 683).
\* - None: the kept messages start nothing; the dispatcher keeps them (keep, 633-637
\*   and 760, at most a mailbox's worth: 777). START_AT_ONCE: they start the
\*   next activation themselves (the reverted 6f09540).
Finish(r) ==
    /\ act[r] = "closed" /\ mbox[r] = <<>>
    /\ wkept' = [wkept EXCEPT ![r] = <<>>]
    /\ held' = [held EXCEPT ![r] = <<>>]
    /\ IF held[r] # <<>> \/ (START_AT_ONCE /\ wkept[r] # <<>>)
         THEN /\ claim' = claim + 1
              /\ gen' = [gen EXCEPT ![r] = claim + 1]
              /\ act' = [act EXCEPT ![r] = "open"]
              /\ mbox' = [mbox EXCEPT ![r] = OpenWith(wkept[r], held[r])]
              /\ UNCHANGED <<kept, lost>>
         ELSE LET all == kept[r] \o wkept[r]
                  bound == IF BUG_KEEP_UNBOUNDED THEN Len(all) ELSE CAPACITY
              IN /\ gen' = [gen EXCEPT ![r] = 0]
                 /\ act' = [act EXCEPT ![r] = "none"]
                 /\ kept' = [kept EXCEPT ![r] =
                               IF Len(all) > bound THEN SubSeq(all, 1, bound) ELSE all]
                 /\ lost' = IF Len(all) > bound
                              THEN lost \cup Range(SubSeq(all, bound + 1, Len(all)))
                              ELSE lost
                 /\ UNCHANGED <<claim, mbox>>
    /\ UNCHANGED <<unsent, order, accepts, needed, commits, failed, expired, refused,
                   wasKept, requestsFenced>>

\* An open activation with an empty mailbox goes idle and ends (nothing to commit).
Deactivate(r) ==
    /\ act[r] = "open" /\ mbox[r] = <<>>
    /\ gen' = [gen EXCEPT ![r] = 0]
    /\ act' = [act EXCEPT ![r] = "none"]
    /\ UNCHANGED <<claim, mbox, held, wkept, kept, unsent, order, accepts, needed,
                   commits, failed, expired, lost, refused, wasKept, requestsFenced>>

\* A kept tell's deadline (at most TOLD_KEPT_MS_MAX after it was given back) comes
\* before a new message: dropped as expired (dispatcher.rs kept_expired 839,
\* drop_expired). Deadlines differ per tell, so any of them may go first.
Expire(r, i) ==
    /\ ~BUG_KEPT_NO_DEADLINE
    /\ i \in 1..Len(kept[r])
    /\ expired' = expired \cup {kept[r][i]}
    /\ kept' = [kept EXCEPT ![r] = RemoveAt(@, i)]
    /\ UNCHANGED <<claim, gen, act, mbox, held, wkept, unsent, order, accepts, needed,
                   commits, failed, lost, refused, wasKept, requestsFenced>>

-----------------------------------------------------------------------------
Done ==
    /\ unsent = {}
    /\ \A r \in Runtimes : act[r] = "none" /\ kept[r] = <<>>

\* Everything settled: stuttering is allowed (and only then).
Terminated == Done /\ UNCHANGED vars

RuntimeStep ==
    \E r \in Runtimes :
        \/ Run(r) \/ FenceFound(r) \/ Drain(r) \/ Finish(r) \/ Deactivate(r)
        \/ \E i \in 1..Len(kept[r]) : Expire(r, i)

Next ==
    \/ \E t \in Tells : Send(t)
    \/ RuntimeStep
    \/ Terminated

\* The runtimes keep running and deadlines come; clients need not send.
Spec == Init /\ [][Next]_vars /\ WF_vars(RuntimeStep)

-----------------------------------------------------------------------------
(* Safety *)

Entry == [tell : Tells, rt : Runtimes, gen : Nat, epoch : Nat]

TypeOK ==
    /\ claim \in Nat
    /\ gen \in [Runtimes -> Nat]
    /\ act \in [Runtimes -> {"none", "open", "closed"}]
    /\ \A r \in Runtimes : \A s \in {mbox[r], held[r], wkept[r], kept[r]} :
          s \in Seq(Tells)
    /\ unsent \subseteq Tells
    /\ order \in [Tells -> Nat]
    /\ accepts \in Nat /\ needed \in Nat
    /\ commits \in Seq(Entry)
    /\ failed \subseteq Tells /\ expired \subseteq Tells /\ lost \subseteq Tells
    /\ refused \subseteq Tells /\ wasKept \subseteq Tells
    /\ requestsFenced \in 0..REQUESTS_FENCED_MAX

Committed == {commits[i].tell : i \in 1..Len(commits)}

(* An acknowledged (accepted) tell commits at most once. *)
AcceptedTellRunsAtMostOnce ==
    \A i, j \in 1..Len(commits) : i # j => commits[i].tell # commits[j].tell

(* No commit is made by a stale activation: every commit is under the latest claim. *)
NoCommitInAStaleActivation ==
    \A i \in 1..Len(commits) : commits[i].gen = commits[i].epoch

(* Within one runtime, tells commit in the order it accepted them: so the kept ones  *)
(* (accepted before the stale activation closed) run before the new message that     *)
(* starts the next activation, and in their own order. Not across runtimes.          *)
InAcceptanceOrderPerRuntime ==
    \A i, j \in 1..Len(commits) :
        (i < j /\ commits[i].rt = commits[j].rt) =>
            order[commits[i].tell] < order[commits[j].tell]

(* At most a mailbox's worth kept per actor, and a next activation opens with at most *)
(* CARRIED_OVER_MAX_MAILBOXES mailboxes' worth (Mailbox::open asserts it).            *)
KeptWithinAMailbox ==
    \A r \in Runtimes : Len(wkept[r]) <= CAPACITY /\ Len(kept[r]) <= CAPACITY

MailboxWithinCarriedOverMax ==
    \A r \in Runtimes : Len(mbox[r]) <= CARRIED_OVER_MAX_MAILBOXES * CAPACITY

(* Nothing accepted is lost without a word: every accepted tell is in exactly one    *)
(* place: a mailbox, held, kept, committed, failed at the fence, expired or lost.    *)
Occurrences(t) ==
    LET InSeq(s) == Cardinality({i \in 1..Len(s) : s[i] = t})
        InSet(S) == IF t \in S THEN 1 ELSE 0
    IN Cardinality({i \in 1..Len(commits) : commits[i].tell = t})
       + InSet(failed) + InSet(expired) + InSet(lost)
       + InSeq(mbox["A"]) + InSeq(mbox["B"]) + InSeq(held["A"]) + InSeq(held["B"])
       + InSeq(wkept["A"]) + InSeq(wkept["B"]) + InSeq(kept["A"]) + InSeq(kept["B"])

EveryAcceptedTellAccountedFor ==
    \A t \in Tells :
        /\ (order[t] > 0) => Occurrences(t) = 1
        /\ (order[t] = 0) => Occurrences(t) = 0

(* The reason the rule was chosen (the ping-pong of 6f09540). Every claim is paid    *)
(* for by an accepted tell that found its runtime with no open activation (a new     *)
(* message, started or held): kept messages add no claim, so a runtime fences the    *)
(* other back only as often as new messages reach it. START_AT_ONCE breaks it: the   *)
(* fenced runtime claims back with no new message, fencing the other, whose queued   *)
(* tells do the same.                                                                *)
ClaimsOnlyForNewMessages == claim <= needed

(* Liveness: every accepted tell settles: committed, failed at the fence, expired,    *)
(* or lost (told_lost). None waits forever.                                           *)
Settled == Committed \cup failed \cup expired \cup lost
EveryAcceptedTellSettles == \A t \in Tells : [](order[t] > 0 => <>(t \in Settled))

(* Reachability witnesses, not properties: a config that lists one must FAIL,         *)
(* showing the safe configs reach that path.                                          *)
KeptTellNeverCommits == \A i \in 1..Len(commits) : commits[i].tell \notin wasKept
NothingLostPastTheBound == lost = {}

Symmetry == Permutations(TellsA) \cup Permutations(TellsB)
=============================================================================
