#!/usr/bin/env python3
"""Mutation runs: plant one bug at a time in the *production* code of a scratch git
worktree (never in the real checkout) and check that the DST suite catches it.

Each mutant is an exact text replacement in one file (the script stops if the text is
gone, so a mutant can never silently become a no-op), the scenarios expected to catch
it, and the invariant expected in the failure. Usage (from the repository root):

    python3 crates/troupe-sim/mutants/mutants.py [--seeds N] [NAME ...]

It creates (or reuses) the worktree /tmp/troupe-mutants at HEAD, applies each mutant in
turn, runs `bash scripts/dst --seeds N --scenario ...` there with its own target dir,
and requires the run to FAIL, printing the first violation line. The worktree is
reset after each mutant. Exit status 1 if any mutant survives.
"""
import argparse
import os
import re
import subprocess
import sys

MUTANTS = [
    {
        "name": "second-activation",
        "invariant": "SingleActivation",
        "file": "crates/troupe-runtime/src/dispatcher.rs",
        "old": "        let refused = match self.table.get_mut(&target) {",
        "new": "        if self.table.get(&target).is_some_and(|a| !a.open) { self.table.remove(&target); } // MUTANT\n"
               "        let refused = match self.table.get_mut(&target) {",
        "scenarios": ["dst_single_activation::", "dst_random_workload::random_workload_without_faults"],
    },
    {
        "name": "skip-depth-check",
        "invariant": "DepthBounded",
        "file": "crates/troupe-core/src/admission.rs",
        "edits": [
            ("    if context.depth() >= AGENT_CALL_DEPTH_MAX {", "    if false && context.depth() >= AGENT_CALL_DEPTH_MAX { // MUTANT"),
            ("    assert!(child.depth() <= AGENT_CALL_DEPTH_MAX);\n", "    // MUTANT: depth assertion removed\n"),
        ],
        "scenarios": ["dst_depth_limit::chains_across_nodes"],
    },
    {
        "name": "skip-chain-check",
        "invariant": "NoCycleInCallChain",
        "file": "crates/troupe-core/src/admission.rs",
        "old": "    if target == caller || context.contains(target) {",
        "new": "    if target == caller { // MUTANT: chain not checked",
        "scenarios": ["dst_cycle_detection::chains_that_revisit"],
    },
    {
        "name": "deadline-grows",
        "invariant": "DeadlineMonotone",
        "edits_by_file": {
            "crates/troupe-core/src/call_context.rs": [
                ("            deadline: self.deadline.min(deadline),", "            deadline, // MUTANT: not clipped to the parent"),
                ('        assert!(child.deadline <= self.deadline, "a child deadline grew: {child:?} > {self:?}");\n', "        // MUTANT: assertion removed\n"),
            ],
            "crates/troupe-core/src/admission.rs": [
                ('    assert!(timeout <= capped, "timeout {timeout:?} exceeds the cap {capped:?}");\n', "    // MUTANT: assertion removed\n"),
                ("    assert!(child.deadline() <= context.deadline());\n", "    // MUTANT: assertion removed\n"),
            ],
            "crates/troupe-runtime/src/turn.rs": [
                ('        assert!(child.deadline() <= self.deadline(), "a child deadline outlives its parent turn");\n', "        // MUTANT: assertion removed\n"),
            ],
        },
        "scenarios": ["dst_random_workload::random_workload_without_faults"],
    },
    {
        "name": "turn-ignores-deadline",
        "invariant": "EveryCallResolves",
        "file": "crates/troupe-runtime/src/activation.rs",
        "old": "    let outcome = shared.clock.run_until(deadline, live.actor.handle(&mut turn, payload)).await;",
        "new": "    let outcome: Result<_, tokio::time::error::Elapsed> = Ok(live.actor.handle(&mut turn, payload).await); // MUTANT",
        "scenarios": ["dst_timeout_under_delay::calls_to_slow_callees"],
    },
    {
        "name": "ack-despite-failed-commit",
        "invariant": "NoAckedStateLost",
        "file": "crates/troupe-runtime/src/activation.rs",
        "old": "        Ok(Ok(answer)) => commit(live, shared.store.as_ref(), turn).await.map(|()| answer),",
        "new": "        Ok(Ok(answer)) => { let _ = commit(live, shared.store.as_ref(), turn).await; Ok(answer) } // MUTANT",
        "scenarios": ["dst_random_workload::random_workload_with_every_fault"],
    },
    {
        "name": "partial-commit-on-failure",
        "invariant": "TurnWritesAtomic",
        "file": "crates/troupe-runtime/src/memory_store.rs",
        "old": '        self.faults.take(&self.faults.inner.fail_commits, "commit")?;',
        "new": "        { let partial = TurnCommit { state: None, writes: commit.writes.clone() }; let mut disk = self.lock(); "
               "disk.visible.apply(actor, &partial); disk.durable.apply(actor, &partial); } // MUTANT\n"
               '        self.faults.take(&self.faults.inner.fail_commits, "commit")?;',
        "scenarios": ["dst_crash::storage_failures"],
    },
    {
        "name": "wait-for-graph-off",
        "invariant": "WaitForGraphAcyclic",
        "file": "crates/troupe-runtime/src/wait_for_graph.rs",
        "old": "        if let Some(path) = self.path(target, caller) {",
        "new": "        if let Some(path) = self.path(target, caller).filter(|_| false) { // MUTANT",
        "scenarios": ["dst_cycle_detection::crossing_calls"],
    },
]

