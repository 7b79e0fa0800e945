"""The typed request models of the inference servers: every bound, the error that names it, the published schema,
and property-based fuzzing of the schema (hypothesis): any JSON object is either a request inside every bound or a
BadRequest naming a field, never another exception."""

import json
import math

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from i3core.plugins.inference.protocol import (
    MAX_N,
    MAX_STOP_STRINGS,
    MAX_TOP_LOGPROBS,
    MIN_TEMPERATURE,
    REQUEST_MODELS,
    SEED_MAX,
    BadRequest,
    ChatRequest,
    CompletionRequest,
    GenerateRequest,
    UpdateWeightsRequest,
    error_body,
    openapi,
    parse,
    parse_json_object,
)

MAX_LEN, VOCAB = 512, 300


def sampling(body: dict, model=CompletionRequest):
    return parse(model, body).stream_sampling(MAX_LEN, VOCAB, [0])


def refused(model, body: dict) -> BadRequest:
    with pytest.raises(BadRequest) as info:
        request = parse(model, body)
        if hasattr(request, "stream_sampling"):
            request.stream_sampling(MAX_LEN, VOCAB, [0])
        if hasattr(request, "prompt_ids"):
            request.prompt_ids(VOCAB, lambda text: [1])
    return info.value


@pytest.mark.parametrize(
    ("field", "good", "bad", "words"),
    [
        ("n", [1, MAX_N], [0, MAX_N + 1, 1.0, True, "2"], f"n must be an integer in [1, {MAX_N}]"),
        ("max_tokens", [1, MAX_LEN], [0, -1, 2.5, 10**30, "8"], "max_tokens must be an integer in [1, "),
        ("temperature", [0, 0.0, 1e-300, 2, 1e300], [-1e-9, math.nan, math.inf, -math.inf, "hot", True],
         "temperature must be a finite number >= 0"),
        ("top_p", [1e-9, 0.5, 1], [0, -0.1, 1.0000001, math.nan], "top_p must be a finite number in (0, 1]"),
        ("top_k", [-1, 0, 1, 1 << 30], [-2, 1.5, (1 << 30) + 1], "top_k must be -1, 0 (off) or an integer in [1, "),
        ("seed", [None, 0, -(1 << 63), SEED_MAX], [SEED_MAX + 1, -(1 << 63) - 1, 1.5], "seed must be an integer in"),
        ("logprobs", [None, 0, MAX_TOP_LOGPROBS], [-1, MAX_TOP_LOGPROBS + 1, True],
         f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}]"),
        ("stop", ["x", ["a"] * MAX_STOP_STRINGS, "s" * 256], ["", [""], ["a"] * (MAX_STOP_STRINGS + 1), "s" * 257, 5],
         f"stop must be a non-empty string or a list of at most {MAX_STOP_STRINGS}"),
        ("stop_token_ids", [[], [0, VOCAB - 1]], [[VOCAB], [-1], 5, [True], list(range(257))],
         "stop_token_ids must be"),
        ("skip_special_tokens", [True, False], [1, "yes"], "skip_special_tokens must be true or false"),
    ],
)
def test_each_sampling_bound_is_a_400_naming_the_field_and_the_bound(field, good, bad, words):
    for value in good:
        sampling({"prompt": [1], field: value})
    for value in bad:
        error = refused(CompletionRequest, {"prompt": [1], field: value})
        assert words in str(error) and error.param == field, (value, str(error))


