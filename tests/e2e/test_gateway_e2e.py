"""The whole request path, end to end: the official `openai` client, unchanged, against the gateway of a real
stack (nats-server + gateway, tokenizer, scheduler, detokenizer, each its own OS process) serving the demo
model; outputs equal the offline LLM on the same model (greedy)."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import nats
import openai
import pytest
from conftest import TEST_SCHEDULER_ARGS
from kubesgl import LLM, SamplingParams
from kubesgl.bench import serve as bench_serve
from kubesgl.cli import build_parser
from kubesgl.launcher import Stack
from kubesgl.protocol import SchedulerStats, stats_subject
from kubesgl.shell import ChatSession, repl, sampling_of
from kubesgl.text.tokenizer import ModelTokenizer
from kubesgl.values.sampling import LogprobOptions
from prompt_toolkit import PromptSession
from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput
from support.numerics import logprob_tolerance
from support.waiting import wait_until

MODEL = "demo"
CONTEXT = 256
PROMPTS = ["The quick brown fox", "Kubernetes schedules pods onto nodes", "hello"]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def served(stack_factory: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = stack_factory(
        tmp_path_factory.mktemp("e2e"),
        scheduler_args=(*TEST_SCHEDULER_ARGS, "--context-length", str(CONTEXT)),
    )
    try:
        yield stack
    finally:
        stack.stop(timeout_s=10)


@pytest.fixture(scope="module")
def url(served: Stack) -> str:
    return served.gateway_urls[0]


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir: str) -> ModelTokenizer:
    return ModelTokenizer.load(demo_model_dir)


@pytest.fixture(scope="module")
def offline(demo_model_dir: str) -> Iterator[LLM]:
    llm = LLM(demo_model_dir, device="cpu", num_pages=4096)
    try:
        yield llm
    finally:
        llm.shutdown()


def _greedy(llm: LLM, ids: list[int], max_tokens: int = MAX_TOKENS, **kw: Any) -> dict[str, Any]:
    return llm.generate([ids], SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw))[0]


def _chat_ids(tokenizer: ModelTokenizer, content: str) -> list[int]:
    return tokenizer.render_chat([{"role": "user", "content": content}])


def test_chat_matches_the_offline_llm_streaming_or_not(client, offline, tokenizer) -> None:
    for prompt in PROMPTS:
        ref = _greedy(offline, _chat_ids(tokenizer, prompt))
        expected = tokenizer.decode(ref["token_ids"])
        messages = [{"role": "user", "content": prompt}]
        r = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0
        )
        assert r.choices[0].message.content == expected
        assert r.choices[0].finish_reason == ref["finish_reason"]
        assert r.usage.prompt_tokens == ref["prompt_tokens"]
        assert r.usage.completion_tokens == len(ref["token_ids"])
        assert r.usage.prompt_tokens_details.cached_tokens is not None
        stream = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref["finish_reason"]
        assert chunks[-1].usage.completion_tokens == len(ref["token_ids"])


def test_completions_accept_text_token_and_batched_prompts(client, offline, tokenizer) -> None:
    ids = [tokenizer.encode(p) for p in PROMPTS]
    expected = [tokenizer.decode(_greedy(offline, i)["token_ids"]) for i in ids]
    r = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == expected
    assert r.usage.prompt_tokens == sum(len(i) for i in ids)
    r = client.completions.create(model=MODEL, prompt=ids[0], max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == expected[0]
    r = client.completions.create(model=MODEL, prompt=ids[1:], max_tokens=MAX_TOKENS, temperature=0)
    assert [c.text for c in r.choices] == expected[1:]
    stream = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == expected[0]


def test_n_2_gives_two_indexed_choices(client, offline, tokenizer) -> None:
    ref = _greedy(offline, _chat_ids(tokenizer, PROMPTS[0]))
    expected = tokenizer.decode(ref["token_ids"])
    messages = [{"role": "user", "content": PROMPTS[0]}]
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0, n=2
    )
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert [c.message.content for c in r.choices] == [expected, expected]
    assert r.usage.completion_tokens == 2 * len(ref["token_ids"])
    assert r.usage.prompt_tokens == ref["prompt_tokens"]  # the prompt counts once
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0, n=2, stream=True
    )
    texts = ["", ""]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == [expected, expected]


def test_seeded_sampling_is_reproducible_and_matches_offline(client, offline, tokenizer) -> None:
    ids = tokenizer.encode(PROMPTS[1])
    ref = offline.generate([ids], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_k=20, seed=11))[
        0
    ]
    r = client.completions.create(
        model=MODEL,
        prompt=PROMPTS[1],
        max_tokens=MAX_TOKENS,
        temperature=0.9,
        seed=11,
        extra_body={"top_k": 20},
    )
    assert r.choices[0].text == tokenizer.decode(ref["token_ids"])


def test_stop_strings_truncate_the_offline_text(client, offline, tokenizer) -> None:
    ids = tokenizer.encode(PROMPTS[1])
    full = tokenizer.decode(_greedy(offline, ids, max_tokens=24)["token_ids"])
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), f"pick a visible stop string from {full!r}"
    expected = full[: full.index(stop)]
    r = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    stream = client.completions.create(
        model=MODEL, prompt=PROMPTS[1], max_tokens=24, temperature=0, stop=stop, stream=True
    )
    chunks = [c for c in stream if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_logprobs_match_the_offline_llm(client, offline, tokenizer, demo_model_dir) -> None:
    ids = _chat_ids(tokenizer, PROMPTS[0])
    ref = _greedy(offline, ids, logprobs=LogprobOptions(top=2))
    tol = logprob_tolerance(demo_model_dir, context=len(ids) + MAX_TOKENS)  # another batch: other rounding
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPTS[0]}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == [tokenizer.token_text(t) for t in ref["token_ids"]]
    for got, want in zip(content, ref["logprobs"], strict=True):
        assert got.logprob == pytest.approx(want.logprob, rel=0, abs=tol)
        assert len(got.top_logprobs) == 2
        assert got.top_logprobs[0].logprob == pytest.approx(want.top[0][1], rel=0, abs=tol)
    c = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0, logprobs=1)
    assert len(c.choices[0].logprobs.token_logprobs) == 4 and len(c.choices[0].logprobs.top_logprobs[0]) == 1


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_echo_returns_the_prompt_with_the_offline_prompt_logprobs(
    client, offline, tokenizer, stream, demo_model_dir
) -> None:
    """echo + logprobs: the prompt (as sent, or decoded from token ids) and its tokens' logprobs, the first
    null, then the completion; equal to the offline LLM's prompt logprobs, streamed or whole."""
    ids = tokenizer.encode(PROMPTS[1])
    ref = _greedy(offline, ids, max_tokens=3, logprobs=LogprobOptions(top=2, prompt_start=0))
    for prompt in (PROMPTS[1], ids):
        body = {"prompt": prompt, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 2}
        r = client.completions.create(model=MODEL, stream=stream, **body)
        choices = [c.choices[0] for c in r] if stream else r.choices
        text = "".join(c.text for c in choices)
        lps = [
            e
            for c in choices
            if c.logprobs
            for e in zip(c.logprobs.tokens, c.logprobs.token_logprobs, strict=True)
        ]
        assert text == PROMPTS[1] + tokenizer.decode(ref["token_ids"])
        assert [t for t, _ in lps] == [tokenizer.token_text(t) for t in ids + ref["token_ids"]]
        want = [e.logprob for e in ref["prompt_logprobs"] + ref["logprobs"]]
        assert lps[0][1] is None and want[0] is None
        tol = logprob_tolerance(demo_model_dir, context=len(ids) + 3)  # another batch: other rounding
        assert [lp for _, lp in lps[1:]] == pytest.approx(want[1:], rel=0, abs=tol)
    # max_tokens 0: the prompt alone (what lm-evaluation-harness's loglikelihood asks for).
    only = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=0)
    assert only.choices[0].text == PROMPTS[1] and only.usage.completion_tokens == 0
    assert len(only.choices[0].logprobs.token_logprobs) == len(ids)


