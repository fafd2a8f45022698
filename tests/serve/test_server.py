"""The OpenAI-compatible server with lookahead, through the ``openai`` client.

Greedy text must equal a plain server's on the same prompts, for completions
and chat, streaming or not, with stop strings and max_tokens; per-request
control works (and bad per-request input is a 400 that leaves the server
serving); a tenant's outputs do not speed up another tenant (``cache_salt``);
``/metrics`` counters move by what the responses imply.
"""

from __future__ import annotations

import os
import re
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm
openai = pytest.importorskip("openai")

MAX_TOKENS = 40
NUM_CODE = 3
NUM_CHAT = 2


@pytest.fixture(scope="module")
def code_prompts() -> list[str]:
    from lookahead_lab.datasets import load_humaneval

    return load_humaneval(NUM_CODE)


@pytest.fixture(scope="module")
def chat_questions() -> list[str]:
    from lookahead_lab.datasets import load_mtbench

    return load_mtbench(NUM_CHAT)


def _both(plain, lookahead, fn):
    """Run ``fn(server)`` on both servers at once (one core each); return (plain, lookahead)."""
    with ThreadPoolExecutor(2) as pool:
        a, b = pool.submit(fn, plain), pool.submit(fn, lookahead)
        return a.result(), b.result()


def _both_and_streamed(plain, lookahead, fn):
    """``fn(plain)``, ``fn(lookahead)`` and ``fn(lookahead, stream=True)`` at once; return the three.
    The lookahead server runs its two side by side: 2 running requests, not above its
    ``load_shrink_above`` (tests/serve/conftest.py), so both draft in full."""
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(fn, plain), pool.submit(fn, lookahead), pool.submit(fn, lookahead, True)]
        return tuple(f.result() for f in futures)


def complete(server, prompt, stream=False, **kw):
    client = server.client()
    args = {"model": server.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **kw}
    if not stream:
        r = client.completions.create(**args)
        return r.choices[0].text, r.choices[0].finish_reason, r
    text, finish = "", None
    for chunk in client.completions.create(stream=True, **args):
        for c in chunk.choices:
            text += c.text
            finish = c.finish_reason or finish
    return text, finish, None


def chat(server, question, stream=False, **kw):
    client = server.client()
    args = {
        "model": server.model, "messages": [{"role": "user", "content": question}],
        "max_tokens": MAX_TOKENS, "temperature": 0, **kw,
    }
    if not stream:
        r = client.chat.completions.create(**args)
        return r.choices[0].message.content, r.choices[0].finish_reason, r
    text, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **args):
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    return text, finish, None


def spec_metrics(response) -> dict:
    return response.model_extra["metrics"]["speculative_decoding"]


def scrape(server) -> dict[str, float]:
    """``/metrics`` samples without the ``model_name``/``engine`` labels: name{labels} -> value."""
    out: dict[str, float] = {}
    for line in server.metrics_text().splitlines():
        if not line or line.startswith("#"):
            continue
        name, value = line.rsplit(" ", 1)
        name = re.sub(r'(engine|model_name)="[^"]*",?', "", name).replace(",}", "}").replace("{}", "")
        out[name] = out.get(name, 0.0) + float(value)
    return out


def test_completions_identical_to_plain(plain, lookahead, code_prompts):
    drafted = 0
    for prompt in code_prompts:
        ref, la, streamed = _both_and_streamed(plain, lookahead, lambda s, stream=False: complete(s, prompt, stream))
        assert la[0] == ref[0] and la[1] == ref[1]
        assert streamed[:2] == ref[:2]
        drafted += spec_metrics(la[2])["num_accepted_draft_tokens"]
        assert la[2].usage.completion_tokens == ref[2].usage.completion_tokens
    assert drafted > 0  # lookahead really drafted (and drafts were accepted)


def test_chat_identical_to_plain(plain, lookahead, chat_questions):
    for question in chat_questions:
        ref, la, streamed = _both_and_streamed(plain, lookahead, lambda s, stream=False: chat(s, question, stream))
        assert la[:2] == ref[:2]
        assert streamed[:2] == ref[:2]


def test_stop_strings_and_max_tokens(plain, lookahead, code_prompts):
    prompt = code_prompts[0]
    ref, la, streamed = _both_and_streamed(plain, lookahead,
                                           lambda s, stream=False: complete(s, prompt, stream, stop=["return"]))
    assert la[:2] == ref[:2] and ref[1] == "stop" and "return" not in la[0]
    assert streamed[:2] == ref[:2]
    ref, la = _both(plain, lookahead, lambda s: complete(s, prompt, max_tokens=7))
    assert la[:2] == ref[:2] and la[1] == "length"
    assert la[2].usage.completion_tokens == 7


