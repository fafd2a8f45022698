"""What tree verification did with each tree, for tests against an oracle
(tests/e2e/test_tree_oracle.py); the plugin itself records nothing."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

from lookahead_lab.reference.trees import batch_plan


@contextmanager
def recording(verifier: Any) -> Iterator[list[dict[str, Any]]]:
    """Within the block, ``verifier`` (a ``tree_verify.TreeVerifier``) appends one dict per
    verified tree to the yielded list: ``req_id``, ``context`` (the committed ids, root last) and
    ``plan`` when its step begins; ``logits`` (the tree's rows), ``output`` (accepted + bonus)
    and ``kv`` (the committed K/V per layer, after compaction) once the step finished."""
    entries: list[dict[str, Any]] = []
    begin, finish = verifier.begin_step, verifier.finish_step

    def begin_step(runner: Any, scheduler_output: Any, num_scheduled_tokens: Any) -> None:
        begin(runner, scheduler_output, num_scheduled_tokens)
        batch, step = runner.input_batch, verifier.current
        for t, (req_id, row) in enumerate(zip(step.req_ids, step.rows.tolist()) if step is not None else ()):
            context = batch.token_ids_cpu[row, :int(batch.num_tokens_no_spec[row])].tolist()
            entries.append({"req_id": req_id, "context": context, "plan": batch_plan(step.trees, t)})

    def finish_step(runner: Any, logits: Any, spec_metadata: Any, sampler_output: Any) -> None:
        step = verifier.current
        finish(runner, logits, spec_metadata, sampler_output)
        if step is None or spec_metadata is None:
            return
        cu_sampled = spec_metadata.cu_num_sampled_tokens.tolist()
        sampled = sampler_output.sampled_token_ids
        mine = {e["req_id"]: e for e in entries[-len(step.req_ids):]}
        for req_id, row, start, num_rows in zip(step.req_ids, step.rows.tolist(), step.starts.tolist(),
                                                step.num_rows.tolist()):
            first = cu_sampled[row] - num_rows
            entry = mine[req_id]
            entry["logits"] = logits[first : first + num_rows].float().clone()
            entry["output"] = [t for t in sampled[row].tolist() if t >= 0]
            committed = step.slot_mapping[start + 1 : start + len(entry["output"])]
            entry["kv"] = [cache.gather_slots(committed) for cache in step.caches.values()]

    verifier.begin_step, verifier.finish_step = begin_step, finish_step
    try:
        yield entries
    finally:
        del verifier.begin_step, verifier.finish_step