def test_a_repeated_prompt_reports_cached_tokens(client) -> None:
    messages = [{"role": "user", "content": "a prompt long enough to be worth caching " * 3}]
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens > 0


def test_no_max_tokens_means_the_rest_of_the_context(client, tokenizer) -> None:
    prompt = "count " * 200
    r = client.completions.create(model=MODEL, prompt=prompt, temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens + r.usage.completion_tokens == CONTEXT


async def test_32_concurrent_streams_complete_with_in_order_text(url, offline, tokenizer) -> None:
    prompts = [f"request number {i}: " + "lorem ipsum " * (i % 7) for i in range(32)]
    refs = offline.generate(
        [tokenizer.encode(p) for p in prompts], SamplingParams(max_tokens=8, temperature=0.0)
    )
    expected = [tokenizer.decode(r["token_ids"]) for r in refs]
    aclient = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)

    async def one(prompt: str) -> tuple[str, str | None]:
        stream = await aclient.completions.create(
            model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True
        )
        text, reason = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                reason = chunk.choices[0].finish_reason or reason
        return text, reason

    results = await asyncio.gather(*(one(p) for p in prompts))
    await aclient.close()
    assert [t for t, _ in results] == expected
    assert all(r is not None for _, r in results)


BAD_INPUTS = [
    (b'{"model": "demo", "messages": [', 400, None),
    (json.dumps({"model": "demo", "messages": "hi"}).encode(), 400, "messages"),
    (
        json.dumps(
            {"model": "demo", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}
        ).encode(),
        400,
        "temperature",
    ),
    (json.dumps({"model": "nope", "messages": [{"role": "user", "content": "x"}]}).encode(), 404, "model"),
    (
        json.dumps(
            {"model": "demo", "messages": [{"role": "user", "content": "x " * 400}], "max_tokens": 4}
        ).encode(),
        400,
        "messages",
    ),
    (
        json.dumps(
            {"model": "demo", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}
        ).encode(),
        400,
        "max_tokens",
    ),
    (
        json.dumps(
            {"model": "demo", "messages": [{"role": "user", "content": "x"}], "temperature": -0.5}
        ).encode(),
        400,
        "temperature",
    ),
    (
        json.dumps({"model": "demo", "messages": [{"role": "user", "content": "x"}], "n": 0}).encode(),
        400,
        "n",
    ),
    (
        json.dumps(
            {"model": "demo", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}
        ).encode(),
        400,
        "tools[0]",
    ),
    (
        json.dumps(
            {"model": "demo", "messages": [{"role": "user", "content": "x"}], "frobnicate": True}
        ).encode(),
        400,
        "frobnicate",
    ),
    # One path syntax in `param` (OpenAI's), however deep the field: once `unsupported field: None` and
    # `tools.0` with a Python-repr path in the message.
    (
        json.dumps({"model": "demo", "messages": [{"role": "user", "content": "x"}], "": 1}).encode(),
        400,
        '[""]',
    ),
    (
        json.dumps(
            {
                "model": "demo",
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"maximum": 2**64}}}],
            }
        ).encode(),
        400,
        "tools[0].function.parameters.maximum",
    ),
    (
        json.dumps({"model": "demo", "messages": [{"role": "user", "content": 5}]}).encode(),
        400,
        "messages[0].content",
    ),
]


