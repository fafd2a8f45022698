"""Lookahead configuration (fields, knobs and terms: docs/configuration.md): the public :class:`LookaheadConfig`,
the internal :class:`Profile` knobs and both as :class:`Settings`, resolved once and carried to the workers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

if TYPE_CHECKING:
    from lookahead_vllm.core.draft_index import DraftIndexConfig

DRAFT_SHAPES = ("hier", "par", "one")
SOURCES = ("index", "trie", "jacobi", "both", "index+trie", "index+jacobi")  # "both" = "trie+jacobi"
DEBUG_SWITCHES = ("positions", "mask", "compaction")
DRAFT_SHARINGS = ("per-salt", "per-salt-saved", "all", "none")
# vLLM's num_speculative_tokens when the user gives none (and decoding_length without an engine). CPU: 16
# beat 8 on every class of the dev suite's replay; GPU: k sets a full-graph step's price (docs/gpu.md).
DEFAULT_DECODING_LENGTH = 16
PLATFORM_DECODING_LENGTH = {"cpu": DEFAULT_DECODING_LENGTH, "gpu": 8}
PLATFORMS = tuple(PLATFORM_DECODING_LENGTH)
PROFILE_KEY = "_profile"  # beside the public fields: the profile knobs to override (developers only)


class LookaheadConfig(BaseModel):
    """The public fields; a bad one raises ``ValueError`` naming it, its value and what is allowed."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    source: Literal[SOURCES] = "index"  # "+"-joined, merged in that order: core/draft_index.py, trie.py, jacobi.py
    draft_shape: Literal[DRAFT_SHAPES] = "one"  # a chain, or a tree verified with tree attention (vllm/tree_verify.py)
    # Max draft nodes per request per step (None: num_speculative_tokens less the Jacobi window).
    decoding_length: int | None = Field(None, ge=1, le=256)
    index_corpus_bytes: int = Field(128 << 20, ge=0, le=1 << 40)  # memory cap of the outputs kept for drafting
    warm_start: str = ""  # texts learned at engine start (core/warm_start.py); "" = none
    snapshot_path: str = ""  # what the drafter learned, read on start, written on shutdown (vllm/persistence.py)
    draft_sharing: Literal[DRAFT_SHARINGS] = "per-salt"  # whose outputs a request drafts from (core/partitions.py)
    # Forward-cost model (core/budget.py): -1 (both) = fitted online (core/prices.py); 0 free tokens = off.
    cost_free_tokens: int = Field(-1, ge=-1, le=1 << 16)
    cost_marginal_tokens: float = Field(-1.0, ge=-1.0, le=1e6)

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as err:
            raise ValueError(_explain(err)) from None

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, values: Any) -> Any:
        """Refuse retired, internal and unknown field names, by name."""
        if not isinstance(values, Mapping):
            return values
        for name in values:
            if name in RETIRED:
                raise ValueError(f"{name}: no longer a lookahead field; {RETIRED[name]}")
            if name in PROFILE_FIELDS:
                raise ValueError(f"{name}: no longer a lookahead field; it is internal now (a tuning knob of the "
                                 "platform profile, docs/configuration.md 'Developer settings'); the public fields "
                                 f"are {list(PUBLIC_FIELDS)}")
        unknown = sorted(set(values) - set(PUBLIC_FIELDS))
        if unknown:
            raise ValueError(f"unknown lookahead field(s) {unknown}; the fields are {list(PUBLIC_FIELDS)}")
        return values

    @field_validator("cost_marginal_tokens")
    @classmethod
    def _marginal_at_least_one(cls, value: float) -> float:
        if value != -1 and value < 1:
            raise ValueError("must be -1 (measured online) or in [1, 1e+06]")
        return value

    @model_validator(mode="after")
    def _snapshot_is_not_the_warm_file(self) -> "LookaheadConfig":
        # A non-snapshot file at snapshot_path is moved aside and replaced at shutdown: the warm-start file is lost.
        if self.snapshot_path and self.warm_start and _same_file(self.snapshot_path, self.warm_start):
            raise ValueError(f"snapshot_path={self.snapshot_path!r} names the warm_start file: the snapshot "
                             "(a binary file the engine writes at shutdown) needs a path of its own")
        return self