def test_n_greater_than_one(plain, lookahead, code_prompts):
    # Greedy n > 1 is refused by vLLM itself, with or without speculation.
    for server in (plain, lookahead):
        with pytest.raises(openai.BadRequestError, match="n must be 1 when using greedy sampling"):
            complete(server, code_prompts[0], n=2)
    # Sampled n > 1 works with lookahead: n independent choices.
    r = lookahead.client().completions.create(
        model=lookahead.model, prompt=code_prompts[1], max_tokens=16, temperature=0.8, seed=1, n=2,
        extra_body={"vllm_xargs": {"lookahead_enabled": True}},  # seeded: drafts only where enabled
    )
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert all(c.text for c in r.choices) and r.usage.completion_tokens > 16


def test_logit_bias_and_min_p_served_as_plain(plain, lookahead, code_prompts):
    """vLLM answers ``logit_bias`` and ``min_p`` with a 400 under any speculative method; the lookahead server
    serves them, drafting nothing for those requests, with plain's text."""
    prompt = code_prompts[0]
    first = plain.client().completions.create(model=plain.model, prompt=prompt, max_tokens=1, temperature=0,
                                              extra_body={"return_token_ids": True}).choices[0]
    banned = {"logit_bias": {str(first.token_ids[0]): -100}}  # greedy's first token banned
    ref, la = _both(plain, lookahead, lambda s: complete(s, prompt, max_tokens=24, **banned))
    assert la[:2] == ref[:2] and not ref[0].startswith(first.text)  # the bias moved the text
    assert spec_metrics(la[2])["num_draft_tokens"] == 0
    sampled = {"temperature": 1.0, "seed": 5, "extra_body": {"min_p": 0.3}}
    ref, la = _both(plain, lookahead, lambda s: complete(s, prompt, max_tokens=24, **sampled))
    assert la[:2] == ref[:2] and spec_metrics(la[2])["num_draft_tokens"] == 0


PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


def _api_shapes(server, prompt: str, token_ids: list[int]) -> dict:
    """One answer (greedy) per request shape a client may send besides plain completions and chat."""
    client, model = server.client(), server.model
    out = {"token_ids": client.completions.create(model=model, prompt=token_ids, max_tokens=24,
                                                  temperature=0).choices[0].text}
    text, tokens = "", []  # chunks differ (a lookahead step may emit several tokens): their concatenation may not
    for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=32, temperature=0, stream=True,
                                           logprobs=2, stop=["\n\n", "return"]):
        for c in chunk.choices:
            text += c.text
            tokens += c.logprobs.tokens if c.logprobs else []
    out["stream_logprobs_stop"] = (text, tokens)
    r = client.chat.completions.create(model=model, temperature=0, max_tokens=40, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
        messages=[{"role": "user", "content": "Alice is 30. Reply as JSON."}])
    out["json_schema"] = r.choices[0].message.content
    r = client.chat.completions.create(model=model, temperature=0, max_tokens=12,
                                       extra_body={"structured_outputs": {"regex": "[0-9]{3}-[0-9]{4}"}},
                                       messages=[{"role": "user", "content": "Give a phone number."}])
    out["regex"] = r.choices[0].message.content
    out["responses"] = client.responses.create(model=model, input="Count from one to twelve in words.",
                                               max_output_tokens=40, temperature=0).output_text
    return out


def test_other_api_shapes_identical_to_plain(plain, lookahead, code_prompts):
    """Token-id prompts, streamed logprobs with stop strings, structured output (a JSON schema, a regex) and the
    Responses API: the lookahead server answers each as plain does."""
    prompt = code_prompts[2]
    ids = plain.client().completions.create(model=plain.model, prompt=prompt, max_tokens=1, temperature=0,
                                            extra_body={"return_token_ids": True}).choices[0].prompt_token_ids
    ref, la = _both(plain, lookahead, lambda s: _api_shapes(s, prompt, ids))
    assert la == ref
    assert re.fullmatch("[0-9]{3}-[0-9]{4}", ref["regex"]) and '"age"' in ref["json_schema"]  # formats held


def test_per_request_off_identical_and_undrafted(plain, lookahead, code_prompts):
    prompt = code_prompts[1]
    before = scrape(lookahead)
    off = {"vllm_xargs": {"lookahead_enabled": False}}
    ref, la = _both(plain, lookahead, lambda s: complete(s, prompt, extra_body=off))
    assert la[:2] == ref[:2]
    m = spec_metrics(la[2])
    assert m["num_draft_tokens"] == 0 and m["num_spec_steps"] == 0
    after = scrape(lookahead)
    assert after["vllm:spec_decode_num_draft_tokens_total"] == before["vllm:spec_decode_num_draft_tokens_total"]
    assert after["vllm:spec_decode_num_drafts_total"] == before["vllm:spec_decode_num_drafts_total"]
    # The same request with lookahead on does draft (so "zero" above means something).
    assert spec_metrics(complete(lookahead, prompt, max_tokens=16)[2])["num_draft_tokens"] > 0