def test_bad_inputs_get_openai_errors_and_the_server_keeps_serving(url, client) -> None:
    with httpx.Client(base_url=url, timeout=60) as http:
        for body, status, param in BAD_INPUTS:
            r = http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
            assert r.status_code == status, (body[:80], r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"]
            if param is not None:
                assert err["param"] == param, (body[:80], err)
        stream = http.post(
            "/v1/chat/completions",
            json={"model": "demo", "messages": [{"role": "user", "content": "x " * 400}], "stream": True},
        )
        assert stream.status_code == 400 and stream.json()["error"]["code"] == "context_length_exceeded"
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "ok"}], max_tokens=2
    )
    assert r.choices[0].finish_reason in ("stop", "length")


async def _stats(served: Stack) -> SchedulerStats:
    instance = next(s.instance_id for s in served.services.values() if s.kind == "scheduler")
    nc = await nats.connect(served.nats_url)
    try:
        msg = await nc.request(stats_subject(str(instance)), b"", timeout=10)
        return SchedulerStats.from_bytes(msg.data)
    finally:
        await nc.close()


async def _settled(served: Stack, baseline: int, timeout_s: float = 15.0) -> SchedulerStats:
    end = time.monotonic() + timeout_s
    while True:
        s = await _stats(served)
        if (s.running, s.queued, s.available_pages, s.active_rids) == (
            0,
            0,
            baseline,
            [],
        ) or time.monotonic() > end:
            return s
        await asyncio.sleep(0.2)