WORKTREE = "/tmp/troupe-mutants"


def run(command, cwd, env=None, check=True):
    result = subprocess.run(command, cwd=cwd, env=env, text=True, capture_output=True)
    if check and result.returncode != 0:
        sys.exit(f"{' '.join(command)} failed:\n{result.stdout}\n{result.stderr}")
    return result


def edits_of(mutant):
    if "edits_by_file" in mutant:
        return mutant["edits_by_file"]
    if "edits" in mutant:
        return {mutant["file"]: mutant["edits"]}
    return {mutant["file"]: [(mutant["old"], mutant["new"])]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=100)
    parser.add_argument("names", nargs="*")
    args = parser.parse_args()
    root = run(["git", "rev-parse", "--show-toplevel"], cwd=".").stdout.strip()
    head = run(["git", "rev-parse", "HEAD"], cwd=root).stdout.strip()
    if not os.path.isdir(WORKTREE):
        run(["git", "worktree", "add", "--detach", WORKTREE, head], cwd=root)
    run(["git", "checkout", "--detach", "--force", head], cwd=WORKTREE)
    env = dict(os.environ, CARGO_TARGET_DIR=os.path.join(root, "target", "madsim-mutants"))
    survivors = []
    for mutant in MUTANTS:
        if args.names and mutant["name"] not in args.names:
            continue
        run(["git", "checkout", "--force", head, "--", "."], cwd=WORKTREE)
        for path, edits in edits_of(mutant).items():
            full = os.path.join(WORKTREE, path)
            text = open(full).read()
            for old, new in edits:
                if text.count(old) != 1:
                    sys.exit(f"mutant {mutant['name']}: the text to mutate is not found exactly once in {path}:\n{old}")
                text = text.replace(old, new)
            open(full, "w").write(text)
        command = ["bash", "scripts/dst", "--seeds", str(args.seeds), "--max-failures", "1"]
        for scenario in mutant["scenarios"]:
            command += ["--scenario", scenario]
        result = run(command, cwd=WORKTREE, env=env, check=False)
        output = result.stdout + result.stderr
        broken = "the build failed" in output
        caught = result.returncode != 0 and not broken
        violation = next((line.strip() for line in output.splitlines() if mutant["invariant"] in line and "violated" in line), None)
        first = next((line.strip() for line in output.splitlines() if "seed" in line and ("violated" in line or "panicked" in line)), None)
        verdict = "BROKEN" if broken else "CAUGHT" if caught else "SURVIVED"
        print(f"mutant {mutant['name']:<28} {verdict:<9} expected {mutant['invariant']}")
        print(f"    {violation or first or '(no failure line)'}"[:400])
        replay = next((line.strip() for line in output.splitlines() if line.strip().startswith("replay:")), None)
        if replay:
            print(f"    {replay}")
        if not caught:
            survivors.append(mutant["name"])
            if broken:
                errors = [line for line in output.splitlines() if line.startswith("error")]
                print("    " + "\n    ".join(errors[:5]))
        sys.stdout.flush()
    run(["git", "checkout", "--force", head, "--", "."], cwd=WORKTREE)
    if survivors:
        print(f"survived or broken: {', '.join(survivors)}")
        sys.exit(1)
    print("every mutant was caught")


if __name__ == "__main__":
    main()