def _same_file(a: str, b: str) -> bool:
    """Whether two paths name one file (the same path once resolved, or the same inode)."""
    with contextlib.suppress(OSError):  # either does not exist (yet)
        if os.path.samefile(a, b):
            return True
    return os.path.realpath(a) == os.path.realpath(b)


def sources_of(source: str) -> tuple[str, ...]:
    """The draft sources of ``source``, in merge order."""
    return ("trie", "jacobi") if source == "both" else tuple(source.split("+"))


PUBLIC_FIELDS = tuple(LookaheadConfig.model_fields)

# Fields that were public once: what to use instead (a profile knob not named here is "internal now").
RETIRED = {
    "index_corpus_tokens": "renamed; use index_corpus_bytes (a cap in bytes: an output token is charged 80-190 of it)",
    "index_upkeep": "internal now (the platform profile's upkeep_thread: a thread on GPUs, inline on the CPU)",
    "insert_output": "removed (it was never read: generated tokens always enter the trie)",
    "cost_per_path": "internal now (the platform profile's path_setup and cost_per_path)"}


def _explain(err: ValidationError) -> str:
    """One clause per failed field: its name, its value and what is allowed."""
    return "; ".join(map(_clause, err.errors(include_url=False)))


def _clause(error: Mapping[str, Any]) -> str:
    if error["type"] == "value_error":  # a validator's own message (a model validator's names no field)
        message = str(error["ctx"]["error"])
        return f"{error['loc'][0]}={error['input']!r}: {message}" if error["loc"] else message
    info = LookaheadConfig.model_fields[str(error["loc"][0])]
    head = f"{error['loc'][0]}={error['input']!r}: must be"
    choices = getattr(info.annotation, "__args__", ())
    if choices and all(isinstance(c, str) for c in choices):
        return f"{head} one of {choices}"
    kind = {float: "a number", str: 'a file path (a string; "" = none)'}.get(info.annotation, "an integer")
    bounds = {type(m).__name__: m for m in info.metadata}
    if "Ge" not in bounds:
        return f"{head} {kind}"
    lo, hi = bounds["Ge"].ge, bounds["Le"].le
    return f"{head} {kind} in [{_num(lo)}, {_num(hi)}]" + (" (-1: measured online)" if lo == -1 else "")


