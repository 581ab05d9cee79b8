"""The SDK against real draft and target services on loopback (multi-process: marked slow)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

import grpc
import pytest
from conftest_sdk import AUTH_TOKEN, Stack, TCPProxy, free_port, wait_until

import specsplit
from specsplit import AsyncClient, Client, FinishReason, GenerateOptions, RetryPolicy

pytest_plugins = ["conftest_sdk"]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPT = [3, 14, 15, 92, 65]
FINISHED = "specsplit_requests_finished_total"
RUNNING = "specsplit_running_requests"
WAITING = "specsplit_waiting_requests"


@pytest.fixture
def client(sdk_stack: Stack) -> Iterator[Client]:
    with Client(sdk_stack.target.address) as c:
        yield c


@pytest.fixture(scope="module")
def long_gen(sdk_stack: Stack) -> GenerateOptions:
    """A generation as long as the context allows: still running when a test leaves it."""
    with Client(sdk_stack.target.address) as c:
        max_new_tokens = c.model_info().max_context_length - len(PROMPT)
    return {"max_new_tokens": max_new_tokens, "ignore_eos": True}


def aborted(sdk_stack: Stack) -> float:
    return sdk_stack.target.metric(FINISHED, reason="aborted")


def assert_server_freed(sdk_stack: Stack, request_id: str, aborted_before: float) -> None:
    """The target saw the cancellation: one more aborted request, nothing running, the id is gone."""
    wait_until(
        lambda: aborted(sdk_stack) == aborted_before + 1, what="requests_finished_total{reason=aborted} + 1"
    )
    wait_until(lambda: sdk_stack.target.metric(RUNNING) == 0, what="running_requests == 0")
    with Client(sdk_stack.target.address) as c:
        assert c.abort(request_id) is False


def test_generate_stream_and_async_agree_with_plain_decoding(sdk_stack: Stack, client: Client) -> None:
    result = client.generate(PROMPT, max_new_tokens=24, ignore_eos=True, request_id="sdk-greedy")
    assert result.request_id == "sdk-greedy" and result.finish_reason == FinishReason.LENGTH
    assert len(result.token_ids) == 24 and result.usage.output_tokens == 24
    assert result.usage.prompt_tokens == len(PROMPT) and result.usage.steps >= 1
    assert 0 < result.usage.accepted_tokens <= result.usage.drafted_tokens  # speculation ran and paid

    # Greedy speculative decoding is lossless: plain decoding (k=0) gives the same tokens.
    plain = client.generate(PROMPT, max_new_tokens=24, ignore_eos=True, num_speculative_tokens=0)
    assert plain.token_ids == result.token_ids and plain.usage.drafted_tokens == 0
    assert plain.usage.acceptance_rate == 0.0  # a float even when nothing was drafted

    with client.stream(PROMPT, max_new_tokens=24, ignore_eos=True) as stream:
        deltas = list(stream)
    assert [t for d in deltas for t in d.token_ids] == result.token_ids
    assert (
        all(d.finish_reason is None for d in deltas[:-1]) and deltas[-1].finish_reason == FinishReason.LENGTH
    )
    assert deltas[-1].usage is not None and deltas[-1].usage.output_tokens == 24

    async def via_async() -> list[int]:
        async with AsyncClient(sdk_stack.target.address) as aclient:
            return (await aclient.generate(PROMPT, max_new_tokens=24, ignore_eos=True)).token_ids

    assert asyncio.run(via_async()) == result.token_ids


def test_model_info_and_health(sdk_stack: Stack, client: Client) -> None:
    info = client.model_info()
    assert info.vocab_size == 512 and info.target_tp_size == 1 and info.max_context_length > 0
    assert client.health() == "SERVING" and client.health("") == "SERVING"
    with pytest.raises(specsplit.APIError) as error:
        client.health("no.such.Service")
    assert error.value.code == grpc.StatusCode.NOT_FOUND

    async def via_async() -> tuple[specsplit.ModelInfo, str]:
        async with AsyncClient(sdk_stack.target.address) as aclient:
            return await aclient.model_info(), await aclient.health()

    assert asyncio.run(via_async()) == (info, "SERVING")


def test_dns_target_round_robin(sdk_stack: Stack) -> None:
    with Client(f"dns:///localhost:{sdk_stack.target.port}") as c:
        assert c.generate(PROMPT, max_new_tokens=4).usage.output_tokens >= 1


def test_abort_a_running_request(sdk_stack: Stack, client: Client, long_gen: GenerateOptions) -> None:
    with client.stream(PROMPT, **long_gen) as stream:
        deltas = iter(stream)
        first = next(deltas)
        assert first.token_ids
        assert client.abort(stream.request_id) is True
        rest = list(deltas)
    assert rest and rest[-1].finish_reason == FinishReason.ABORTED
    assert client.abort(stream.request_id) is False
    assert client.abort("never-existed") is False


def test_leaving_a_stream_early_cancels_on_the_server(
    sdk_stack: Stack, client: Client, long_gen: GenerateOptions
) -> None:
    before = aborted(sdk_stack)
    with client.stream(PROMPT, **long_gen) as stream:
        for delta in stream:
            assert delta.finish_reason is None
            break
    assert_server_freed(sdk_stack, stream.request_id, before)

    # A bare `break` out of the loop, without `with`, cancels as well.
    before = aborted(sdk_stack)
    stream = client.stream(PROMPT, **long_gen)
    for _ in stream:
        break
    assert_server_freed(sdk_stack, stream.request_id, before)


def test_exception_inside_a_stream_cancels_on_the_server(
    sdk_stack: Stack, client: Client, long_gen: GenerateOptions
) -> None:
    before = aborted(sdk_stack)
    with pytest.raises(KeyError), client.stream(PROMPT, **long_gen) as stream:
        for _ in stream:
            raise KeyError("consumer failed")
    assert_server_freed(sdk_stack, stream.request_id, before)


def test_cancelling_the_asyncio_task_cancels_on_the_server(
    sdk_stack: Stack, long_gen: GenerateOptions
) -> None:
    before = aborted(sdk_stack)
    started = asyncio.Event()
    request_ids: list[str] = []

    async def consume(aclient: AsyncClient) -> None:
        async with aclient.stream(PROMPT, **long_gen) as stream:
            request_ids.append(stream.request_id)
            async for _ in stream:
                started.set()

    async def main() -> None:
        async with AsyncClient(sdk_stack.target.address) as aclient:
            task = asyncio.create_task(consume(aclient))
            await asyncio.wait_for(started.wait(), 60)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(main())
    assert_server_freed(sdk_stack, request_ids[0], before)


def test_invalid_arguments_name_the_field(client: Client) -> None:
    cases = [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"top_k": -1}, "sampling.top_k"),
        ({"top_p": 1.5}, "sampling.top_p"),
        ({"temperature": -1.0}, "sampling.temperature"),
        ({"num_speculative_tokens": 1000}, "num_speculative_tokens"),
    ]
    for options, field in cases:
        with pytest.raises(specsplit.InvalidRequestError) as error:
            client.generate(PROMPT, **options)
        assert error.value.field == field, error.value
    with pytest.raises(specsplit.InvalidRequestError) as error:
        client.generate([10_000_000])
    assert error.value.field == "token_ids" and len(error.value.request_id or "") == 32  # the SDK's uuid
    with pytest.raises(specsplit.InvalidRequestError) as error:
        client.generate(PROMPT, max_new_tokens=0, request_id="bad-request")
    assert error.value.request_id == "bad-request" and "request bad-request" in str(error.value)


def test_call_mistakes_never_reach_the_server(sdk_stack: Stack, client: Client) -> None:
    """Each of these ran before as something else (128 tokens, no stops, stops 'a' and 's', ids [104,
    105]); now each is a TypeError and the server sees no request."""
    finished = sdk_stack.target.metric(FINISHED)
    mistakes: list[tuple[object, dict[str, object]]] = [
        (PROMPT, {"max_tokens": 5}),
        (PROMPT, {"stop": ["a"]}),
        (PROMPT, {"stop_strings": "as"}),
        (b"hi", {}),
    ]
    for prompt, options in mistakes:
        with pytest.raises(TypeError):
            client.generate(prompt, **options)  # type: ignore[arg-type]

    async def via_async() -> None:
        async with AsyncClient(sdk_stack.target.address) as aclient:
            for prompt, options in mistakes:
                with pytest.raises(TypeError):
                    await aclient.generate(prompt, **options)  # type: ignore[arg-type]

    asyncio.run(via_async())
    # The right spellings work (ignore_eos: a stop must not end it first).
    result = client.generate(PROMPT, max_new_tokens=5, ignore_eos=True, stop_strings=["\x00never"])
    assert len(result.token_ids) == 5
    assert sdk_stack.target.metric(FINISHED) == finished + 1


def test_async_client_built_outside_a_loop_serves_two_loops(sdk_stack: Stack, client: Client) -> None:
    reference = client.generate(PROMPT, max_new_tokens=6, ignore_eos=True).token_ids
    aclient = AsyncClient(sdk_stack.target.address)  # no running loop: the channel comes later

    async def use() -> list[int]:
        return (await aclient.generate(PROMPT, max_new_tokens=6, ignore_eos=True)).token_ids

    assert asyncio.run(use()) == reference
    assert asyncio.run(use()) == reference  # a second loop gets its own channel

    async def close_then_call() -> None:
        await aclient.close()
        with pytest.raises(specsplit.ClientClosedError):
            await aclient.health()

    asyncio.run(close_then_call())


def test_calls_after_close_raise_client_closed_error(sdk_stack: Stack) -> None:
    c = Client(sdk_stack.target.address)
    assert c.health() == "SERVING"
    c.close()
    with pytest.raises(specsplit.ClientClosedError):
        c.generate(PROMPT, max_new_tokens=2)
    with pytest.raises(specsplit.ClientClosedError):
        c.model_info()


def test_deadline_exceeded(client: Client, sdk_stack: Stack, long_gen: GenerateOptions) -> None:
    with pytest.raises(specsplit.DeadlineExceededError) as error:
        client.generate(PROMPT, timeout=0.3, **long_gen)
    assert error.value.request_id
    # The tokens streamed before the deadline stay on the exception: a prefix of the full generation.
    with pytest.raises(specsplit.DeadlineExceededError) as error:
        client.generate(PROMPT, timeout=3.0, request_id="slow", **long_gen)
    partial = error.value.token_ids
    assert error.value.request_id == "slow" and 0 < len(partial) < long_gen["max_new_tokens"]
    wait_until(lambda: sdk_stack.target.metric(RUNNING) == 0, what="running_requests == 0")
    assert client.generate(PROMPT, max_new_tokens=len(partial), ignore_eos=True).token_ids == partial
    with Client(sdk_stack.target.address, timeout=0.3) as short:  # the client default applies too
        with pytest.raises(specsplit.DeadlineExceededError):
            short.generate(PROMPT, **long_gen)
        assert len(short.generate(PROMPT, timeout=60, max_new_tokens=2).token_ids) == 2
    wait_until(lambda: sdk_stack.target.metric(RUNNING) == 0, what="running_requests == 0")


def test_unreachable_server_fails_fast(sdk_stack: Stack) -> None:
    """A client that never reached its server fails at once, retry policy or not (no backoff for a
    wrong address); wait_ready() is what waits for a server that is starting."""
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    for retry in (RetryPolicy(), None):
        start = time.monotonic()
        with Client(address, retry=retry) as c, pytest.raises(specsplit.UnavailableError, match=address):
            c.model_info()
        assert time.monotonic() - start < 1.0

    async def via_async() -> None:
        async with AsyncClient(address) as aclient:
            await aclient.generate(PROMPT)

    start = time.monotonic()
    with pytest.raises(specsplit.UnavailableError, match="cannot connect"):
        asyncio.run(via_async())
    assert time.monotonic() - start < 1.0
    # Power: the same call with the default policy on a connected client that loses its server is
    # retried (next test); wait_for_ready=True waits its deadline instead of failing fast.
    start = time.monotonic()
    with Client(address, wait_for_ready=True) as c, pytest.raises(specsplit.DeadlineExceededError):
        c.model_info(timeout=1.5)
    assert time.monotonic() - start >= 1.4


def test_retry_before_the_first_token_when_the_server_restarts(sdk_stack: Stack, client: Client) -> None:
    reference = client.generate(PROMPT, max_new_tokens=8, ignore_eos=True).token_ids
    for retry in (RetryPolicy(), None):
        proxy = TCPProxy(("127.0.0.1", sdk_stack.target.port))
        try:
            with Client(proxy.address, retry=retry) as c:
                assert c.model_info().vocab_size == 512  # connected once
                # The connection drops and the next one is refused before any byte: a restarting server.
                proxy.refuse_first = proxy.refused + 1
                proxy.sever()
                if retry is None:  # control: without the retry policy the same situation is an error
                    with pytest.raises(specsplit.UnavailableError):
                        c.generate(PROMPT, max_new_tokens=8, ignore_eos=True)
                else:
                    assert c.generate(PROMPT, max_new_tokens=8, ignore_eos=True).token_ids == reference
                    assert proxy.refused == 1 and proxy.accepted >= 3
        finally:
            proxy.close()


def test_the_draft_address_is_named_as_the_mistake(sdk_stack: Stack) -> None:
    draft = sdk_stack.draft.address
    with Client(draft) as c:
        for call in (c.model_info, lambda: c.generate(PROMPT, max_new_tokens=2)):
            with pytest.raises(specsplit.WrongServiceError, match="this is a draft service, not a target"):
                call()

    async def via_async() -> None:
        async with AsyncClient(draft) as aclient:
            await aclient.generate(PROMPT, max_new_tokens=2)

    with pytest.raises(specsplit.WrongServiceError, match=f"{draft}: this is a draft service"):
        asyncio.run(via_async())


def test_an_unknown_chat_role_is_refused_naming_the_field(client: Client) -> None:
    with pytest.raises(specsplit.InvalidRequestError, match="'wizard' is not one of") as error:
        client.chat([{"role": "user", "content": "hi"}, {"role": "wizard", "content": "abracadabra"}])
    assert error.value.field == "messages[1].role"


def test_no_retry_after_the_first_token(sdk_stack: Stack, long_gen: GenerateOptions) -> None:
    before = aborted(sdk_stack)
    finished_before = sdk_stack.target.metric(FINISHED)
    proxy = TCPProxy(("127.0.0.1", sdk_stack.target.port))
    received: list[int] = []
    # A generous policy, so that a replay would have every chance to happen.
    policy = RetryPolicy(max_attempts=5, initial_backoff_s=0.05, max_backoff_s=0.2)
    try:
        with Client(proxy.address, retry=policy) as c:
            stream = c.stream(PROMPT, **long_gen)
            with pytest.raises(specsplit.UnavailableError), stream:
                for delta in stream:
                    received += delta.token_ids
                    proxy.sever()  # the connection dies after the first tokens
            assert 0 < len(received) < long_gen["max_new_tokens"]
            time.sleep(1.5)  # well past every backoff of the policy
        # The server saw exactly one request, cancelled: a replay would be running or finished too.
        assert_server_freed(sdk_stack, stream.request_id, before)
        assert sdk_stack.target.metric(FINISHED) == finished_before + 1
    finally:
        proxy.close()


def test_overloaded_when_the_queue_is_full(sdk_stack: Stack, long_gen: GenerateOptions) -> None:
    # The secure target admits max_batch_size running requests plus one queued; the rest are refused.
    tls = sdk_stack.certs.client_tls()
    with Client(sdk_stack.secure_target.address, tls=tls, auth_token=AUTH_TOKEN) as c:
        batch = c.model_info().max_batch_size
        streams = [c.stream(PROMPT, **long_gen) for _ in range(batch + 3)]

        def drain(stream: specsplit.GenerateStream) -> str:
            try:
                for _ in stream:
                    pass
            except specsplit.OverloadedError:
                return "overloaded"
            except specsplit.RequestCancelledError:
                return "cancelled"
            return "finished"

        with ThreadPoolExecutor(len(streams)) as pool:
            futures = [pool.submit(drain, s) for s in streams]
            wait(futures, timeout=60, return_when=FIRST_COMPLETED)
            for s in streams:
                s.cancel()
            outcomes = [f.result() for f in futures]
        wait_until(
            lambda: sdk_stack.secure_target.metric(RUNNING) + sdk_stack.secure_target.metric(WAITING) == 0,
            what="the secure target's batch and queue empty",
        )
    assert outcomes.count("overloaded") >= 1, outcomes


def test_mtls_and_bearer_token(sdk_stack: Stack) -> None:
    target = sdk_stack.secure_target.address
    with Client(target, tls=sdk_stack.certs.client_tls(), auth_token=AUTH_TOKEN) as c:
        assert c.generate(PROMPT, max_new_tokens=3).usage.output_tokens >= 1
    with Client(target, tls=sdk_stack.certs.client_tls(), auth_token="wrong") as c:
        with pytest.raises(specsplit.AuthenticationError):
            c.generate(PROMPT, max_new_tokens=3)
        assert c.health() == "SERVING"  # health stays open for probes
    with Client(target, tls=sdk_stack.certs.client_tls()) as c, pytest.raises(specsplit.AuthenticationError):
        c.model_info()
    # No client certificate, or no TLS at all: the handshake fails.
    for tls in (sdk_stack.certs.client_tls(with_client_cert=False), None):
        with Client(target, tls=tls, auth_token=AUTH_TOKEN) as c:
            with pytest.raises(specsplit.UnavailableError) as error:
                c.model_info(timeout=5)
        if tls is not None:
            assert "TLS handshake" in error.value.details, error.value.details

    async def via_async() -> int:
        async with AsyncClient(target, tls=sdk_stack.certs.client_tls(), auth_token=AUTH_TOKEN) as aclient:
            return len((await aclient.generate(PROMPT, max_new_tokens=3)).token_ids)

    assert asyncio.run(via_async()) >= 1