def test_per_request_cap(plain, lookahead, code_prompts):
    prompt = code_prompts[2]
    cap = {"vllm_xargs": {"lookahead_max_draft_tokens": 1}}
    ref, la = _both(plain, lookahead, lambda s: complete(s, prompt, max_tokens=24, extra_body=cap))
    assert la[:2] == ref[:2]
    m = spec_metrics(la[2])
    assert 0 < m["num_draft_tokens"] <= m["num_spec_steps"]  # at most one draft token per step


def test_one_tenant_does_not_speed_up_another(lookahead, chat_questions, code_prompts):
    """Tenant isolation seen from outside: with vLLM's ``cache_salt`` in the request body, what
    tenant A's requests wrote does not make tenant B's same requests accept more drafts (B
    accepts about what A did when A's text was new), while A asking again accepts far more (its
    own outputs: the control, what a salt-blind drafter would also give B)."""
    def accepted(salt: str) -> int:
        total = 0
        for question in chat_questions:
            total += spec_metrics(chat(lookahead, question, max_tokens=64, extra_body={"cache_salt": salt})[2])[
                "num_accepted_draft_tokens"]
        total += spec_metrics(complete(lookahead, code_prompts[1], max_tokens=64, extra_body={"cache_salt": salt})[2])[
            "num_accepted_draft_tokens"]
        return total

    first_a, b, again_a = accepted("tenant-a"), accepted("tenant-b"), accepted("tenant-a")
    assert again_a > 1.5 * first_a  # a tenant's own outputs are there to draft from
    assert b < (first_a + again_a) / 2, (first_a, b, again_a)  # another tenant's are not


@pytest.mark.parametrize(
    "xargs, message",
    [
        ({"lookahead_enabeld": 0}, r"unknown per-request lookahead key\(s\) \['lookahead_enabeld'\]"),
        ({"lookahead_max_draft_tokens": 999}, r"lookahead_max_draft_tokens=999: must be an integer in \[0, 256\]"),
        ({"lookahead_max_draft_tokens": "two"}, r"lookahead_max_draft_tokens='two': must be an integer"),
        ({"lookahead_enabled": "off"}, r"lookahead_enabled='off': must be true or false"),
    ],
)
def test_bad_per_request_field_is_400_and_server_keeps_serving(lookahead, code_prompts, xargs, message):
    with pytest.raises(openai.BadRequestError, match=message) as info:
        complete(lookahead, code_prompts[0], max_tokens=4, extra_body={"vllm_xargs": xargs})
    assert info.value.status_code == 400
    with pytest.raises(openai.BadRequestError, match=message):
        chat(lookahead, "hi", max_tokens=4, extra_body={"vllm_xargs": xargs})
    assert complete(lookahead, code_prompts[0], max_tokens=4)[2].usage.completion_tokens == 4