def _num(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def _knob(default: Any = dataclasses.MISSING, *, within: tuple[Any, Any]) -> Any:
    """A :class:`Profile` knob whose values must lie in ``within`` (bounds included)."""
    return dataclasses.field(default=default, metadata={"within": within})


@dataclass(frozen=True, slots=True)
class Profile:
    """Internal tuning knobs (docs/configuration.md, "Developer settings"). Build with :meth:`for_platform`."""

    # Per platform (PLATFORM_VALUES), no default. Token prices in forwards (core/budget.py; the online fit's prior).
    platform: str
    free_tokens: int = _knob(within=(1, 1 << 16))
    marginal_tokens: float = _knob(within=(1.0, 8192.0))  # the online fit's bounds (prices.MARGINAL_BOUNDS)
    path_setup: float = _knob(within=(0.0, 100.0))
    cost_per_path: float = _knob(within=(0.0, 100.0))
    draft_setup: float = _knob(within=(0.0, 10.0))
    row_price: float = _knob(within=(0.0, 1.0))
    context_price: float = _knob(within=(0.0, 2.0))
    load_shrink_above: int = _knob(within=(0, 1 << 16))  # load adaptation (core/load.py)
    load_stop_at: int = _knob(within=(1, (1 << 16) + 1))
    upkeep_thread: bool  # the native index's upkeep on a thread while the forward runs, or inline (same drafts)

    # One default everywhere. Trie (core/trie.py).
    branch_length: int = _knob(12, within=(2, 128))
    max_match_length: int = _knob(6, within=(1, 127))
    min_match_length: int = _knob(1, within=(1, 127))
    min_retrieved_nodes: int = _knob(4, within=(1, 1 << 16))
    trie_capacity: int = _knob(1 << 16, within=(64, 1 << 26))
    prompt_weight: float = _knob(1e4, within=(0.0, 1e9))
    insert_prompt: bool = True
    context_match: int = _knob(3, within=(0, 64))
    min_draft_confidence: float = _knob(0.025, within=(0.0, 1.0))  # budget.confidence_floor
    step_draft_budget: int = _knob(0, within=(0, 1 << 16))  # draft tokens per step (0 = no cap)
    uniform_steps: bool = True  # full CUDA graphs: fill chains to k (uniform 1 + k steps only; docs/gpu.md)
    calibrate_confidence: bool = True  # core/calibration.py
    argmax_sampling: bool = True  # CPU: greedy steps verified from one argmax (vllm/patches.py greedy_sample)
    # Draft index (core/draft_index.py); index_threads 0 = min(4, cores).
    index_ngram: int = _knob(2, within=(1, 4))
    index_backoff: int = _knob(1, within=(0, 3))
    index_max_match: int = _knob(64, within=(1, 1 << 16))
    index_candidates: int = _knob(16, within=(1, 1024))
    index_occurrences: int = _knob(32, within=(1, 1024))
    index_threads: int = _knob(1, within=(0, 256))
    jacobi_window: int = _knob(4, within=(1, 64))  # W: window columns
    jacobi_ngram: int = _knob(3, within=(2, 16))  # N: n-gram size
    jacobi_guesses: int = _knob(4, within=(1, 64))  # G: pool n-grams per step
    debug_disable: tuple[str, ...] = ()  # debug only: DEBUG_SWITCHES off in tree verification; NOT lossless

    def __post_init__(self) -> None:
        if not isinstance(self.debug_disable, list | tuple) or any(x not in DEBUG_SWITCHES for x in self.debug_disable):
            raise ValueError(f"{PROFILE_KEY}.debug_disable={self.debug_disable!r}: a list drawn from {DEBUG_SWITCHES}")
        object.__setattr__(self, "debug_disable", tuple(self.debug_disable))
        for f in dataclasses.fields(self):  # bool knobs: a bool; the others: their _knob range
            value, within = getattr(self, f.name), f.metadata.get("within")
            if f.type in ("bool", bool) and not isinstance(value, bool):  # a string annotation here
                raise ValueError(f"{PROFILE_KEY}.{f.name}={value!r}: must be true or false")
            if within is not None:
                (lo, hi), number = within, isinstance(within[0], float)
                if not (isinstance(value, (int, float) if number else int) and not isinstance(value, bool)
                        and lo <= value <= hi):
                    raise ValueError(f"{PROFILE_KEY}.{f.name}={value!r}: must be "
                                     f"{'a number' if number else 'an integer'} in [{_num(lo)}, {_num(hi)}]")
        for name, lo, hi in (("max_match_length", 1, self.branch_length - 1),
                             ("min_match_length", 1, self.max_match_length),
                             ("index_backoff", 0, max(0, self.index_ngram - 1)),
                             ("index_max_match", self.index_ngram, 1 << 16),
                             ("load_stop_at", self.load_shrink_above + 1, (1 << 16) + 1)):
            if not lo <= getattr(self, name) <= hi:
                raise ValueError(f"{PROFILE_KEY}.{name}={getattr(self, name)!r}: must be in [{lo}, {hi}]")
        if self.platform not in PLATFORMS:
            raise ValueError(f"{PROFILE_KEY}.platform={self.platform!r}: must be one of {PLATFORMS}")

    @classmethod
    def for_platform(cls, platform: str, overrides: Mapping[str, Any] | None = None) -> "Profile":
        """The profile of ``platform`` ("cpu" or "gpu"), knobs in ``overrides`` replaced."""
        overrides = dict(overrides or {})
        if platform not in PLATFORM_VALUES:
            raise ValueError(f"platform={platform!r}: must be one of {PLATFORMS}")
        if overrides.get("platform", platform) != platform:
            raise ValueError(f"{PROFILE_KEY}.platform={overrides['platform']!r}: this engine runs on {platform!r}")
        unknown = sorted(set(overrides) - set(PROFILE_FIELDS))
        if unknown:
            raise ValueError(f"{PROFILE_KEY}: unknown knob(s) {unknown}; the knobs are {list(PROFILE_FIELDS)}")
        return cls(**{**PLATFORM_VALUES[platform], **overrides})

    @property
    def draft_threads(self) -> int:
        """``index_threads``, with 0 resolved to min(4, the cores this process may use)."""
        if self.index_threads:
            return self.index_threads
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        return max(1, min(4, cores))

    @property
    def jacobi_nodes(self) -> int:
        """The Jacobi window's nodes per step: W * (N - 1) - 1."""
        return self.jacobi_window * (self.jacobi_ngram - 1) - 1

    @property
    def jacobi_step_slots(self) -> int:
        """Draft slots a full Jacobi step needs, the window plus G pool n-grams: (W + G) * (N - 1) - 1."""
        return (self.jacobi_window + self.jacobi_guesses) * (self.jacobi_ngram - 1) - 1


# "cpu": a 2-core host with SmolLM2 (docs/prices.md; load adaptation from 16 rows, tuned on dev-split serving);
# "gpu": one H200, Llama-3-8B shape, bf16 (docs/gpu.md; one launch runs every path; setup, context price unmeasured).
PLATFORM_VALUES: dict[str, dict[str, Any]] = {
    "cpu": dict(platform="cpu", free_tokens=5, marginal_tokens=20.0, path_setup=0.09, cost_per_path=0.02,
                draft_setup=0.05, row_price=0.04, context_price=0.08, load_shrink_above=16, load_stop_at=64,
                upkeep_thread=False),
    "gpu": dict(platform="gpu", free_tokens=32, marginal_tokens=675.0, path_setup=0.0, cost_per_path=0.0,
                draft_setup=0.0, row_price=0.0, context_price=0.0, load_shrink_above=32, load_stop_at=128,
                upkeep_thread=True)}
PROFILE_FIELDS = tuple(f.name for f in dataclasses.fields(Profile))


@dataclass(frozen=True, slots=True)
class Settings:
    """What the engine runs on: the public fields (``decoding_length`` resolved) and the profile (:func:`resolve`)."""

    source: str
    draft_shape: str
    decoding_length: int
    index_corpus_bytes: int
    warm_start: str
    snapshot_path: str
    draft_sharing: str
    cost_free_tokens: int
    cost_marginal_tokens: float
    profile: Profile

    @property
    def sources(self) -> tuple[str, ...]:
        """The draft sources, in merge order."""
        return sources_of(self.source)

    @property
    def uses_index(self) -> bool:
        return "index" in self.sources

    @property
    def uses_trie(self) -> bool:
        return "trie" in self.sources

    @property
    def uses_jacobi(self) -> bool:
        return "jacobi" in self.sources

    @property
    def lookahead_nodes(self) -> int:
        """Jacobi window nodes per step: W * (N - 1) - 1 (0 without a Jacobi source)."""
        return self.profile.jacobi_nodes if self.uses_jacobi else 0

    def index_config(self, ngram: int | None = None) -> "DraftIndexConfig":
        """The draft index's settings (keyed by ``ngram`` tokens, default the profile's index_ngram)."""
        from lookahead_vllm.core.draft_index import DraftIndexConfig

        p = self.profile
        shares = 2 if p.index_backoff else 1  # the corpus cap, split evenly
        return DraftIndexConfig(ngram or p.index_ngram, p.index_max_match, p.index_occurrences,
                                p.index_candidates, self.index_corpus_bytes // shares)

    def to_carried(self) -> dict[str, Any]:
        """These settings as JSON for vLLM's ``additional_config`` (read by :meth:`from_carried`, :func:`resolve`)."""
        profile = dataclasses.asdict(self.profile)
        profile["debug_disable"] = list(self.profile.debug_disable)
        return {**{name: getattr(self, name) for name in PUBLIC_FIELDS}, PROFILE_KEY: profile}

    @classmethod
    def from_carried(cls, values: Mapping[str, Any]) -> "Settings":
        """The settings :meth:`to_carried` wrote: nothing defaulted, nothing resolved again."""
        values = dict(values)
        profile = values.pop(PROFILE_KEY, None)
        missing = sorted(set(PROFILE_FIELDS) - set(profile or {}))
        if missing or values.get("decoding_length") is None:
            raise ValueError("lookahead settings were not resolved where the engine config was built "
                             "(patch lookahead_validation); missing: " + ", ".join(missing or ["decoding_length"]))
        return cls(**LookaheadConfig(**values).model_dump(), profile=Profile(**profile))


def default_decoding_length(platform: str) -> int:
    """vLLM's ``num_speculative_tokens`` when the user gives none, on ``platform`` ("cpu" or "gpu")."""
    if platform not in PLATFORMS:
        raise ValueError(f"platform={platform!r}: must be one of {PLATFORMS}")
    return PLATFORM_DECODING_LENGTH[platform]


def resolve(values: Mapping[str, Any] | LookaheadConfig | None = None, *, platform: str = "cpu",
            num_speculative_tokens: int | None = None) -> Settings:
    """The settings of public ``values`` (and an optional ``"_profile"`` of knobs) on ``platform``, checked against
    vLLM's ``num_speculative_tokens`` (None: no engine; ``decoding_length`` per platform). ValueError names a field."""
    if isinstance(values, LookaheadConfig):
        values = values.model_dump()
    if values is not None and not isinstance(values, Mapping):
        raise ValueError(f"the lookahead config must be a mapping of lookahead fields, got {type(values).__name__}")
    values = dict(values or {})
    overrides = values.pop(PROFILE_KEY, None)
    if overrides is not None and not isinstance(overrides, Mapping):
        raise ValueError(f"{PROFILE_KEY} must be a mapping of profile knobs, got {type(overrides).__name__}")
    user = LookaheadConfig(**values)
    profile = Profile.for_platform(platform, overrides)
    window = profile.jacobi_nodes if "jacobi" in sources_of(user.source) else 0
    k, length = num_speculative_tokens, user.decoding_length
    if k is not None:
        if window and profile.jacobi_step_slots > k:
            raise ValueError(f"_profile jacobi_window={profile.jacobi_window}, jacobi_ngram={profile.jacobi_ngram}, "
                             f"jacobi_guesses={profile.jacobi_guesses}: the step needs (W + G) * (N - 1) - 1 = "
                             f"{profile.jacobi_step_slots} draft slots, more than "
                             f"speculative_config.num_speculative_tokens={k} (raise num_speculative_tokens)")
        length = k - window if length is None else length
        if length < 1 or length + window > k:
            extra = f" + {window} Jacobi lookahead nodes" if window else ""
            raise ValueError(f"decoding_length={length}{extra}: must be <= speculative_config.num_speculative_tokens="
                             f"{k} (raise num_speculative_tokens or lower decoding_length)")
    length = default_decoding_length(platform) if length is None else length
    return Settings(**{**user.model_dump(), "decoding_length": length}, profile=profile)