def test_max_tokens_over_the_context_is_openais_context_length_exceeded():
    settings_ = sampling({"prompt": [1], "max_tokens": MAX_LEN})
    with pytest.raises(BadRequest, match=f"This model's maximum context length is {MAX_LEN} tokens") as info:
        settings_.fit(1, MAX_LEN)
    assert info.value.code == "context_length_exceeded" and info.value.param == "max_tokens"
    assert settings_.fit(0 + 2, MAX_LEN + 2) == MAX_LEN
    clipped = sampling({"prompt": [1], "max_tokens": MAX_LEN, "clip_max_tokens": True})
    assert clipped.fit(10, MAX_LEN) == MAX_LEN - 10  # the orchestrator's client: generate up to the context
    chat = sampling({"messages": [{"role": "user", "content": "x"}]}, ChatRequest)
    assert chat.fit(10, MAX_LEN) == MAX_LEN - 10  # chat's default: as many as fit
    with pytest.raises(BadRequest, match="leaves no room") as info:
        chat.fit(MAX_LEN, MAX_LEN)
    assert info.value.code == "context_length_exceeded"
    echo = sampling({"prompt": [1], "max_tokens": 0, "echo": True})
    assert echo.echo and echo.fit(MAX_LEN - 1, MAX_LEN) == 0


def test_temperature_below_epsilon_is_greedy_and_tiny_ones_are_raised():
    assert sampling({"prompt": [1], "temperature": 1e-300}).temperature == 0.0
    assert sampling({"prompt": [1], "temperature": 1e-3}).temperature == MIN_TEMPERATURE
    assert sampling({"prompt": [1], "temperature": 0.7}).temperature == 0.7
    assert sampling({"prompt": [1], "top_k": -1}).top_k == 0  # vLLM's "off"


@pytest.mark.parametrize(
    ("model", "body", "words", "param"),
    [
        (CompletionRequest, {}, "prompt must be a non-empty string, a non-empty list of token ids", "prompt"),
        (CompletionRequest, {"prompt": [[1], []]}, "prompt must be a non-empty string", "prompt"),
        (CompletionRequest, {"prompt": [1], "max_tokens": 0}, "(0 only with echo)", "max_tokens"),
        (CompletionRequest, {"prompt": [1, VOCAB]}, f"prompt token ids must be in [0, {VOCAB})", "prompt"),
        (CompletionRequest, {"prompt": ["a", "b"]}, "one prompt a request", "prompt"),
        (CompletionRequest, {"prompt": [1], "max_tokns": 3}, "did you mean 'max_tokens'", "max_tokns"),
        (CompletionRequest, {"prompt": [1], "presence_penalty": 3}, "presence_penalty must be a finite number in [-2, 2]",
         "presence_penalty"),
        (CompletionRequest, {"prompt": [1], "logit_bias": {"x": 1}}, "logit_bias must map token ids", "logit_bias"),
        (CompletionRequest, {"prompt": [1], "logit_bias": {"1": 101}}, "logit_bias must map token ids", "logit_bias"),
        (CompletionRequest, {"prompt": [1], "logit_bias": {str(VOCAB): 1}}, "logit_bias token ids must be in",
         "logit_bias"),
        (CompletionRequest, {"prompt": [1], "repetition_penalty": 0}, "repetition_penalty must be a finite number > 0",
         "repetition_penalty"),
        (CompletionRequest, {"prompt": [1], "best_of": 2}, "best_of is not supported", "best_of"),
        (ChatRequest, {"messages": []}, "messages must be a non-empty list of at most", "messages"),
        (ChatRequest, {"messages": [{"role": "user", "content": "x"}] * 4097}, "at most 4096 messages", "messages"),
        (ChatRequest, {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
         "max_completion_tokens must be an integer in [1, max_len]", "max_completion_tokens"),
        (ChatRequest, {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
         "top_logprobs needs logprobs = true", "top_logprobs"),
        (ChatRequest, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         "messages[0].content: only text content parts are supported", "messages[0].content"),
        (ChatRequest, {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
         "tools[0].function must be", "tools[0].function"),
        (GenerateRequest, {"token_ids": []}, "token_ids must be a non-empty list", "token_ids"),
        (GenerateRequest, {"token_ids": [1], "sampling_params": {"detokenize": False}},
         "sampling_params.detokenize must be true", "sampling_params.detokenize"),
        (UpdateWeightsRequest, {"version": -1}, "version must be an integer >= 0", "version"),
    ],
)
def test_request_errors_name_the_field(model, body, words, param):
    error = refused(model, body)
    assert words in str(error) and error.param == param, str(error)


def test_lone_surrogates_are_refused_and_nul_bytes_kept():
    with pytest.raises(BadRequest, match=r"messages\[0\].content holds a lone UTF-16 surrogate"):
        parse_json_object(b'{"messages": [{"role": "user", "content": "a\\udc80b"}]}')
    assert parse_json_object(b'{"prompt": "a\\u0000b"}')["prompt"] == "a\x00b"


def test_the_error_shape_is_openais():
    assert error_body("m", "temperature") == {"error": {"message": "m", "type": "invalid_request_error",
                                                        "param": "temperature", "code": None}}


def test_the_published_schema_is_valid_openapi_and_holds_the_bounds():
    document = openapi(REQUEST_MODELS, "test")
    schemas = document["components"]["schemas"]
    completion = schemas["CompletionRequest"]["properties"]
    assert completion["n"]["maximum"] == MAX_N and completion["top_p"]["exclusiveMinimum"] == 0
    assert completion["max_tokens"]["x-bound"].startswith("an integer in [1, max_len]")
    assert set(document["paths"]) == set(REQUEST_MODELS)
    body = {"prompt": [1, 2], "max_tokens": 3, "temperature": 0.5, "stop": ["x"]}
    resolver = {"components": document["components"], **schemas["CompletionRequest"]}
    jsonschema.validate(body, resolver)
    json.dumps(document)  # JSON all the way down


JSON_LEAVES = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(1 << 70), max_value=1 << 70),
                        st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20))
