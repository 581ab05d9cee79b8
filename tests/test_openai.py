"""The OpenAI-compatible HTTP API (target_service/openai_api.py) against a real target with a draft, through
the real openai-python client, sync and async, streamed and not.

Every generation is checked token for token against the same request through the gRPC SDK (greedy, or
sampled with a seed); usage carries the speculation fields; errors come in OpenAI's shape with the right
HTTP status (openai-python raises its typed error per status); the token is the gRPC one; /metrics counts
HTTP requests by route and status.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
from service_util import start_draft, start_target

from specsplit import Client
from specsplit.launch import REPO, ServiceProcess

pytestmark = pytest.mark.slow

TOKEN = "openai-test-token"
# ChatML, as SmolLM2 and Qwen write it: the tiny model's tokenizer has no chat template of its own.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name the draft service."}]


@dataclass
class Server:
    target: ServiceProcess
    http_port: int

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/v1"

    def sdk(self) -> Client:
        return Client(self.target.address, auth_token=TOKEN)

    def openai(self, api_key: str = TOKEN) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key=api_key, max_retries=0)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("openai")
    target_model, draft_model = root / "tiny", root / "tiny-draft"
    target_args = ["--seed", "0", "--late-layer-scale", "0.3", "--late-layers-from", "1"]
    draft_args = ["--seed", "1", "--num-layers", "1", "--base", str(target_model), "--share-layers", "1"]
    for path, args in ((target_model, target_args), (draft_model, draft_args)):
        subprocess.run([sys.executable, "-m", "common.tiny", str(path), *args], cwd=REPO, check=True)
    (target_model / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    token = root / "token"
    token.write_text(TOKEN + "\n")
    draft = start_draft(draft_model, root)
    target = start_target(target_model, root, draft, "--http-port", "0", "--auth-token-file", str(token),
                          "--served-model-name", "tiny", "--max-context-length", "256")  # fmt: skip
    try:
        draft.wait_ready()
        target.wait_ready()
        port = int(re.search(r"SPECSPLIT_HTTP port=(\d+)", target.log_text()).group(1))
        yield Server(target, port)
    finally:
        target.stop()
        draft.stop()


def test_models_and_completions_match_the_sdk(server: Server) -> None:
    client = server.openai()
    assert [m.id for m in client.models.list().data] == ["tiny"]
    with server.sdk() as sdk:
        want = sdk.generate("The draft service", max_new_tokens=12, temperature=0.0, ignore_eos=True)
    # ignore_eos is not an OpenAI parameter: compare against the SDK's output up to its length
    got = client.completions.create(model="tiny", prompt="The draft service", max_tokens=12, temperature=0)
    choice = got.choices[0]
    assert want.text.startswith(choice.text) and choice.text, (want.text, choice.text)
    usage = got.usage.model_dump()
    assert usage["completion_tokens"] <= 12 and usage["prompt_tokens"] == want.usage.prompt_tokens
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    # The speculation fields: the target drafts every step (fixed policy) and the draft is often right.
    assert usage["drafted_tokens"] > 0 and 0 < usage["accepted_tokens"] <= usage["drafted_tokens"]
    assert usage["acceptance_rate"] == pytest.approx(usage["accepted_tokens"] / usage["drafted_tokens"])
    assert usage["speculation_note"] == ""
    assert choice.finish_reason == ("length" if usage["completion_tokens"] == 12 else "stop")


def test_chat_streamed_and_not_and_stop(server: Server) -> None:
    client = server.openai()
    with server.sdk() as sdk:
        want = sdk.chat(CHAT, max_new_tokens=24, temperature=0.0)
    whole = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=24, temperature=0)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == want.text
    assert whole.usage.completion_tokens == want.usage.output_tokens
    stream = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True})  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == want.usage.output_tokens
    # stop: the text ends before the stop string, as the SDK's stop_strings (the power check: it occurs).
    cut = want.text[len(want.text) // 2 :].strip()[:3]
    if cut:
        with server.sdk() as sdk:
            stopped = sdk.chat(CHAT, max_new_tokens=24, temperature=0.0, stop_strings=[cut])
        got = client.chat.completions.create(
            model="tiny", messages=CHAT, max_tokens=24, temperature=0, stop=cut
        )
        assert got.choices[0].message.content == stopped.text and cut not in stopped.text
        assert got.choices[0].finish_reason == "stop"


def test_sampling_with_a_seed_and_logprobs(server: Server) -> None:
    client = server.openai()
    kwargs = dict(model="tiny", messages=CHAT, max_tokens=16, temperature=0.9, top_p=0.9, seed=7)
    a = client.chat.completions.create(**kwargs)
    b = client.chat.completions.create(**kwargs)
    with server.sdk() as sdk:
        want = sdk.chat(CHAT, max_new_tokens=16, temperature=0.9, top_p=0.9, seed=7, logprobs=2)
    assert a.choices[0].message.content == b.choices[0].message.content == want.text
    lp = client.chat.completions.create(**kwargs, logprobs=True, top_logprobs=2).choices[0].logprobs.content
    assert [e.logprob for e in lp] == pytest.approx([x.logprob for x in want.logprobs], abs=1e-6)
    assert all(len(e.top_logprobs) == 2 for e in lp) and len(lp) == want.usage.output_tokens
    assert "".join(e.token for e in lp) == want.text
    comp = client.completions.create(
        model="tiny", prompt="The draft", max_tokens=6, temperature=0, logprobs=1
    )
    logprobs = comp.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs)
    assert "".join(logprobs.tokens) == comp.choices[0].text


def test_async_client_streams(server: Server) -> None:
    async def run() -> tuple[str, str]:
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key=TOKEN, max_retries=0)
        whole = await client.completions.create(
            model="tiny", prompt="Speculative", max_tokens=10, temperature=0
        )
        stream = await client.completions.create(model="tiny", prompt="Speculative", max_tokens=10,
                                                 temperature=0, stream=True)  # fmt: skip
        text = "".join([chunk.choices[0].text async for chunk in stream])
        chat = await client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, temperature=0,
                                                    stream=True)  # fmt: skip
        assert "".join([c.choices[0].delta.content or "" async for c in chat])
        await client.close()
        return whole.choices[0].text, text

    whole, streamed = asyncio.run(run())
    assert whole and streamed == whole


def _error(excinfo: pytest.ExceptionInfo) -> dict:
    return excinfo.value.response.json()["error"]


def test_errors_in_openais_shape(server: Server) -> None:
    client = server.openai()
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=CHAT, n=2)
    assert err.value.status_code == 400 and _error(err)["param"] == "n" and "n=1" in _error(err)["message"]
    assert _error(err)["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=[{"role": "wizard", "content": "hi"}])
    assert _error(err)["param"] == "messages[0].role" and "wizard" in _error(err)["message"]
    with pytest.raises(openai.BadRequestError) as err:  # refused by the target (the context length)
        client.completions.create(model="tiny", prompt="hi", max_tokens=100000, stream=True)
    assert _error(err)["param"] == "max_tokens" and "context length" in _error(err)["message"]
    assert _error(err)["message"].startswith("max_tokens: ")  # OpenAI's name, not the gRPC field's
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4", prompt="hi")
    assert _error(err)["code"] == "model_not_found"
    with pytest.raises(openai.AuthenticationError) as err:
        server.openai(api_key="wrong").completions.create(model="tiny", prompt="hi")
    assert err.value.status_code == 401 and _error(err)["code"] == "invalid_api_key"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt="hi", frequency_penalty=1.0)
    assert _error(err)["param"] == "frequency_penalty"
    # A raw request: a body that is not JSON, a route that does not exist.
    for url, data, status in (
        (server.base_url + "/completions", b"{", 400),
        (server.base_url + "/nope", b"{}", 404),
    ):
        req = urllib.request.Request(url, data=data, headers={"Authorization": f"Bearer {TOKEN}"})
        with pytest.raises(urllib.error.HTTPError) as http:
            urllib.request.urlopen(req, timeout=10)
        assert http.value.code == status and set(json.load(http.value)["error"]) == {
            "message",
            "type",
            "param",
            "code",
        }


def test_http_metrics_by_route_and_status(server: Server) -> None:
    client = server.openai()
    route = "/v1/chat/completions"
    before_ok = server.target.metric("specsplit_http_requests_total", route=route, status="200")
    before_bad = server.target.metric("specsplit_http_requests_total", route=route, status="400")
    client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=CHAT, n=3)
    assert server.target.metric("specsplit_http_requests_total", route=route, status="200") == before_ok + 1
    assert server.target.metric("specsplit_http_requests_total", route=route, status="400") == before_bad + 1
    assert server.target.metric("specsplit_http_request_duration_seconds_count", route=route) >= 2


def test_curl_example_of_the_docs(server: Server, tmp_path: Path) -> None:
    """docs/openai.md's curl command, as written there (the address and token substituted)."""
    doc = (REPO / "docs" / "openai.md").read_text()
    command = re.search(r"^curl .*$", doc, re.M).group(0)
    command = command.replace("localhost:8000", f"127.0.0.1:{server.http_port}").replace("$TOKEN", TOKEN)
    command = command.replace('"model": "SmolLM2-135M-Instruct"', '"model": "tiny"')
    out = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60, check=True)
    body = json.loads(out.stdout)
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"]


def test_python_example_of_the_docs(server: Server, tmp_path: Path) -> None:
    """docs/openai.md's openai-python example, as written there (the address and token substituted)."""
    doc = (REPO / "docs" / "openai.md").read_text()
    code = re.search(r"```python\n(.*?)```", doc, re.S).group(1)
    code = code.replace("http://localhost:8000/v1", server.base_url).replace(
        'api_key="TOKEN"', f"api_key={TOKEN!r}"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    first = out.stdout.splitlines()[0]
    assert float(first.split()[-1]) >= 0 and len(out.stdout) > len(first), out.stdout