async def test_client_disconnect_mid_stream_returns_the_page_pool_to_baseline(served, url) -> None:
    baseline = (await _stats(served)).available_pages
    body = {
        "model": MODEL,
        "prompt": "disconnect me " * 20,
        "max_tokens": 200,
        "ignore_eos": True,
        "stream": True,
    }
    async with (
        httpx.AsyncClient(base_url=url, timeout=60) as http,
        http.stream("POST", "/v1/completions", json=body) as s,
    ):
        seen = 0
        lines = s.aiter_lines()
        async for line in lines:
            seen += line.startswith("data: ")
            if seen >= 3:
                break
        during = await _stats(served)
    # The stream is closed: the gateway sees the disconnect and aborts; the scheduler frees the pages.
    after = await _settled(served, baseline)
    assert during.running == 1 and during.available_pages < baseline
    assert (after.running, after.queued, after.active_rids) == (0, 0, [])
    assert after.available_pages == baseline


def test_native_generate_models_ready_and_metrics(url, offline, tokenizer, demo_model_dir) -> None:
    ids = tokenizer.encode(PROMPTS[0])
    expected = _greedy(offline, ids, max_tokens=6)
    with httpx.Client(base_url=url, timeout=60) as http:
        body = {"text": PROMPTS[0], "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
        r = http.post("/generate", json=body).json()
        assert r["output_ids"] == expected["token_ids"] and r["text"] == tokenizer.decode(
            expected["token_ids"]
        )
        assert (
            r["meta_info"]["prompt_tokens"] == len(ids)
            and r["meta_info"]["finish_reason"]["type"] == "length"
        )
        # SGLang's logprob_start_len: the input tokens' logprobs from there on, as the offline engine has them.
        scored = _greedy(offline, ids, max_tokens=1, logprobs=LogprobOptions(top=1, prompt_start=1))
        lp_body = {**body, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
        lp_body |= {"return_logprob": True, "top_logprobs_num": 1, "logprob_start_len": 1}
        meta = http.post("/generate", json=lp_body).json()["meta_info"]
        assert [e[1] for e in meta["input_token_logprobs"]] == ids[1:]
        want = [e.logprob for e in scored["prompt_logprobs"]]
        tol = logprob_tolerance(demo_model_dir, context=len(ids) + 1)  # another batch: other rounding
        assert [e[0] for e in meta["input_token_logprobs"]] == pytest.approx(want, rel=0, abs=tol)
        assert len(meta["input_top_logprobs"][0]) == 1 and len(meta["output_token_logprobs"]) == 1
        with http.stream("POST", "/generate", json={**body, "stream": True}) as s:
            events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["text"] == r["text"]
        models = http.get("/v1/models").json()
        assert models["data"][0]["id"] == MODEL and models["data"][0]["owned_by"] == "kubesgl"
        assert http.get("/ready").status_code == 200 and http.get("/health").status_code == 200
        metrics = http.get("/metrics").text
        assert (
            'kubesgl_gateway_requests_total{model="demo",route="/v1/chat/completions",status="200"}'
            in metrics
        )
        assert "kubesgl_gateway_time_to_first_token_seconds_bucket" in metrics


def test_ttft_is_a_streams_own_and_a_non_streamed_answer_has_none(served: Stack, client) -> None:
    """A non-streamed answer sends its first token with its last: its access line says `ttft=-` (it used to
    repeat the duration) and it adds nothing to the gateway's TTFT histogram; a stream's line times its first
    token."""
    ttft_count = "kubesgl_gateway_time_to_first_token_seconds_count"

    def ttfts() -> float:
        metrics = httpx.get(f"{served.gateway_urls[0]}/metrics", timeout=30).text
        return sum(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(ttft_count))

    def access_line(rid: str) -> str:
        log = (served.workdir / "gateway-0.log").read_text(errors="replace")
        return next((line for line in log.splitlines() if f"rid={rid} " in line), "")

    messages = [{"role": "user", "content": "time me"}]
    before = ttfts()
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    line = wait_until(lambda: access_line(whole.id), f"the access line of {whole.id}")
    assert " ttft=- " in line, line
    assert ttfts() == before
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, stream=True)
    rid = [chunk.id for chunk in stream][0]
    line = wait_until(lambda: access_line(rid), f"the access line of {rid}")
    ttft = float(line.split(" ttft=")[1].split("s ")[0])
    duration = float(line.split(" duration=")[1].removesuffix("s"))
    assert 0 < ttft <= duration, line
    assert ttfts() == before + 1


def test_shell_streams_replies_keeps_history_and_resets(url, offline, tokenizer) -> None:
    def expected(messages: list[dict[str, str]]) -> tuple[str, str]:
        """The reply's text, and the line the shell prints for it (with its note when cut at max_tokens)."""
        out = _greedy(offline, tokenizer.render_chat(messages), max_tokens=6)
        text = tokenizer.decode(out["token_ids"])
        return text, text + ("\n(cut at 6 tokens: --max-tokens)" if out["finish_reason"] == "length" else "")

    first, first_shown = expected([{"role": "user", "content": "hello"}])
    _, second_shown = expected(
        [
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": first},
            {"role": "user", "content": "and then?"},
        ]
    )
    out = io.StringIO()
    with create_pipe_input() as keys, httpx.Client(base_url=url, timeout=60) as http:
        keys.send_text("hello\nand then?\n/reset\nhello\n/exit\n")
        session = ChatSession(http, MODEL, sampling={"max_tokens": 6, "temperature": 0})
        assert repl(session, PromptSession(input=keys, output=DummyOutput()), out) == 0
    banner, rest = out.getvalue().split("\n", 1)
    assert MODEL in banner
    assert rest == f"{first_shown}\n{second_shown}\n(conversation cleared)\n{first_shown}\n"


def test_the_shell_caps_replies_by_default_so_it_never_streams_forever() -> None:
    parse = build_parser("shell").parse_args
    assert sampling_of(parse(["shell"])) == {"max_tokens": 256}
    assert sampling_of(parse(["shell", "--max-tokens", "0", "--temperature", "0"])) == {"temperature": 0.0}


def test_bench_serve_drives_the_gateway_and_reports_latencies(url, demo_model_dir, capsys, tmp_path) -> None:
    """With `--model`, the offline LLM runs the same requests twice: all at once, then each when its served
    request was written (the burst's connections opened first, so those writes leave together). The burst hook
    runs once on each side of the burst, its clock inside the hook's two runs."""
    parser = argparse.ArgumentParser()
    bench_serve.add_arguments(parser)
    flags = ["--url", url, "--num-seqs", "4", "--max-input", "32", "--max-output", "20"]
    hook_log = tmp_path / "hook.log"
    hook = f'echo "$BURST_PHASE $(date +%s.%N)" >> {hook_log}'
    args = parser.parse_args([*flags, "--model", demo_model_dir, "--num-pages", "512", "--burst-hook", hook])
    assert bench_serve.main(args) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    (phase0, t0), (phase1, t1) = (line.split() for line in hook_log.read_text().splitlines())
    assert (phase0, phase1) == ("start", "end") and float(t1) - float(t0) >= res["seconds"]
    assert res["failed"] == 0 and res["output_tokens"] == res["requested_output_tokens"]
    assert 0 < res["ttft_p50_s"] <= res["ttft_p99_s"] and res["itl_p50_s"] > 0 and res["output_tok_s"] > 0
    assert res["tokens_per_event"] >= 1  # every event with text carries at least one token
    assert res["connect_first"] and 0 <= res["client_send_p50_s"] <= res["client_send_max_s"]
    assert "arrivals" not in res and res["offline_output_tok_s"] > 0
    assert 0 < res["offline_arrival_ttft_p50_s"] <= res["offline_arrival_ttft_p99_s"]
    assert res["ttft_after_send_p99_over_offline_same_arrival"] == round(
        res["ttft_after_send_p99_s"] / res["offline_arrival_ttft_p99_s"], 3
    )


def test_bench_serve_shared_prefix_reports_the_cache_hit_rate(url, capsys) -> None:
    parser = argparse.ArgumentParser()
    bench_serve.add_arguments(parser)
    flags = "--workload shared-prefix --groups 2 --conversations 2 --turns 2 --prefix-len 48 --turn-input 8"
    args = parser.parse_args(["--url", url, *flags.split(), "--turn-output", "4"])
    assert bench_serve.main(args) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["requests"] == 8 and res["failed"] == 0 and res["output_tokens"] == 8 * 4
    # Every second turn finds at least its own first turn's prompt (prefix + user tokens) cached.
    assert res["cached_tokens"] >= 4 * (48 + 8) and 0 < res["cache_hit_rate"] < 1
    assert 0 < res["ttft_p50_s"] <= res["ttft_p99_s"]