JSON = st.recursive(JSON_LEAVES, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                    max_leaves=12)


def bodies(model) -> st.SearchStrategy[dict]:
    """Objects over the model's own field names (mostly) with any JSON values: the interesting cases are
    near-miss requests, not random keys."""
    fields = sorted(model.model_fields)
    return st.dictionaries(st.one_of(st.sampled_from(fields), st.text(max_size=6)), JSON, max_size=6)


def chat_bodies():
    message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x"])},
                                    optional={"content": JSON, "tool_calls": JSON, "tool_call_id": JSON})
    return st.builds(lambda extra, messages: {**extra, "messages": messages}, bodies(ChatRequest),
                     st.lists(message, max_size=3))


def check_outcome(model, body: dict) -> None:
    """Either a BadRequest naming a field (or the body), or settings inside every bound."""
    try:
        request = parse(model, body)
        if isinstance(request, GenerateRequest):
            settings_ = request.sampling_params.sampling(MAX_LEN, VOCAB, [0])
        else:
            settings_ = request.stream_sampling(MAX_LEN, VOCAB, [0])
        if isinstance(request, CompletionRequest):
            request.prompt_ids(VOCAB, lambda text: [1])
    except BadRequest as exc:
        assert str(exc)
        return
    try:
        max_tokens = settings_.fit(1, MAX_LEN)  # what a one-token prompt may generate
    except BadRequest as exc:  # more than the context holds, min_tokens above it
        assert exc.param in ("max_tokens", "min_tokens")
        return
    assert 1 <= settings_.n <= MAX_N and 0 <= max_tokens <= MAX_LEN - 1
    assert settings_.temperature == 0 or MIN_TEMPERATURE <= settings_.temperature < math.inf
    assert 0 < settings_.top_p <= 1 and settings_.top_k >= 0
    assert all(0 <= t < VOCAB for t in settings_.stop_token_ids)
    assert settings_.logprobs is None or 0 <= settings_.logprobs <= MAX_TOP_LOGPROBS


FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(bodies(CompletionRequest))
def test_fuzzed_completion_bodies_are_parsed_or_refused_by_name(body):
    check_outcome(CompletionRequest, body)


@FUZZ
@given(chat_bodies())
def test_fuzzed_chat_bodies_are_parsed_or_refused_by_name(body):
    check_outcome(ChatRequest, body)


@FUZZ
@given(st.builds(lambda body, params: {**body, "sampling_params": params}, bodies(GenerateRequest),
                 bodies(GenerateRequest.model_fields["sampling_params"].annotation)))
def test_fuzzed_generate_bodies_are_parsed_or_refused_by_name(body):
    check_outcome(GenerateRequest, body)