def test_metrics_move_by_what_responses_imply(lookahead, code_prompts):
    before = settled_scrape(lookahead)
    drafts = accepted = tokens = steps = 0
    for prompt in code_prompts[:3]:
        _, _, r = complete(lookahead, prompt)
        m = spec_metrics(r)
        drafts, accepted, steps = drafts + m["num_draft_tokens"], accepted + m["num_accepted_draft_tokens"], steps + m["num_spec_steps"]
        tokens += r.usage.completion_tokens
    after = scrape(lookahead)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert accepted > 0
    assert delta("vllm:spec_decode_num_draft_tokens_total") == drafts
    assert delta("vllm:spec_decode_num_accepted_tokens_total") == accepted
    assert delta("vllm:spec_decode_num_drafts_total") == steps
    per_pos = sum(v - before.get(k, 0.0) for k, v in after.items()
                  if k.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total"))
    assert per_pos == accepted
    assert delta("vllm:generation_tokens_total") == tokens
    # Our own series: published twice a second by the engine's worker process.
    # (Over clean requests they agree exactly; a request stopped by a stop string can have one
    # more step sampled in the worker than the scheduler keeps, so totals may differ slightly.)
    ours = _wait_for(lookahead, lambda m: m.get("lookahead_accepted_tokens_total", 0.0)
                     - before.get("lookahead_accepted_tokens_total", 0.0) >= accepted)
    assert ours["lookahead_accepted_tokens_total"] - before.get("lookahead_accepted_tokens_total", 0.0) == accepted
    # We hand vLLM at least what it scheduled (it drops drafts past a request's end).
    assert ours["lookahead_draft_tokens_total"] - before.get("lookahead_draft_tokens_total", 0.0) >= drafts
    assert ours["lookahead_drafter_bytes"] > 0  # the drafter's memory (draft index, trie)
    assert ours["lookahead_drafter_seconds_count"] > before.get("lookahead_drafter_seconds_count", 0.0)
    assert ours["lookahead_draft_tokens_per_step_sum"] > before.get("lookahead_draft_tokens_per_step_sum", 0.0)
    assert ours["lookahead_accepted_tokens_per_step_count"] == ours["lookahead_steps_total"]
    assert re.search(r"lookahead: drafted [\d.]+ nodes/step, accepted [\d.]+ tok/step, trie \d+ nodes",
                     lookahead.log_text())


def test_load_adaptation_stops_drafting_under_concurrency(plain, lookahead, code_prompts):
    # The lookahead server stops drafting at 4 running requests (tests/serve/conftest.py). 16
    # concurrent requests of 40 tokens: with 8 of 24 tokens one clean-clone CI run counted no
    # load-skipped step (timing on a 2-core machine), so the requests now overlap for longer.
    # Plain's requests run at the same time (one core each), which only stretches that overlap.
    before = scrape(lookahead)
    prompts = code_prompts * 4
    with ThreadPoolExecutor(2 * len(prompts)) as pool:
        outs = [pool.submit(complete, lookahead, p, max_tokens=40) for p in prompts]
        refs = [pool.submit(complete, plain, p, max_tokens=40) for p in prompts]
        outs, refs = [f.result() for f in outs], [f.result() for f in refs]
    assert [o[:2] for o in outs] == [r[:2] for r in refs]
    after = _wait_for(lookahead, lambda m: m.get('lookahead_skipped_request_steps_total{reason="load"}', 0.0)
                      > before.get('lookahead_skipped_request_steps_total{reason="load"}', 0.0))
    assert after['lookahead_skipped_request_steps_total{reason="load"}'] > \
        before.get('lookahead_skipped_request_steps_total{reason="load"}', 0.0)


def settled_scrape(server) -> dict[str, float]:
    """A scrape after our engine-side snapshot has caught up (it is written every 0.5 s)."""
    import time

    from lookahead_vllm.vllm.metrics import PUBLISH_INTERVAL_S

    time.sleep(2 * PUBLISH_INTERVAL_S + 0.2)
    return scrape(server)


def _wait_for(server, predicate, timeout_s: float = 10.0) -> dict[str, float]:
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        m = scrape(server)
        if predicate(m) or time.monotonic() > deadline:
            return m
        time.sleep(0.25)


@pytest.mark.slow
def test_several_api_servers_each_serve_the_lookahead_series(plain, smollm2_dir, code_prompts, tmp_path):
    """``--api-server-count 2`` (prometheus multiprocess mode, as with data parallel): greedy
    output stays plain's, and every scrape, whichever API server answers it, carries the
    ``lookahead_*`` series with the engine's totals, which agree with the responses."""
    from tests.serve.conftest import start_server, wait_healthy

    server = start_server("two-api-servers", smollm2_dir,
                          ["--speculative-model", "lookahead", "--api-server-count", "2",
                           "--per-request-spec-decode-metrics", "summary"], tmp_path)
    try:
        wait_healthy([server])
        accepted = 0
        for prompt in code_prompts[:3]:
            text, _, r = complete(server, prompt)
            assert text == complete(plain, prompt)[0]
            accepted += spec_metrics(r)["num_accepted_draft_tokens"]
        assert accepted > 0
        api_servers = _api_server_pids(server)
        assert sorted(api_servers) == ["APIServer_0", "APIServer_1"]
        for name in api_servers:  # each scrape answered by one known API server: the other is stopped
            others = [pid for other, pid in api_servers.items() if other != name]
            for pid in others:
                os.kill(pid, signal.SIGSTOP)
            try:
                m = _wait_for(server, lambda m: m.get("lookahead_accepted_tokens_total", 0) >= accepted)
            finally:
                for pid in others:
                    os.kill(pid, signal.SIGCONT)
            assert m["lookahead_accepted_tokens_total"] == accepted and m["lookahead_steps_total"] > 0, name
    finally:
        server.stop()


def _api_server_pids(server) -> dict[str, int]:
    """The API server processes of ``server`` (its process group), by the title vLLM gives them."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getpgid(int(entry.name)) != server.proc.pid:
                continue
            title = (entry / "cmdline").read_bytes().decode(errors="replace")
        except (OSError, ProcessLookupError):
            continue
        if match := re.search(r"APIServer_\d+", title):
            found[match.group(0)] = int(entry.name)
    return found
