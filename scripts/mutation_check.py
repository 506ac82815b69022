"""Proof that tests can fail: break the code on purpose, one change at a time, and see a test fail.

    python scripts/mutation_check.py          # every mutation below; exit 1 if one survives
    python scripts/mutation_check.py --check  # only check that every snippet is still there

Each mutation replaces one snippet of a module (it must occur exactly once) and runs the tests
that claim to cover it; a mutation the tests do not notice *survives*. The file is restored
after each run, whatever happens.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAILBOX_TESTS = ["tests/test_mailbox.py"]
FRAMING_TESTS = ["tests/test_framing.py"]
STATE_TESTS = ["tests/test_state_format.py"]
PLAN_TESTS = ["tests/test_ops_plan.py"]
ADAM_TESTS = ["tests/test_optimizers.py::test_the_wrapped_optimizers_state_is_its_own"]
BLUEFOG = "tests/test_bluefog.py::test_"
UNIFORM_TESTS = [BLUEFOG + "uniform_averages_sum_first_and_divide_once"]
EARLY_TESTS = [BLUEFOG + "a_write_before_win_create_is_applied_at_creation",
               BLUEFOG + "a_read_before_win_create_waits_for_the_window"]
GATHER_TESTS = [BLUEFOG + "allgather_concatenates_variable_first_dimensions"]
PUSH_TESTS = ["tests/test_push_algorithms.py"]
KERAS_TESTS = ["tests/test_tf.py::test_keras_distributed_optimizer_sums_passes_in_a_compiled_fit"]
MULTI = "tests/test_multiworker.py::test_"
SHRINK_TESTS = ("tests/test_worker_memory.py::"
                "test_a_worker_that_shrinks_registered_memory_fails_its_ops_and_nothing_else")
SENDS, RECEIVES = SHRINK_TESTS + "[sends]", SHRINK_TESTS + "[receives]"
FAULTS = "tests/test_faults.py::test_"
RESULTS = "tests/test_results.py::test_"
AGREE = "tests/test_agreement.py::test_"
STREAMING = "tests/test_streaming.py::test_"
DATA_PATH = "tests/test_data_path.py::test_"
KERAS_STEP = "tests/test_tf.py::test_a_keras_step_makes_no_model_sized_tensor"
ALLOCATIONS = ("tests/test_optimizers.py::test_the_general_path_allocates_no_model_sized_tensor_"
               "per_step")
KERAS_GA = "tests/test_tf.py::test_keras_gradient_allreduce_steps_on_the_reduced_gradients"
TF_NUMPY = "tests/test_tf.py::test_the_tf_client_takes_numpy_arrays_and_gives_numpy_arrays"
KERAS_REJOIN = ("tests/test_rejoin.py::test_a_restarted_keras_rank_takes_the_state_of_a_live_"
                "rank_and_trains_on")
KERAS_MATCH = "tests/test_tf.py::test_keras_wrapper_matches_the_torch_wrapper"
COMBINED = STREAMING + "an_in_place_result_is_combined_by_its_worker_with_the_daemons_bits"
COMBINED_EARLY = (STREAMING + "a_neighbors_tensor_that_arrived_before_the_call_is_combined_by_"
                  "the_worker")
COMBINED_HALF = (STREAMING + "a_neighbors_tensor_half_here_before_the_call_is_combined_once_"
                 "whole")
LOCKED = STREAMING + "an_in_place_request_is_locked_from_before_it_is_sent_until_it_is_copied_in"
LONE_LOST = FAULTS + "a_lone_in_neighbor_killed_before_sending_is_reweighted_by_the_worker"
LIFECYCLE = "tests/test_lifecycle.py::test_"
CONCURRENCY = "tests/test_concurrency.py::test_"
COMPLETIONS = "tests/test_completions.py::test_"

#: (file, snippet, replacement, tests, what the change breaks)
MUTATIONS: list[tuple[str, str, str, list[str], str]] = [
    ("daemon/mailbox/slots.py",
     "            self._held.setdefault((name, round_), []).append(arrival)\n"
     "            fut.set_result(arrival)", "            fut.set_result(arrival)",
     MAILBOX_TESTS, "an early arrival is not held for its op"),
    ("daemon/mailbox/slots.py", "            if slot.arriving is not None and accepts == "
     "accepts_of(slot.arriving):", "            if False:", MAILBOX_TESTS,
     "no acknowledgement when the op starts while its part arrives"),
    ("daemon/mailbox/slots.py", "            if slot.accepts is not None and slot.accepts == "
     "accepts_of(p):", "            if slot.accepts is not None:", MAILBOX_TESTS,
     "early acknowledgement of a part the op does not accept"),
    ("daemon/mailbox/slots.py", "            early = self._early_aborts.pop(key, None)",
     "            early = None", MAILBOX_TESTS, "an abort before the op opens is forgotten"),
    ("daemon/mailbox/slots.py",
     "                messages.update(self._drop(self._slots.pop(slot_key)))",
     "                self._slots.pop(slot_key)", MAILBOX_TESTS,
     "closing an op leaves its waiters and early data"),
    ("daemon/mailbox/slots.py",
     "        if op_key in self._closed:\n            arrival.release()\n"
     "            return\n", "", MAILBOX_TESTS, "arrivals for a closed op are kept"),
    ("daemon/mailbox/slots.py", "            wanted = wanted or slot.waiter is not None or "
     "(p.name, int(p.round)) in self._open", "            wanted = wanted or slot.waiter "
     "is not None", MAILBOX_TESTS, "an RTS for an open op with no waiter yet is not cleared"),
    ("daemon/mailbox/slots.py", "        if slot.message is not None and slot.message in "
     "self._announced:\n            self._clear_to_send(slot.message)\n", "", MAILBOX_TESTS,
     "an op that starts after an RTS never clears it"),
    ("daemon/mailbox/slots.py", "        if header is None or not self._all_closed(header.parts):",
     "        if header is None:", MAILBOX_TESTS,
     "a message is dropped while one of its ops still wants it"),
    ("daemon/mailbox/slots.py", "            self._discard[msg] = None\n", "", MAILBOX_TESTS,
     "a cleared payload whose op ended becomes a protocol error"),
    ("daemon/mailbox/slots.py", "        if self._all_closed(header.parts):\n            return  #",
     "        if False:\n            return  #", MAILBOX_TESTS,
     "an RTS after its op ended is taken"),
    ("daemon/mailbox/slots.py", "            if not reaches(key):\n                continue\n", "",
     MAILBOX_TESTS, "a lost peer fails the waiters of every peer"),
    ("daemon/mailbox/slots.py",
     "        if slot.landing is not None:\n            slot.landing.cancel()",
     "        if False:\n            pass", MAILBOX_TESTS,
     "a closed op's payload goes on landing in its memory"),
    ("daemon/mailbox/arrivals.py", "        if msg.refs == 0 and msg.on_release is not None:",
     "        if msg.on_release is not None:", MAILBOX_TESTS,
     "a message is released with its first part"),
    ("daemon/mailbox/slots.py", "            listener.stray(key, arrival)", "            pass",
     MAILBOX_TESTS, "a stray part of an open op is not checked"),
    ("daemon/net/flow.py", "        if self.unconsumed + nbytes > self.window:",
     "        if self.unconsumed + nbytes > 2 * self.window:", MAILBOX_TESTS,
     "a peer may send past its window"),
    ("daemon/net/flow.py", "            header.credit += self.owed\n            self.owed = 0",
     "            header.credit += self.owed", MAILBOX_TESTS, "owed credit is given back twice"),
    ("daemon/net/flow.py",
     "        if self.flush_pending is not None and self.flush_pending <= delay:",
     "        if False:", MAILBOX_TESTS, "a credit flush is scheduled per consumed payload"),
    ("daemon/net/flow.py", "CREDIT_SOON if 4 * self.owed >= self.window else CREDIT_IDLE",
     "CREDIT_SOON", MAILBOX_TESTS,
     "a little owed credit is flushed as soon as a quarter of the window (latency)"),
    ("wire/framing.py", "    if length > limit:", "    if length > 2 * limit:", FRAMING_TESTS,
     "a frame past the reader's limit is accepted"),
    ("wire/framing.py", "        del buf[:start]", "        pass", FRAMING_TESTS,
     "a frame is read twice"),
    ("daemon/ops/pairs.py", "    if not ctx.same_host(j):\n        return None\n", "",
     PLAN_TESTS, "pairs across a network average by halves"),
    ("daemon/ops/pairs.py", "    if len(recv) != 1 or set(send) != set(recv) or "
     "explicit_weights(ctx) or", "    if len(recv) != 1 or set(send) != set(recv) or",
     PLAN_TESTS,
     "a call with its own weights is taken for a pair step"),
    ("clients/core/training/state.py",
     '        return {"u" if isinstance(state, tuple) else "l": items}',
     '        return {"l": items}', STATE_TESTS, "tuples come back as lists"),
    ("clients/core/training/state.py", "    if math.prod(shape) > MAX_ELEMENTS:", "    if False:",
     STATE_TESTS, "an announced tensor of any size is allocated"),
    ("clients/torch/optim.py", "        return [self.algorithm_state.setdefault(p, {}) for p in "
     "params]", "        return [self.optimizer.state[p] for p in params]", ADAM_TESTS,
     "the algorithm's state is kept inside Adam's (issue 22: KeyError 'exp_avg')"),
    ("wire/numerics.py", "    first_is_out = first is out or (", "    first_is_out = True or (",
     ["tests/test_data_path.py::test_weighted_sums_over_the_input_or_into_memory_of_their_own"],
     "a sum into memory of its own skips copying its first term (one pass, latency)"),
    ("clients/core/requests/handles.py",
     "        if self._open:\n            return True\n        if not",
     "        if True:\n            return True\n        if not",
     ["tests/test_concurrency.py::test_a_requests_latch_lets_every_waiter_through_once_it_is_set"],
     "a request's latch lets a waiter through before it is set (latency)"),
    ("wire/numerics.py", "    k = round(1.0 / weights[0])\n", "    return None\n",
     UNIFORM_TESTS, "uniform averages scale every term instead of dividing the sum once"),
    ("daemon/windows/store.py", "            elif j in w.without_base and not zero_init:",
     "            elif False:", EARLY_TESTS,
     "an accumulate before win_create loses the initial copy"),
    ("daemon/windows/store.py", "        if arrival.op in READS and self._park(src, name, round_, "
     "arrival):", "        if False:", EARLY_TESTS, "a get before win_create fails at once"),
    ("daemon/ops/api.py", "        rows = (self.spec.rows(self) or {}).get(src)",
     "        rows = None", GATHER_TESTS, "a gather's stray part is checked against our shape"),
    ("clients/core/training/algorithms/push.py",
     "        self.weight = float(c.values(hw.wait())[0])",
     "        hw.wait()", PUSH_TESTS, "push-sum forgets its weight"),
    ("clients/tf/optim.py",
     "        rate.assign(keras.ops.cast(wrapper.learning_rate, rate.dtype))", "        pass",
     KERAS_TESTS, "the Keras wrappers ignore model.optimizer.learning_rate"),
    ("daemon/keys.py", "    return key if who == NODE else at_worker(base, rank)",
     "    return key", [MULTI + "neighbor_allreduce_among_workers"],
     "a part travels under its sender's key, not its receiver's"),
    ("daemon/engine/hierarchy.py", "        divisor = covered if", "        divisor = "
     "max(1, covered // self.per_node) if", [MULTI + "allreduce_and_broadcast_are_hierarchical"],
     "a node-level average divides by the daemons, not the workers"),
    ("daemon/engine/hierarchy.py", "        return None\n        what = (", "        return None\n"
     "        return None\n        what = (",
     [MULTI + "workers_of_one_node_that_disagree_fail_everywhere_naming_both"],
     "the node's workers may disagree about a collective"),
    ("daemon/mailbox/absences.py", "        self._departed[(job, rank)] = error\n", "",
     [MULTI + "peers_leave_out_a_worker_that_left_at_once_until_it_is_back"],
     "a worker that left is waited for until the timeout"),
    ("daemon/engine/node_gathers.py", "    return [(lo, min(lo + step, elements)) for lo in",
     "    return [(lo, min(lo + step, elements - 1)) for lo in",
     [MULTI + "large_node_tensors_run_in_segments_exactly"],
     "the last segment of a large node tensor is cut short"),
    ("daemon/engine/hierarchy.py",
     "                if other is not ctx:\n                    other.fail(err)",
     "                if False:\n                    other.fail(err)",
     [MULTI + "daemons_whose_large_tensors_differ_fail_with_both_shapes"],
     "segments only one daemon has wait out the timeout when another segment fails"),
    ("daemon/net/outbound.py",
     "        while self._queue:\n            item = self._queue.popleft()\n"
     "            if item.abandoned", "        if self._queue:\n            item = "
     "self._queue.popleft()\n            if item.abandoned", ["tests/test_sender.py"],
     "frames queued for a peer go out one write each"),
    ("daemon/service/cli.py", "    sigbus.install()", "    pass", [SENDS],
     "memory a worker shrinks kills the daemon (no SIGBUS guard)"),
    ("daemon/net/outbound.py", "        fault_in(buffers)\n", "", [SENDS],
     "sending from memory a worker shrank breaks the connection"),
    ("daemon/ops/api.py", "        dest = None if not p.sink.landable else into",
     "        dest = into",
     [RECEIVES], "a payload is received straight into memory a worker may shrink"),
    ("daemon/service/rpc.py",
     "            why = links.auth.admit_status(request.from_rank, links.rank, "
     "request.server_nonce,", "            why = None and links.auth.admit_status("
     "request.from_rank, links.rank, request.server_nonce,",
     ["tests/test_cluster_status.py::test_the_peer_port_tells_its_status_only_to_proven_peers"],
     "a peer's status is told to anyone who asks"),
    ("daemon/service/metrics.py",
     '"OK" if error is None else pb.ErrorCode.Name(error.code)', '"OK"',
     ["tests/test_metrics.py::test_failed_ops_are_counted_by_their_error"],
     "failed ops are counted as OK"),
    # issue 26: faults
    ("daemon/net/late_rounds.py",
     "        if not self.ready:\n            return\n        self._seq += 1",
     "        if True:\n            return\n        self._seq += 1",
     [FAULTS + "a_restarted_node_rejoins_and_pairs_with_the_current_rounds"],
     "a late peer's rounds are not mapped onto ours"),
    ("daemon/net/late_rounds.py",
     "            if self.is_late(peer, p.name) and (peer, p.name) not in self._offsets:\n"
     "                return False", "            pass",
     [FAULTS + "a_node_missing_at_start_joins_later_under_min_nodes"],
     "a late peer's frame is placed before its offset is known"),
    # issue 42: workers restarted on live daemons, state from several donors
    ("daemon/net/late_rounds.py",
     "        for key in [k for k in self._offsets if owner(k[1]) == rank and job_of(k[1]) == job]:"
     "\n            del self._offsets[key]", "        pass",
     [FAULTS + "workers_restarted_one_after_another_on_live_daemons_pair_with_the_others"],
     "a worker that registered again is translated for as if it were the old one"),
    ("clients/core/training/chunks.py",
     "        return digest(data) == self.primary[c]", "        return True",
     ["tests/test_state_chunks.py::"
      "test_chunks_that_fail_their_checksum_are_fetched_again_from_another_donor"],
     "a chunk is taken without checking its digest"),
    ("daemon/ops/faults.py", "    return self_weight + moved, kept,",
     "    return self_weight, kept,",
     [FAULTS + "a_daemon_killed_mid_op_is_reweighted_out_exactly"],
     "a dead in-neighbor's weight is not given to self"),
    ("daemon/ops/faults.py", "    if not members.has_quorum():", "    if False:",
     [FAULTS + "a_collective_needs_a_majority_of_the_daemons"],
     "a collective runs without a majority of the daemons"),
    ("daemon/ops/faults.py", "    ctx.live_schedule = \"@\" + \",\".join(map(str, live))\n",
     "    return ctx.topology_step()\n",
     ["tests/test_fault_windows.py::test_a_dynamic_schedule_runs_over_the_live_ranks"],
     "a dynamic schedule keeps pairing survivors with dead ranks"),
    ("daemon/windows/groups.py", "                if m == rank or self.live(m)]",
     "                ]",
     ["tests/test_fault_windows.py::test_window_ops_skip_a_dead_peer_and_groups_shrink"],
     "a WAGMA group keeps its dead members"),
    ("clients/torch/optim.py", "        if rejoin and self.client.rejoining:\n            "
     "self._take_state()", "        pass",
     ["tests/test_rejoin.py"], "a restarted rank starts from its own state"),
    ("daemon/membership/liveness.py",
     "        if self.members.state(rank) is not PeerState.DOWN:  # down: "
     "forgotten already\n            self._forget(rank, reason)", "        pass",
     [FAULTS + "daemons_silent_past_the_deadline_are_counted_out_then_pair_again"],
     "an op that started before a counted-out peer came back waits for a round it never ran"),
    ("daemon/membership/liveness.py",
     "        self.links.rounds.joined([-(rank + 1), *range(rank * per, "
     "(rank + 1) * per)])", "        pass",
     [FAULTS + "daemons_silent_past_the_deadline_are_counted_out_then_pair_again"],
     "a counted-out peer's rounds are not placed afresh"),
    ("clients/tf/optim.py", "        if self._rejoin and self.client.rejoining:",
     "        if False:",
     [KERAS_REJOIN], "a restarted Keras rank starts from its own state"),
    ("clients/core/requests/placement.py",
     "            off = self.spill.take(nbytes)", "            pass",
     ["tests/test_concurrency.py::test_a_full_arena_with_opposite_orders_completes_in_memory_"
      "of_its_own"], "a request waits for room in a full arena (opposite orders deadlock)"),
    # issue 27: inputs sent while copied in
    ("daemon/workers/staging.py",
     "        in_frame = self.head + max(0, self.fill.filled - self.base)",
     "        in_frame = frame_bytes", ["tests/test_streaming.py"],
     "a sender writes a frame past what its worker has copied in"),
    ("daemon/ops/neighbor.py", "    await ctx.inputs_whole()\n    if how.handoff is not None:",
     "    if how.handoff is not None:", ["tests/test_streaming.py::test_a_receiver_still_"
                                         "copying_its_input_waits_for_it_before_combining"],
     "the weighted sum reads an input still being copied in"),
    ("daemon/workers/staging.py",
     "                                          or self.released or interrupted(), STALL)",
     "                                          or self.released or interrupted())",
     ["tests/test_streaming.py::test_a_worker_that_stops_copying_fails_its_op_and_the_link_"
      "carries_the_next"], "a frame waits for ever for a worker that stopped copying"),
    # issue 28: collectives end the same way on every rank; gradients
    ("daemon/ops/agreement.py", "    return next((r for r in rulings if r is not None), None)",
     "    return None", ["tests/test_agreement.py"],
     "ranks that disagree run the collective anyway"),
    ("daemon/ops/agreement.py", "    raw = (ruled.to_pb() if ruled is not None else "
     "pb.Error()).SerializeToString()", "    raw = pb.Error().SerializeToString()",
     ["tests/test_agreement.py"], "the coordinator of a larger group tells the others to run a "
     "collective it found against (it alone fails)"),
    ("daemon/ops/collectives.py",
     "        sends = [asyncio.ensure_future(ctx.send(r, DIRECT_TAG, extra=described))",
     "        sends = [asyncio.ensure_future(ctx.send(r, DIRECT_TAG))",
     [AGREE + "a_small_allreduce_among_a_few_agrees_in_its_own_exchange"],
     "a small allreduce among a few sends no descriptions (its peers wait for them)"),
    ("daemon/ops/collectives.py",
     "        await ctx.send(peer, DIRECT_TAG, extra=described)",
     "        await ctx.send(peer, DIRECT_TAG)",
     [AGREE + "a_small_allreduce_among_a_few_agrees_in_its_own_exchange"],
     "a small allreduce between two daemons sends no descriptions (its peer waits for them)"),
    ("daemon/ops/collectives.py",
     "        return _rule(ctx, [f.result() for f in said], others)",
     "        return None",
     [AGREE + "a_small_allreduce_among_a_few_agrees_in_its_own_exchange"],
     "descriptions that came before the op looked are not ruled on (ranks that disagree run it)"),
    ("daemon/ops/api.py",
     "(self.level.node and self.op in AGREED_AMONG_DAEMONS)",
     "False",
     [PLAN_TESTS[0] + "::test_an_agreement_takes_a_peers_verdict_as_it_is"],
     "a collective that its agreement decides relays a peer's verdict wrapped (ranks that take "
     "it from there fail with another text)"),
    ("daemon/net/outbox.py",
     "HELD_WHILE_REOPENING = frozenset({pb.ABORT, pb.SKIP, pb.DATA})",
     "HELD_WHILE_REOPENING = frozenset({pb.ABORT, pb.SKIP})",
     [PLAN_TESTS[0] + "::test_a_refusals_descriptions_wait_for_a_link_being_reopened"],
     "a refusal's descriptions are dropped while their link is reopened"),
    ("clients/core/requests/handles.py",
     "        if p.event.is_set():\n            return p\n", "",
     ["tests/test_neighbor_allreduce.py::test_blocked_seconds_count_waits_on_unfinished_ops_"
      "only"], "a wait on a finished op counts as blocked time"),
    ("clients/core/requests/handles.py",
     "            self._requests.blocked(time.perf_counter() - began)", "            pass",
     ["tests/test_neighbor_allreduce.py::test_blocked_seconds_count_waits_on_unfinished_ops_"
      "only"], "blocked time is never counted"),
    ("clients/core/surface/adjoints.py",
     "            \"src_weights\": {int(d): float(w) for d, w in "
     "dst_weights.items()},\n            \"dst_weights\": {int(j): float(w) for j, w in "
     "src_weights.items()}}", "            \"src_weights\": {int(j): float(w) for j, w in "
     "src_weights.items()},\n            \"dst_weights\": {int(d): float(w) for d, w in "
     "dst_weights.items()}}", ["tests/test_gradients.py"],
     "neighbor_allreduce's gradient uses W instead of W transposed"),
    ("clients/core/surface/adjoints.py",
     "    return Adjoint(\"allreduce\", back, _identity if rank "
     "== root else _zero)", "    return Adjoint(\"allreduce\", back)", ["tests/test_gradients.py"],
     "broadcast's gradient reaches the ranks that are not the root"),
    ("clients/core/surface/default_client.py",
     "        if handle is None or handle.pending.waited:", "        if True:",
     ["tests/test_horovod.py::test_two_ops_of_one_name_in_flight_are_a_value_"
      "error_as_in_horovod"], "a second op of a name in flight is accepted"),

    ("clients/core/requests/calls.py", "    receives_only = self_weight == 0.0 and dsts == {}",
     "    receives_only = self_weight == 0.0",
     [RESULTS + "weights_of_zero_and_one_on_a_two_way_call_copy_as_usual"],
     "a receive-only call that still sends is left out (one way copies less)"),
    ("clients/core/requests/calls.py", "    adds_nothing = self_weight == 1.0 and srcs is not None "
     "and not any(srcs.values())", "    adds_nothing = self_weight == 1.0",
     [RESULTS + "weights_of_zero_and_one_on_a_two_way_call_copy_as_usual"],
     "a keep-own call that receives is not copied back (one way copies less)"),
    ("daemon/ops/neighbor.py", "    check_blank(ctx, self_weight)\n    large = ",
     "    large = ", [FAULTS + "a_worker_that_dies_between_ops_is_left_out_at_once"],
     "a left-out input takes a lost in-neighbor's weight (one way copies less)"),

    ("daemon/windows/groups.py",
     "        if len(set(asked.values())) > 1:\n            raise disagreement(*key, asked)\n",
     "", [AGREE + "group_calls_that_disagree_before_their_round_is_decided_fail_every_member"],
     "a group round whose calls disagree is decided anyway (group agreement)"),
    ("daemon/ops/window_ops.py", "    if decided != terms:", "    if False:",
     [AGREE + "a_group_call_that_disagrees_with_its_decided_round_fails_alone"],
     "a late group call on other terms takes the round's result (group agreement)"),

    ("clients/tf/client.py", "        start = tf.reduce_sum(rows[:self.rank])",
     "        start = tf.reduce_sum(rows[:0])",
     ["tests/test_gradients.py::test_tensorflow_allgather_gradient_is_each_ranks_rows_of_the_"
      "summed_gradient"], "TensorFlow's allgather gradient takes rank 0's rows (tf allgather)"),

    ("daemon/ops/folding.py", "            sink.final(filled)", "            pass",
     [STREAMING + "an_in_place_result_is_copied_out_while_the_rest_arrives"],
     "a landed result is not told to its worker (drain)"),
    ("clients/core/requests/submitter.py",
     "ctypes.memmove(sink + done, src.ctypes.data + done,",
     "ctypes.memmove(sink, src.ctypes.data,",
     [STREAMING + "an_in_place_result_is_copied_out_while_the_rest_arrives"],
     "a drained result's tail is copied over its head (drain)"),

    ("clients/core/training/algorithms/base.py",
     "                out[...] = a\n", "                pass\n",
     ["tests/test_algorithms.py"], "a reused tensor keeps its old values (spares)"),
    ("clients/core/training/algorithms/gossip.py", "            if p is not s[\"psi\"]:",
     "            if True:", ["tests/test_algorithms.py"],
     "exact diffusion reuses the psi it keeps for the next step (spares)"),

    ("clients/core/requests/fusion.py",
     "        with self._cv:\n            self._holds += 1\n        try:",
     "        try:", [DATA_PATH + "a_fused_block_goes_out_as_one_request_however_slowly"
                               "_it_is_filled"], "the timer splits a fused() block"),
    ("clients/tf/codec.py", "        if value is None or not isinstance(unwrap(into), tf.Variable):"
     "\n            return value", "        if True:\n            return None",
     [RESULTS + "a_tf_variable_takes_its_in_place_result_where_the_daemon_wrote_it",
      KERAS_STEP], "a tf.Variable's in-place result is copied out instead of taken"),
    ("clients/tf/optim.py", "        if self.algorithm.in_place:\n            self._apply_in_place",
     "        if False:\n            self._apply_in_place", [KERAS_STEP],
     "the Keras adapt-then-combine step makes x_k, d_k and x - d again"),
    ("clients/tf/optim.py", "            for v, n in zip(variables, new, strict=True):\n"
     "                v.assign(n)", "            pass", [KERAS_MATCH],
     "a compiled Keras step reads its variables before the combine is assigned"),
    ("clients/tf/codec.py", "    if typed.ctypes.data % ALIGNMENT:\n        return None\n", "",
     [RESULTS + "tensorflow_is_given_only_memory_aligned_as_its_kernels_require"],
     "misaligned memory handed to TensorFlow"),
    # issue 27: the other Keras algorithms over host buffers
    ("clients/tf/optim.py", "        if hostable([unwrap(v) for v in variables]):",
     "        if False:", [KERAS_STEP], "the other Keras algorithms make new tensors again"),
    ("clients/tf/host.py", "            np.subtract(x, view_of(v), out=d)",
     "            d[...] = x - view_of(v)", [KERAS_STEP], "d_k made in a new array each step"),
    ("clients/tf/host.py", "        weakref.finalize(lent, self._give_back, home)", "",
     [KERAS_STEP], "a home never comes back to the pool (a new buffer every step)"),
    ("clients/tf/host.py", "        self._turn ^= 1", "",
     [KERAS_MATCH + "[extra-True]"], "x_k written over the previous step's, which EXTRA keeps"),
    ("clients/tf/optim.py", "        return self._states if self._prepared else list(self._taken "
     "or [])", "        return self._states", [KERAS_REJOIN + "[gradient-tracking]"],
     "algorithm_state hides what a joining rank took"),
    ("clients/tf/codec.py", "        if isinstance(like, np.ndarray):\n            return "
     "_NUMPY.wrap(owner, dtype, shape)\n", "", [TF_NUMPY], "the TF client cannot share a numpy "
     "array (the Keras host buffers stay out of the arena)"),
    ("clients/tf/gradients.py", "    if isinstance(tensor, np.ndarray):\n        return False\n",
     "", [TF_NUMPY], "a blocking op turns a numpy array into a TensorFlow tensor"),
    ("clients/core/training/algorithms/gossip.py",
     "            wx -= d\n            out.append(wx)",
     "            out.append(wx - d)", [ALLOCATIONS + "[dsgd-cta]"],
     "combine-then-adapt D-SGD makes W x - d in a new tensor each step"),
    ("clients/torch/optim.py",
     "            self.optimizer.step()\n        elif self.algorithm.in_place:",
     "            pass\n        if self.algorithm.in_place:",
     [ALLOCATIONS + "[gradient-allreduce]"],
     "gradient averaging copies x_k and makes x - d again after its step"),
    ("clients/tf/optim.py", "        if self.algorithm.reduces_gradients:\n"
     "            self._apply_averaged(grads, variables)\n            return\n", "",
     [KERAS_GA], "the Keras wrapper of gradient-allreduce never reduces the gradients"),
    ("clients/tf/optim.py", "        dense = [tf.convert_to_tensor(grads[i]) for i in present]",
     "        dense = [grads[i] for i in present]", [KERAS_GA],
     "a sparse gradient breaks the Keras gradient reduction"),
    ("clients/tf/optim.py", "        present = [i for i, g in enumerate(grads) if g is not None]\n"
     "        dense = [tf.convert_to_tensor(grads[i]) for i in present]",
     "        present = list(range(len(grads)))\n        dense = [tf.zeros_like(v) if g is None "
     "else tf.convert_to_tensor(g) for g, v in zip(grads, variables, strict=True)]", [KERAS_GA],
     "a missing gradient becomes zeros (weight decay moves a variable plain Keras leaves)"),
    ("daemon/service/cli.py", "    outlive_namespace(cfg.timeouts.shutdown)\n", "",
     ["tests/test_lifecycle.py::test_a_daemon_as_pid_1_outlives_the_trainer_that_stopped_it"],
     "a daemon as PID 1 exits before the trainer that stopped it (the kernel kills it)"),
    ("daemon/ops/handoff.py",
     "    if len(parts) != 1 or len(srcs) != 1 or not p.sink.hands_off(p.nbytes):\n",
     "    if True:\n", [COMBINED, COMBINED_EARLY],
     "the daemon never hands the combine to the worker (the copy back stays)"),
    ("clients/core/requests/placement.py",
     "        landing = landing and in_place and resident is None\n",
     "        landing = False\n", [COMBINED],
     "an in-place call asks no second slot to combine from"),
    ("clients/core/requests/submitter.py",
     "            if combine is None:\n", "            if True:\n",
     [COMBINED], "the worker copies the neighbor's tensor as if it were the result"),
    ("daemon/ops/handoff.py", "weight=self.src_weight * weight)", "weight=self.src_weight)",
     [COMBINED], "the sender's dst weight is left out of the worker's combine"),
    ("daemon/ops/handoff.py", "        if data.ctypes.data != out.ctypes.data:\n",
     "        if False:\n", [COMBINED_EARLY, COMBINED_HALF],
     "a tensor that arrived before the op is not put where the worker combines from"),
    ("daemon/ops/handoff.py", "        if buf.ctypes.data == self.start:\n", "        if True:\n",
     [COMBINED_HALF], "the worker is told to combine bytes that landed elsewhere"),
    ("daemon/ops/handoff.py", "            return pb.Combine(self_weight=self_weight, weight=0.0)",
     "            return pb.Combine(self_weight=self.self_weight, weight=0.0)", [LONE_LOST],
     "a lost lone in-neighbor's weight does not go to the worker's own tensor"),
    ("clients/core/requests/submitter.py",
     "            with p.lock:  # from before the request: what it is "
     "told waits for the copy in\n                self._send(", "            if True:\n"
     "                self._send(", [LOCKED],
     "a partial completion may combine into the tensor before it is copied in"),
    ("clients/core/requests/placement.py", "            if landing := spare is not None:\n",
     "            if landing := spare is not None and False:\n", [COMBINED],
     "the second slot is taken but never used"),
    ("clients/core/requests/completions.py",
     "            self._turns.notify_all()  # it may be sitting out a caller's read\n", "",
     [LIFECYCLE + "a_killed_daemon_is_not_reported_as_shutting_down",
      COMPLETIONS + "the_end_of_the_channel_is_reported_once_while_a_caller_reads"],
     "a caller reading the channel when the daemon dies leaves the loss unreported"),
    ("clients/core/requests/completions.py",
     "                if self._followers or self._sitting:\n",
     "                if self._followers:\n",
     [COMPLETIONS + "the_background_thread_sits_out_a_callers_turn_and_takes_over_after_it"],
     "the background thread is not woken when the reading caller is done"),
    ("clients/core/requests/completions.py",
     "                self._turns.wait(None if self._leader else LINGER)\n",
     "                self._turns.wait()\n",
     [COMPLETIONS + "the_background_thread_sits_out_a_callers_turn_and_takes_over_after_it",
      CONCURRENCY + "an_op_nobody_waits_for_finishes_in_the_background"],
     "an op nobody waits for is never delivered after a caller read the channel"),
    ("clients/core/requests/completions.py",
     "            lead = not self._leader and self._ended is None\n",
     "            lead = self._ended is None\n",
     [COMPLETIONS + "threads_waiting_together_each_get_theirs",
      CONCURRENCY + "threads_waiting_at_once_each_get_their_own_result"],
     "two callers read the channel at once"),
]


def run(path: str, old: str, new: str, tests: list[str]) -> bool:
    """Apply one mutation, run its tests; True when they failed (the mutation was caught)."""
    target = ROOT / path
    original = target.read_text()
    if original.count(old) != 1:
        raise SystemExit(f"{path}: the snippet to mutate occurs {original.count(old)} times:\n"
                         f"{old}")
    target.write_text(original.replace(old, new))
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                               *tests], cwd=ROOT, capture_output=True, text=True, timeout=600)
    finally:
        target.write_text(original)
    return proc.returncode != 0


def main(argv: list[str]) -> int:
    """Run every mutation (or those whose file or description contains one of ``argv``);
    exit 1 if one survives. Every snippet is checked before any test runs."""
    check_only = "--check" in argv
    argv = [a for a in argv if a != "--check"]
    chosen = [m for m in MUTATIONS if not argv or any(w in m[0] or w in m[4] for w in argv)]
    for path, old, *_ in chosen:
        count = (ROOT / path).read_text().count(old)
        if count != 1:
            raise SystemExit(f"{path}: the snippet to mutate occurs {count} times:\n{old}")
    if check_only:
        print(f"{len(chosen)} mutations: every snippet occurs once")
        return 0
    survived = 0
    for path, old, new, tests, what in chosen:
        caught = run(path, old, new, tests)
        survived += not caught
        print(f"{'caught  ' if caught else 'SURVIVED'} {path}: {what}", flush=True)
    print(f"{len(chosen) - survived} of {len(chosen)} mutations caught")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
