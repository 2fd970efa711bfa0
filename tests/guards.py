"""Delete each safety guard once, in a scratch copy, and check that a named
test fails: a guard that no test misses is a guard nobody would notice losing.

Run with ``make test-guards``. Exits 1 when any guard goes unnoticed.
``python -m tests.guards WORDS...`` checks only the guards whose name holds
one of the words.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE_ROOTS = (
    "core",
    "cli",
    "sdk",
    "services/engine",
    "services/journal",
    "services/inputs",
    "services/gateway",
)


@dataclass(frozen=True)
class Guard:
    name: str
    file: str
    guard: str
    removed: str
    how: str
    tests: tuple[str, ...]


GUARDS = (
    Guard(
        name="a task goes to its owner's poll before another replica's",
        file="core/dagnats/core/partitions.py",
        guard="    return 0 if partition in owned else 1\n",
        removed="    return 0\n",
        how="a task goes to whichever replica's poll waited first: a run's work leaves its owner",
        tests=(
            "tests/test_partitions.py::"
            "test_a_task_goes_to_its_owners_poll_and_to_another_replica_only_when_none_waits",
        ),
    ),
    Guard(
        name="an expired replica's partitions are free for the others to take",
        file="services/engine/dagnats/engine/partition_rules.py",
        guard="        if view.owner(k).replica not in present  # no owner, or one not present\n",
        removed="        if view.owner(k).replica is None\n",
        how="a killed replica keeps its partitions for ever: nobody consumes its runs' work",
        tests=(
            "tests/test_partition_rules.py::test_an_expired_replicas_partitions_are_taken",
            "tests/test_ownership.py::test_replicas_join_split_evenly_and_take_a_killed_ones_share",
        ),
    ),
    Guard(
        name="a fork's copied record names the copies before it, not the source's records",
        file="services/journal/dagnats/journal/fork.py",
        guard="    copy.expected_seq = to(record.expected_seq)\n",
        removed="    copy.expected_seq = record.expected_seq\n",
        how="a forked journal's chain points into the source's sequences; journal check fails",
        tests=("tests/test_fork.py::test_fork_inside_the_unsafe_tools_window",),
    ),
    Guard(
        name="journal check compares a fork's copied prefix with the digest it recorded",
        file="services/journal/dagnats/journal/audit.py",
        guard="    if digests.copied != fork.digest:\n",
        removed="    if False:\n",
        how="a copied prefix altered after the fork passes journal check",
        tests=(
            "tests/test_fork.py::"
            "test_a_fork_stopped_half_way_is_finished_by_its_retry_and_an_altered_copy_is_found",
            "tests/test_fork_rules.py::"
            "test_an_altered_copy_a_forged_fork_record_and_a_wrong_count_are_found",
        ),
    ),
    Guard(
        name="journal check compares a fork's prefix with its source's records",
        file="services/journal/dagnats/journal/audit.py",
        guard="    if digests.source is not None and digests.source != fork.digest:\n",
        removed="    if False:\n",
        how="a fork record forged to match an altered copy passes journal check",
        tests=(
            "tests/test_fork_rules.py::"
            "test_an_altered_copy_a_forged_fork_record_and_a_wrong_count_are_found",
        ),
    ),
    Guard(
        name="a forked step's first dispatch is not taken for an empty journal",
        file="services/engine/dagnats/engine/service.py",
        guard="    return (task.iteration, task.attempt, delivery) == (0, 1, 1) and not again "
        "and not forked\n",
        removed="    return (task.iteration, task.attempt, delivery) == (0, 1, 1) and not again\n",
        how="a fork at iteration 0 claims with the lease on an empty tail; its first record is "
        "fenced, and the step waits a lease for its redelivery",
        tests=("tests/test_fork.py::test_fork_at_a_tool_result",),
    ),
    Guard(
        name="the local socket's file is created its owner's alone",
        file="services/engine/dagnats/engine/local_transport.py",
        guard="    mask = os.umask(0o177)\n",
        removed="    mask = os.umask(0o022)\n",
        how="any user of the host may connect to the local socket",
        tests=(
            "tests/test_local_socket.py::"
            "test_the_socket_file_is_the_owners_and_a_live_one_is_not_taken",
        ),
    ),
    Guard(
        name="the other services read the run now, caught up with its journal",
        file="services/engine/dagnats/engine/runs.py",
        guard="        return None if stored is None else await self.caught_up_stored(stored)\n",
        removed="        return stored\n",
        how="journal check reports missing iterations on a healthy loop; GetRun lags",
        tests=(
            "tests/test_journal_check_live.py::"
            "test_journal_check_polled_through_a_loop_of_fast_turns_finds_nothing",
        ),
    ),
    Guard(
        name="the audit reads the run again after the journal",
        file="services/journal/dagnats/journal/service.py",
        guard="        after = await self._run(run_id) if run.status == epb.RUN_STATUS_RUNNING "
        "else run\n",
        removed="        after = run\n",
        how="journal check reports the commits of iterations made while it read the journal",
        tests=(
            "tests/test_journal_check_live.py::"
            "test_journal_check_polled_through_a_loop_of_fast_turns_finds_nothing",
        ),
    ),
    Guard(
        name="the local socket checks the hello's token for each method",
        file="services/engine/dagnats/engine/local_transport.py",
        guard="                if (refusal := listener.admit(call.method, hello.token)) "
        "is not None:\n",
        removed="                if (refusal := None) is not None:\n",
        how="the local socket lets any connection call the journal, poll or watch",
        tests=(
            "tests/test_local_socket.py::"
            "test_the_socket_takes_a_worker_token_when_the_server_needs_one",
            "tests/test_local_socket.py::test_the_polls_socket_takes_only_a_token_that_may_poll",
            "tests/test_local_socket.py::test_the_watches_socket_takes_only_a_token_that_may_watch",
        ),
    ),
    Guard(
        name="a poll or a watch on the local socket ends with its connection",
        file="services/engine/dagnats/engine/local_transport.py",
        guard="            self._task.cancel()  # as a gRPC stream's end cancels its handler\n",
        removed="            pass\n",
        how="a worker gone from the socket leaves its poll pulling; the task it takes waits",
        tests=(
            "tests/test_engine_polls.py::"
            "test_a_poll_left_on_the_local_socket_does_not_take_the_next_task",
            "tests/test_local_socket.py::"
            "test_a_watch_left_before_its_run_ends_is_cancelled_on_the_server",
        ),
    ),
    Guard(
        name="a lease claims on its guess only when nobody else wrote the run since",
        file="services/engine/dagnats/engine/service.py",
        guard="        known = current is task and self.engine.quiet(task.run_id)\n",
        removed="        known = current is task\n",
        how="a handler starts on the claim of a run another engine ended",
        tests=(
            "tests/test_journal_api.py::"
            "test_a_lease_on_a_guess_another_engine_wrote_over_claims_on_a_read",
        ),
    ),
    Guard(
        name="a dispatch sent again is claimed on a read of its journal",
        file="services/engine/dagnats/engine/service.py",
        guard="    again = record is not None and (record.redispatches > 0 or record.kept_seq > 0)"
        "\n",
        removed="    again = False\n",
        how="the claim of a vanished task's new message takes its journal as empty",
        tests=(
            "tests/test_journal_api.py::"
            "test_a_lease_of_a_dispatch_sent_again_claims_nothing_over_its_records",
        ),
    ),
    Guard(
        name="the local socket refuses a hello for another socket",
        file="services/engine/dagnats/engine/local_transport.py",
        guard="        if hello.instance and hello.instance != listener.instance:\n",
        removed="        if False:\n",
        how="a worker takes another server's socket at the path for its own",
        tests=(
            "tests/test_local_socket.py::"
            "test_another_servers_socket_at_the_path_puts_the_calls_back_on_grpc",
        ),
    ),
    Guard(
        name="a local session copies the request it answers",
        file="services/engine/dagnats/engine/local_transport.py",
        guard="        sent.CopyFrom(request)\n",
        removed="        sent = request\n",
        how="a handler in the services' process shares its request with the servicer",
        tests=(
            "tests/test_handlers_in_services.py::"
            "test_a_local_session_answers_in_order_and_copies_the_request",
        ),
    ),
    Guard(
        name="expected-sequence header",
        file="services/journal/dagnats/journal/store.py",
        guard='            "Nats-Expected-Last-Subject-Sequence": str(token.last_seq),\n',
        removed="",
        how="appends are sent without Nats-Expected-Last-Subject-Sequence",
        tests=("tests/test_journal_store.py::test_writer_with_a_stale_view_is_fenced",),
    ),
    Guard(
        name="writer nonce in the Msg-Id",
        file="services/journal/dagnats/journal/store.py",
        guard='            f".{token.writer}.{token.written}"\n',
        removed='            f".{token.written}"\n',
        how="the Msg-Id is built from the dispatch only, without the writer nonce",
        tests=(
            "tests/test_journal_store.py::test_zombie_reusing_its_successors_identity_is_fenced",
        ),
    ),
    Guard(
        name="a record under our Msg-Id is ours only if it records the same thing",
        file="services/journal/dagnats/journal/store.py",
        guard="        and _body(landed) == _body(record)\n",
        removed='        and landed.WhichOneof("kind") == record.WhichOneof("kind")\n',
        how="any record of the same kind under the writer's Msg-Id passes as its retried write",
        tests=(
            "tests/test_journal_store.py::"
            "test_a_token_sent_again_for_another_record_of_the_same_kind_is_fenced",
        ),
    ),
    Guard(
        name="claim identity (the claim record that fences earlier holders)",
        file="services/journal/dagnats/journal/service.py",
        guard="        stored = await write(token, claim)\n",
        removed="        stored = token, claim  # guard removed: the claim is not written\n",
        how="a claim is not appended, so earlier holders are not fenced",
        tests=(
            "tests/test_journal.py::test_zombie_is_fenced_and_writes_nothing_after_its_successor",
        ),
    ),
    *(
        Guard(
            name=f"a claim stored with the first record: {what}",
            file="services/journal/dagnats/journal/replay.py",
            guard="    return attempt == 1 and delivery == 1 and limit > 1\n",
            removed=f"    return {kept}\n",
            how=how,
            tests=(
                "tests/test_journal_api.py::"
                f"test_a_claim_that_may_fence_or_count_is_stored_at_once[{test}]",
            ),
        )
        for what, kept, how, test in (
            (
                "the first delivery only",
                "attempt == 1 and limit > 1",
                "a redelivery's claim waits for its first record and fences no stalled holder",
                "redelivery",
            ),
            (
                "the first attempt only",
                "delivery == 1 and limit > 1",
                "a retry's claim waits for its first record and fences no earlier attempt",
                "retry",
            ),
            (
                "not one that alone reaches the restart limit",
                "attempt == 1 and delivery == 1",
                "a claim that alone reaches the restart limit is not stored and fails nothing",
                "limit_1",
            ),
        )
    ),
    Guard(
        name="engine acceptance rule",
        file="services/engine/dagnats/engine/rules.py",
        guard=(
            "    if (ident.iteration, ident.attempt) != (step.iteration, step.attempt)"
            " and not committed:\n"
        ),
        removed="    if False:\n",
        how="a report for another dispatch is applied like the current one",
        tests=("tests/test_engine.py::test_duplicate_and_stale_continues_are_dropped",),
    ),
    Guard(
        name="engine acceptance of a journal commit: of the step's iteration",
        file="services/engine/dagnats/engine/rules.py",
        guard="        and ident.iteration == step.iteration\n",
        removed="",
        how="a report carrying a journal commit of any iteration is applied to the current one",
        tests=(
            "tests/test_engine_fencing.py"
            "::test_a_commit_of_an_earlier_iteration_does_not_settle_the_current_one",
        ),
    ),
    Guard(
        name="engine acceptance of a journal commit: one that ends the iteration",
        file="services/engine/dagnats/engine/rules.py",
        guard="        and _ends_iteration(report.outcome)\n",
        removed="",
        how="an earlier attempt's retriable failure or pause is applied to the current attempt",
        tests=(
            "tests/test_rules.py"
            "::test_a_commit_of_an_earlier_attempt_counts_only_when_it_ends_the_iteration",
        ),
    ),
    Guard(
        name="engine report check against the journal",
        file="services/engine/dagnats/engine/service.py",
        guard=(
            "        if not cancelled and await self._contradicted(event):\n"
            "            return pb.ReportResponse(stale=True)\n"
        ),
        removed="",
        how="a report is published whatever commit it names, or none",
        tests=(
            "tests/test_engine_fencing.py"
            "::test_a_fenced_holders_complete_is_refused_and_the_run_ends_with_the_last_commit",
            "tests/test_engine_fencing.py"
            "::test_a_fenced_holders_continue_neither_advances_the_loop_nor_drops_the_commit",
        ),
    ),
    Guard(
        name="engine heartbeat check against the journal's holder",
        file="services/engine/dagnats/engine/service.py",
        guard="        await self._check_holder(lease, releasing=False)\n",
        removed="",
        how="a heartbeat with a fenced holder's lease extends the task's lease",
        tests=(
            "tests/test_engine_fencing.py"
            "::test_a_fenced_holders_heartbeat_is_refused_and_keeps_no_lease_alive",
        ),
    ),
    Guard(
        name="engine check of a task let go or given back against the journal's holder",
        file="services/engine/dagnats/engine/service.py",
        guard='            await self._check_holder(lease, releasing=kind == "acknowledge")\n',
        removed="",
        how="a fenced holder's report acknowledges, or hands back, its successor's task",
        tests=(
            "tests/test_engine_fencing.py::test_a_fenced_holder_cannot_release_its_successors_task",
            "tests/test_engine_fencing.py"
            "::test_a_fenced_holder_cannot_give_back_its_successors_task",
        ),
    ),
    Guard(
        name="restart limit",
        file="services/journal/dagnats/journal/replay.py",
        guard="    return deliveries_without_progress(records) >= limit\n",
        removed="    return False\n",
        how="the restart limit is never reached",
        tests=(
            "tests/test_journal.py::test_restart_limit_fails_the_attempt_and_the_retry_resumes",
        ),
    ),
    Guard(
        name="restart limit: a claim that rode and was never stored counts",
        file="services/journal/dagnats/journal/replay.py",
        guard="    if after is not None and _followed_an_unstored_claim(after):\n",
        removed="    if False:\n",
        how="a first delivery's or a handed-over claim whose holder died before its first"
        " record is not counted: the step fails one delivery later than its limit",
        tests=(
            "tests/test_journal_limits.py::test_the_restart_limit_is_reached_at_the_limits_delivery",
            "tests/test_journal.py::"
            "test_restart_limit_counts_a_first_deliverys_claim_made_with_its_lease",
        ),
    ),
    Guard(
        name="a refusal no retry gets past fails the step for good",
        file="sdk/dagnats/sdk/_worker.py",
        guard="        elif isinstance(err, REFUSALS):\n",
        removed="        elif False:\n",
        how="a record too large, a replay mismatch or an invalid argument fails the attempt"
        " (retriable): every retry is refused the same way",
        tests=(
            "tests/test_refusals.py::test_a_replay_mismatch_fails_the_step_at_once_with_its_message",
        ),
    ),
    Guard(
        name="a failure refused as too large is committed without the state",
        file="sdk/dagnats/sdk/_context.py",
        guard="                    commit = _small_failure(commit)\n",
        removed="",
        how="the failure carries the state that was refused and is refused too: nothing is"
        " committed, and the step waits out its lease and its restart limit",
        tests=(
            "tests/test_refusals.py::test_a_state_too_large_for_the_journal_fails_the_step_at_once",
        ),
    ),
    Guard(
        name="a tool output too large answers its intent and raises",
        file="sdk/dagnats/sdk/_journal.py",
        guard="            await self._locked(finish(stored), then)\n            raise\n"
        "        return result\n",
        removed="            await self._locked(finish(stored), then)\n        return result\n",
        how="the handler goes on as if the tool's error were its result, and the run ends"
        " without saying why",
        tests=(
            "tests/test_refusals.py::"
            "test_a_tool_output_too_large_for_the_journal_fails_the_step_at_once",
        ),
    ),
    Guard(
        name="the bridge fails the step on a record too large",
        file="services/gateway/dagnats/gateway/bridge_ops.py",
        guard="    except RecordTooLarge as err:\n"
        "        raise await _failed_for_good(b, t, err, intent_seq or t.intent_seq) from None\n",
        removed="",
        how="a bridge worker is told 400 and its step waits out leases, failing later"
        " with 'restart limit'",
        tests=(
            "tests/test_refusals.py::test_a_refusal_through_the_bridge_is_a_4xx_and_fails_the_step",
        ),
    ),
    Guard(
        name="replay rule for unsafe tools",
        file="services/journal/dagnats/journal/replay.py",
        guard="    if at.safe and call.safe:\n",
        removed="    if True:\n",
        how="an intent without a result is run again whatever its declaration",
        tests=("tests/test_journal.py::test_crash_after_unsafe_intent_records_interrupted",),
    ),
    Guard(
        name="replay rule for safe tools",
        file="services/journal/dagnats/journal/replay.py",
        guard="    if at.safe and call.safe:\n",
        removed="    if False:\n",
        how="a safe intent without a result is never run again",
        tests=("tests/test_journal.py::test_crash_after_safe_intent_runs_it_again",),
    ),
    Guard(
        name="journal check: every input placed once",
        file="services/journal/dagnats/journal/audit.py",
        guard="        if r.request_id in first:\n",
        removed="        if False:\n",
        how="an input placed twice is not reported",
        tests=("tests/test_audit.py::test_an_input_placed_twice",),
    ),
    Guard(
        name="journal check: the engine's outcome is the last commit",
        file="services/journal/dagnats/journal/audit.py",
        guard="        found.extend(_outcome(records, engine_step))\n",
        removed="        pass\n",
        how="a step whose engine outcome differs from its last commit is not reported",
        tests=(
            "tests/test_engine_fencing.py"
            "::test_journal_check_flags_a_run_whose_outcome_is_not_the_last_commit",
        ),
    ),
    Guard(
        name="reconciler applies a lost event",
        file="services/engine/dagnats/engine/processor.py",
        guard="                if self._unapplied.get(run_id) == last:\n",
        removed="                if False:  # guard removed: lost events wait\n",
        how="an event an engine took and never applied waits out history_ack_wait",
        tests=(
            "tests/test_restarts.py::"
            "test_an_engine_killed_after_taking_a_continue_stalls_the_run_for_a_reconcile_only",
        ),
    ),
    Guard(
        name="honour only an earlier attempt's intents",
        file="services/journal/dagnats/journal/replay.py",
        guard="            and r.attempt < attempt\n            and not r.safe\n",
        removed="            and r.attempt <= attempt\n            and not r.safe\n",
        how="a redelivery of the same attempt honours its own unsafe intents by name and input",
        tests=(
            "tests/test_replay.py::"
            "test_a_redelivery_of_the_same_attempt_honours_none_of_its_own_intents",
        ),
    ),
    Guard(
        name="an honouring intent is not honoured again",
        file="services/journal/dagnats/journal/replay.py",
        guard="            and r.honours_seq == 0\n",
        removed="",
        how="an intent that honoured another (and started nothing) stands for a tool run",
        tests=("tests/test_replay.py::test_an_honouring_intent_is_never_honoured_itself",),
    ),
    Guard(
        name="a claim decided from a guessed tail",
        file="services/journal/dagnats/journal/replay.py",
        guard="    if seen.guessed and (seen.guess_missed or not isinstance(decision, Proceed)):\n",
        removed="    if seen.guessed and seen.guess_missed:\n",
        how="a stale or already-committed answer stands on a guessed tail, never read",
        tests=(
            "tests/test_replay.py::"
            "test_a_claim_answer_that_writes_nothing_never_stands_on_a_guessed_tail",
        ),
    ),
    Guard(
        name="an output or result answers an intent of its own iteration",
        file="services/journal/dagnats/journal/service.py",
        guard="    if not token.base_seq < intent_seq <= token.last_seq:\n",
        removed="    if not 0 < intent_seq <= token.last_seq:\n",
        how="a tool output or result may answer an intent of an earlier iteration",
        tests=(
            "tests/test_journal_api.py::"
            "test_an_output_or_result_cannot_answer_an_intent_of_an_earlier_iteration",
        ),
    ),
    Guard(
        name="compare-and-swap on an input's state",
        file="services/inputs/dagnats/inputs/store.py",
        guard='                    lambda: self._inputs.update(name, value, revision), "update"\n',
        removed='                    lambda: self._inputs.put(name, value), "update"\n',
        how="an input is written over whatever changed since it was read",
        tests=(
            "tests/test_waits_inputs.py::"
            "test_a_withdrawal_between_a_placements_read_and_its_claim_wins",
        ),
    ),
    Guard(
        name="a placement's earlier try is the writer's own records only",
        file="services/journal/dagnats/journal/placement.py",
        guard="            if record.writer != token.writer:\n",
        removed="            if False:\n",
        how="a fenced holder takes its successor's records as its own, and writes after them",
        tests=(
            "tests/test_harness_regressions.py::"
            "test_place_inputs_by_a_holder_fenced_by_a_redelivery_writes_nothing",
        ),
    ),
    Guard(
        name="a late copy of a placement writes nothing once its writer went on",
        file="services/journal/dagnats/journal/placement.py",
        guard="        if not replay.placed_by_earlier_try("
        "[convert.entry(r) for r in retried], position=position):\n",
        removed="        if False:\n",
        how="a late copy of a placement places an input after its writer's commit: lost",
        tests=(
            "tests/test_harness_regressions.py::"
            "test_a_late_copy_of_a_placement_after_its_writer_committed_places_nothing",
        ),
    ),
    Guard(
        name="a retried placement's token carries its claim no more",
        file="services/journal/dagnats/journal/placement.py",
        guard='            moved.ClearField("claim")\n',
        removed="",
        how="the writer's next record after a retried placement stores its claim again",
        tests=(
            "tests/test_harness_regressions.py::"
            "test_a_placement_retried_after_a_lost_answer_stores_its_riding_claim_once",
        ),
    ),
    Guard(
        name="a retried placement carries each earlier input once",
        file="services/journal/dagnats/journal/placement.py",
        guard="                    if earlier_input.request_id in done:\n",
        removed="                    if False:\n",
        how="a retried placement of a new attempt carries an earlier attempt's input again",
        tests=(
            "tests/test_harness_regressions.py::"
            "test_a_new_attempt_retrying_its_placement_carries_each_earlier_input_once",
        ),
    ),
    Guard(
        name="a placement answers the inputs that fit",
        file="services/journal/dagnats/journal/placement.py",
        guard=(
            "            if state.status is input_rules.Status.QUEUED and _full(placed, state):\n"
        ),
        removed="            if False:\n",
        how="one PlaceInputs call places every queued input, past a default client's 4 MiB",
        tests=(
            "tests/test_journal_limits.py::"
            "test_inputs_placed_by_one_call_fit_its_answer_and_the_rest_wait",
        ),
    ),
    Guard(
        name="an input created while its step finished is closed",
        file="services/inputs/dagnats/inputs/service.py",
        guard="            if not _accepts_inputs(run, step_id):\n"
        "                state = await self._close_created(state)\n",
        removed="",
        how="the run is not checked again after the create: it stays queued on a finished step",
        tests=(
            "tests/test_inputs.py::"
            "test_an_input_created_while_its_step_finished_is_closed_and_refused",
        ),
    ),
    Guard(
        name="a refused input change is decided again",
        file="services/inputs/dagnats/inputs/store.py",
        guard="            state, revision = stored\n",
        removed="            return state, False\n",
        how="a refused compare-and-swap is taken as another writer's win, even when it was ours",
        tests=(
            "tests/test_harness_regressions.py::"
            "test_place_inputs_whose_claim_landed_without_an_answer_records_the_input",
        ),
    ),
    Guard(
        name="a live stream shows only the chunks of the last claim's writer",
        file="services/journal/dagnats/journal/stream.py",
        guard="        if sid in self.ended or (self.holder and writer != self.holder):\n",
        removed="        if sid in self.ended:\n",
        how="a zombie's stream that began after its successor's claim is shown as current",
        tests=(
            "tests/test_live_stream_process.py::"
            "test_a_frozen_streamer_woken_after_its_successor_claimed_shows_nothing",
        ),
    ),
    Guard(
        name="a task is settled as stale on a read only, never on a guess",
        file="services/engine/dagnats/engine/service.py",
        guard="            current = _current_task(found, task, seq)\n",
        removed="            pass\n",
        how="a task the engine's last write of the run does not know is acknowledged: lost",
        tests=(
            "tests/test_engine_writes.py::"
            "test_a_task_dispatched_by_another_engine_is_leased_though_this_one_guessed_older",
        ),
    ),
    Guard(
        name="a task of an outbox past the duplicate window is not published again",
        file="services/engine/dagnats/engine/rules.py",
        guard=(
            "    return not is_task_subject(subject) or outbox_age < dedupe_window - CLOCK_MARGIN\n"
        ),
        removed="    return True\n",
        how="an outbox read two minutes on publishes its task again: a second, current delivery",
        tests=(
            "tests/test_engine_writes.py::"
            "test_a_task_of_an_outbox_past_the_duplicate_window_is_not_published_again",
        ),
    ),
    Guard(
        name="an input dropped on the engine's own last write is decided again on a read",
        file="services/engine/dagnats/engine/processor.py",
        guard="                if guessed:\n"
        "                    continue  # nothing to swap checks the guess: decide on a read\n",
        removed="",
        how="a report is dropped on the run as this engine last wrote it, though another moved it",
        tests=(
            "tests/test_engine.py::"
            "test_an_engine_whose_last_write_is_stale_applies_what_a_read_accepts",
        ),
    ),
    Guard(
        name="a response that rides an intent is stored in the intent's record",
        file="services/journal/dagnats/journal/service.py",
        guard="        return await self._store_model(token, model, intent)\n",
        removed="        return await self._writer.append(token, intent)\n",
        how="the intent is stored, and the tool starts, without the response that asked for it",
        tests=("tests/test_journal.py::test_crash_after_safe_intent_runs_it_again",),
    ),
    Guard(
        name="a result that rides the commit is stored in the commit's record",
        file="services/journal/dagnats/journal/service.py",
        guard="                record.leading_tool_result.CopyFrom(result)\n",
        removed="",
        how="the commit is stored without the result it carries, its intent left unanswered",
        tests=("tests/test_journal.py::test_a_crash_free_run",),
    ),
    Guard(
        name="a pending response or result is stored before the next call",
        file="sdk/dagnats/sdk/_journal.py",
        guard="            if pending_first:\n                await self._store_pending()\n",
        removed="",
        how="a call that cannot carry the pending entry goes out first, and the entry is lost",
        tests=("tests/test_journal_api.py::test_two_model_calls_in_a_row_keep_both_responses",),
    ),
    Guard(
        name="a pending response or result is stored once the handler awaits anything else",
        file="sdk/dagnats/sdk/_journal.py",
        guard="            self._storing = asyncio.ensure_future(self._store_apart())\n",
        removed="            pass\n",
        how="the entry waits for the handler's next journal call however long it awaits first",
        tests=(
            "tests/test_journal.py::"
            "test_a_handler_that_awaits_between_its_calls_stores_each_on_its_own",
        ),
    ),
    Guard(
        name="a kept task's lease is checked against the dispatch it was kept for",
        file="services/engine/dagnats/engine/service.py",
        guard="            identity = await self._leased_dispatch(task, seq)\n",
        removed="            pass\n",
        how="a heartbeat of a kept task is checked against the dispatch it was published for",
        tests=("tests/test_kept_task.py::test_a_kept_task_is_heartbeated_by_its_holder",),
    ),
    Guard(
        name="a kept task delivered again is leased for the dispatch it was kept for",
        file="services/engine/dagnats/engine/service.py",
        guard="        kept=record is not None and record.kept_seq == seq,\n",
        removed="        kept=False,\n",
        how="a kept task's message delivered again is settled as stale",
        tests=(
            "tests/test_kept_task.py::"
            "test_a_kept_task_whose_holder_goes_silent_is_delivered_again_for_its_iteration",
        ),
    ),
    Guard(
        name="the reconciler finds a kept task by its sequence",
        file="services/engine/dagnats/engine/processor.py",
        guard=(
            "            if not await self.store.task_in_flight("
            "subject, prefix, kept_seq=kept, kept_on=on):\n"
        ),
        removed=(
            "            if not await self.store.task_in_flight(subject, prefix, kept_on=on):\n"
        ),
        how="the reconciler looks for a kept dispatch's own task, finds none, dispatches anew",
        tests=("tests/test_kept_task.py::test_the_reconciler_leaves_a_kept_task_in_flight",),
    ),
    Guard(
        name="a pinned step's dispatch goes to its build's lane",
        file="services/engine/dagnats/engine/rules.py",
        guard="        build=pinned_build(run, step),\n",
        removed='        build="",\n',
        how="a pinned step's next dispatch goes to any worker, of any build",
        tests=("tests/test_builds.py::test_a_run_whose_build_is_gone_waits_until_upgraded",),
    ),
    Guard(
        name="a message off its pinned step's lane is moved, not leased",
        file="services/engine/dagnats/engine/service.py",
        guard="                await self._move_to_lane(current, msg, lane)\n",
        removed="                pass\n",
        how="a pinned step's kept message, delivered again, is leased to a worker of any build",
        tests=(
            "tests/test_builds.py::"
            "test_an_iteration_cut_short_waits_for_its_build_and_is_never_replayed_by_another",
            "tests/test_builds.py::"
            "test_an_upgrade_that_dies_before_its_purge_leaves_one_dispatch_that_counts",
        ),
    ),
    Guard(
        name="the lease of a step without a build reads the build of its journal's holder",
        file="services/engine/dagnats/engine/service.py",
        guard=(
            "            holder = convert.holder_build(tail, task.iteration)"
            ' if tail is not None else ""\n'
        ),
        removed='            holder = ""\n',
        how="a first iteration cut short is delivered again to a worker of another build",
        tests=(
            "tests/test_builds.py::"
            "test_a_first_iteration_cut_short_belongs_to_the_build_that_claimed_it",
        ),
    ),
    Guard(
        name="each record a holder of a build appends carries its build",
        file="services/journal/dagnats/journal/writer.py",
        guard="            record.build_id = token.build_id\n",
        removed="            pass\n",
        how="a step's tail names no build; its first iteration cut short goes to any build",
        tests=(
            "tests/test_builds.py::"
            "test_a_first_iteration_cut_short_belongs_to_the_build_that_claimed_it",
        ),
    ),
    Guard(
        name="the reconciler finds a pinned step's kept message on the unpinned lane",
        file="services/engine/dagnats/engine/processor.py",
        guard=(
            "            unpinned = task_subject(task_type, run.run_id, step.step_id)"
            ' if build else ""\n'
        ),
        removed='            unpinned = ""\n',
        how="a pinned step's kept loop is taken for a vanished task and dispatched again",
        tests=(
            "tests/test_builds.py::"
            "test_a_pinned_steps_kept_loop_keeps_its_message_past_the_reconciler",
        ),
    ),
    Guard(
        name="a dispatch handed over with a commit stores its claim with its first record",
        file="services/journal/dagnats/journal/writer.py",
        guard="            record.leading_claim.CopyFrom(token.claim)\n",
        removed="            pass\n",
        how="the handed holder's records are stored without its claim",
        tests=("tests/test_journal.py::test_a_turn_is_three_records_and_reads_back_whole",),
    ),
    Guard(
        name="a watcher started at a commit shows the handed holder's stream",
        file="services/journal/dagnats/journal/stream.py",
        guard=(
            "            return cls(holder_seq=tail.seq, "
            "ended_dispatch=(tail.iteration, tail.attempt))\n"
        ),
        removed="            return cls(holder=tail.writer, holder_seq=tail.seq)\n",
        how="a watcher that starts between a commit and the next holder's first record drops it",
        tests=(
            "tests/test_live_stream.py::"
            "test_a_dispatch_handed_over_with_the_commit_streams_to_every_watcher",
        ),
    ),
    Guard(
        name="a hand-over's marker at the commit's sequence names the holder",
        file="services/journal/dagnats/journal/stream.py",
        guard=(
            '            if event.get("record_seq", 0) and event["record_seq"] < self.holder_seq:\n'
        ),
        removed=(
            '            if event.get("record_seq", 0) and event["record_seq"] '
            "<= self.holder_seq:\n"
        ),
        how="a watcher started at the commit never learns the handed holder, so a zombie shows",
        tests=(
            "tests/test_stream_rules.py::"
            "test_a_watcher_started_at_a_commit_shows_the_next_dispatch_until_a_claim",
        ),
    ),
    Guard(
        name="a commit's event no engine answered goes to the history",
        file="services/engine/dagnats/engine/report.py",
        guard="            await self._store.publish_event(event, outcome_msg_id(event))\n",
        removed="            pass\n",
        how="a commit's event that no engine took directly is stored nowhere",
        tests=(
            "tests/test_kept_task.py::"
            "test_with_no_engine_taking_held_events_they_are_stored_on_the_history",
            "tests/test_kept_task.py::"
            "test_a_held_event_taken_by_an_engine_that_never_answers_is_stored_on_the_history",
            "tests/test_kept_task.py::"
            "test_a_commit_event_its_own_engine_leaves_unanswered_is_stored_on_the_history",
        ),
    ),
    Guard(
        name="a reconciler pass enters the runs written since its mark",
        file="services/engine/dagnats/engine/store.py",
        guard="            indexed[run_id] = await self.enter_active(run_id)\n",
        removed="            pass\n",
        how="a run stored with its task unpublished is in no index, found by no reconciler",
        tests=(
            "tests/test_engine_writes.py::"
            "test_a_task_never_published_from_an_old_outbox_is_dispatched_anew",
            "tests/test_parked_runs.py::"
            "test_a_wake_stopped_after_its_write_is_entered_and_finished_by_the_reconciler",
        ),
    ),
    Guard(
        name="a write after a park is entered beside the entry the park purges",
        file="services/engine/dagnats/engine/store.py",
        guard="            if indexed.get(run_id, 0) > record.parked_entry:\n",
        removed="            if run_id in indexed:\n",
        how="a wake read beside the entry a late park purges leaves its run out of the index",
        tests=(
            "tests/test_engine_writes.py::"
            "test_a_write_after_a_park_is_entered_again_beside_the_entry_the_park_purges",
        ),
    ),
    Guard(
        name="a model call's tail check when the holder's last write is not fresh",
        file="sdk/dagnats/sdk/_journal.py",
        guard="            if position >= token.replay_positions and self._tail_is_fresh():\n",
        removed="            if position >= token.replay_positions:\n",
        how="a holder fenced long after its last write still spends a model call",
        tests=(
            "tests/test_journal.py::test_a_holder_fenced_before_its_model_call_does_not_spend_it",
        ),
    ),
    Guard(
        name="BeginModel reads the tail before it clears a model call",
        file="services/journal/dagnats/journal/service.py",
        guard=(
            "        await self._writer.check_tail(token)"
            "  # a fenced holder must not spend a model call\n"
        ),
        removed="",
        how="a fenced holder's BeginModel clears its model call",
        tests=(
            "tests/test_journal.py::test_a_holder_fenced_before_its_model_call_does_not_spend_it",
        ),
    ),
    Guard(
        name="a claim names the positions it may replay",
        file="services/journal/dagnats/journal/service.py",
        guard="        token.replay_positions = replay.replay_positions(entries)\n",
        removed="",
        how="a successor takes a recorded model call as new and asks the model again",
        tests=("tests/test_journal.py::test_crash_after_model_reuses_the_response",),
    ),
    Guard(
        name="a kept iteration goes unwritten only while nobody wrote the run since",
        file="services/engine/dagnats/engine/processor.py",
        guard="        return read is not None and read.revision == stored.revision\n",
        removed="        return read is not None\n",
        how="an engine decides a kept iteration on its old write after another engine wrote "
        "the run",
        tests=(
            "tests/test_run_writes_heard.py::"
            "test_a_kept_iteration_is_deferred_only_on_a_run_nobody_wrote_since",
        ),
    ),
    Guard(
        name="a run another engine wrote since is not taken as quiet",
        file="services/engine/dagnats/engine/heard.py",
        guard="        return self._last.get(run_id, 0) <= mark.heard\n",
        removed="        return True\n",
        how="an engine decides on its old write of a run another engine cancelled since",
        tests=(
            "tests/test_run_writes_heard.py::test_an_engine_hears_another_engines_write_of_a_run",
            "tests/test_kept_writes.py::"
            "test_a_cancel_by_another_engine_stops_the_holder_of_unwritten_iterations",
        ),
    ),
    Guard(
        name="nothing heard before a reconnect is trusted",
        file="services/engine/dagnats/engine/heard.py",
        guard="        if mark.reconnects != now.reconnects or mark.heard < self._floor:\n",
        removed="        if mark.heard < self._floor:\n",
        how="writes sent while the connection was down are taken as never made",
        tests=("tests/test_run_writes_heard.py::test_nothing_heard_before_a_reconnect_is_trusted",),
    ),
    Guard(
        name="a publish taken but not heard yet leaves nothing trusted",
        file="services/engine/dagnats/engine/heard.py",
        guard="        if now.pending:\n",
        removed="        if False:\n",
        how="a write whose publish waits in the queue is taken as never made",
        tests=(
            "tests/test_run_writes_heard.py::"
            "test_a_publish_waiting_or_dropped_leaves_nothing_trusted",
        ),
    ),
    Guard(
        name="a dropped publish leaves no earlier mark trusted",
        file="services/engine/dagnats/engine/heard.py",
        guard="            self._floor = self._heard\n            return None\n",
        removed="",
        how="a write whose publish a slow subscription dropped is taken as never made",
        tests=(
            "tests/test_run_writes_heard.py::"
            "test_a_publish_waiting_or_dropped_leaves_nothing_trusted",
        ),
    ),
    Guard(
        name="nothing heard on a cluster is trusted",
        file="services/engine/dagnats/engine/store.py",
        guard="        one_server = info.cluster is None or not info.cluster.name\n",
        removed="        one_server = True\n",
        how="an engine trusts what it heard across routes that may drop or reorder it",
        tests=("tests/test_run_writes_heard.py::test_on_a_cluster_nothing_heard_is_trusted",),
    ),
    Guard(
        name="a task whose run is not stored yet waits for it",
        file="services/engine/dagnats/engine/service.py",
        guard="            if found is None and (wait := self._run_awaited(msg)) is not None:\n",
        removed="            if found is None and (wait := None) is not None:\n",
        how="a run's first task, published with the run's write, is settled when it comes first",
        tests=(
            "tests/test_engine_writes.py::"
            "test_a_task_that_comes_before_its_run_is_stored_waits_for_it",
        ),
    ),
    Guard(
        name="a claim that finds records of its iteration does not ride",
        file="services/journal/dagnats/journal/replay.py",
        guard="    if rides and not records and isinstance(decision, Proceed):\n",
        removed="    if rides and isinstance(decision, Proceed):\n",
        how="a first delivery whose iteration has records claims without fencing their writer",
        tests=(
            "tests/test_replay.py::"
            "test_a_claim_rides_the_first_record_only_when_it_proceeds_on_nothing_stored",
            "tests/test_journal_api.py::"
            "test_a_lease_of_a_dispatch_sent_again_claims_nothing_over_its_records",
        ),
    ),
    Guard(
        name="a lease carries only a claim that rides the first record",
        file="services/journal/dagnats/journal/replay.py",
        guard="    if asked.with_lease:\n        return NoClaim()\n",
        removed="",
        how="the engine's lease stores a claim, or settles a dispatch, on its worker's behalf",
        tests=(
            "tests/test_replay.py::test_a_claim_with_the_lease_answers_only_when_it_rides",
            "tests/test_journal_api.py::"
            "test_a_lease_of_a_dispatch_sent_again_claims_nothing_over_its_records",
        ),
    ),
    Guard(
        name="a run's watchers are told each state the engine stores",
        file="services/engine/dagnats/engine/processor.py",
        guard='        self._stored(written)\n        await seam("after_dispatch_saved")\n',
        removed='        await seam("after_dispatch_saved")\n',
        how="a watch of a run this engine writes waits for its consumer to see a change",
        tests=(
            "tests/test_watch_run.py::test_a_run_this_engine_writes_is_watched_without_a_consumer",
        ),
    ),
    Guard(
        name="another writer's write of a watched run starts its watch",
        file="services/engine/dagnats/engine/watch.py",
        guard="            hub.wake()\n",
        removed="            pass\n",
        how="a watch misses another engine's writes until WATCH_AFTER has passed",
        tests=(
            "tests/test_watch_run.py::"
            "test_a_watch_starts_at_once_when_another_engine_writes_its_run",
        ),
    ),
    Guard(
        name="an engine that read the run catches up with the journal before it decides",
        file="services/engine/dagnats/engine/processor.py",
        guard=(
            "                run = await self.caught_up("
            "as_stored, stored.record, through_last=through_last)\n"
        ),
        removed="                pass\n",
        how="a cancel is decided on a run behind the journal; unwritten iterations are lost",
        tests=(
            "tests/test_kept_writes.py::"
            "test_a_cancel_by_another_engine_stops_the_holder_of_unwritten_iterations",
        ),
    ),
    Guard(
        name="a vanished kept task is decided through the step's last commit",
        file="services/engine/dagnats/engine/processor.py",
        guard="            through_last=vanished,\n",
        removed="            through_last=False,\n",
        how="the committed iteration is dispatched again and settled as stale, for ever",
        tests=(
            "tests/test_kept_writes.py::"
            "test_a_kept_task_lost_between_a_commit_and_the_next_record_runs_the_next_iteration",
        ),
    ),
    Guard(
        name="a kept message's dispatch is read caught up with the journal",
        file="services/engine/dagnats/engine/service.py",
        guard="        stored = await self.engine.read_run(task.run_id)\n",
        removed="        stored = await self.store.load_run(task.run_id)\n",
        how="the holder of unwritten iterations has its heartbeat refused as fenced",
        tests=("tests/test_kept_writes.py::test_a_run_behind_its_journal_is_read_caught_up",),
    ),
    Guard(
        name="only an ended run is purged",
        file="services/engine/dagnats/engine/purge.py",
        guard="    if run.status not in FINAL_RUN_STATUSES:\n",
        removed="    if False:\n",
        how="a purge timer that reaches a running run purges its journal, resetting its fences",
        tests=("tests/test_retention.py::test_a_purge_timer_never_purges_a_running_run",),
    ),
    Guard(
        name="a run's purge is set only by the decision that ends it",
        file="services/engine/dagnats/engine/rules.py",
        guard="    if not isinstance(decision, Accepted) or not decision.run.status.terminal:\n",
        removed="    if not isinstance(decision, Accepted):\n",
        how="every write of a running run sets a purge timer, due a retention after it",
        tests=("tests/test_rules.py::test_only_the_decision_that_ends_a_run_sets_its_purge",),
    ),
    Guard(
        name="provisioning takes the TTL off an existing bucket",
        file="core/dagnats/core/jetstream.py",
        guard="    config.max_age = bucket.ttl or 0.0\n",
        removed="",
        how="a deployment from before keeps expiring the inputs and run keys of live runs",
        tests=(
            "tests/test_retention.py::"
            "test_provisioning_removes_the_age_limits_an_earlier_release_set",
        ),
    ),
    Guard(
        name="a queued input older than the dedupe window is never placed",
        file="services/inputs/dagnats/inputs/rules.py",
        guard="        if expired(state, now=now, window=window):\n"
        "            return expire(state, now=now, window=window)\n",
        removed="",
        how="an input queued past the window is placed, though it reads expired",
        tests=(
            "tests/test_inputs_rules.py::"
            "test_claim_for_expires_a_queued_input_older_than_the_dedupe_window",
            "tests/test_retention.py::test_a_queued_input_older_than_the_dedupe_window_ends_expired",
        ),
    ),
    Guard(
        name="an input placed into an iteration that never committed is dropped",
        file="services/inputs/dagnats/inputs/rules.py",
        guard="        case Status.PLACED if state.placed_iteration >= step.committed:\n",
        removed="        case Status.PLACED if False:\n",
        how="an input placed by a turn that failed or was cancelled stays placed forever",
        tests=(
            "tests/test_retention.py::test_an_input_placed_into_an_iteration_that_fails_ends_dropped",
        ),
    ),
    Guard(
        name="a call's bearer token is taken exactly as sent",
        file="services/engine/dagnats/engine/security.py",
        guard='            return bearer_token(value) if isinstance(value, str) else ""\n',
        removed=(
            '            return value.partition(" ")[2].strip() if isinstance(value, str) else ""\n'
        ),
        how="a token with a newline or a space after it passes for the token",
        tests=("tests/test_secured_edges.py::test_a_token_with_a_control_character_is_refused",),
    ),
    Guard(
        name="grpc's loggers leave credentials out",
        file="core/dagnats/core/credentials.py",
        guard="            logger.addFilter(_FILTER)\n",
        removed="            pass\n",
        how="a token followed by a byte that is not UTF-8 is written whole into the log",
        tests=(
            "tests/test_secured_edges.py::"
            "test_a_token_with_a_byte_that_is_not_utf8_is_refused_and_not_logged",
            "tests/test_secured_edges.py::test_no_serving_process_logs_a_token_sent_with_a_bad_byte",
        ),
    ),
    Guard(
        name="the gateway's keep-alive timer leaves a connection a request has reached",
        file="services/gateway/dagnats/gateway/server.py",
        guard="        http=_Http11,\n",
        removed='        http="h11",\n',
        how="a request that arrived as the timer fired is reset, unanswered and unlogged",
        tests=(
            "tests/test_gateway_keepalive.py::"
            "test_a_request_that_reached_the_gateway_as_its_keep_alive_ends_is_answered",
        ),
    ),
    Guard(
        name="a run's end seals each stopped step's journal",
        file="services/engine/dagnats/engine/rules.py",
        guard="        elif step.status is not StepStatus.PENDING:\n",
        removed="        elif False:\n",
        how="a cancelled run's holder goes on writing intents, model calls and claims",
        tests=(
            "tests/test_cancel.py::"
            "test_the_journal_refuses_every_new_call_of_a_cancelled_run_and_writes_nothing",
            "tests/test_cancel.py::"
            "test_a_bridge_worker_is_refused_new_calls_once_the_cancel_returns",
        ),
    ),
    Guard(
        name="a claim on a sealed journal is refused",
        file="services/journal/dagnats/journal/replay.py",
        guard="    if (cancel := cancel_of(seen.tail)) is not None:\n",
        removed="    if (cancel := None) is not None:\n",
        how="a claim after the cancel lands after the cancel record and opens the journal again",
        tests=(
            "tests/test_replay.py::"
            "test_a_claim_on_a_sealed_journal_is_cancelled_before_its_records_are_read",
            "tests/test_cancel.py::"
            "test_the_journal_refuses_every_new_call_of_a_cancelled_run_and_writes_nothing",
        ),
    ),
    Guard(
        name="only a result of an intent written before the cancel is kept after it",
        file="services/journal/dagnats/journal/replay.py",
        guard=(
            "    if not result_for or not (isinstance(first, CancelEntry) and first.by_engine):\n"
        ),
        removed="    if not result_for:\n",
        how="a fenced holder's result is stored after the cancel, past its successor's claim",
        tests=(
            "tests/test_replay.py::"
            "test_a_result_of_a_writer_a_successor_fenced_before_the_cancel_is_refused",
        ),
    ),
    Guard(
        name="a worker watches its handlers' runs for their cancel",
        file="sdk/dagnats/sdk/_worker.py",
        guard="            self._cancels.add(tc.run_id)\n",
        removed="",
        how="a handler hears of its run's cancel only from a heartbeat, a third of a lease later",
        tests=(
            "tests/test_cancel.py::test_a_cancelled_run_starts_no_tool_after_the_cancel_returns",
            "tests/test_cancel.py::test_a_handler_without_a_journal_hears_the_cancel",
        ),
    ),
    Guard(
        name="a watch hears a cancel announced before it",
        file="services/engine/dagnats/engine/cancels.py",
        guard="        cancelled = [r for r in runs if r in self._heard]\n",
        removed="        cancelled: list[str] = []\n",
        how="a handler started just before its run's cancel waits for a heartbeat to hear it",
        tests=(
            "tests/test_cancel.py::"
            "test_a_watch_sent_after_the_cancel_hears_it_at_once_and_bad_ones_are_refused",
        ),
    ),
    Guard(
        name="a response sent with a tool call that writes no intent is stored on its own",
        file="services/journal/dagnats/journal/service.py",
        guard="            token, _ = await self._store_model(token, model)\n",
        removed="            pass\n",
        how="a tool call answered from a result succeeds and the response it carried is lost",
        tests=(
            "tests/test_journal_api.py::"
            "test_a_response_with_a_tool_call_that_writes_no_intent_is_stored_on_its_own",
        ),
    ),
    Guard(
        name="an outbox another engine left is published by the engine that reads it",
        file="services/engine/dagnats/engine/processor.py",
        guard="                    await self.publish_outbox(stored)\n",
        removed="                    pass\n",
        how="another engine's unpublished task waits for the reconciler; its wake is lost for good",
        tests=(
            "tests/test_engine_writes.py::"
            "test_an_outbox_another_engine_left_is_published_by_the_engine_whose_guess_missed",
            "tests/test_engine_writes.py::"
            "test_a_wake_another_engine_left_in_its_outbox_is_set_by_the_engine_that_reads_it",
        ),
    ),
    Guard(
        name="a write is fresh from when it was sent, not from its answer",
        file="sdk/dagnats/sdk/_journal.py",
        guard="            self._checked_at = sent\n",
        removed="            self._checked_at = asyncio.get_running_loop().time()\n",
        how="a holder fenced while its commit's answer was on its way spends a model call",
        tests=(
            "tests/test_journal.py::"
            "test_a_holder_fenced_while_its_commit_is_answered_does_not_spend_the_next_model_call",
        ),
    ),
    Guard(
        name="a heard write that names no engine is another writer's",
        file="services/engine/dagnats/engine/heard.py",
        guard="        if writer == self.writer:\n",
        removed="        if writer in (None, self.writer):\n",
        how="a run written by a store that signs nothing is taken as quiet; its guess decides",
        tests=(
            "tests/test_run_writes_heard.py::test_a_write_that_names_no_engine_is_another_writers",
        ),
    ),
    Guard(
        name="only the kept message carries a kept dispatch",
        file="services/engine/dagnats/engine/service.py",
        guard="        kept=record is not None and record.kept_seq == seq,\n",
        removed="        kept=record is not None and record.kept_seq > 0,\n",
        how="a copy of the step's first task is leased beside the kept one: two holders",
        tests=(
            "tests/test_engine_fencing.py::"
            "test_a_copy_of_a_kept_tasks_first_dispatch_is_settled_not_leased",
        ),
    ),
    Guard(
        name="a task delivered again is leased on a read, never on a guess",
        file="services/engine/dagnats/engine/service.py",
        guard="        if current is None or msg.delivered > 1:\n",
        removed="        if current is None:\n",
        how="a kept message delivered again is leased on an older engine's last write for a "
        "past iteration; its claim acknowledges it and the loop waits for the reconciler",
        tests=(
            "tests/test_engine_fencing.py::"
            "test_a_task_delivered_again_is_leased_on_a_read_by_the_engine_that_only_started_it",
            "tests/test_engine_fencing.py::"
            "test_a_kept_task_delivered_again_is_leased_for_the_iteration_its_journal_reached",
        ),
    ),
    Guard(
        name="a handed-over claim names its holder's delivery",
        file="services/journal/dagnats/journal/service.py",
        guard="        handed.claim.delivery = token.delivery\n",
        removed="",
        how="a holder fenced at a later kept iteration still heartbeats its successor's task",
        tests=(
            "tests/test_engine_fencing.py::"
            "test_a_holder_of_a_kept_task_fenced_at_a_later_iteration_keeps_no_lease_alive",
        ),
    ),
    Guard(
        name="a handed-over token names its holder's delivery",
        file="services/journal/dagnats/journal/service.py",
        guard="            delivery=token.delivery,\n",
        removed="            delivery=0,\n",
        how="a holder fenced at a later kept iteration still heartbeats its successor's task",
        tests=(
            "tests/test_engine_fencing.py::"
            "test_a_holder_of_a_kept_task_fenced_at_a_later_iteration_keeps_no_lease_alive",
        ),
    ),
    Guard(
        name="a parallel group of another size or start at a recorded group is a mismatch",
        file="services/journal/dagnats/journal/replay.py",
        guard="    if (at.group_position, at.group_size) != (position, len(calls)):\n",
        removed="    if False:\n",
        how="a handler that now asks for fewer or more calls replays the recorded ones as its own",
        tests=("tests/test_replay.py::test_another_group_at_a_recorded_group_is_a_mismatch",),
    ),
    Guard(
        name="a call made alone where a parallel group was recorded is a mismatch",
        file="services/journal/dagnats/journal/replay.py",
        guard="    if isinstance(at, IntentEntry) and at.in_group:\n",
        removed="    if False:\n",
        how="a single call takes a group member's result as its own",
        tests=(
            "tests/test_replay.py::"
            "test_a_group_where_one_call_was_made_alone_is_a_mismatch_both_ways",
        ),
    ),
    Guard(
        name="a parallel group where a call was made alone is a mismatch",
        file="services/journal/dagnats/journal/replay.py",
        guard="    if not at.in_group:\n",
        removed="    if False:\n",
        how="a group takes a single call's result as its member's",
        tests=(
            "tests/test_replay.py::"
            "test_a_group_where_one_call_was_made_alone_is_a_mismatch_both_ways",
        ),
    ),
    Guard(
        name="a parallel group's result after a cancel answers its own call by index",
        file="services/journal/dagnats/journal/replay.py",
        guard="        if isinstance(entry, ResultEntry) and entry.intent_ref == "
        "(result_for, result_index):\n",
        removed="        if isinstance(entry, ResultEntry) and entry.intent_seq == result_for:\n",
        how="a second call of a group finishing after the cancel is taken as stored already",
        tests=(
            "tests/test_replay.py::"
            "test_a_second_result_of_a_group_after_a_cancel_is_stored_after_the_first",
        ),
    ),
    Guard(
        name="the results of a parallel group are stored as they finish, never left pending",
        file="sdk/dagnats/sdk/_journal.py",
        guard="        if stop is None and raised is None and result.ByteSize() "
        "<= PENDING_BYTES:\n",
        removed="        if raised is None and result.ByteSize() <= PENDING_BYTES:\n",
        how="one pending entry holds one result: the group's other results are lost",
        tests=(
            "tests/test_parallel_tools.py::"
            "test_a_group_runs_at_once_and_answers_in_the_responses_order",
        ),
    ),
    Guard(
        name="journal check finds a parallel group's call that ran before all its intents",
        file="services/journal/dagnats/journal/audit.py",
        guard="            if isinstance(r, OutputEntry | ResultEntry) and r.intent_ref in refs "
        "and r.seq < last:\n",
        removed="            if False:\n",
        how="a group whose calls started before its last intent was stored passes the audit",
        tests=(
            "tests/test_audit.py::"
            "test_a_call_of_a_group_that_ran_before_the_groups_last_intent_was_stored",
        ),
    ),
    Guard(
        name="journal check finds an unsafe call (parallel group or alone) started twice",
        file="services/journal/dagnats/journal/audit.py",
        guard="        if intent is None or r.writer == intent.writer:\n",
        removed="        if True:\n",
        how="a successor that ran an unsafe call again passes the audit",
        tests=(
            "tests/test_audit.py::test_an_unsafe_call_of_a_group_run_again_by_a_successor",
            "tests/test_audit.py::test_an_unsafe_call_alone_with_output_from_a_successor",
        ),
    ),
    Guard(
        name="the calls pydantic-ai starts together wait for each other: one parallel group",
        file="sdk/dagnats/integrations/pydantic_ai/_journaled.py",
        guard="        waiting = not gathered.expected <= gathered.members.keys()\n",
        removed="        waiting = False\n",
        how="a call that reaches the toolset a loop turn late runs as a group of its own",
        tests=(
            "tests/test_pydantic_ai_parallel.py::"
            "test_a_call_that_reaches_the_toolset_a_loop_turn_late_joins_its_group",
        ),
    ),
    Guard(
        name="the state chain refuses a state past the size setting",
        file="core/dagnats/core/statechain.py",
        guard="    if size > settings.state_max_bytes:\n",
        removed="    if False:\n",
        how="a conversation grows past DAGNATS_STATE_MAX_BYTES and fails later, elsewhere",
        tests=(
            "tests/test_state_chain.py::test_a_state_past_the_setting_is_refused_with_its_size",
            "tests/test_state_chain.py::test_a_state_past_the_size_setting_fails_the_step_with_its_size",
        ),
    ),
    Guard(
        name="the state chain's rebuild refuses a delta that keeps more than there is",
        file="core/dagnats/core/statechain.py",
        guard="        if delta.keep > len(state):\n",
        removed="        if False:\n",
        how="a claim loads a state a broken chain made, short of what it says",
        tests=("tests/test_state_chain.py::test_a_delta_that_does_not_apply_breaks_the_chain",),
    ),
    Guard(
        name="the state chain's audit finds a delta that does not apply",
        file="services/journal/dagnats/journal/audit.py",
        guard="    if d.delta.keep > size:\n",
        removed="    if False:\n",
        how="journal check passes a chain whose delta keeps more than its base holds",
        tests=("tests/test_state_chain.py::test_the_audit_finds_a_delta_that_does_not_apply",),
    ),
    Guard(
        name="the state chain's commit is refused past the size setting by the journal",
        file="services/journal/dagnats/journal/service.py",
        guard="    if size > limit:\n",
        removed="    if False:\n",
        how="a worker that does not check the size stores a state past the setting",
        tests=(
            "tests/test_state_chain.py::test_the_journal_refuses_a_commit_past_the_size_setting",
        ),
    ),
    Guard(
        name="the state chain's held state serves only the commit it is at",
        file="sdk/dagnats/sdk/_state.py",
        guard="        return self.present and self.seq == seq and self.kept == len(self.data)\n",
        removed="        return self.present\n",
        how="a dispatch resumes from a state another commit stored, or one changed since",
        tests=("tests/test_state_chain.py::test_a_held_state_serves_only_the_commit_it_is_at",),
    ),
    Guard(
        name="the state chain leaves a state larger than a claim's answer to ReadState",
        file="services/journal/dagnats/journal/service.py",
        guard="        if claimed.state_chain.size > STATE_IN_ANSWER:\n",
        removed="        if False:\n",
        how="a claim of a large state answers past what a gRPC client receives",
        tests=(
            "tests/test_state_chain.py::test_a_state_larger_than_a_claims_answer_is_read_with_read_state",
        ),
    ),
    Guard(
        name="an approval of another digest is refused",
        file="core/dagnats/core/approvals.py",
        guard="    if act.digest != waiting.digest:\n",
        removed="    if False:\n",
        how="an approval given for other arguments approves the call that waits",
        tests=(
            "tests/test_approval_rules.py::"
            "test_an_approval_of_another_digest_is_a_conflict_naming_both",
            "tests/test_approvals.py::"
            "test_an_approval_of_other_arguments_is_refused_and_changes_nothing",
        ),
    ),
    Guard(
        name="a call that asks for approval does not run",
        file="sdk/dagnats/sdk/_journal.py",
        guard="            if digest and approval is None:\n",
        removed="            if False:\n",
        how="a tool that needs approval runs before anyone approved it",
        tests=("tests/test_approvals.py::test_an_approval_of_the_digest_runs_the_tool_once",),
    ),
    Guard(
        name="an approval decides its position once",
        file="services/journal/dagnats/journal/replay.py",
        guard="        and not decided\n",
        removed="",
        how="a second approval of an asked call runs the tool again at the same position",
        tests=(
            "tests/test_replay.py::test_a_call_under_another_approval_than_recorded_is_a_mismatch",
        ),
    ),
    Guard(
        name="journal check: an approved call ran with the approved arguments",
        file="services/journal/dagnats/journal/audit.py",
        guard="    elif not approval.edited and approval.digest != intent.digest:\n",
        removed="    elif False:\n",
        how="a call that ran with other arguments than approved is not reported",
        tests=("tests/test_audit.py::test_a_call_that_ran_with_other_arguments_than_approved",),
    ),
    Guard(
        name="the journal refuses an approval digest that is not the call's",
        file="services/journal/dagnats/journal/service.py",
        guard="    if not approval.edited and approval.digest != request.digest:\n",
        removed="    if False:\n",
        how="a worker may store a call under an approval given for other arguments",
        tests=("tests/test_approvals.py::test_the_journal_refuses_an_approval_of_another_digest",),
    ),
    Guard(
        name="a parallel group's call needing approval waits: ApprovalPending once the others ran",
        file="sdk/dagnats/sdk/_journal.py",
        guard="        if waiting:\n",
        removed="        if False:\n",
        how="a group's call that asked for approval is handed to the handler as a result",
        tests=(
            "tests/test_approvals.py::"
            "test_a_group_runs_its_other_calls_while_one_waits_then_the_approved_one_once",
        ),
    ),
    Guard(
        name="a parallel group's call that asked waits even when its ask was replayed",
        file="sdk/dagnats/sdk/_journal.py",
        guard="results=[waits if m.asks else r for m, r in zip(made, results, strict=True)],\n",
        removed="results=results,\n",
        how=(
            "a group whose holder stopped between a call's ask and its answer hands the"
            " successor's handler that call interrupted, and the approval is never used"
        ),
        tests=(
            "tests/test_approvals.py::"
            "test_an_approval_keeps_its_guarantees_with_its_holder_stopped_at_each_seam"
            "[group-after_approval_intent-kill]",
        ),
    ),
    Guard(
        name="the decided call of a parallel group runs at the position that asked",
        file="services/journal/dagnats/journal/replay.py",
        guard="        if _decides_the_ask(records, at, call):\n            decided.append(",
        removed="        if False:\n            decided.append(",
        how="an approval placed by a redelivery of the iteration that asked is a mismatch",
        tests=(
            "tests/test_replay.py::"
            "test_each_call_of_a_group_is_decided_with_its_approval_as_if_alone",
        ),
    ),
    Guard(
        name="journal check matches a parallel group's approval result to its own call",
        file="services/journal/dagnats/journal/audit.py",
        guard="            intent = intents.get(r.intent_ref)  # a parallel group's by its index\n",
        removed="            intent = intents.get((r.intent_seq, 0))\n",
        how="a group's awaiting_approval result is checked against its first call's intent",
        tests=(
            "tests/test_approvals.py::"
            "test_a_group_runs_its_other_calls_while_one_waits_then_the_approved_one_once",
        ),
    ),
    Guard(
        name="a journal export cut short is refused",
        file="sdk/dagnats/sdk/export.py",
        guard=(
            "        raise _bad(source, last, "
            '"the export ends without its end line: it was cut short")\n'
        ),
        removed='        end = {"records": sum(len(r) for r in records.values())}\n',
        how="a truncated export replays as a shorter run, and its missing dispatches pass unseen",
        tests=(
            "tests/test_journal_replay.py::"
            "test_a_damaged_export_is_refused_naming_the_file_and_line[cut-short]",
        ),
    ),
    Guard(
        name="a replay runs no tool the recording did not",
        file="sdk/dagnats/sdk/testing/_recorded.py",
        guard=(
            "            case replay.RunNew() | replay.Honour():\n"
            '                raise self._diverge("unrecorded_call", position, asked)\n'
        ),
        removed=(
            "            case replay.RunNew() | replay.Honour():\n"
            "                return jpb.BeginToolResponse(token=request.token, run=True)\n"
        ),
        how="new code's extra tool call runs its tool during the replay, and passes",
        tests=(
            "tests/test_journal_replay.py::"
            "test_each_change_is_named_with_what_was_recorded_and_what_was_asked[extra_tool]",
        ),
    ),
    Guard(
        name="the budget's check: a journal with a budget never skips BeginModel",
        file="sdk/dagnats/sdk/_journal.py",
        guard="            if self._budget is not None:  # the budget's check is never skipped\n",
        removed="            if False:  # the budget's check is never skipped\n",
        how="a model call on a fresh tail skips BeginModel, and none asks for the check: "
        "the run spends past its budget",
        tests=(
            "tests/test_usage.py::"
            "test_the_budget_refuses_the_call_that_would_start_past_it_and_the_run_fails",
        ),
    ),
    Guard(
        name="the budget's check: BeginModel refuses a call once the run spent its budget",
        file="services/journal/dagnats/journal/service.py",
        guard='        if request.HasField("budget"):\n'
        "            return await self._within_budget(token, request)\n",
        removed="",
        how="the journal lets every model call start: the run spends past its budget",
        tests=(
            "tests/test_usage.py::"
            "test_the_budget_refuses_the_call_that_would_start_past_it_and_the_run_fails",
        ),
    ),
    Guard(
        name="the usage ledger charges a fenced call once",
        file="services/journal/dagnats/journal/ledger.py",
        guard="        if entry.usage is None or _call(entry) in seen:\n",
        removed="        if entry.usage is None:\n",
        how="a fenced call reported twice, or stored after all, is charged twice to the "
        "run's totals and to its budget's check",
        tests=(
            "tests/test_ledger.py::"
            "test_a_fenced_call_is_charged_once_even_when_reported_twice_or_also_stored",
        ),
    ),
    Guard(
        name="a page of runs skips an entry of the runs by creation time with no run",
        file="services/engine/dagnats/engine/service.py",
        guard="                loaded[run_id] = None if stored is None "
        "else listed(stored, whole=True)\n",
        removed="                loaded[run_id] = listed(stored, whole=True)  # type: ignore\n",
        how="an entry whose run's write never landed, or whose run was purged, fails ListRuns",
        tests=(
            "tests/test_list_runs.py::"
            "test_an_entry_with_no_run_is_skipped_and_a_run_with_none_yet_is_listed_after_a_pass",
        ),
    ),
    Guard(
        name="a run's entry by creation time rides in its first outbox",
        file="services/engine/dagnats/engine/processor.py",
        guard="        record.outbox.append(convert.created_run_entry(record.run))\n",
        removed="",
        how="runs are stored with no entry by creation time: ListRuns never shows them, and a "
        "create stopped before its publish leaves nothing for a pass to publish",
        tests=(
            "tests/test_list_runs.py::"
            "test_an_entry_with_no_run_is_skipped_and_a_run_with_none_yet_is_listed_after_a_pass",
        ),
    ),
    Guard(
        name="the pass that reads an ended run's write publishes its outbox",
        file="services/engine/dagnats/engine/store.py",
        guard="                    await ended(stored)\n",
        removed="                    pass\n",
        how="an engine that stopped after the write that ended a run, before publishing its "
        "outbox, leaves the cancel unannounced and the purge timer unset for ever",
        tests=(
            "tests/test_engine_writes.py::"
            "test_an_end_whose_outbox_was_not_published_is_published_by_the_pass_that_reads_it",
        ),
    ),
)


def scratch_copy() -> Path:
    """The tracked files of the working tree, in a temporary folder."""
    target = Path(tempfile.mkdtemp(prefix="dagnats-guards-"))
    files = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.split(b"\0")
    for name in filter(None, files):
        source = ROOT / name.decode()
        if source.is_file():
            dest = target / name.decode()
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest)
    return target


def run_without(guard: Guard | None, tests: tuple[str, ...]) -> tuple[int, float]:
    """Remove the guard (None: remove nothing) in a scratch copy and run the
    tests; returns pytest's exit code (1: a test failed) and the time taken."""
    copy = scratch_copy()
    try:
        if guard is not None:
            path = copy / guard.file
            text = path.read_text()
            if text.count(guard.guard) != 1:
                raise SystemExit(f"guard {guard.name!r}: its code is no longer in {guard.file}")
            path.write_text(text.replace(guard.guard, guard.removed))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [*(str(copy / r) for r in SOURCE_ROOTS), str(copy), env.get("PYTHONPATH", "")]
        )
        started = time.monotonic()
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
            cwd=copy,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        return result.returncode, time.monotonic() - started
    finally:
        shutil.rmtree(copy, ignore_errors=True)


def main(words: list[str]) -> int:
    guards = [g for g in GUARDS if not words or any(w in g.name for w in words)]
    if not guards:
        print(f"no guard's name holds any of {words}")
        return 2
    every_test = tuple(dict.fromkeys(t for g in guards for t in g.tests))
    code, seconds = run_without(None, every_test)
    if code != 0:
        print(f"the guard tests fail with every guard in place (exit {code}); fix them first")
        return 1
    print(f"baseline: the {len(every_test)} guard tests pass with every guard ({seconds:.0f}s)")
    missed = []
    for guard in guards:
        code, seconds = run_without(guard, guard.tests)
        caught = code == 1  # a test failed; not a crash of pytest itself
        verdict = "caught" if caught else "MISSED"
        print(f"{verdict:7} {guard.name}  ({seconds:.0f}s)")
        print(f"        removed: {guard.how}")
        print(f"        by: {', '.join(guard.tests)}", flush=True)
        if not caught:
            missed.append(guard.name)
    print(f"\n{len(guards) - len(missed)} of {len(guards)} guards caught")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
