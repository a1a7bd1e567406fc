"""kiln serve with the official `openai` Python client: completions and chat, streamed
and not, seeded. Oracle: the same request streamed and not must agree, and the
client's own parsing of every response must succeed. Exits 77 (skip) when the openai
package is missing (scripts/install-test-deps.sh installs it into build/venv)."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import harness as H  # noqa: E402

A = H.args()
try:
    import openai
except ImportError:
    print("skip: the openai package is not installed (run scripts/install-test-deps.sh)")
    sys.exit(H.SKIP)

RUN = H.model(A.kiln, A.workdir)
NAME = "serve-model"
client = None


def test_models():
    ids = [m.id for m in client.models.list()]
    assert ids == [NAME], ids


def test_completion_plain_and_stream():
    kw = dict(model=NAME, prompt="The", max_tokens=24, temperature=0.8, seed=42)
    r = client.completions.create(**kw)
    assert r.object == "text_completion" and r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.completion_tokens >= 1 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == r.choices[0].text, (text, r.choices[0].text)
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_chat_plain_and_stream():
    msgs = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Say something."}]
    kw = dict(model=NAME, messages=msgs, max_tokens=24, temperature=0.8, seed=7)
    r = client.chat.completions.create(**kw)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content


def test_errors_raise_typed_exceptions():
    try:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
        raise AssertionError("an unknown model was accepted")
    except openai.NotFoundError as e:
        assert e.status_code == 404
    try:
        client.completions.create(model=NAME, prompt="x", max_tokens=100000)
        raise AssertionError("max_tokens past the context was accepted")
    except openai.BadRequestError as e:
        assert e.status_code == 400 and "context length" in str(e)


def test_sampling_knobs():
    """presence_penalty, frequency_penalty and logit_bias as the client sends them (OpenAI's
    names), min_p and repetition_penalty as extra body fields (llama.cpp's and vLLM's
    names): a bias of 100 on one token makes greedy decoding repeat it, -100 on the greedy
    token keeps it out, penalties change greedy text that repeats itself, and a value out
    of range is a 400 naming the field."""
    plain = client.completions.create(model=NAME, prompt="The", max_tokens=16, temperature=0, logprobs=1)
    first = plain.choices[0].logprobs.tokens[0]
    forced = client.completions.create(model=NAME, prompt="The", max_tokens=8, temperature=0, logit_bias={"65": 100})
    assert forced.choices[0].text == "A" * 8, forced.choices[0].text  # (the byte tokenizer: token 65 is "A")
    banned = client.completions.create(model=NAME, prompt="The", max_tokens=1, temperature=0,
                                       logit_bias={str(ord(first)) if len(first) == 1 else "0": -100})
    assert len(first) != 1 or banned.choices[0].text != first, (first, banned.choices[0].text)
    pen = client.completions.create(model=NAME, prompt="The", max_tokens=16, temperature=0, presence_penalty=2,
                                    frequency_penalty=2, extra_body={"repetition_penalty": 1.5, "min_p": 0.1})
    assert pen.usage.completion_tokens >= 1
    if len(set(plain.choices[0].text)) < len(plain.choices[0].text):  # greedy repeated a token: penalties change it
        assert pen.choices[0].text != plain.choices[0].text, (pen.choices[0].text, plain.choices[0].text)
    for kw, field in ((dict(presence_penalty=3), "presence_penalty"), (dict(logit_bias={"x": 1}), "logit_bias"), (dict(logit_bias={" 5": 1}), "logit_bias"),
                      (dict(logit_bias={"+5": 1}), "logit_bias"),
                      (dict(logit_bias={"1": 101}), "logit_bias"), (dict(extra_body={"min_p": 1.5}), "min_p"),
                      (dict(logit_bias={"99999": 1}), "logit_bias")):
        try:
            client.completions.create(model=NAME, prompt="x", max_tokens=2, **kw)
            raise AssertionError(f"{kw} was accepted")
        except openai.BadRequestError as e:
            assert e.status_code == 400 and field in str(e), (kw, str(e))


def main():
    global client
    with H.Server(A.kiln, RUN, "--api-key", "k-test", log=os.path.join(A.workdir, "serve-openai.log")) as s:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{s.port}/v1", api_key="k-test", max_retries=0, timeout=60)
        rc = H.run_tests([test_models, test_completion_plain_and_stream, test_chat_plain_and_stream,
                          test_errors_raise_typed_exceptions, test_sampling_knobs])
    sys.exit(rc)


if __name__ == "__main__":
    main()
