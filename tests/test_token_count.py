"""count_prompt_tokens: the exact token count the web extension shows (through the server route) is the one the
prompt encoder reports, template included, for short, long (> 512) and non-ASCII prompts."""

from __future__ import annotations

import pytest
import torch

from flux2_core.errors import Flux2Error
from flux2_core.families.flux2.variants import QWEN3_4B, QWEN3_TEMPLATE
from flux2_core.models.text_encoder import build_qwen3_encoder, count_prompt_tokens, render_prompt
from flux2_core.models.tokenizer import build_qwen3_tokenizer, load_tokenizer
from tests.tiny.text_encoder import build_tiny_qwen3

LONG = "a red fox in the snow, " * 90     # 7 tokens a repeat (words, comma), 1 for the last space: 631 + 12
PROMPTS = ["", "a red fox in the snow", LONG, "Ein Café in Zürich, 東京の夜景 🌃, ночь, مرحبا", "line one\n\nline two"]
# Qwen3's chat template around a prompt, as ids (Qwen/Qwen3-4B tokenizer_config.json):
# "<|im_start|>user\n" before it, "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n" after it.
TEMPLATE_IDS = 3 + 9


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def encoder(tokenizer):
    return build_qwen3_encoder(build_tiny_qwen3().state_dict(), device="cpu", dtype=torch.float32,
                               tokenizer=tokenizer, spec=QWEN3_4B)


def test_count_is_the_prompt_plus_the_template(tokenizer):
    counts = [count_prompt_tokens(tokenizer, p, QWEN3_TEMPLATE) for p in PROMPTS]
    assert counts == [TEMPLATE_IDS + len(tokenizer.encode(p)) for p in PROMPTS]
    assert counts[0] == 12 and counts[1] == 12 + 6 and counts[2] == 12 + 631    # "a| red| fox| in| the| snow"


def test_count_equals_the_encoders_token_counts(encoder, tokenizer):
    out = encoder.encode(PROMPTS)
    assert out.token_counts == [count_prompt_tokens(tokenizer, p, QWEN3_TEMPLATE) for p in PROMPTS]
    assert out.dropped == [max(0, count_prompt_tokens(tokenizer, p, QWEN3_TEMPLATE) - 512) for p in PROMPTS]
    assert out.dropped[2] == 643 - 512


def test_count_and_template_equal_transformers_chat_template():
    """The count and the rendering equal what transformers' Qwen2TokenizerFast makes of Qwen3's Jinja chat template
    (apply_chat_template with the generation prompt, thinking off) and its untruncated ids."""
    hf, ours = build_qwen3_tokenizer(), load_tokenizer()
    for prompt in [*PROMPTS, "<think>a</think>", "  spaced  ", "{{ braces }} {% raw %}"]:
        text = hf.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                      add_generation_prompt=True, enable_thinking=False)
        assert render_prompt(prompt, QWEN3_TEMPLATE) == text
        assert count_prompt_tokens(ours, prompt, QWEN3_TEMPLATE) == len(hf(text)["input_ids"])
    assert render_prompt("a cat", QWEN3_TEMPLATE) == "<|im_start|>user\na cat<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_a_prompt_that_is_not_a_string_is_refused(tokenizer):
    with pytest.raises(Flux2Error, match="must be a string"):
        count_prompt_tokens(tokenizer, None, QWEN3_TEMPLATE)


def test_a_prompt_holding_bytes_that_are_not_utf8_is_refused(tokenizer, encoder):
    """A prompt read through Python's surrogateescape (a shell in another encoding) names the bad character instead of
    a tokenizer TypeError; counting and encoding say the same."""
    prompt = b"a caf\xe9 by the sea".decode("utf-8", "surrogateescape")
    with pytest.raises(Flux2Error, match=r"character 5 stands for a byte that is not UTF-8 \('a caf' comes before"):
        count_prompt_tokens(tokenizer, prompt, QWEN3_TEMPLATE)
    with pytest.raises(Flux2Error, match="not valid text"):
        encoder.encode([prompt])


def test_an_encoders_spec_gives_its_template_and_length(tokenizer, encoder):
    """Another family's encoder spec (its own template, 48 tokens): the counts are the tokens of the prompt in that
    template, and each row equals the same prompt in the same template padded to 512 (Qwen3 is causal and masks the
    pads as keys: what follows a token never reaches it)."""
    from dataclasses import replace

    template = "<|im_start|>system\nDraw.<|im_end|>\n<|im_start|>user\n{prompt}<|im_end|>\n"
    prompts = ["a red fox in the snow", "Ein Café in Zürich"]
    counts = [len(tokenizer.encode(template.replace("{prompt}", p))) for p in prompts]
    full = build_qwen3_encoder(build_tiny_qwen3().state_dict(), device="cpu", dtype=torch.float32,
                               tokenizer=tokenizer, spec=replace(encoder.spec, template=template))
    short = build_qwen3_encoder(build_tiny_qwen3().state_dict(), device="cpu", dtype=torch.float32,
                                tokenizer=tokenizer, spec=replace(full.spec, max_length=48))
    cut, whole = short.encode(prompts), full.encode(prompts)
    assert cut.token_counts == whole.token_counts == counts and max(counts) < 48 and cut.embeds.shape[1] == 48
    torch.testing.assert_close(cut.embeds, whole.embeds[:, :48], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(whole.embeds, encoder.encode(prompts).embeds)          # Qwen3's own template differs
    assert count_prompt_tokens(tokenizer, prompts[0], template) == counts[0]
