"""Compare the per-rank draft traces of a tensor-parallel run (written by
:mod:`lookahead_vllm.vllm.draft_trace` under ``$LOOKAHEAD_DRAFT_TRACE_DIR``).

:func:`compare_traces` reads every trace of a directory and reports the
first step where two traces differ::

    python -m lookahead_lab.draft_traces DIR   # exit status 1 if ranks differ

Example: rank 0 writes ``7 3f2a9c0d1e4b5a69 2 9`` and rank 1 ``7 8c1d... 2 9``
for step 7: ``compare_traces`` returns a :class:`TraceComparison` whose
``divergence`` names step 7 and both files.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from lookahead_vllm.vllm.draft_trace import SUFFIX, TRACE_DIR_ENV


def read_trace(path: str | Path) -> dict[int, str]:
    """step -> digest (the whole line after the step) of one trace file."""
    steps: dict[int, str] = {}
    for line in Path(path).read_text().splitlines():
        step, _, rest = line.partition(" ")
        if rest:
            steps[int(step)] = rest
    return steps


@dataclass(slots=True)
class TraceComparison:
    # Trace files compared (sorted by name: rank order).
    files: list[str]
    # Steps every trace recorded.
    steps: int = 0
    # First difference, or None: (step, file a, its line, file b, its line);
    # a missing step reads as "missing".
    divergence: tuple[int, str, str, str, str] | None = None
    # Steps at which some trace differs from the first one.
    differing_steps: list[int] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return len(self.files) >= 2 and self.divergence is None and self.steps > 0


def compare_traces(directory: str | Path) -> TraceComparison:
    """Compare every ``*.trace`` of ``directory`` with the first one, step by step."""
    paths = sorted(Path(directory).glob(f"*{SUFFIX}"))
    result = TraceComparison(files=[p.name for p in paths])
    if not paths:
        return result
    traces = [read_trace(p) for p in paths]
    ref = traces[0]
    all_steps = sorted(set().union(*traces))
    result.steps = sum(all(s in t for t in traces) for s in all_steps)
    for step in all_steps:
        for path, trace in zip(paths[1:], traces[1:]):
            a, b = ref.get(step, "missing"), trace.get(step, "missing")
            if a != b:
                if result.divergence is None:
                    result.divergence = (step, paths[0].name, a, path.name, b)
                if not result.differing_steps or result.differing_steps[-1] != step:
                    result.differing_steps.append(step)
    return result


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(f"usage: python -m lookahead_lab.draft_traces DIR   (traces written under ${TRACE_DIR_ENV})",
              file=sys.stderr)
        return 2
    cmp = compare_traces(args[0])
    if len(cmp.files) < 2:
        print(f"{len(cmp.files)} trace file(s) in {args[0]}: nothing to compare", file=sys.stderr)
        return 2
    if cmp.divergence is None:
        print(f"{len(cmp.files)} traces identical over {cmp.steps} steps")
        return 0
    step, fa, la, fb, lb = cmp.divergence
    print(f"drafts differ at step {step}: {fa} '{la}' vs {fb} '{lb}' "
          f"({len(cmp.differing_steps)} differing steps)")
    return 1


if __name__ == "__main__":
    sys.exit(main())
