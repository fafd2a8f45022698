"""The drafter's snapshot is written when the engine shuts down (SmolLM2, CPU)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm


def test_engine_shutdown_writes_the_snapshot(engines, prompts, tmp_path):
    from vllm import SamplingParams

    from lookahead_lab.offline import find_proposers, generate
    from lookahead_vllm.core.snapshot import read_snapshot

    snap = tmp_path / "drafter.snap"
    llm = engines.get("lookahead-snapshot", lookahead={"snapshot_path": str(snap)})
    (proposer,) = find_proposers(llm)
    out = generate(llm, prompts["humaneval"][:2], SamplingParams(temperature=0.0, max_tokens=16), 2)
    assert not snap.exists()  # nothing writes it while the engine runs
    del llm
    engines.shutdown("lookahead-snapshot")
    # The proposer is still referenced here and the process still runs: only
    # the engine's shutdown (patch runner_shutdown) can have written it.
    assert snap.exists()
    written = read_snapshot(snap, proposer._persistence.identity())
    # Both outputs, though their requests' finish had not reached the proposer
    # (a sequence may run past max_tokens: the runner's last step's tokens).
    assert len(written.sequences) == 2
    for tokens in out.token_ids:
        assert any(list(seq[:len(tokens)]) == tokens for seq in written.sequences)
    proposer.close()  # a second close writes nothing new
    assert read_snapshot(snap, proposer._persistence.identity()).info == written.info
